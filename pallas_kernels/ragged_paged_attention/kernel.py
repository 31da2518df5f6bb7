"""Pallas ragged paged attention: prefill chunks and decode tokens of many rows in one call.

Shape legend: T query tokens (flat), N query heads, K kv heads, G = N // K (query heads per kv
head), Gp = G padded to a power of two, H head dim, P pages in the pool, Z page size, R rows,
M block-table width, bq query tokens per block, T_pad = T + bq, W work items.

Contract: reference.py's (prefill chunks and decode tokens side by side in q [T, N, H], row r
owning q[query_start[r] : + num_queries[r]] over its keys 0 .. kv_lengths[r] - 1 through
block_tables [R, M]), plus wraps=True for a ring: position p is in page
block_tables[r, (p // Z) % M], and the caller keeps every visible key in place (M * Z >=
window + num_queries[r] - 1 suffices).

Design (docs/ragged_paged_attention.md): a work list of the query blocks the rows have makes
the grid (W, K); program (w, h) holds [bq * Gp, H] query rows of kv head h and walks its row's
visible pages through the block table with an online softmax in float32, storing only its
valid rows; quantized pages are dequantized per gathered block. A portable pallas_call:
interpret=True on CPU, Triton on GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.ragged_paged_attention import block_sizes
from pallas_kernels.ragged_paged_attention.reference import check_inputs

# Columns of the [W, 4] work table.
KV_LENGTH, FIRST_TOKEN, FIRST_POSITION, NUM_VALID = range(4)


def num_work_items(num_tokens: int, num_rows: int, block_q: int) -> int:
    """A static bound on the query blocks of rows whose ranges do not overlap inside [0, T)."""
    return (num_tokens + min(num_rows, num_tokens) * (block_q - 1)) // block_q


def work_items(kv_lengths, query_start, num_queries, *, num_tokens, block_q):
    """The grid's work list: (rows [W] int32, table [W, 4] int32), W = num_work_items(...).
    Item w is a query block of row rows[w]; its table row holds the row's kv length, the block's
    first token and first query position, and its valid queries (0: an idle item)."""
    R = kv_lengths.shape[0]
    W = num_work_items(num_tokens, R, block_q)
    counts = jnp.clip(num_queries, 0, num_tokens)
    blocks = (counts + block_q - 1) // block_q                                   # [R]
    ends = jnp.cumsum(blocks)                                                    # inclusive
    w = jnp.arange(W, dtype=jnp.int32)
    rows = jnp.searchsorted(ends, w, side="right").astype(jnp.int32)             # [W]
    live = rows < R
    rows = jnp.minimum(rows, R - 1)
    first_query = (w - (ends[rows] - blocks[rows])) * block_q
    num_valid = jnp.where(live, jnp.clip(counts[rows] - first_query, 0, block_q), 0)
    first_token = jnp.clip(query_start[rows] + first_query, 0, num_tokens)
    first_position = kv_lengths[rows] - counts[rows] + first_query
    table = jnp.stack([kv_lengths[rows], first_token, first_position, num_valid], axis=1)
    return rows, table.astype(jnp.int32)


def _store_rows(o_ref, start, value, mask):
    """o_ref[start : start + rows] = value, only where mask [rows] is set (a masked store)."""
    pl_triton.store(o_ref.at[pl.ds(start, value.shape[0])], value,
                    mask=jnp.broadcast_to(mask[:, None], value.shape))


def ragged_paged_attention_kernel(work_ref, block_table_ref, q_ref, k_pages_ref, v_pages_ref,
                                  *refs, page_size, pages_per_block, block_q, group_rows,
                                  sm_scale, softcap, sliding_window, wraps=False):
    # work_ref [4] int32 (this item's row of the work table); block_table_ref [M] int32;
    # q_ref, o_ref [T_pad * Gp, H], k_pages_ref, v_pages_ref [P, Z, H] (this kv head);
    # refs: (o_ref,), or (k_scale_ref, v_scale_ref [P, Z], o_ref) for quantized pages.
    if len(refs) == 3:
        k_scale_ref, v_scale_ref, o_ref = refs
    else:
        (o_ref,), k_scale_ref, v_scale_ref = refs, None, None
    H = q_ref.shape[-1]
    rows = block_q * group_rows
    block_k = pages_per_block * page_size
    max_pages = block_table_ref.shape[0]
    num_valid = work_ref[NUM_VALID]

    @pl.when(num_valid > 0)
    def _():
        length = jnp.maximum(work_ref[KV_LENGTH], 0)
        first_position = work_ref[FIRST_POSITION]
        start = work_ref[FIRST_TOKEN] * group_rows
        q = q_ref[pl.ds(start, rows), :]                                         # [rows, H]
        token = lax.div(lax.broadcasted_iota(jnp.int32, (rows,), 0), jnp.int32(group_rows))
        q_pos = first_position + token                                           # [rows]

        end_key = jnp.clip(first_position + num_valid, 0, length)
        end_page = lax.div(end_key + page_size - 1, jnp.int32(page_size))
        if not wraps:
            end_page = jnp.minimum(end_page, max_pages)
        if sliding_window is None:
            first_page = jnp.int32(0)
        else:
            first_page = lax.div(jnp.maximum(first_position - sliding_window + 1, 0),
                                 jnp.int32(page_size))
        num_steps = lax.div(jnp.maximum(end_page - first_page, 0) + pages_per_block - 1,
                            jnp.int32(pages_per_block))

        def step(i, carry):
            m_prev, l_prev, acc_prev = carry                  # [rows], [rows], [rows, H] float32
            slot0 = first_page + i * pages_per_block
            slots = slot0 + lax.broadcasted_iota(jnp.int32, (pages_per_block,), 0)
            slots = jnp.minimum(slots, end_page - 1)
            if wraps:  # logical page j of a ring is table entry j % M
                slots = lax.rem(slots, jnp.int32(max_pages))
            pages = block_table_ref[slots]                                # [pages_per_block]
            k = k_pages_ref[pages].reshape(block_k, H)                    # [block_k, H]
            v = v_pages_ref[pages].reshape(block_k, H)
            if k_scale_ref is not None:
                k_scale = k_scale_ref[pages].reshape(block_k)
                v_scale = v_scale_ref[pages].reshape(block_k)
                k = (k.astype(jnp.float32) * k_scale[:, None]).astype(q.dtype)
                v = (v.astype(jnp.float32) * v_scale[:, None]).astype(q.dtype)

            k_pos = slot0 * page_size + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
            key_ok = k_pos < end_key                          # real keys, not stale or re-read
            visible = key_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])  # [rows, block_k]
            if sliding_window is not None:
                visible &= k_pos[None, :] > q_pos[:, None] - sliding_window

            s = lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())),
                                precision=lax.Precision.HIGHEST,
                                preferred_element_type=jnp.float32) * sm_scale  # [rows, block_k]
            if softcap is not None:
                s = softcap * jnp.tanh(s / softcap)
            s = jnp.where(visible, s, -jnp.inf)

            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
            # A row that has seen no key yet keeps m = -inf: exponentials against 0 give 0 there
            # (exp(-inf - -inf) would be NaN).
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
            alpha = jnp.exp(m_prev - m_safe)
            p = jnp.exp(s - m_safe[:, None])
            l_next = alpha * l_prev + jnp.sum(p, axis=1)
            # Slots past the keys (stale or re-read pages) may hold NaN, and 0 * NaN is NaN.
            v = jnp.where(key_ok[:, None], v, jnp.zeros_like(v))
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 precision=lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32)         # [rows, H]
            return m_next, l_next, alpha[:, None] * acc_prev + pv

        init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
                jnp.zeros((rows, H), jnp.float32))
        _, l, acc = lax.fori_loop(0, num_steps, step, init)
        out = acc / jnp.where(l == 0, 1.0, l)[:, None]      # a query that sees no key: 0
        _store_rows(o_ref, start, out.astype(o_ref.dtype), token < num_valid)


def _compute_dtype(q, k_pages, k_scale):
    """q's dtype for quantized pages (dequantized to it), else the promotion with the pages'."""
    return q.dtype if k_scale is not None else jnp.promote_types(q.dtype, k_pages.dtype)


def ragged_paged_attention(q, k_pages, v_pages, kv_lengths, block_tables, query_start,
                           num_queries, *, sliding_window=None, softcap=None, sm_scale=None,
                           k_scale=None, v_scale=None, interpret=False, pages_per_block=None,
                           block_q=None, wraps=False):
    """Causal attention of a flat, ragged batch of query tokens over paged K/V.
    q [T, N, H] -> [T, N, H] in q.dtype.

    k_pages, v_pages [P, Z, K, H] (or int8 / float8_e4m3fn codes with k_scale, v_scale
    [P, Z, K]); kv_lengths, query_start, num_queries [R] int32; block_tables [R, M] int32;
    reference.py states the contract, the module docstring wraps. pages_per_block and block_q
    override the block-size table (raised to its floors; powers of two on GPU). Raises
    ValueError for wrong ranks, dtypes, N % K != 0 or an unsupported H.
    """
    if check_inputs(q, k_pages, v_pages, kv_lengths, block_tables, query_start, num_queries,
                    sliding_window, softcap, k_scale, v_scale):
        k_scale = jnp.asarray(k_scale, jnp.float32)
        v_scale = jnp.asarray(v_scale, jnp.float32)
    if pages_per_block is not None and pages_per_block < 1:
        raise ValueError(f"pages_per_block is {pages_per_block}; it must be >= 1")
    if block_q is not None and block_q < 1:
        raise ValueError(f"block_q is {block_q}; it must be >= 1")
    group_rows = block_sizes.group_rows_for(q.shape[1] // k_pages.shape[2])
    backend = jax.default_backend()
    pages_per_block = block_sizes.pages_per_block_for(
        backend, k_pages.shape[1], block_tables.shape[1], pages_per_block,
        key_bytes=q.shape[2] * jnp.dtype(_compute_dtype(q, k_pages, k_scale)).itemsize)
    tokens_per_row = -(-q.shape[0] // max(block_tables.shape[0], 1))
    block_q = block_sizes.block_q_for(backend, group_rows, tokens_per_row, block_q)
    return _ragged_paged_attention(
        q, k_pages, v_pages, kv_lengths, block_tables, query_start, num_queries, k_scale,
        v_scale, sliding_window=sliding_window, softcap=softcap, sm_scale=sm_scale,
        interpret=interpret, pages_per_block=pages_per_block, block_q=block_q,
        group_rows=group_rows, backend=backend, wraps=bool(wraps))


@functools.partial(jax.jit, static_argnames=("sliding_window", "softcap", "sm_scale", "interpret",
                                             "pages_per_block", "block_q", "group_rows",
                                             "backend", "wraps"))
def _ragged_paged_attention(q, k_pages, v_pages, kv_lengths, block_tables, query_start,
                            num_queries, k_scale, v_scale, *, sliding_window, softcap, sm_scale,
                            interpret, pages_per_block, block_q, group_rows, backend, wraps):
    T, N, H = q.shape
    P, page_size, K, _ = k_pages.shape
    R, max_pages = block_tables.shape
    G = N // K
    Gp = group_rows
    if T * R * P * page_size * max_pages == 0:      # no query row or no key slot at all
        return jnp.zeros_like(q)
    T_pad = T + block_q

    rows, work = work_items(kv_lengths, query_start, num_queries, num_tokens=T,
                            block_q=block_q)
    W = work.shape[0]
    tables = block_tables[rows]                                                  # [W, M]

    compute_dtype = _compute_dtype(q, k_pages, k_scale)
    qg = jnp.pad(q.astype(compute_dtype).reshape(T, K, G, H),
                 ((0, T_pad - T), (0, 0), (0, Gp - G), (0, 0)))
    qg = qg.transpose(1, 0, 2, 3).reshape(K, T_pad * Gp, H)                      # token-major

    kernel = functools.partial(
        ragged_paged_attention_kernel, page_size=page_size, pages_per_block=pages_per_block,
        block_q=block_q, group_rows=Gp,
        sm_scale=sm_scale if sm_scale is not None else H ** -0.5, softcap=softcap,
        sliding_window=sliding_window, wraps=wraps)
    sizes = block_sizes.block_sizes_for(backend)
    pages_spec = pl.BlockSpec((P, page_size, None, H), lambda w, h: (0, 0, h, 0))
    tokens_spec = pl.BlockSpec((None, T_pad * Gp, H), lambda w, h: (h, 0, 0))
    in_specs = [
        pl.BlockSpec((None, 4), lambda w, h: (w, 0)),                 # work table
        pl.BlockSpec((None, max_pages), lambda w, h: (w, 0)),         # block tables
        tokens_spec,                                                  # q
        pages_spec,                                                   # k_pages
        pages_spec,                                                   # v_pages
    ]
    operands = [work, tables, qg, k_pages, v_pages]
    if k_scale is not None:
        scale_spec = pl.BlockSpec((P, page_size, None), lambda w, h: (0, 0, h))  # [P, Z]
        in_specs += [scale_spec, scale_spec]                          # k_scale, v_scale
        operands += [k_scale, v_scale]
    out = pl.pallas_call(
        kernel,
        grid=(W, K),
        in_specs=in_specs,
        out_specs=tokens_spec,
        out_shape=jax.ShapeDtypeStruct((K, T_pad * Gp, H), q.dtype),
        compiler_params=None if interpret else pl_triton.CompilerParams(
            num_warps=sizes.num_warps, num_stages=sizes.num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(*operands)
    out = out.reshape(K, T_pad, Gp, H)[:, :T, :G].transpose(1, 0, 2, 3).reshape(T, N, H)

    # Tokens no row owns were never written: a difference array over the ranges marks the owned.
    counts = jnp.clip(num_queries, 0, T)
    starts = jnp.clip(query_start, 0, T)
    ends = jnp.clip(query_start + counts, 0, T)
    marks = (jnp.zeros((T + 1,), jnp.int32).at[starts].add(jnp.where(counts > 0, 1, 0))
             .at[ends].add(jnp.where(counts > 0, -1, 0)))
    owned = jnp.cumsum(marks)[:T] > 0
    return jnp.where(owned[:, None, None], out, jnp.zeros_like(out))
