"""Engine scheduling on a tiny HF model: warmup covers every shape, slots are refilled, and
batching does not change greedy results."""

import os

import numpy as np
import pytest

import jaxinfer as ji

TINY = os.path.join(os.path.dirname(__file__), "..", "data", "tiny_models", "llama")


@pytest.fixture(scope="module")
def llm():
    # Small buckets: batch {1, 4}, prefill chunk {16, 32}, kv_view {128} (capacity 128).
    return ji.LLM(TINY, max_seq_len=128, max_num_seqs=4, prefill_chunk=32, decode_steps=4)


def _prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(1, 90))).tolist() for _ in range(n)]


def test_no_compilation_after_warmup(llm, compile_recorder):
    llm.warmup()
    with compile_recorder() as rec:
        # Mixed lengths (chunked prefill over 1..3 chunks), more requests than slots, each
        # sampling mode, seeds and stop strings: nothing may compile.
        prompts = _prompts(7, 0)
        params = [ji.SamplingParams(max_tokens=int(m), temperature=t, top_k=k, seed=i)
                  for i, (m, t, k) in enumerate(zip([3, 9, 20, 1, 5, 30, 2],
                                                    [0, 0.5, 1.0, 0, 0.9, 0, 1.5],
                                                    [0, 0, 8, 0, 3, 0, 0]))]
        outs = llm.generate(prompts, params)
        outs += llm.generate(_prompts(1, 1), ji.SamplingParams(max_tokens=40, ignore_eos=True))
        assert rec.logs == [] and rec.events == [], rec.logs
    assert [len(o.token_ids) for o in outs[:7]] == [3, 9, 20, 1, 5, 30, 2]


def test_batching_and_slot_reuse_keep_greedy_results(llm):
    """Ten requests through four slots (slots refilled as requests finish) give the tokens each
    gets when run alone."""
    prompts = _prompts(10, 2)
    params = [ji.SamplingParams(max_tokens=m, ignore_eos=True)
              for m in [12, 3, 25, 7, 1, 18, 9, 30, 4, 14]]
    together = llm.generate(prompts, params)
    for prompt, sp, out in zip(prompts, params, together):
        alone = llm.generate([prompt], sp)[0]
        assert out.token_ids == alone.token_ids
        assert len(out.token_ids) == sp.max_tokens and out.finish_reason == "length"
    assert llm.stats()["running"] == 0 and llm.stats()["waiting"] == 0


def test_greedy_matches_hf_generate(llm):
    """HF transformers' greedy continuation of the tiny model (golden.npz), via the engine."""
    golden = np.load(os.path.join(TINY, "golden.npz"))
    n = int(golden["greedy_prompt_len"])
    prompt = golden["input_ids"][0, :n].tolist()
    want = golden["greedy_ids"][0].tolist()
    out = llm.generate([prompt], ji.SamplingParams(max_tokens=len(want), ignore_eos=True))[0]
    assert out.token_ids == want
