"""num_pages=None: the page pool sized from device memory and the compiled step's memory
analysis. The CPU backend reports no memory, so the device's figures are given here; the
compile and the analysis are real."""

import os

import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer.engine import memory

TINY = os.path.join(os.path.dirname(__file__), "..", "data", "tiny_models", "llama")


def test_pages_for_memory_arithmetic():
    # 90% of 1000 = 900; minus 300 in use and 100 of scratch leaves 500: 4 pages of 120.
    assert memory.pages_for_memory(1000, 300, 100, 120) == 4
    assert memory.pages_for_memory(1000, 900, 100, 120) == 0


def test_cpu_reports_no_memory():
    assert memory.free_device_memory() is None


def _llm(monkeypatch, limit, in_use):
    monkeypatch.setattr(memory, "free_device_memory", lambda device=None: (limit, in_use))
    return ji.LLM(TINY, max_seq_len=128, max_num_seqs=4, prefill_chunk=32, decode_steps=4,
                  page_size=8)


def test_num_pages_from_device_memory(monkeypatch):
    """The pool takes what is left of 90% of the device after the weights and the step's
    scratch memory: the bytes of the cache arrays the engine really allocated (not the
    formula's page size) plus those two fit, and one page more would not."""
    import jax

    limit, in_use = 64 << 20, 4 << 20
    llm = _llm(monkeypatch, limit, in_use)
    engine = llm._engine
    step = engine.step_scratch_bytes()
    assert 0 < step < limit
    out = llm.generate([[1, 2, 3]], ji.SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5  # the pages work (and the state now exists)
    cache = engine.state.cache
    pool = sum(int(x.nbytes) for x in jax.tree.leaves((cache.k, cache.v)))
    page = pool // engine.num_pages
    assert page * engine.num_pages == pool
    assert page == memory.kv_page_bytes(llm.model_config, 8, np.float32)
    budget = limit * memory.UTILIZATION
    assert in_use + step + pool <= budget < in_use + step + pool + page
    # Far more pages than the CPU default (every slot at max_seq_len).
    assert engine.num_pages > 4 * 16 + 1
    assert llm.stats()["num_pages"] == engine.num_pages


def test_too_little_memory_names_the_numbers(monkeypatch):
    with pytest.raises(ValueError, match=r"of 90% of 2000000 device bytes, 1500000 are in use"
                                         r".*needs 17"):
        _llm(monkeypatch, 2_000_000, 1_500_000)



def test_num_pages_from_device_memory_with_a_hybrid_cache(monkeypatch):
    """A hybrid cache (tiny Gemma 3: two sliding-window layers in a ring, one global layer in
    the pool): the ring's bytes come off the top and each page holds the global layer only, so
    weights, step scratch, ring and pool fit in 90% of the device, and one page more would not."""
    import jax

    limit, in_use = 16 << 20, 1 << 20
    monkeypatch.setattr(memory, "free_device_memory", lambda device=None: (limit, in_use))
    llm = ji.LLM(TINY.replace("llama", "gemma3"), max_seq_len=128, max_num_seqs=4,
                 prefill_chunk=16, decode_steps=4, page_size=8)
    engine = llm._engine
    assert llm.stats()["ring_slots"] == 8 + 16 - 1
    llm.generate([[1, 2, 3]], ji.SamplingParams(max_tokens=5, ignore_eos=True))
    cache = engine.state.cache
    pool = sum(int(x.nbytes) for x in jax.tree.leaves((cache.k, cache.v)))
    ring = sum(int(x.nbytes) for x in jax.tree.leaves((cache.local_k, cache.local_v)))
    page = pool // engine.num_pages
    assert page * engine.num_pages == pool and cache.k.shape[0] == 1
    assert ring == memory.ring_bytes(llm.model_config, 4, 23, 8, np.float32) == 2 * page * 3 * 4
    budget = limit * memory.UTILIZATION
    step = engine.step_scratch_bytes()
    assert in_use + step + ring + pool <= budget < in_use + step + ring + pool + page
