"""Pallas ragged paged attention: prefill chunks and decode tokens of many rows in one call.

Shape legend: T query tokens (flat), N query heads, K kv heads, G = N // K (query heads per kv
head), Gp = G padded to a power of two, H head dim, P pages in the pool, Z page size, R rows,
M block-table width, bq query tokens per block, W work items.

Contract (the same as reference.py's):
- q [T, N, H] is a flat batch of query tokens, prefill chunks and single decode tokens side by
  side; k_pages, v_pages [P, Z, K, H] a page pool; N % K == 0; H in (32, 64, 128, 256).
- kv_lengths, query_start, num_queries [R] int32 and block_tables [R, M] int32: row r owns
  q[query_start[r] : query_start[r] + num_queries[r]]; its keys are positions 0 ..
  kv_lengths[r] - 1, position p in page block_tables[r, p // Z] at offset p % Z.
- Query i of row r sits at position t = kv_lengths[r] - num_queries[r] + i (the last at
  kv_lengths[r] - 1) and sees key j iff j <= t, and with a sliding window w also j > t - w.
  Logits are softcap * tanh(sm_scale * q.k / softcap) (softcap before masking); sm_scale
  defaults to 1/sqrt(H).
- Rows with num_queries 0 contribute nothing; rows' query ranges do not overlap but need not be
  sorted or contiguous, and tokens no row owns get zeros. Any page order and lengths
  (kv_lengths >= num_queries); block-table entries past a row's last page may hold anything
  (never dereferenced) and unused pages may hold NaN (never leaks into the output).
- Returns [T, N, H] in q.dtype. ValueError only for wrong ranks, dtypes, shapes, N % K != 0, an
  unsupported H, a sliding window < 1 or a softcap <= 0 (static arguments).
- wraps=True (a ring buffer, beyond reference.py's contract): position p is in page
  block_tables[r, (p // Z) % M], so a row's positions past M * Z reuse its oldest pages. The
  caller keeps every key a query sees in place: with a sliding window w and n = num_queries[r],
  M * Z >= w + n - 1 suffices (the step writes positions kv_lengths[r] - n .. kv_lengths[r] - 1
  over slots whose keys are at least M * Z positions older, outside every query's window).
  Logical pages that alias a visible one hold only keys no query sees.

Work list. A grid over (row, query block) would need a static bound on each row's blocks
(cdiv(T, bq) for a row that might own every token) and so R * cdiv(T, bq) programs, nearly all
empty. Instead the jitted wrapper lists the query blocks rows actually have: row r has
cdiv(num_queries[r], bq) blocks, their cumulative sum numbers them, and work item w finds its row
by a search over that sum. Ranges that do not overlap inside [0, T) hold at most T tokens over at
most min(R, T) non-empty rows, so W = (T + min(R, T) * (bq - 1)) // bq items always suffice (a
decode-only batch, T = R, gets exactly R at any bq); items past the last block are idle. Each item's
scalars (kv length, first token, first query position, valid queries) are a [4] int32 row of a
[W, 4] table and its row's block table a [M] row of a [W, M] gather, both ordinary inputs read in
the kernel (scalar prefetch is TPU-only).

Grid (W, K): program (w, h) holds the bq tokens of its block times the G query heads of kv head h
as one [bq * Gp, H] block (token-major), so each K/V page is read once per kv head and query
block whatever the GQA ratio. The queries are laid out [K, T_pad * Gp, H] (T_pad = T + bq, so a
block starting at any token fits) and the program loads its rows with a dynamic slice of kv head
h's [T_pad * Gp, H] view. The page pool of kv head h stays in place ([P, Z, H]); a fori_loop with
a dynamic trip count walks the row's pages `pages_per_block` at a time, gathering them through the
block table, with an online softmax in float32. Query row k (token k // Gp of the block) sits at
position pos0 + k // Gp and sees key j iff j <= its position (and j > position - window).

Only block-table slots first_page .. end_page - 1 are dereferenced: end_page = ceil(end_key / Z)
with end_key = position of the block's last query + 1 (<= kv_length), and first_page the page
holding the first key the block's first query sees in the window (0 without one). The last step
may run past end_page; its slots are clamped to end_page - 1 (a page of the row, read again) and
their keys masked, so a garbage block-table entry is never used. A query row that has seen no key
yet (causal or window masking within a step) keeps a running max of -inf and the exponentials are
taken against 0 instead, so it stays exactly zero until its first key.

Output. The programs write into [K, T_pad * Gp, H], kv head h's view again, with a masked store
of the block's valid query rows only (rows past the row's last query belong to another row or to
no row, and are not written), so programs never write the same element and no [R, max queries]
padded buffer is needed. The wrapper undoes the layout ([T, N, H]) and zeroes the tokens no row
owns (an ownership mask from a difference array over the query ranges), so elements no program
wrote are never returned.

The body is a portable `pallas_call` (grid, BlockSpecs, refs, ref gathers, pl.when, fori_loop, a
masked store): it runs with interpret=True on CPU and lowers through Triton on GPU.

Quantized pages (int8 or float8_e4m3fn codes with k_scale, v_scale [P, Z, K] float32) are handled
as in paged_attention: the pool stays in its storage dtype, the scales reach program (w, h) as a
[P, Z] view of kv head h's scales (BlockSpec (P, Z, None), index map (0, 0, h)), and each step
gathers the scales through the same page ids as its K/V pages and computes
k.astype(float32) * scale[:, None] (cast to the query dtype for the dots), v likewise before the
key mask zeroes stale slots (a NaN scale there never leaks). Without scales the body is the float
one (a static branch on the number of refs).
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

    Item w is query block b of row rows[w]: queries b * block_q .. of that row. Its table row
    holds the row's kv length, the flat index of the block's first token, the position of its
    first query and the number of valid queries in it (0 for an idle item past the last block,
    whose row is clamped to R - 1)."""
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
    # work_ref [4] int32 (this work item: kv length, first token, first position, valid queries)
    # block_table_ref [M] int32 (this item's row); q_ref [T_pad * Gp, H] (this kv head)
    # k_pages_ref, v_pages_ref [P, Z, H] (this kv head); o_ref [T_pad * Gp, H] (this kv head)
    # refs: (o_ref,), or for quantized pages (k_scale_ref, v_scale_ref, o_ref) with the scales
    # [P, Z] of this kv head.
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
    """The dtype the kernel computes in: q's for quantized pages (dequantized to it), else the
    promotion of q's and the pages'."""
    return q.dtype if k_scale is not None else jnp.promote_types(q.dtype, k_pages.dtype)


def ragged_paged_attention(q, k_pages, v_pages, kv_lengths, block_tables, query_start,
                           num_queries, *, sliding_window=None, softcap=None, sm_scale=None,
                           k_scale=None, v_scale=None, interpret=False, pages_per_block=None,
                           block_q=None, wraps=False):
    """Causal attention of a flat, ragged batch of query tokens (prefill chunks and decode tokens
    side by side) over paged K/V. q [T, N, H] -> [T, N, H] in q.dtype.

    k_pages, v_pages [P, Z, K, H]; kv_lengths, query_start, num_queries [R] int32; block_tables
    [R, M] int32. Row r owns q[query_start[r] : query_start[r] + num_queries[r]], query i at
    position kv_lengths[r] - num_queries[r] + i over keys 0 .. kv_lengths[r] - 1 (position p in
    page block_tables[r, p // Z] at offset p % Z); tokens no row owns get zeros (reference.py
    states the contract in full). sm_scale defaults to 1/sqrt(H); softcap s maps logits to
    s * tanh(logits / s); a sliding window w hides keys at or before position - w.
    pages_per_block (pages per loop step) and block_q (query tokens per program) override the
    block-size table (raised to the backend's floor; on GPU Z, pages_per_block and block_q must be
    powers of two); by default block_q follows the table's target rows per program, at most the
    mean tokens per row ceil(T / R) rounded up to a power of two.
    Quantized pages: k_pages, v_pages may hold int8 (value = code * scale) or float8_e4m3fn
    (value = float(code) * scale) codes when k_scale, v_scale [P, Z, K] (floating, one scale per
    slot and kv head) are given; the kernel dequantizes each gathered block after its load.
    wraps (a ring buffer): position p is in page block_tables[r, (p // Z) % M], so positions
    past M * Z reuse a row's oldest pages; every key a query sees must still be in place
    (M * Z >= sliding window + the row's num_queries - 1; the module docstring has the rule).
    Raises ValueError for wrong ranks, dtypes, N % K != 0 or an unsupported H.
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

    # Tokens no row owns were never written: a difference array over the query ranges marks the
    # owned ones (+1 at each range's start, -1 past its end, a running sum).
    counts = jnp.clip(num_queries, 0, T)
    starts = jnp.clip(query_start, 0, T)
    ends = jnp.clip(query_start + counts, 0, T)
    marks = (jnp.zeros((T + 1,), jnp.int32).at[starts].add(jnp.where(counts > 0, 1, 0))
             .at[ends].add(jnp.where(counts > 0, -1, 0)))
    owned = jnp.cumsum(marks)[:T] > 0
    return jnp.where(owned[:, None, None], out, jnp.zeros_like(out))
