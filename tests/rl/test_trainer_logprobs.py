"""token_logprobs against the trainer's forward (jaxinfer.models.sequence_logits of the same
params), and LoRA updates from a trainer's LoraParams (docs/rl.md).

Reference: sequence_logits' logits in float64 numpy; the sampling law (temperature, then top-p
over the renormalised distribution) applied to them independently of the engine's sampler.
Tolerances (max |engine - reference| in nats), measured and stated per dtype: float32 2e-3
(measured below 1e-4); bfloat16 with the native kernels 0.15 for single tokens and 0.03 on
average (measured up to 0.05 and 0.01: the engine's kernels round differently from the
differentiable forward's products)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer import backends
from jaxinfer.lora.trainable import LoraParams
from jaxinfer.models import sequence_logits

TINY = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "tiny_models", "llama")
TOL = {"float32": (2e-3, 2e-3), "bfloat16": (0.15, 0.03)}


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def reference(llm, out, lora=None):
    """(raw log-probs, the logits) of out's tokens from sequence_logits, float64."""
    c = out.outputs[0]
    sampled = list(c.token_ids) + ([] if c.stop_token_id is None else [c.stop_token_id])
    ids = list(out.prompt_token_ids) + sampled
    logits = np.asarray(sequence_logits(llm.params, llm.model_config,
                                        jnp.asarray([ids], jnp.int32), lora=lora),
                        np.float64)[0]
    P, toks = len(out.prompt_token_ids), np.asarray(sampled)
    logits = logits[P - 1:len(ids) - 1]
    return log_softmax(logits)[np.arange(len(toks)), toks], logits


def law(logits, toks, temperature: float, top_p: float):
    """log p(token) under temperature then top-p (the smallest prefix of the sorted
    distribution whose mass reaches top_p), per position."""
    out = []
    for z, t in zip(logits, toks):
        lp = log_softmax(z / temperature)
        order = np.argsort(-lp, kind="stable")
        p = np.exp(lp[order])
        keep = order[(np.cumsum(p) - p) < top_p]
        assert t in keep, "the engine sampled a token the reference filters out"
        out.append(lp[t] - np.log(np.exp(lp[keep]).sum()))
    return np.asarray(out)


def check(got, want, dtype):
    worst, mean = TOL[dtype]
    diff = np.abs(np.asarray(got, np.float64) - want)
    assert diff.max() < worst and diff.mean() < mean, (diff.max(), diff.mean())


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2 at the users' default dtype (bf16 on CPU), with one LoRA slot of rank 8."""
    return ji.LLM("smollm2-135m", dtype=backends.default_dtype(), max_seq_len=128,
                  max_num_seqs=4, max_loras=1, max_lora_rank=8)


@pytest.mark.parametrize("model,dtype", [(TINY, "float32"), ("smollm2-135m", None)])
def test_token_logprobs_equal_the_trainers_forward(model, dtype, request):
    dtype = dtype or backends.default_dtype()
    llm = ji.LLM(model, dtype=dtype, max_seq_len=128, max_num_seqs=4) if model == TINY \
        else request.getfixturevalue("smollm2")
    prompts = [[1, 17, 93, 45, 6], [1, 200, 3, 3, 9, 14, 71]] if model == TINY else \
        ["The capital of France is", "def fib(n):"]
    greedy = ji.SamplingParams(max_tokens=20, ignore_eos=True, token_logprobs=True)
    hot = ji.SamplingParams(max_tokens=20, ignore_eos=True, token_logprobs=True,
                            temperature=0.8, top_p=0.9, seed=7)
    for sp in (greedy, hot):
        for out in llm.generate(prompts, sp):
            c = out.outputs[0]
            assert c.sampling_logprobs.dtype == np.float32
            assert c.sampling_logprobs.shape == c.model_logprobs.shape == (20,)
            raw, logits = reference(llm, out)
            check(c.model_logprobs, raw, dtype)
            if sp.temperature == 0:
                assert (c.sampling_logprobs == 0).all()  # a one-hot law
            else:
                check(c.sampling_logprobs, law(logits, c.token_ids, 0.8, 0.9), dtype)
                assert (c.sampling_logprobs > c.model_logprobs - 1e-6).mean() > 0.5
    if model != TINY:
        # An output that EOS ends: the arrays cover the stop id too (not in token_ids).
        chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}],
                                                 add_generation_prompt=True)
        out = llm.generate(chat, ji.SamplingParams(max_tokens=48, token_logprobs=True))[0]
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.stop_token_id in llm._engine.eos_ids
        assert c.model_logprobs.shape == (len(c.token_ids) + 1,)
        check(c.model_logprobs, reference(llm, out)[0], dtype)


def test_lora_updates_from_a_trainer(smollm2, compile_recorder):
    """A trainer's LoraParams into an adapter slot: the engine's log-probs under it equal
    sequence_logits(lora=) of the same arrays; a second update recompiles nothing."""
    dtype, llm = backends.default_dtype(), smollm2
    cfg = llm.model_config
    lp = LoraParams.init(jax.random.key(0), cfg, 8, ("q_proj", "v_proj", "up_proj",
                                                     "down_proj"), alpha=16)

    def moved(lp, seed):
        return lp.replace(b={f: 0.1 * jax.random.normal(jax.random.key(seed + i), x.shape)
                             for i, (f, x) in enumerate(sorted(lp.b.items()))})

    first = moved(lp, 1)
    sp = ji.SamplingParams(max_tokens=16, ignore_eos=True, token_logprobs=True)
    prompt = ["Write a haiku about the sea."]
    base = llm.generate(prompt, sp)[0]
    llm.update_weights(first, lora="policy")
    assert llm.list_loras()[0]["name"] == "policy"
    out = llm.generate(prompt, sp, lora="policy")[0]
    raw, _ = reference(llm, out, lora=first)
    check(out.outputs[0].model_logprobs, raw, dtype)
    base_raw, _ = reference(llm, out)  # the same tokens without the adapter
    assert np.abs(base_raw - raw).mean() > 0.1  # the adapter matters
    v = llm.weight_version
    assert out.weight_version == v and base.weight_version == v - 1
    second = moved(lp, 2)
    with compile_recorder() as rec:
        llm.update_weights(second, lora="policy")
        again = llm.generate(prompt, sp, lora="policy")[0]
    assert rec.logs == [] and rec.events == []
    assert again.weight_version == v + 1 and again.token_ids != out.token_ids
    check(again.outputs[0].model_logprobs, reference(llm, again, lora=second)[0], dtype)
    assert llm.generate(prompt, sp)[0].token_ids == base.token_ids  # the base is untouched
    wide = LoraParams.init(jax.random.key(0), cfg, 16, ("q_proj",))
    with pytest.raises(ValueError, match="max_lora_rank is 8"):
        llm.update_weights(wide, lora="policy")
    bad = first.replace(a={**first.a, "wq": first.a["wq"][:, :5]})
    with pytest.raises(ValueError, match="wq has shape"):
        llm.update_weights(bad, lora="policy")
    with pytest.raises(ValueError, match="LoraParams"):
        llm.update_weights({"wq": 1}, lora="policy")
    assert llm.weight_version == v + 1
