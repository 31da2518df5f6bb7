"""Exact properties of the cache and the device loop, on tiny random models (float32).

chunked prefill == one-shot prefill; prefill + N decode steps == one full forward; a ring of
capacity window + chunk that wraps == a dense forward with a sliding-window mask; one flat step
mixing decode tokens and a prefill chunk == each sequence's full forward. Tolerance 1e-5 (the
same math in a different order).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.device import state as device_state
from jaxinfer.device.loop import decode_loop
from jaxinfer.device.step import step_jit
from jaxinfer.config import ModelConfig
from jaxinfer.device.kv_cache import PagedKVCache
from jaxinfer.device.token_batch import TokenBatch
from jaxinfer.models import llama
from jaxinfer.models import sequence_logits
from jaxinfer.device.sampling import SamplingArrays

# Jitted so each shape compiles once (an eager lax.scan would re-trace on every call).
forward = jax.jit(llama.LLAMA.forward, static_argnums=(1,))

TINY = ModelConfig("llama", vocab_size=97, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, ffn_dim=64, rope_theta=10000.0, max_position_embeddings=512)


def _params(cfg, seed=0):
    return llama.LLAMA.init_params(cfg, jax.random.key(seed))


def _full_logits(cfg, params, tokens):
    """One forward over the whole sequence from an empty cache."""
    return np.asarray(sequence_logits(params, cfg, jnp.asarray([tokens], jnp.int32)))[0]


def _chunked_logits(cfg, params, tokens, chunk, capacity, pad_to=None):
    cache = PagedKVCache.ring(cfg.num_layers, 1, capacity, cfg.num_kv_heads, cfg.head_dim)
    out = []
    for s in range(0, len(tokens), chunk):
        piece = tokens[s:s + chunk]
        width = pad_to or len(piece)
        toks = np.zeros((1, width), np.int32)
        toks[0, :len(piece)] = piece
        h, cache = forward(params, cfg, jnp.asarray(toks), cache,
                                 jnp.asarray([len(piece)], jnp.int32))
        out.append(np.asarray(llama.LLAMA.head(params, h))[0, :len(piece)])
    return np.concatenate(out), cache


def test_chunked_prefill_equals_one_shot():
    params = _params(TINY)
    tokens = np.random.default_rng(0).integers(0, TINY.vocab_size, 45).tolist()
    full = _full_logits(TINY, params, tokens)
    for chunk, pad in ((8, None), (16, 16), (7, 16)):  # padded chunks carry invisible padding
        got, cache = _chunked_logits(TINY, params, tokens, chunk, capacity=64, pad_to=pad)
        np.testing.assert_allclose(got, full, atol=1e-5, rtol=0)
        assert int(cache.lengths[0]) == len(tokens)


def test_prefill_then_decode_steps_equal_full_forward():
    params = _params(TINY, 1)
    tokens = np.random.default_rng(1).integers(0, TINY.vocab_size, 30).tolist()
    full = _full_logits(TINY, params, tokens)
    got, _ = _chunked_logits(TINY, params, tokens, chunk=1, capacity=32)  # 1 prompt chunk of 1..
    np.testing.assert_allclose(got, full, atol=1e-5, rtol=0)
    cache = PagedKVCache.ring(TINY.num_layers, 1, 32, TINY.num_kv_heads, TINY.head_dim)
    h, cache = forward(params, TINY, jnp.asarray([tokens[:20]]), cache, jnp.asarray([20]))
    steps = []
    for t in tokens[20:]:
        h, cache = forward(params, TINY, jnp.asarray([[t]]), cache, jnp.asarray([1]))
        steps.append(np.asarray(llama.LLAMA.head(params, h))[0, 0])
    np.testing.assert_allclose(np.stack(steps), full[20:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_ring_wrap_with_sliding_window_matches_dense(chunk):
    """capacity == window + chunk (the most a row writes in one call): each call writes before
    it attends, the ring wraps several times, and it still equals a dense masked forward."""
    window = 6
    cfg = TINY.replace(sliding_window=window)
    params = _params(cfg, 2)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, 40).tolist()
    dense = _full_logits(cfg, params, tokens)  # capacity 40 > window: no wrap, mask only
    got, cache = _chunked_logits(cfg, params, tokens, chunk, capacity=window + chunk)
    np.testing.assert_allclose(got, dense, atol=1e-5, rtol=0)
    assert cache.capacity == window + chunk and cache.wraps  # 40 positions went round it
    # And the window matters: without it the logits differ.
    no_window = _full_logits(TINY, params, tokens)
    assert np.abs(no_window[window + 1:] - dense[window + 1:]).max() > 1e-3


def _rows(B, max_new, temperature=0.0, seed=0, stop=-1):
    sp = SamplingArrays(temperature=np.full(B, temperature, np.float32),
                        top_k=np.zeros(B, np.int32), top_p=np.ones(B, np.float32),
                        min_p=np.zeros(B, np.float32), repetition_penalty=np.ones(B, np.float32),
                        seed=np.full(B, seed, np.uint32))
    return device_state.RowParams(sampling=sp, max_new=np.full(B, max_new, np.int32),
                                  stop_ids=np.full((B, 2), stop, np.int32),
                                  logprobs=np.zeros(B, bool), prompt_logprobs=np.zeros(B, bool),
                                  sampled_logprobs=np.zeros(B, bool))


def _started(cfg, params, rows, prompts, capacity=64):
    """A state whose rows hold the prompts [B, T] (all real) and their first sampled token."""
    B = prompts.shape[0]
    state = device_state.DecodeState.create(cfg, B, capacity, num_stop_ids=2)
    state = device_state.admit_rows(state, np.ones(B, bool), np.zeros(B, np.int32),
                                    np.zeros(B, np.int32), rows)
    batch = TokenBatch.dense(jnp.asarray(prompts), jnp.full((B,), prompts.shape[1], jnp.int32),
                             None, B)
    out, state = step_jit(params, state, batch, jnp.arange(B, dtype=jnp.int32), cfg=cfg,
                          query_tile=prompts.shape[1])
    return out.tokens, state


def test_decode_loop_matches_stepwise_greedy():
    """decode_loop (many steps in one while_loop) == argmax of step-by-step full forwards."""
    params = _params(TINY, 3)
    prompt = np.random.default_rng(3).integers(0, TINY.vocab_size, 11).tolist()
    first, state = _started(TINY, params, _rows(1, max_new=9), np.asarray([prompt], np.int32))
    state, out, num_out, done, _, _ = decode_loop(params, state, np.asarray([0], np.int32),
                                                      cfg=TINY, num_steps=16)
    got = [int(first[0])] + np.asarray(out)[0, :int(num_out[0])].tolist()
    assert len(got) == 9 and bool(done[0])
    seq = list(prompt)
    for _ in range(9):
        seq.append(int(np.argmax(_full_logits(TINY, params, seq)[-1])))
    assert got == seq[11:]


def test_decode_loop_stops_rows_independently():
    params = _params(TINY, 4)
    B = 3
    prompts = np.random.default_rng(4).integers(0, TINY.vocab_size, (B, 5)).astype(np.int32)
    rows = _rows(B, max_new=6).replace(max_new=np.asarray([2, 6, 4], np.int32))
    _, state = _started(TINY, params, rows, prompts)
    # Row 1 twice in a padded list (B marks empty entries) would be an error; list each once.
    state, out, num_out, done, _, _ = decode_loop(
        params, state, np.asarray([2, 0, 1, B], np.int32), cfg=TINY, num_steps=8)
    assert np.asarray(num_out).tolist() == [1, 5, 3]  # the first token came from prefill
    assert np.asarray(done).all()
    assert np.asarray(state.cache.lengths).tolist() == [5 + 1, 5 + 5, 5 + 3]


def test_decode_loop_leaves_unlisted_rows_alone():
    params = _params(TINY, 6)
    B = 3
    prompts = np.random.default_rng(6).integers(0, TINY.vocab_size, (B, 4)).astype(np.int32)
    _, state = _started(TINY, params, _rows(B, max_new=6), prompts)
    state, out, num_out, done, _, _ = decode_loop(
        params, state, np.asarray([1, B], np.int32), cfg=TINY, num_steps=3)
    assert np.asarray(num_out).tolist() == [0, 3, 0]
    assert np.asarray(state.cache.lengths).tolist() == [4, 4 + 3, 4]


forward_tokens = jax.jit(llama.LLAMA.forward_tokens, static_argnums=(1,),
                         static_argnames=("backend", "query_tile", "num_tiles"))


@pytest.mark.parametrize("cache_kind", ["ring", "ring-window", "paged"])
def test_flat_step_equals_separate_full_forwards(cache_kind):
    """One flat step holding a decode token for rows 2 and 0 and an 8-token prefill chunk for
    row 1 (in that order in the batch, padding after them; row 3 idle) == each sequence's full
    forward. The sliding-window ring is window + 8 slots: it wraps under the chunk."""
    from jaxinfer.device.token_batch import host_batch

    cfg = TINY if cache_kind != "ring-window" else dataclasses.replace(TINY, sliding_window=6)
    params = _params(cfg, 5)
    rng = np.random.default_rng(5)
    B, capacity = 4, (6 + 8 if cache_kind == "ring-window" else 32)
    if cache_kind == "paged":
        tables = rng.permutation(np.arange(1, 1 + B * 8)).reshape(B, 8).astype(np.int32)
        cache = PagedKVCache.create(cfg.num_layers, 1 + B * 8, 4, cfg.num_kv_heads,
                                    cfg.head_dim, tables)
        cache = cache.replace(k=jnp.full_like(cache.k, jnp.nan), v=jnp.full_like(cache.v, jnp.nan))
    else:
        cache = PagedKVCache.ring(cfg.num_layers, B, capacity, cfg.num_kv_heads, cfg.head_dim)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (10, 8, 13, 0)]
    # Rows 0 and 2 hold all but their last token; row 1 is empty.
    pre = np.zeros((B, 16), np.int32)
    num = np.array([9, 0, 12, 0], np.int32)
    for b in (0, 2):
        pre[b, :num[b]] = seqs[b][:-1]
    _, cache = forward(params, cfg, jnp.asarray(pre), cache, jnp.asarray(num))

    batch = host_batch(16, B, [(2, [seqs[2][-1]]), (0, [seqs[0][-1]]), (1, seqs[1])])
    h, cache = forward_tokens(params, cfg, batch, cache, query_tile=4)
    assert np.asarray(cache.lengths).tolist() == [10, 8, 13, 0]
    logits = np.asarray(llama.LLAMA.head(params, h))
    np.testing.assert_allclose(logits[0], _full_logits(cfg, params, seqs[2])[-1], atol=1e-5)
    np.testing.assert_allclose(logits[1], _full_logits(cfg, params, seqs[0])[-1], atol=1e-5)
    np.testing.assert_allclose(logits[2:10], _full_logits(cfg, params, seqs[1]), atol=1e-5)
    # The cache now holds row 1's keys: its next decode token sees them.
    nxt = int(np.argmax(logits[9]))
    h, _ = forward_tokens(params, cfg, host_batch(4, B, [(1, [nxt])]), cache, query_tile=1)
    np.testing.assert_allclose(np.asarray(llama.LLAMA.head(params, h))[0],
                               _full_logits(cfg, params, seqs[1] + [nxt])[-1], atol=1e-5)
