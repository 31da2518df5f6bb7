"""16-bit weights with float32 activations (LLM(dtype="bfloat16") on CPU).

float_matmul is checked against the float32 product of the same rounded operands (tolerance:
float32 summation order, rtol 1e-5), and its compiled program for the absence of a float32 copy
of the weight matrix. The real model in bfloat16 is checked against the float32 model's
perplexity on GPL-3 text.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import ModelConfig
from jaxinfer.layers import float_matmul, linear
from jaxinfer.models import llama


@pytest.mark.parametrize("rows", [(1,), (1, 1), (3,), (2, 5)])
@pytest.mark.parametrize("spec", ["...i,io->...o", "...D,VD->...V"])
def test_float_matmul_rounds_x_to_the_weights_dtype(rows, spec):
    rng = np.random.default_rng(0)
    I, O = 96, 200
    x = jnp.asarray(rng.normal(size=rows + (I,)), jnp.float32)
    shape = (I, O) if spec.endswith("o") else (O, I)
    w = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
    fn = jax.jit(lambda x, w: float_matmul(x, w, spec))
    got = fn(x, w)
    want = np.einsum(spec, np.asarray(x.astype(jnp.bfloat16), np.float32),
                     np.asarray(w, np.float32))
    assert got.dtype == jnp.float32 and got.shape == rows + (O,)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # No float32 copy of the weights: XLA:CPU makes one for a single-row bf16 dot unless
    # float_matmul pads the row (45 ms a call for SmolLM2's head).
    hlo = fn.lower(x, w).compile().as_text()
    assert f"f32[{shape[0]},{shape[1]}]" not in hlo


def test_linear_keeps_the_activation_dtype():
    x = jnp.ones((2, 8), jnp.float32)
    w = jnp.full((8, 4), 0.5, jnp.bfloat16)
    y = linear(x, w, jnp.ones((4,), jnp.float32))
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y), np.full((2, 4), 5.0))


def test_with_float32_activations_embed_and_forward():
    """Vectors become float32, matrices stay bf16; the embedding gathers the table's rows
    exactly; the forward matches a float32 model whose weights are the same bf16 values within
    the error of rounding activations to bf16 before each matmul."""
    cfg = ModelConfig(architecture="llama", vocab_size=128, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, ffn_dim=96, max_position_embeddings=64)
    rounded = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32),
                           llama.init_params(cfg, jax.random.key(0), jnp.float32))
    mixed = llama.with_float32_activations(jax.tree.map(lambda a: a.astype(jnp.bfloat16),
                                                        rounded))
    assert mixed.final_norm.dtype == jnp.float32 and mixed.layers[0].mlp_norm.dtype == jnp.float32
    assert mixed.layers[0].wq.dtype == jnp.bfloat16 and mixed.embed.dtype == jnp.bfloat16
    assert llama.activation_dtype(mixed) == jnp.float32
    tokens = jnp.asarray([[3, 127, 0, 64]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(llama.embed(mixed, tokens)),
                                  np.asarray(rounded.embed)[np.asarray(tokens)])
    want = llama.sequence_logits(rounded, cfg, tokens)
    got = llama.sequence_logits(mixed, cfg, tokens)
    assert got.dtype == jnp.float32
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-2 * scale)


@pytest.mark.slow
def test_smollm2_bfloat16_on_cpu(smollm2_gguf):
    """LLM(dtype="bfloat16") on CPU: bf16 matrices, float32 vectors and KV cache; perplexity on
    the first 1024 tokens of GPL-3 within 1% of float32 (at 4,096 tokens: 24.979 against
    24.973, +0.02%, greedy agreement 0.993); the same greedy text on a short prompt."""
    import jaxinfer as ji
    from jaxinfer.evaluation import perplexity

    path = "/usr/share/common-licenses/GPL-3"
    if jax.default_backend() != "cpu" or not os.path.exists(path):
        pytest.skip("CPU only, needs GPL-3 text")
    f32 = ji.LLM("smollm2-135m", max_seq_len=512, max_num_seqs=1)
    bf16 = ji.LLM("smollm2-135m", dtype="bfloat16", max_seq_len=512, max_num_seqs=1)
    params = bf16._engine.params
    assert params.layers[0].w_up.dtype == jnp.bfloat16 and params.embed.dtype == jnp.bfloat16
    assert params.final_norm.dtype == jnp.float32
    with open(path) as f:
        tokens = f32.tokenizer.encode(f.read())[:1024]
    want = perplexity(f32._engine.params, f32.model_config, tokens)
    got = perplexity(params, bf16.model_config, tokens)
    assert abs(got / want - 1) < 0.01, (got, want)
    prompt = "The capital of France is"
    greedy = ji.SamplingParams(max_tokens=8, temperature=0.0)
    assert bf16.generate([prompt], greedy)[0].text == f32.generate([prompt], greedy)[0].text
    floats = [x.dtype for x in jax.tree.leaves(bf16._engine.state.cache)
              if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(d == jnp.float32 for d in floats)
