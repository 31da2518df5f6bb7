"""The paged KV cache under the model: exact properties against one-shot forwards.

Pages of each row are scattered over the pool in random order and unused pages hold NaN, so a
wrong read shows. Chunked prefill and decode through the paged cache equal a full forward
(float32, 1e-5), with the jnp attention (a loop over each row's pages) and with the ragged paged
attention kernel (interpret mode). The jnp attention equals the dense reference on a mixed
batch of decode rows, prefill chunks, an empty row and a window; its decode rows both through
the jnp loop and through the native CPU decode kernel (jaxinfer.backends.cpu_kernels) where it
builds.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import backends
from jaxinfer.config import ModelConfig
from jaxinfer.device.kv_cache import Bits16KV, PagedKVCache
from jaxinfer.models import llama
from jaxinfer.models import sequence_logits

forward = jax.jit(llama.LLAMA.forward, static_argnums=(1,), static_argnames=("backend",))

CFG = ModelConfig("llama", vocab_size=97, d_model=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=32, ffn_dim=64, max_position_embeddings=512)
PAGE = 4


def with_attention(attention: str):
    return dataclasses.replace(backends.default(), attention=attention)


@pytest.fixture(params=["jnp", "cpu_kernel"])
def decode_path(request):
    """The Backend whose decode rows go through the jnp loop (the native kernels off) or the
    native CPU kernel."""
    backend = backends.resolve(num_devices=1)
    if request.param == "jnp":
        return dataclasses.replace(backend, kernels=None, batch_invariant=False)
    if backend.kernels is None:
        pytest.skip("the native CPU kernels are not built here")
    return backend


def _paged_cache(cfg, B, pages_per_row, rng, window=None):
    """A pool with row pages in shuffled order, page 0 the null page, the rest NaN-filled."""
    num_pages = 1 + B * pages_per_row + 3
    order = rng.permutation(np.arange(1, num_pages))[:B * pages_per_row]
    tables = order.reshape(B, pages_per_row).astype(np.int32)
    cache = PagedKVCache.create(cfg.num_layers, num_pages, PAGE, cfg.num_kv_heads, cfg.head_dim,
                                tables)
    nan = jnp.full_like(cache.k, jnp.nan)
    return cache.replace(k=nan, v=nan)


def _run(cfg, params, prompts, steps, chunk, attention):
    """Chunked prefill of ragged prompts, then `steps` greedy decode steps; returns the logits
    of every prompt position and decode step per row."""
    rng = np.random.default_rng(0)
    B = len(prompts)
    cache = _paged_cache(cfg, B, pages_per_row=16, rng=rng)
    lens = np.array([len(p) for p in prompts])
    logits = [[] for _ in range(B)]
    for s in range(0, lens.max(), chunk):
        toks = np.zeros((B, chunk), np.int32)
        num = np.clip(lens - s, 0, chunk).astype(np.int32)
        for b, p in enumerate(prompts):
            toks[b, :num[b]] = p[s:s + num[b]]
        h, cache = forward(params, cfg, jnp.asarray(toks), cache, jnp.asarray(num),
                           backend=with_attention(attention))
        lg = np.asarray(llama.LLAMA.head(params, h))
        for b in range(B):
            logits[b].extend(lg[b, :num[b]])
    nxt = np.array([np.argmax(logits[b][-1]) for b in range(B)], np.int32)
    seqs = [list(p) + [int(nxt[b])] for b, p in enumerate(prompts)]
    for _ in range(steps):
        h, cache = forward(params, cfg, jnp.asarray(nxt[:, None]), cache,
                           jnp.ones(B, jnp.int32), backend=with_attention(attention))
        lg = np.asarray(llama.LLAMA.head(params, h))[:, 0]
        for b in range(B):
            logits[b].append(lg[b])
        nxt = lg.argmax(-1).astype(np.int32)
        for b in range(B):
            seqs[b].append(int(nxt[b]))
    return [np.stack(x) for x in logits], seqs, cache


@pytest.mark.parametrize("attention", ["reference", "pallas"])
def test_paged_prefill_and_decode_equal_full_forward(attention):
    params = llama.LLAMA.init_params(CFG, jax.random.key(0))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (13, 1, 22)]
    got, seqs, cache = _run(CFG, params, prompts, steps=5, chunk=8, attention=attention)
    for b, seq in enumerate(seqs):
        full = np.asarray(sequence_logits(params, CFG, jnp.asarray([seq[:-1]])))[0]
        assert np.isfinite(got[b]).all()
        np.testing.assert_allclose(got[b], full, atol=1e-5, rtol=0)
    assert np.asarray(cache.lengths).tolist() == [len(p) + 5 for p in prompts]


def test_paged_sliding_window_matches_dense():
    cfg = CFG.replace(sliding_window=5)
    params = llama.LLAMA.init_params(cfg, jax.random.key(2))
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, 19).tolist()
    got, seqs, _ = _run(cfg, params, [prompt], steps=4, chunk=8, attention="reference")
    full = np.asarray(sequence_logits(params, cfg, jnp.asarray([seqs[0][:-1]])))[0]
    np.testing.assert_allclose(got[0], full, atol=1e-5, rtol=0)


def test_padding_writes_never_touch_live_pages():
    """Padding tokens (row index B) leave the pool as it was; real tokens land in their page."""
    rng = np.random.default_rng(4)
    cache = _paged_cache(CFG, 2, pages_per_row=4, rng=rng)
    rows = jnp.asarray([0, 0, 0, 2, 2, 2, 2, 2], jnp.int32)
    positions = jnp.asarray([0, 1, 2, 0, 0, 0, 0, 0], jnp.int32)
    slots = np.asarray(cache.write_slots(rows, positions))
    P = cache.num_pages
    assert (slots[3:] == P * PAGE).all()
    table = np.asarray(cache.block_tables)[0]
    assert slots[:3].tolist() == [table[0] * PAGE + i for i in range(3)]
    new = jnp.ones((8, CFG.num_kv_heads, CFG.head_dim))
    buf = PagedKVCache.write_layer(cache.k, 1, new, jnp.asarray(slots))
    changed = ~np.isnan(np.asarray(buf[1]))                      # [P * Z, K, H]
    assert changed.sum() == 3 * CFG.num_kv_heads * CFG.head_dim
    assert changed[table[0] * PAGE:table[0] * PAGE + 3].all()
    assert np.isnan(np.asarray(buf[0])).all()


@pytest.mark.parametrize("window,softcap,tile", [(None, None, 4), (6, None, 4), (None, 5.0, 4),
                                                 (None, None, 16), (3, None, 1)])
def test_loop_attention_equals_reference(window, softcap, tile, decode_path):
    """The jnp ragged attention over a page pool == the dense reference over each row's keys,
    on a mixed flat batch: a chunk of 7 queries (tiles split it), single decode tokens, an
    empty row, a row at a full page, rows out of order in the batch, padding at the end;
    scattered pages and NaN in every unwritten slot."""
    kv_lengths = np.array([9, 0, 1, 24, 13], np.int32)  # 24 = a full last page
    num_queries = np.array([1, 0, 1, 1, 7], np.int32)
    if tile == 1:
        num_queries[4] = 1
    query_start = np.array([2, 0, 3, 1, 4], np.int32)
    _check_loop_attention(kv_lengths, num_queries, query_start, M=6, T=16, window=window,
                          softcap=softcap, tile=tile, backend=decode_path)


@pytest.mark.parametrize("window,static", [(None, False), (11, False), (None, True)])
def test_decode_work_list_spans_rows_and_iterations(window, static, decode_path):
    """Decode rows of very different lengths with blocks of 2 pages (8 keys): the work list of
    (row, block) pairs (23 blocks over 8 tiles, 3 iterations) puts blocks of several rows in
    one iteration and one row's blocks in several, an empty row has none, and a window starts
    rows past their first page; with static=True the static trip count of the differentiable
    forward. Each row still equals the dense reference over its keys."""
    kv_lengths = np.array([1, 37, 5, 64, 0, 19, 33], np.int32)
    num_queries = np.array([1, 1, 1, 1, 0, 1, 1], np.int32)
    query_start = np.array([5, 0, 1, 2, 0, 3, 4], np.int32)
    _check_loop_attention(kv_lengths, num_queries, query_start, M=16, T=8, window=window,
                          softcap=None, tile=1, single_pages_per_block=2,
                          static_pages=16 if static else None, backend=decode_path)


@pytest.mark.parametrize("window,softcap,tile", [(None, None, 1), (11, None, 1), (None, 5.0, 1),
                                                 (None, None, 4)])
def test_loop_attention_over_a_bf16_pool(window, softcap, tile, decode_path):
    """Over a 16-bit pool kept as bits (the CPU engine's bf16 KV cache), decode rows and
    prefill chunks of very different lengths (blocks of 2 pages, several iterations) equal the
    dense reference over the same bf16 keys and values, NaN in every unwritten slot."""
    kv_lengths = np.array([1, 37, 5, 64, 0, 19, 33], np.int32)
    num_queries = np.array([1, 1, 1, 1, 0, 1, 1 if tile == 1 else 6], np.int32)
    query_start = np.array([5, 0, 1, 2, 0, 3, 6], np.int32)
    _check_loop_attention(kv_lengths, num_queries, query_start, M=16, T=12, window=window,
                          softcap=softcap, tile=tile, pool_dtype=jnp.bfloat16,
                          single_pages_per_block=2, backend=decode_path)


@pytest.mark.parametrize("max_pairs,static,lockstep", [
    (None, False, False), (3, False, False), (3, True, False), (None, True, False),
    (None, False, True), (None, True, True)])
def test_prefill_work_list_spans_tiles_rows_and_iterations(monkeypatch, max_pairs, static,
                                                           lockstep):
    """Chunks of several rows (tiles of 4 queries, blocks of one 4-key page): the work list of
    (tile, block) pairs skips the step's empty tiles and walks each tile's own block count.
    max_pairs=3 caps an iteration at 3 pairs, so the online softmax folds into a sliding
    window of tiles (the path of a forward over thousands of rows) with a tile's blocks split
    over iterations; static=True takes the differentiable forward's static trip count;
    lockstep=True the loop a mesh that splits rows takes (every tile its i-th block at
    iteration i). Each row still equals the dense reference over its keys."""
    import jaxinfer.backends.attention as attention
    import jaxinfer.backends.work_list as work_list

    if max_pairs is not None:
        monkeypatch.setattr(work_list, "MAX_PAIRS", max_pairs)
    if lockstep:
        monkeypatch.setattr(attention, "tile_loop",
                            lambda *a: work_list.tile_loop(*a[:5], rows_split=True))
    kv_lengths = np.array([40, 3, 64, 0, 21, 7], np.int32)
    num_queries = np.array([12, 3, 16, 0, 5, 1], np.int32)
    query_start = np.array([0, 12, 15, 0, 31, 36], np.int32)
    _check_loop_attention(kv_lengths, num_queries, query_start, M=16, T=40, window=None,
                          softcap=None, tile=4, pages_per_block=1,
                          static_pages=16 if static else None)


def _check_loop_attention(kv_lengths, num_queries, query_start, *, M, T, window, softcap, tile,
                          pool_dtype=jnp.float32, backend=None, **meta_kw):
    """ragged_attention (the jnp path) over a NaN-filled pool with shuffled pages == the dense
    reference over each row's keys; tokens of no row get zeros. With pool_dtype bfloat16 the
    pool is a 16-bit one as the engine keeps it on CPU (kv_cache.Bits16KV), the reference sees
    the same bf16-rounded keys and values in float32, and the tolerance is bf16's (2e-2
    absolute on outputs of order 1: decode multiplies keys by queries rounded to bf16)."""
    from jaxinfer.backends.attention import ragged_attention, reference_attention
    from jaxinfer.device.ragged_meta import num_tiles_bound, ragged_meta

    rng = np.random.default_rng(7)
    B, N, K, H = len(kv_lengths), 4, 2, 32
    cache = _paged_cache(CFG.replace(num_layers=1, num_kv_heads=K, head_dim=H), B, M, rng)
    Z, P = PAGE, cache.num_pages
    k = np.asarray(cache.k[0]).reshape(P, Z, K, H).copy()
    v = k.copy()
    tables = np.asarray(cache.block_tables)
    for b in range(B):
        for pos in range(kv_lengths[b]):
            page, z = tables[b, pos // Z], pos % Z
            k[page, z], v[page, z] = rng.standard_normal((2, K, H))
    q = rng.standard_normal((T, N, H)).astype(np.float32)
    k_all, v_all = jnp.asarray(k.reshape(1, P * Z, K, H)), jnp.asarray(v.reshape(1, P * Z, K, H))
    tol = 1e-5
    if pool_dtype == jnp.bfloat16:
        k_all, v_all = (Bits16KV(bits=Bits16KV.encode(a, "bfloat16")) for a in (k_all, v_all))
        k = np.asarray(k.astype(jnp.bfloat16).astype(np.float32))  # NaN stays NaN
        v = np.asarray(v.astype(jnp.bfloat16).astype(np.float32))
        tol = 2e-2
    meta = ragged_meta(jnp.asarray(query_start), jnp.asarray(num_queries),
                       jnp.asarray(kv_lengths), num_tokens=T, query_tile=tile,
                       num_tiles=num_tiles_bound(T, tile, B), page_size=Z,
                       sliding_window=window, **meta_kw)
    got = ragged_attention(backend or with_attention("reference"), jnp.asarray(q), k_all,
                           v_all, 0, jnp.asarray(tables), meta, page_size=Z,
                           sliding_window=window, softcap=softcap)
    got = np.asarray(got)
    assert np.isfinite(got).all()
    owned = np.zeros(T, bool)
    for b in range(B):
        n = num_queries[b]
        if n == 0:
            continue
        s0 = query_start[b]
        owned[s0:s0 + n] = True
        S = M * Z
        kb = k[tables[b]].reshape(1, S, K, H)
        vb = v[tables[b]].reshape(1, S, K, H)
        kpos = np.where(np.arange(S) < kv_lengths[b], np.arange(S), -1)[None].astype(np.int32)
        qpos = (kv_lengths[b] - n + np.arange(n))[None].astype(np.int32)
        want = reference_attention(jnp.asarray(q[None, s0:s0 + n]), jnp.asarray(qpos),
                                   [(jnp.asarray(kb), jnp.asarray(vb), jnp.asarray(kpos))],
                                   sliding_window=window, softcap=softcap)
        np.testing.assert_allclose(got[s0:s0 + n], np.asarray(want)[0], atol=tol, rtol=0)
    assert (got[~owned] == 0).all()  # tokens of no row
