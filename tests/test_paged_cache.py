"""The paged KV cache under the model: exact properties against one-shot forwards.

Pages of each row are scattered over the pool in random order and unused pages hold NaN, so a
wrong read shows. Chunked prefill and decode through the paged cache equal a full forward
(float32, 1e-5), with the reference attention, with the reference attention over a flat page
list for decode (decode_pages), and with the Pallas kernels (interpret mode: flash for chunks,
paged for single tokens, reading the pool through the block tables).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import PagedKVCache
from jaxinfer.models import llama

forward = jax.jit(llama.forward, static_argnums=(1,),
                  static_argnames=("kv_view", "attn_impl", "decode_pages"))

CFG = ModelConfig("llama", vocab_size=97, d_model=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=32, ffn_dim=64, max_position_embeddings=512)
PAGE = 4


def _paged_cache(cfg, B, pages_per_row, rng, window=None):
    """A pool with row pages in shuffled order, page 0 the null page, the rest NaN-filled."""
    num_pages = 1 + B * pages_per_row + 3
    order = rng.permutation(np.arange(1, num_pages))[:B * pages_per_row]
    tables = order.reshape(B, pages_per_row).astype(np.int32)
    cache = PagedKVCache.create(cfg.num_layers, num_pages, PAGE, cfg.num_kv_heads, cfg.head_dim,
                                tables)
    nan = jnp.full_like(cache.k, jnp.nan)
    return cache.replace(k=nan, v=nan)


def _run(cfg, params, prompts, steps, chunk, attn_impl, kv_view=None, decode_pages=None):
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
                           kv_view=kv_view, attn_impl=attn_impl)
        lg = np.asarray(llama.lm_head(params, h))
        for b in range(B):
            logits[b].extend(lg[b, :num[b]])
    nxt = np.array([np.argmax(logits[b][-1]) for b in range(B)], np.int32)
    seqs = [list(p) + [int(nxt[b])] for b, p in enumerate(prompts)]
    for _ in range(steps):
        h, cache = forward(params, cfg, jnp.asarray(nxt[:, None]), cache,
                           jnp.ones(B, jnp.int32), kv_view=kv_view, attn_impl=attn_impl,
                           decode_pages=decode_pages)
        lg = np.asarray(llama.lm_head(params, h))[:, 0]
        for b in range(B):
            logits[b].append(lg[b])
        nxt = lg.argmax(-1).astype(np.int32)
        for b in range(B):
            seqs[b].append(int(nxt[b]))
    return [np.stack(x) for x in logits], seqs, cache


@pytest.mark.parametrize("attn_impl", ["reference", "ragged", "pallas"])
def test_paged_prefill_and_decode_equal_full_forward(attn_impl):
    params = llama.init_params(CFG, jax.random.key(0))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (13, 1, 22)]
    # ragged: the rows end with 5 + 2 + 7 pages of 4; the list has padding entries too.
    pages = 16 if attn_impl == "ragged" else None
    got, seqs, cache = _run(CFG, params, prompts, steps=5, chunk=8, kv_view=32,
                            attn_impl="reference" if pages else attn_impl, decode_pages=pages)
    for b, seq in enumerate(seqs):
        full = np.asarray(llama.sequence_logits(params, CFG, jnp.asarray([seq[:-1]])))[0]
        assert np.isfinite(got[b]).all()
        np.testing.assert_allclose(got[b], full, atol=1e-5, rtol=0)
    assert np.asarray(cache.lengths).tolist() == [len(p) + 5 for p in prompts]


@pytest.mark.parametrize("decode_pages", [None, 7])
def test_paged_sliding_window_matches_dense(decode_pages):
    cfg = CFG.replace(sliding_window=5)
    params = llama.init_params(cfg, jax.random.key(2))
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, 19).tolist()
    got, seqs, _ = _run(cfg, params, [prompt], steps=4, chunk=8, attn_impl="reference",
                        decode_pages=decode_pages)
    full = np.asarray(llama.sequence_logits(params, cfg, jnp.asarray([seqs[0][:-1]])))[0]
    np.testing.assert_allclose(got[0], full, atol=1e-5, rtol=0)


def test_padding_writes_never_touch_live_pages():
    """Rows with no new tokens (num_new 0) and padded chunk positions leave the pool as it was."""
    rng = np.random.default_rng(4)
    cache = _paged_cache(CFG, 2, pages_per_row=4, rng=rng)
    plan = cache.plan_write(jnp.asarray([3, 0], jnp.int32), 8)
    slots = np.asarray(plan.slots)
    P = cache.num_pages
    assert (slots[0, 3:] == P * PAGE).all() and (slots[1] == P * PAGE).all()
    table = np.asarray(cache.block_tables)[0]
    assert slots[0, :3].tolist() == [table[0] * PAGE + i for i in range(3)]
    new = jnp.ones((2, 8, CFG.num_kv_heads, CFG.head_dim))
    buf = PagedKVCache.write_layer(cache.k, 1, new, plan)
    changed = ~np.isnan(np.asarray(buf[1]))                      # [P * Z, K, H]
    assert changed.sum() == 3 * CFG.num_kv_heads * CFG.head_dim
    assert changed[table[0] * PAGE:table[0] * PAGE + 3].all()
    assert np.isnan(np.asarray(buf[0])).all()


@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 5.0)])
def test_ragged_paged_attention_equals_reference(window, softcap):
    """Decode attention over a flat page list == the reference over each row's gathered keys:
    rows of 0, 1, a page boundary and many tokens, scattered pages, NaN in every unwritten slot
    and in the null page that pads the list."""
    from jaxinfer.attention import ragged_paged_attention, reference_attention

    rng = np.random.default_rng(7)
    B, M, N, K, H = 4, 6, 4, 2, 32
    lengths = np.array([9, 0, 1, 24], np.int32)  # 24 = a full last page
    cache = _paged_cache(CFG.replace(num_layers=1, num_kv_heads=K, head_dim=H), B, M, rng)
    Z, P = PAGE, cache.num_pages
    k = np.asarray(cache.k[0]).reshape(P, Z, K, H).copy()
    v = k.copy()
    tables = np.asarray(cache.block_tables)
    for b in range(B):
        for pos in range(lengths[b]):
            page, z = tables[b, pos // Z], pos % Z
            k[page, z], v[page, z] = rng.standard_normal((2, K, H))
    q = jnp.asarray(rng.standard_normal((B, N, H)), jnp.float32)
    num_pages = int(sum(-(-lengths // Z))) + 3
    rows, pages, starts = cache.page_list(jnp.asarray(lengths), num_pages)
    rows, pages, starts = map(np.asarray, (rows, pages, starts))
    want_rows = np.concatenate([np.full(-(-n // Z), b) for b, n in enumerate(lengths)])
    n = len(want_rows)
    assert rows[:n].tolist() == want_rows.tolist() and (rows[n:] == B).all()
    assert (pages[n:] == 0).all() and pages[:n].tolist() == [
        tables[b, j] for b in range(B) for j in range(-(-lengths[b] // Z))]
    got = ragged_paged_attention(q, jnp.asarray(k[pages]), jnp.asarray(v[pages]),
                                 jnp.asarray(rows), jnp.asarray(starts), jnp.asarray(lengths),
                                 sliding_window=window, softcap=softcap)
    got = np.asarray(got)
    assert np.isfinite(got).all() and (got[1] == 0).all()  # row 1 has no keys
    for b in (0, 2, 3):
        S = M * Z
        kb = k[tables[b]].reshape(1, S, K, H)
        vb = v[tables[b]].reshape(1, S, K, H)
        kpos = np.where(np.arange(S) < lengths[b], np.arange(S), -1)[None].astype(np.int32)
        want = reference_attention(q[b:b + 1, None], jnp.asarray([[lengths[b] - 1]], jnp.int32),
                                   [(jnp.asarray(kb), jnp.asarray(vb), jnp.asarray(kpos))],
                                   sliding_window=window, softcap=softcap)
        np.testing.assert_allclose(got[b], np.asarray(want)[0, 0], atol=1e-5, rtol=0)
