"""Exact properties of the cache and the device loop, on tiny random models (float32).

chunked prefill == one-shot prefill; prefill + N decode steps == one full forward; a ring of
capacity == window that wraps == a dense forward with a sliding-window mask. Tolerance 1e-5
(the same math in a different order).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import decode
from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import RingKVCache
from jaxinfer.models import llama
from jaxinfer.sampling import SamplingArrays

# Jitted so each shape compiles once (an eager lax.scan would re-trace on every call).
forward = jax.jit(llama.forward, static_argnums=(1,))

TINY = ModelConfig("llama", vocab_size=97, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, ffn_dim=64, rope_theta=10000.0, max_position_embeddings=512)


def _params(cfg, seed=0):
    return llama.init_params(cfg, jax.random.key(seed))


def _full_logits(cfg, params, tokens):
    """One forward over the whole sequence from an empty cache."""
    return np.asarray(llama.sequence_logits(params, cfg, jnp.asarray([tokens], jnp.int32)))[0]


def _chunked_logits(cfg, params, tokens, chunk, capacity, pad_to=None):
    cache = RingKVCache.create(cfg.num_layers, 1, capacity, cfg.num_kv_heads, cfg.head_dim)
    out = []
    for s in range(0, len(tokens), chunk):
        piece = tokens[s:s + chunk]
        width = pad_to or len(piece)
        toks = np.zeros((1, width), np.int32)
        toks[0, :len(piece)] = piece
        h, cache = forward(params, cfg, jnp.asarray(toks), cache,
                                 jnp.asarray([len(piece)], jnp.int32))
        out.append(np.asarray(llama.lm_head(params, h))[0, :len(piece)])
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
    cache = RingKVCache.create(TINY.num_layers, 1, 32, TINY.num_kv_heads, TINY.head_dim)
    h, cache = forward(params, TINY, jnp.asarray([tokens[:20]]), cache, jnp.asarray([20]))
    steps = []
    for t in tokens[20:]:
        h, cache = forward(params, TINY, jnp.asarray([[t]]), cache, jnp.asarray([1]))
        steps.append(np.asarray(llama.lm_head(params, h))[0, 0])
    np.testing.assert_allclose(np.stack(steps), full[20:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_ring_wrap_with_sliding_window_matches_dense(chunk):
    """capacity == window: the ring wraps several times and still equals a dense masked forward."""
    window = 6
    cfg = TINY.replace(sliding_window=window)
    params = _params(cfg, 2)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, 40).tolist()
    dense = _full_logits(cfg, params, tokens)  # capacity 40 > window: no wrap, mask only
    got, cache = _chunked_logits(cfg, params, tokens, chunk, capacity=window)
    np.testing.assert_allclose(got, dense, atol=1e-5, rtol=0)
    # The ring holds exactly the last `window` positions.
    assert sorted(np.asarray(cache.positions[0]).tolist()) == list(range(40 - window, 40))
    # And the window matters: without it the logits differ.
    no_window = _full_logits(TINY, params, tokens)
    assert np.abs(no_window[window + 1:] - dense[window + 1:]).max() > 1e-3


def _rows(B, max_new, temperature=0.0, seed=0, stop=-1):
    sp = SamplingArrays(temperature=np.full(B, temperature, np.float32),
                        top_k=np.zeros(B, np.int32), top_p=np.ones(B, np.float32),
                        min_p=np.zeros(B, np.float32), repetition_penalty=np.ones(B, np.float32),
                        seed=np.full(B, seed, np.uint32))
    return decode.RowParams(sampling=sp, max_new=np.full(B, max_new, np.int32),
                            stop_ids=np.full((B, 2), stop, np.int32), active=np.ones(B, bool),
                            start_index=np.zeros(B, np.int32),
                            logprobs=np.zeros(B, bool), prompt_logprobs=np.zeros(B, bool))


def test_decode_loop_matches_stepwise_greedy():
    """decode_loop (many steps in one while_loop) == argmax of step-by-step full forwards."""
    params = _params(TINY, 3)
    prompt = np.random.default_rng(3).integers(0, TINY.vocab_size, 11).tolist()
    state = decode.DecodeState.create(TINY, 1, 64)
    rows = _rows(1, max_new=9)
    state, first, *_ = decode.prefill_chunk(
        params, state, np.asarray([prompt + [0] * 5], np.int32), np.asarray([11], np.int32),
        np.asarray([True]), np.full((1, 16), -1, np.int32), rows, cfg=TINY)
    state, out, num_out, done, _ = decode.decode_loop(params, state, rows, cfg=TINY,
                                                      num_steps=16)
    got = [int(first[0])] + np.asarray(out)[0, :int(num_out[0])].tolist()
    assert len(got) == 9 and bool(done[0])
    seq = list(prompt)
    for _ in range(9):
        seq.append(int(np.argmax(_full_logits(TINY, params, seq)[-1])))
    assert got == seq[11:]


def test_decode_loop_stops_rows_independently():
    params = _params(TINY, 4)
    B = 3
    state = decode.DecodeState.create(TINY, B, 64)
    prompts = np.random.default_rng(4).integers(0, TINY.vocab_size, (B, 5)).astype(np.int32)
    rows = _rows(B, max_new=6)
    rows = rows.replace(max_new=np.asarray([2, 6, 4], np.int32))
    state, *_ = decode.prefill_chunk(params, state, prompts, np.full(B, 5, np.int32),
                                     np.ones(B, bool), np.full((B, 5), -1, np.int32), rows,
                                     cfg=TINY)
    state, out, num_out, done, _ = decode.decode_loop(params, state, rows, cfg=TINY,
                                                      num_steps=8)
    assert np.asarray(num_out).tolist() == [1, 5, 3]  # the first token came from prefill
    assert np.asarray(done).all()
    assert np.asarray(state.cache.lengths).tolist() == [5 + 1, 5 + 5, 5 + 3]


forward_groups = jax.jit(llama.forward_groups, static_argnums=(1,), static_argnames=("kv_view",))


@pytest.mark.parametrize("cache_kind", ["ring", "ring-window", "paged"])
def test_forward_groups_equal_separate_full_forwards(cache_kind):
    """One forward_groups call with a decode group (one token for rows 0 and 2) and a prefill
    group (8 tokens for row 1, plus a padding row) == each sequence's full forward; row 3 idle.
    With a sliding-window ring smaller than the chunk's reach, the chunk takes the
    write-after-attending path while the decode group writes first."""
    from jaxinfer.kv_cache import PagedKVCache

    cfg = TINY if cache_kind != "ring-window" else dataclasses.replace(TINY, sliding_window=6)
    params = _params(cfg, 5)
    rng = np.random.default_rng(5)
    B, capacity = 4, (6 if cache_kind == "ring-window" else 32)
    if cache_kind == "paged":
        tables = rng.permutation(np.arange(1, 1 + B * 8)).reshape(B, 8).astype(np.int32)
        cache = PagedKVCache.create(cfg.num_layers, 1 + B * 8, 4, cfg.num_kv_heads,
                                    cfg.head_dim, tables)
    else:
        cache = RingKVCache.create(cfg.num_layers, B, capacity, cfg.num_kv_heads, cfg.head_dim)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (10, 8, 13, 0)]
    # Rows 0 and 2 hold all but their last token; row 1 is empty.
    pre = np.zeros((B, 16), np.int32)
    num = np.array([9, 0, 12, 0], np.int32)
    for b in (0, 2):
        pre[b, :num[b]] = seqs[b][:-1]
    _, cache = forward(params, cfg, jnp.asarray(pre), cache, jnp.asarray(num))

    last = np.array([seqs[0][-1], 0, seqs[2][-1], 0], np.int32)[:, None]
    chunk = np.zeros((2, 8), np.int32)
    chunk[0] = seqs[1]
    queries = [llama.Query(jnp.asarray(last), jnp.asarray([1, 0, 1, 0], jnp.int32)),
               llama.Query(jnp.asarray(chunk), jnp.asarray([8, 0], jnp.int32),
                           jnp.asarray([1, B], jnp.int32))]
    (h_dec, h_pre), cache = forward_groups(params, cfg, queries, cache)
    assert np.asarray(cache.lengths).tolist() == [10, 8, 13, 0]
    dec = np.asarray(llama.lm_head(params, h_dec))[:, 0]
    for b in (0, 2):
        np.testing.assert_allclose(dec[b], _full_logits(cfg, params, seqs[b])[-1], atol=1e-5)
    got = np.asarray(llama.lm_head(params, h_pre))[0]
    np.testing.assert_allclose(got, _full_logits(cfg, params, seqs[1]), atol=1e-5)
    # The cache now holds row 1's keys: its next decode token sees them.
    nxt = int(np.argmax(got[-1]))
    step = [llama.Query(jnp.asarray([[0], [nxt], [0], [0]], jnp.int32),
                        jnp.asarray([0, 1, 0, 0], jnp.int32))]
    (h,), _ = forward_groups(params, cfg, step, cache)
    np.testing.assert_allclose(np.asarray(llama.lm_head(params, h))[1, 0],
                               _full_logits(cfg, params, seqs[1] + [nxt])[-1], atol=1e-5)
