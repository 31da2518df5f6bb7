"""Pure-jnp ragged paged attention: the reference the Pallas kernel is checked against.

Shape legend: T query tokens (flat), N query heads, K kv heads, G = N // K, H head dim, P pages in
the pool, Z page size, R rows (sequences), M block-table width, S key slots of a row (M * Z).

One call serves a mixed batch: prefill chunks and single decode tokens side by side in a flat
q [T, N, H]. Row r owns the query tokens q[query_start[r] : query_start[r] + num_queries[r]]; its
keys are positions 0 .. kv_lengths[r] - 1, position p living in page block_tables[r, p // Z] at
offset p % Z of k_pages, v_pages [P, Z, K, H]. Query i of row r sits at position
kv_lengths[r] - num_queries[r] + i (the last query at kv_lengths[r] - 1, the chunk's keys already
written to the pages). Key j is visible to a query at position t iff j <= t, and with a sliding
window w also j > t - w. Logits are softcap * tanh(sm_scale * q.k / softcap) (softcap before
masking); sm_scale defaults to 1/sqrt(H).

Rows with num_queries 0 contribute nothing; query ranges do not overlap but need not be sorted
or contiguous; tokens no row owns get zeros. Block-table entries at or beyond
ceil(kv_lengths[r] / Z) are never dereferenced; unowned pages and slots past a row's length may
hold anything (NaN included).

Quantized pages: int8 or float8_e4m3fn codes with k_scale, v_scale [P, Z, K] (value = code *
scale), dequantized first. An oracle, not a fast path: each query gathers its row's [S, K, H].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention.reference import dequantize
from pallas_kernels.paged_attention.reference import check_pool_inputs


def check_inputs(q, k_pages, v_pages, kv_lengths, block_tables, query_start, num_queries,
                 sliding_window=None, softcap=None, k_scale=None, v_scale=None):
    """check_pool_inputs for a flat batch q [T, N, H] plus one kv length, query start and count
    per block-table row. Raises ValueError; returns True for quantized pages."""
    quantized = check_pool_inputs(
        q, k_pages, v_pages, (("kv_lengths", kv_lengths, 1), ("block_tables", block_tables, 2),
                              ("query_start", query_start, 1), ("num_queries", num_queries, 1)),
        sliding_window, softcap, k_scale, v_scale)
    R = block_tables.shape[0]
    for name, x in (("kv_lengths", kv_lengths), ("query_start", query_start),
                    ("num_queries", num_queries)):
        if x.shape != (R,):
            raise ValueError(f"{name} {x.shape} must have one entry per block-table row ({R})")
    return quantized


def ragged_paged_attention_reference(q, k_pages, v_pages, kv_lengths, block_tables, query_start,
                                     num_queries, *, sliding_window=None, softcap=None,
                                     sm_scale=None, k_scale=None, v_scale=None):
    """Causal attention of a flat, ragged batch of query tokens over paged K/V (the module
    docstring's contract). q [T, N, H] -> [T, N, H] in q.dtype."""
    if check_inputs(q, k_pages, v_pages, kv_lengths, block_tables, query_start, num_queries,
                    sliding_window, softcap, k_scale, v_scale):
        k_pages, v_pages = dequantize(k_pages, k_scale), dequantize(v_pages, v_scale)
    return _reference(q, k_pages, v_pages, kv_lengths, block_tables, query_start, num_queries,
                      sliding_window=sliding_window, softcap=softcap, sm_scale=sm_scale)


@functools.partial(jax.jit, static_argnames=("sliding_window", "softcap", "sm_scale"))
def _reference(q, k_pages, v_pages, kv_lengths, block_tables, query_start, num_queries, *,
               sliding_window, softcap, sm_scale):
    T, N, H = q.shape
    P, page_size, K, _ = k_pages.shape
    R, max_pages = block_tables.shape
    G = N // K
    S = max_pages * page_size
    scale = sm_scale if sm_scale is not None else H ** -0.5
    if T * R * P * page_size * max_pages == 0:      # no query row or no key slot at all
        return jnp.zeros_like(q)
    lengths = jnp.maximum(kv_lengths, 0)
    counts = jnp.maximum(num_queries, 0)

    # The owner of each token: the row whose query range holds it (at most one by contract).
    t = jnp.arange(T, dtype=jnp.int32)[:, None]                                  # [T, 1]
    in_range = (t >= query_start[None, :]) & (t < query_start[None, :] + counts[None, :])
    owned = jnp.any(in_range, axis=1)                                            # [T]
    row = jnp.argmax(in_range, axis=1)                                           # [T]
    qpos = lengths[row] - counts[row] + (t[:, 0] - query_start[row])             # [T]

    # Entries past the row's last page read page 0 (a garbage id is never used), masked.
    used_pages = (lengths + page_size - 1) // page_size                          # [R]
    page_used = jnp.arange(max_pages)[None, :] < used_pages[:, None]            # [R, M]
    pages = jnp.where(page_used, block_tables, 0)
    k = k_pages[pages].reshape(R, S, K, H)[row]                                  # [T, S, K, H]
    v = v_pages[pages].reshape(R, S, K, H)[row]

    kpos = jnp.arange(S)[None, :]                                                # [1, S]
    visible = owned[:, None] & (kpos < lengths[row][:, None]) & (kpos <= qpos[:, None])
    if sliding_window is not None:
        visible &= kpos > qpos[:, None] - sliding_window                         # [T, S]

    qg = q.reshape(T, K, G, H)
    # HIGHEST: on GPU the default f32 precision is TF32, too coarse for a reference.
    s = jnp.einsum("TKGH,TSKH->TKGS", qg, k, precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)          # a token that sees no key (owned by no row)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    v = jnp.where(visible[:, :, None, None], v, 0)  # stale slots may hold NaN; 0 * NaN is NaN
    out = jnp.einsum("TKGS,TSKH->TKGH", p.astype(v.dtype), v, precision=jax.lax.Precision.HIGHEST,
                     preferred_element_type=jnp.float32)
    return out.reshape(T, N, H).astype(q.dtype)
