"""A hybrid KV cache: a model that interleaves sliding-window and global layers (Gemma 3) keeps
its sliding-window layers' keys in a ring of window + (most tokens a row writes in a step) - 1
slots per row, and only its global layers' keys in the page pool (docs/architecture.md, KV
cache).

The tiny Gemma 3 checkpoint has window 8 and layers (local, local, global). At max_seq_len 64,
prefill chunks of 16 and pages of 16, its ring is 8 + 16 - 1 = 23 slots, two pages (32 slots)
a row, so every request below wraps the ring at least once, in its prefill chunks and in its
decode steps. The reference is the scoring forward over the whole sequence (sequence_logits:
no ring, no pages, every key kept and masked by the window)."""

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer as ji
from jaxinfer import backends
from jaxinfer.engine import memory
from jaxinfer.models.base import sequence_logits

TINY = os.path.join(os.path.dirname(__file__), "..", "data", "tiny_models", "gemma3")
SEQ = 64


def _llm(**kw):
    kw = dict(max_seq_len=SEQ, max_num_seqs=2, prefill_chunk=16, decode_steps=4,
              page_size=16, dtype="float32") | kw
    return ji.LLM(TINY, **kw)


def _prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 256, size=n).tolist() for n in (20, 41)]


def test_layout():
    """Two local layers in a ring of two pages a row, the global one in the pool; the pool's
    page bytes count the global layer only, and no prefix caching (a cached prefix's keys would
    be in the pool's layers alone)."""
    llm = _llm()
    engine = llm._engine
    assert engine.runner.ring_capacity == 8 + 16 - 1 == llm.stats()["ring_slots"]
    engine.runner.ensure_state()
    cache = engine.state.cache
    assert cache.local_pages == 2 and cache.local_k.shape[:2] == (2, 2 * 2 * 16)
    assert cache.k.shape[0] == 1
    assert not engine.paged.allocator.enable_prefix_caching
    cfg = llm.model_config
    assert memory.kv_page_bytes(cfg, 16, np.float32, 1) * 3 == memory.kv_page_bytes(
        cfg, 16, np.float32)
    # Where a ring would not be smaller than a row's pages, every layer stays in the pool.
    assert _llm(max_seq_len=32)._engine.runner.ring_capacity == 0
    assert memory.local_ring_capacity(cfg, 16 + 16, 16, 16) == 0
    assert memory.local_ring_capacity(cfg, 16 + 17, 16, 16) == 23
    with pytest.raises(ValueError, match="hybrid_kv_cache must be a bool, got 1"):
        _llm(hybrid_kv_cache=1)


def _dense_greedy(llm, prompt, n):
    """n greedy tokens by rescoring the whole sequence each step (one compiled [1, SEQ] forward:
    padding after the sequence changes no earlier position's logits)."""
    params, cfg = llm.params, llm.model_config
    ids = list(prompt)
    for _ in range(n):
        tokens = np.zeros((1, SEQ), np.int32)
        tokens[0, :len(ids)] = ids
        logits = sequence_logits(params, cfg, jnp.asarray(tokens))
        ids.append(int(np.argmax(np.asarray(logits[0, len(ids) - 1]))))
    return ids[len(prompt):]


def test_greedy_matches_the_dense_forward():
    """Both prompts side by side (chunked prefill and decode steps in one batch), to the end of
    max_seq_len: the ring wraps in every row."""
    llm = _llm()
    prompts = _prompts()
    outs = llm.generate(prompts, ji.SamplingParams(max_tokens=20, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _dense_greedy(llm, prompt, 20)


@pytest.mark.parametrize("case", ["n2", "ngram", "draft", "preempt", "beam"])
def test_same_tokens_as_every_layer_in_the_pool(case):
    """Seeded sampling with n = 2 (the forks copy the ring rows), n-gram speculation and a draft
    model (the tiny model drafting for itself; rejected drafts roll back over the ring),
    preemption (a pool of 6 pages for two rows of up to 4: a preempted request recomputes its
    ring) and beam search (width 4: every fork copies ring rows) give the tokens of the same
    engine with every layer in the pool."""
    kw, params = {}, ji.SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=3)
    if case == "n2":
        params = ji.SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=3, n=2)
    elif case == "ngram":
        kw = dict(speculative=ji.SpeculativeConfig("ngram", num_draft_tokens=3))
        params = ji.SamplingParams(max_tokens=20, ignore_eos=True)
    elif case == "draft":
        kw = dict(speculative=ji.SpeculativeConfig("draft", num_draft_tokens=3,
                                                   draft_model=TINY))
    elif case == "preempt":
        kw = dict(num_pages=6)
    elif case == "beam":
        kw = dict(max_num_seqs=4)
    prompts = _prompts()

    def run(llm):
        if case == "beam":
            from jaxinfer.engine.beam_search import BeamSearchParams

            outs = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=16,
                                                             ignore_eos=True))
            return [[s.token_ids for s in o.sequences] for o in outs]
        return [[o.token_ids for o in out.outputs] for out in llm.generate(prompts, params)]

    hybrid = _llm(**kw)
    assert hybrid._engine.runner.ring_capacity > 0
    got = run(hybrid)
    if case == "preempt":
        assert hybrid.stats()["preemptions"] > 0
    pooled = _llm(hybrid_kv_cache=False, **kw)
    assert pooled._engine.runner.ring_capacity == 0
    assert got == run(pooled)


def test_sliding_window_ring_holds_a_whole_prefill_chunk():
    """A model whose every layer has the window (tiny Mistral, window 8) runs on a ring alone,
    sized by the same rule: 8 + 16 - 1 slots, so a 16-token prefill chunk does not overwrite
    keys its first queries still see (a ring of window + num_draft_tokens slots did)."""
    llm = ji.LLM(TINY.replace("gemma3", "mistral_sw"), max_seq_len=SEQ, max_num_seqs=2,
                 prefill_chunk=16, decode_steps=4)
    assert llm._engine.runner.capacity == 8 + 16 - 1
    with pytest.raises(NotImplementedError, match="every layer has a sliding window"):
        ji.LLM(TINY.replace("gemma3", "mistral_sw"), max_seq_len=SEQ, num_pages=64)
    prompts = _prompts()
    outs = llm.generate(prompts, ji.SamplingParams(max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == _dense_greedy(llm, prompt, 12)


@pytest.mark.parametrize("attention", ["reference", "pallas"])
def test_forward_over_a_hybrid_cache(attention):
    """The model's forward over a hybrid cache, both attention paths (the Pallas kernel in
    interpret mode reads the ring with wraps=True): two rows fed in chunks of 8 and then one
    token a step, the local layers' ring 8 + 8 - 1 slots (two pages of 8) wrapping several
    times, equal the dense scoring forward's logits (float32, 1e-4: the same math in another
    order). The tiny Gemma 3 config with head dim 32 (a kernel head dim), random weights."""
    from jaxinfer.device.kv_cache import PagedKVCache, ring_capacity, ring_tables
    from jaxinfer.loading import load_model
    from jaxinfer.models import get_model

    import jax

    cfg = load_model(TINY).config.replace(head_dim=32)
    model = get_model(cfg.architecture)
    params = model.init_params(cfg, jax.random.key(0))
    B, Z, S, K, H = 2, 8, 48, cfg.num_kv_heads, cfg.head_dim
    R = -(-ring_capacity(8, 8) // Z)
    local = cfg.num_local_layers
    zeros = lambda L, P: jnp.zeros((L, P * Z, K, H), jnp.float32)  # noqa: E731
    M = S // Z
    cache = PagedKVCache(k=zeros(cfg.num_layers - local, B * M),
                         v=zeros(cfg.num_layers - local, B * M),
                         block_tables=jnp.asarray(ring_tables(B, M)),
                         lengths=jnp.zeros(B, jnp.int32), page_size=Z,
                         local_k=zeros(local, B * R), local_v=zeros(local, B * R), local_pages=R)
    tokens = np.random.default_rng(1).integers(3, cfg.vocab_size, (B, S)).astype(np.int32)
    forward = jax.jit(model.forward, static_argnums=(1,), static_argnames=("backend",))
    backend = dataclasses.replace(backends.default(), attention=attention)
    got, pos = [], 0
    for width in [8] * 4 + [1] * (S - 32):
        h, cache = forward(params, cfg, jnp.asarray(tokens[:, pos:pos + width]), cache,
                           jnp.full((B,), width, jnp.int32), backend=backend)
        got.append(np.asarray(model.head(params, h)))
        pos += width
    want = np.asarray(sequence_logits(params, cfg, jnp.asarray(tokens)))
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, atol=1e-4, rtol=0)
    assert int(cache.lengths[0]) == S > 2 * R * Z


def test_no_compilation_after_warmup(compile_recorder):
    """warmup() compiles every program a hybrid engine runs: prompts in chunks and decode steps
    with the ring wrapping, then a fork (n = 2), compile nothing more."""
    llm = _llm()
    llm.warmup()
    prompts = _prompts()
    with compile_recorder() as rec:
        llm.generate(prompts, ji.SamplingParams(max_tokens=12, ignore_eos=True))
        llm.generate(prompts[:1], ji.SamplingParams(max_tokens=8, temperature=0.7, seed=1, n=2))
    assert not rec.logs and not rec.events, rec.logs
