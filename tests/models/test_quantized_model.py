"""The real model with quantized weights, against its float32 weights (the GGUF's blocks
dequantized) through the same scoring forward (sequence_logits).

"int4" on SmolLM2's Q4_1 file keeps the file's blocks (and its Q8_0 embedding), so it is the
float model: logits equal up to float32 summation order (max |diff| 1.4e-4, bound 5e-4). "int8"
(in groups of 32) and "fp8" (per output channel) requantize the dequantized weights: they are
checked by greedy (argmax) agreement over all 116 positions of 4 golden sequences, measured
int8 0.991 and fp8 0.914, bounded at 0.97 and 0.88. Parameter bytes against float32,
measured: int4 0.179, int8 0.266, fp8 0.251. The same for a quantized KV cache (float weights), and the engine end to end
with an int8 KV cache against the golden greedy text (int4-awq weights: the converted
checkpoint in tests/loading/test_quantized_checkpoint.py).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import quant
from jaxinfer.loading import load_model
from jaxinfer.models import sequence_logits


@pytest.fixture(scope="module")
def float_scored(data_dir):
    """The float model's logits over the first 4 golden prompts + continuations, its params,
    config and the tokens (the KV-cache tests need nothing else)."""
    with open(os.path.join(data_dir, "smollm2_greedy.json")) as f:
        cases = json.load(f)["cases"]
    ids = [c["prompt_ids"] + c["greedy_ids"] for c in cases[:4]]
    T = min(len(x) for x in ids)
    tokens = jnp.asarray([x[:T] for x in ids], jnp.int32)
    loaded = load_model("smollm2-135m")
    logits = np.asarray(sequence_logits(loaded.params, loaded.config, tokens))
    return {None: (logits, loaded.params), "config": loaded.config, "tokens": tokens}


@pytest.fixture(scope="module")
def scored(float_scored):
    out = dict(float_scored)
    for mode in ("int4", "int8", "fp8"):
        loaded = load_model("smollm2-135m", quantization=mode)
        out[mode] = (np.asarray(sequence_logits(loaded.params, loaded.config,
                                                      out["tokens"])), loaded.params)
    return out


@pytest.mark.slow  # the scored fixture loads and scores four models (about 50 s)
def test_int4_on_a_q4_1_file_is_the_float_model(scored):
    ref, _ = scored[None]
    got, params = scored["int4"]
    assert isinstance(params.layers[0].wq, quant.QuantizedWeight)
    assert params.layers[0].wq.kind == "int4" and params.layers[0].wq.group_size == 32
    assert params.embed.kind == "int8"  # the file's Q8_0 embedding, kept
    # The same weights; on CPU the int4 product sums two nibble-half dots over tiles, in
    # another order than the float matmul: measured max |diff| 1.4e-4 on logits up to ~20.
    np.testing.assert_allclose(got, ref, atol=5e-4, rtol=0)
    assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.slow  # the scored fixture loads and scores four models (about 50 s)
@pytest.mark.parametrize("mode,group,bound", [("int8", 32, 0.97), ("fp8", 0, 0.88)])
def test_requantized_modes_agree_with_float_greedy(scored, mode, group, bound):
    ref, _ = scored[None]
    got, params = scored[mode]
    assert params.layers[0].w_up.kind == mode and params.layers[0].w_up.group_size == group
    agree = float(np.mean(got.argmax(-1) == ref.argmax(-1)))
    assert agree >= bound, agree


@pytest.mark.slow  # the scored fixture loads and scores four models (about 50 s)
def test_quantized_params_are_smaller(scored):
    nbytes = lambda p: sum(x.nbytes for x in jax.tree.leaves(p))
    f32 = nbytes(scored[None][1])
    ratios = {m: nbytes(scored[m][1]) / f32 for m in ("int8", "int4", "fp8")}
    assert ratios["int8"] < 0.30 and ratios["fp8"] < 0.30 and ratios["int4"] < 0.20, ratios


@pytest.mark.parametrize("kv,bound", [("int8", 0.97), ("fp8", 0.95)])
def test_quantized_kv_cache_agrees_with_float_greedy(float_scored, kv, bound):
    """The float weights attending to their keys and values as a quantized cache stores them
    (the scoring forward with kv_cache_dtype): greedy agreement with the float cache over the
    same 116 positions. Measured: int8 1.0 (max |logit diff| 0.79), fp8 0.991 (2.7)."""
    ref, params = float_scored[None]
    got = np.asarray(sequence_logits(params, float_scored["config"], float_scored["tokens"],
                                           kv_cache_dtype=kv))
    agree = float(np.mean(got.argmax(-1) == ref.argmax(-1)))
    assert agree >= bound, agree


def test_engine_with_an_int8_kv_cache_generates_the_golden_greedy_text(data_dir):
    """LLM(kv_cache_dtype="int8"): the paged pool holds int8 codes and scales (prefill,
    decode over the flat page list, the prefix cache) and greedy generation reproduces the
    golden float32 continuations (from HF transformers; tests/data/smollm2_greedy.json) of 4
    prompts: measured 100% of tokens, bound 95% (positionwise)."""
    import jaxinfer as ji
    from jaxinfer.device.kv_cache import QuantizedKV

    with open(os.path.join(data_dir, "smollm2_greedy.json")) as f:
        cases = json.load(f)["cases"][:4]
    llm = ji.LLM("smollm2-135m", max_seq_len=128, max_num_seqs=4, kv_cache_dtype="int8")
    n = min(len(c["greedy_ids"]) for c in cases)
    outs = llm.generate([c["prompt_ids"] for c in cases],
                        ji.SamplingParams(max_tokens=n, ignore_eos=True))
    assert isinstance(llm._engine.state.cache.k, QuantizedKV)
    assert llm._engine.state.cache.k.codes.dtype == jnp.int8
    agree = np.mean([np.array(o.token_ids[:n]) == np.array(c["greedy_ids"][:n])
                     for o, c in zip(outs, cases)])
    assert agree >= 0.95, agree
