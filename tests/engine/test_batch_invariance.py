"""Batch invariance at the CPU default (bf16 weights, float32 activations, the native kernels)
and at float32: a request's tokens and top-20 log-probabilities are bitwise the same whether it
runs alone or beside other requests, whatever the scheduler makes of it: prefill in one chunk
or many (prefill_chunk, max_num_batched_tokens), decode steps per dispatch, pages from the
prefix cache or computed afresh, preemption and recomputation, n-gram speculation. The
reference is the request alone on one engine; every other run must equal it exactly
(tolerance 0). Without the invariant paths these fail: at float32 with XLA's dots every case
differs, with XLA's RMSNorm reduction about one case in ten.

Where the machine lacks AVX512-BF16 (or JAXINFER_CPU_KERNELS=0), the backend is not batch
invariant (docs/architecture.md, "Batch invariance") and these tests skip.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji


def _invariant_backend() -> bool:
    from jaxinfer import backends
    return jax.default_backend() == "cpu" and backends.resolve(num_devices=1).batch_invariant


pytestmark = pytest.mark.skipif(not _invariant_backend(),
                                reason="the backend is not batch invariant (no AVX512-BF16, "
                                       "or the native kernels are off)")

TINY_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
                  max_position_embeddings=512, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """A random Llama-family model with head dims the native attention reads (32)."""
    import json

    from jaxinfer.loading.checkpoint import save_checkpoint
    from jaxinfer.loading.safetensors import config_from_hf
    from jaxinfer.models import llama

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "configs", "models", "llama-3-8b.json")) as f:
        hf = json.load(f)
    hf.update(TINY_SHAPE)
    cfg = config_from_hf(hf)
    path = str(tmp_path_factory.mktemp("tiny_invariant"))
    save_checkpoint(path, cfg, llama.LLAMA.init_params(cfg, jax.random.key(3), jnp.float32))
    return path


def _default_llm(model, dtype=None, **kw):
    """LLM(model) at the CPU default dtype (conftest sets float32 for the rest of the suite), or
    at `dtype`."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("JAXINFER_DEFAULT_DTYPE", raising=False)
        llm = ji.LLM(model, dtype=dtype, **kw)
    assert llm.dtype == (dtype or "bfloat16") and llm.backend.batch_invariant
    return llm


def _request(rng, vocab: int, max_prompt: int, max_tokens: int):
    """A random prompt and random sampling parameters (greedy or sampled, filters on or off)."""
    prompt = rng.integers(3, vocab, int(rng.integers(1, max_prompt + 1))).tolist()
    temperature = float(rng.choice([0.0, 0.7, 1.0, 1.3]))
    params = ji.SamplingParams(
        max_tokens=int(rng.integers(1, max_tokens + 1)), temperature=temperature,
        top_k=int(rng.choice([0, 1, 7, 50])), top_p=float(rng.choice([1.0, 0.9, 0.5])),
        min_p=float(rng.choice([0.0, 0.0, 0.1])),
        repetition_penalty=float(rng.choice([1.0, 1.0, 1.2])),
        seed=int(rng.integers(0, 2**32)), logprobs=20, ignore_eos=True)
    return prompt, params


def _result(out):
    return out.token_ids, out.logprobs


def _check_cases(engines, reference, cases, rng, vocab, max_prompt, max_tokens):
    """Each case alone on `reference`, then on every engine beside 1 to 5 random companions
    (the case at a random place among them): bitwise equal tokens and logprobs."""
    for i, (prompt, params) in enumerate(cases):
        want = _result(reference.generate([prompt], params)[0])
        assert len(want[0]) == params.max_tokens
        for name, llm in engines.items():
            others = [_request(rng, vocab, max_prompt, max_tokens)
                      for _ in range(int(rng.integers(1, 6)))]
            at = int(rng.integers(0, len(others) + 1))
            others.insert(at, (prompt, params))
            outs = llm.generate([p for p, _ in others], [s for _, s in others])
            got = _result(outs[at])
            assert got == want, (i, name, prompt, params)


@pytest.fixture(scope="module", params=[None, "float32"], ids=["default", "float32"])
def dtype(request):
    return request.param


@pytest.fixture(scope="module")
def tiny_engines(tiny_path, dtype):
    """One engine per scheduling regime of the same tiny model."""
    common = dict(max_seq_len=160, page_size=16, dtype=dtype)
    return {
        # Small chunks and a small token budget: prompts prefill over several steps, beside
        # other rows' decode tokens.
        "chunked": _default_llm(tiny_path, max_num_seqs=6, prefill_chunk=16,
                                max_num_batched_tokens=32, decode_steps=4, **common),
        # One decode step per dispatch, and too few pages for every row: preemption.
        "preempting": _default_llm(tiny_path, max_num_seqs=6, decode_steps=1, num_pages=14,
                                   **common),
        # n-gram speculation: verification forwards of k + 1 tokens a row.
        "ngram": _default_llm(tiny_path, max_num_seqs=6, decode_steps=4,
                              speculative=ji.SpeculativeConfig("ngram", num_draft_tokens=3),
                              **common),
    }


def test_a_request_gets_the_same_bits_alone_and_in_any_batch(tiny_path, tiny_engines, dtype):
    """Random requests (prompts of 1-120 tokens, greedy and sampled with random filters and
    seeds, 1-24 new tokens) alone on an engine with the defaults, then each beside random
    companions on engines that chunk prefill, preempt, and speculate: the same token ids
    and log-probabilities, bit for bit. Repeated prompts hit the prefix cache of pages
    written by an earlier run."""
    reference = _default_llm(tiny_path, dtype, max_num_seqs=1, max_seq_len=160)
    rng = np.random.default_rng(0)
    cases = [_request(rng, 512, 120, 24) for _ in range(10)]
    cases.append(cases[0])  # served from the prefix cache everywhere this time
    _check_cases(tiny_engines, reference, cases, rng, 512, 120, 24)
    stats = {name: llm.stats() for name, llm in tiny_engines.items()}
    assert stats["preempting"]["preemptions"] > 0, stats
    assert any(s.get("prefix_cache_hit_tokens", 0) > 0 for s in stats.values()), stats


def test_smollm2_gets_the_same_bits_alone_and_in_any_batch():
    """The real model at its defaults: a few requests alone and beside companions on an
    engine with small prefill chunks (short outputs, to keep the test quick)."""
    reference = _default_llm("smollm2-135m", max_num_seqs=1, max_seq_len=192)
    chunked = _default_llm("smollm2-135m", max_num_seqs=4, max_seq_len=192, prefill_chunk=16,
                           max_num_batched_tokens=32, decode_steps=4)
    rng = np.random.default_rng(1)
    vocab = reference.model_config.vocab_size
    cases = [_request(rng, vocab, 60, 6) for _ in range(3)]
    _check_cases({"chunked": chunked}, reference, cases, rng, vocab, 60, 6)
