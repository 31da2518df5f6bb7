"""Pure-jnp paged attention for decode: the reference the Pallas kernel is checked against.

Shape legend: B batch, N query heads, K kv heads, G = N // K, H head dim, P pages in the pool,
S key slots of a sequence (max_pages * page_size).

The query of row b sits at position lengths[b] - 1 and sees keys 0 .. lengths[b] - 1 (with a
sliding window w only keys > lengths[b] - 1 - w); key j is in page block_tables[b, j //
page_size] at offset j % page_size. Table entries at or beyond ceil(lengths[b] / page_size) are
never dereferenced. Quantized pages: int8 or float8_e4m3fn codes with k_scale, v_scale
[P, page_size, K] (value = code * scale), dequantized first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention.reference import check_scales, dequantize

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
HEAD_DIMS = (32, 64, 128, 256)


def check_pool_inputs(q, k_pages, v_pages, index_inputs, sliding_window=None, softcap=None,
                      k_scale=None, v_scale=None):
    """The checks of every kernel over a page pool: q [., N, H], float k_pages, v_pages
    [P, page_size, K, H] (or codes with scales: check_scales), int32 index_inputs ((name,
    array, rank), ...), a supported head dim, N % K == 0, window >= 1, softcap > 0. Raises
    ValueError naming the value; returns True for quantized pages. Reads shapes and dtypes."""
    for name, x, rank in (("q", q, 3), ("k_pages", k_pages, 4),
                          ("v_pages", v_pages, 4)) + tuple(index_inputs):
        if jnp.ndim(x) != rank:
            raise ValueError(f"{name} must have rank {rank}; got shape {jnp.shape(x)}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ in shape")
    quantized = check_scales(k_pages, v_pages, k_scale, v_scale, k_name="k_pages",
                             v_name="v_pages")
    for name, x in (("q", q),) + (() if quantized else (("k_pages", k_pages),
                                                         ("v_pages", v_pages))):
        if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
            raise ValueError(f"{name} has dtype {x.dtype}; expected float32, bfloat16 or float16"
                             + ("" if name == "q" else " (or int8 / float8_e4m3fn codes with "
                                                     "k_scale, v_scale)"))
    for name, x, _ in index_inputs:
        if jnp.dtype(x.dtype) != jnp.int32:
            raise ValueError(f"{name} has dtype {x.dtype}; expected int32")
    N, H = q.shape[1:]
    K, Hk = k_pages.shape[2:]
    if H not in HEAD_DIMS:
        raise ValueError(f"head dim {H} is not supported; expected one of {HEAD_DIMS}")
    if Hk != H:
        raise ValueError(f"k_pages head dim {Hk} != q head dim {H}")
    if K == 0 or N % K:
        raise ValueError(f"{N} query heads are not a multiple of {K} kv heads")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window is {sliding_window}; it must be >= 1 (or None)")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap is {softcap}; it must be > 0 (or None)")
    return quantized


def check_inputs(q, k_pages, v_pages, lengths, block_tables, sliding_window=None, softcap=None,
                 k_scale=None, v_scale=None):
    """check_pool_inputs for one query token per row, plus one length and one block-table row
    per query row. Returns True for quantized pages."""
    quantized = check_pool_inputs(q, k_pages, v_pages, (("lengths", lengths, 1),
                                                        ("block_tables", block_tables, 2)),
                                  sliding_window, softcap, k_scale, v_scale)
    B = q.shape[0]
    if lengths.shape != (B,) or block_tables.shape[0] != B:
        raise ValueError(f"lengths {lengths.shape} and block_tables {block_tables.shape} must have "
                         f"{B} rows like q {q.shape}")
    return quantized


def paged_attention_reference(q, k_pages, v_pages, lengths, block_tables, *, sliding_window=None,
                              softcap=None, sm_scale=None, k_scale=None, v_scale=None):
    """Decode attention of one token per row over paged K/V (the module docstring's contract).
    q [B, N, H] -> [B, N, H] in q.dtype."""
    if check_inputs(q, k_pages, v_pages, lengths, block_tables, sliding_window, softcap,
                    k_scale, v_scale):
        k_pages, v_pages = dequantize(k_pages, k_scale), dequantize(v_pages, v_scale)
    return _reference(q, k_pages, v_pages, lengths, block_tables, sliding_window=sliding_window,
                      softcap=softcap, sm_scale=sm_scale)


@functools.partial(jax.jit, static_argnames=("sliding_window", "softcap", "sm_scale"))
def _reference(q, k_pages, v_pages, lengths, block_tables, *, sliding_window, softcap, sm_scale):
    B, N, H = q.shape
    P, page_size, K, _ = k_pages.shape
    max_pages = block_tables.shape[1]
    G = N // K
    scale = sm_scale if sm_scale is not None else H ** -0.5
    if P * page_size * max_pages == 0:              # no key slot at all
        return jnp.zeros_like(q)
    lengths = jnp.maximum(lengths, 0)

    # Entries past the row's last page read page 0 (a garbage id is never used), masked.
    used_pages = (lengths + page_size - 1) // page_size                          # [B]
    page_used = jnp.arange(max_pages)[None, :] < used_pages[:, None]            # [B, max_pages]
    pages = jnp.where(page_used, block_tables, 0)
    k = k_pages[pages].reshape(B, max_pages * page_size, K, H)                   # [B, S, K, H]
    v = v_pages[pages].reshape(B, max_pages * page_size, K, H)

    pos = jnp.arange(max_pages * page_size)[None, :]                             # [1, S]
    visible = pos < lengths[:, None]                                             # [B, S]
    if sliding_window is not None:
        visible &= pos > lengths[:, None] - 1 - sliding_window

    qg = q.reshape(B, K, G, H)
    # HIGHEST: on GPU the default f32 precision is TF32, too coarse for a reference.
    s = jnp.einsum("BKGH,BSKH->BKGS", qg, k, precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)          # a row with no visible key (length 0)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    v = jnp.where(visible[:, :, None, None], v, 0)  # stale slots may hold NaN; 0 * NaN is NaN
    out = jnp.einsum("BKGS,BSKH->BKGH", p.astype(v.dtype), v, precision=jax.lax.Precision.HIGHEST,
                     preferred_element_type=jnp.float32)
    return out.reshape(B, N, H).astype(q.dtype)
