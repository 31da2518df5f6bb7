"""Pallas paged attention for decode: one query token per sequence over K/V pages.

Shape legend: B batch, N query heads, K kv heads, G = N // K (query heads per kv head), Gp the
query block rows (G padded), H head dim, P pages in the pool, page_size keys per page.

Grid (B, K): program (b, h) holds kv head h's G query heads as one [Gp, H] block (each page
read once per kv head) and walks the row's pages, pages_per_block at a time through the block
table, with an online softmax in float32. Only table slots of visible pages are dereferenced
(the last step's are clamped to the last page and masked). Quantized pages (int8 /
float8_e4m3fn codes with k_scale, v_scale [P, page_size, K]) stay in their dtype; each step
dequantizes what it gathered, the scales reaching the program as a [P, page_size] view of kv
head h's. A portable pallas_call: interpret=True on CPU, Triton on GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.paged_attention import block_sizes
from pallas_kernels.paged_attention.reference import check_inputs


def paged_attention_kernel(lengths_ref, block_tables_ref, q_ref, k_pages_ref, v_pages_ref, *refs,
                           page_size, pages_per_block, sm_scale, softcap, sliding_window):
    # lengths_ref [1], block_tables_ref [max_pages] int32 (this sequence); q_ref, o_ref [Gp, H];
    # k_pages_ref, v_pages_ref [P, page_size, H] (this kv head);
    # refs: (o_ref,), or (k_scale_ref, v_scale_ref [P, page_size], o_ref) for quantized pages.
    if len(refs) == 3:
        k_scale_ref, v_scale_ref, o_ref = refs
    else:
        (o_ref,), k_scale_ref, v_scale_ref = refs, None, None
    rows, H = q_ref.shape
    block_k = pages_per_block * page_size
    max_pages = block_tables_ref.shape[0]

    length = jnp.maximum(lengths_ref[0], 0)
    end_page = jnp.minimum((length + page_size - 1) // page_size, max_pages)
    if sliding_window is None:
        first_page = jnp.int32(0)
    else:
        first_page = jnp.maximum(length - sliding_window, 0) // page_size
    # Every step's first page holds at least one visible key, so its running max is finite.
    num_steps = (end_page - first_page + pages_per_block - 1) // pages_per_block

    q = q_ref[...]

    def step(i, carry):
        m_prev, l_prev, acc_prev = carry                      # [Gp], [Gp], [Gp, H] float32
        slot0 = first_page + i * pages_per_block
        slots = slot0 + lax.broadcasted_iota(jnp.int32, (pages_per_block,), 0)
        pages = block_tables_ref[jnp.minimum(slots, end_page - 1)]       # [pages_per_block]
        k = k_pages_ref[pages].reshape(block_k, H)                        # [block_k, H]
        v = v_pages_ref[pages].reshape(block_k, H)
        if k_scale_ref is not None:
            k_scale = k_scale_ref[pages].reshape(block_k)
            v_scale = v_scale_ref[pages].reshape(block_k)
            k = (k.astype(jnp.float32) * k_scale[:, None]).astype(q.dtype)
            v = (v.astype(jnp.float32) * v_scale[:, None]).astype(q.dtype)

        pos = slot0 * page_size + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        visible = pos < length
        if sliding_window is not None:
            visible &= pos > length - 1 - sliding_window

        s = lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())),
                            precision=lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32) * sm_scale   # [Gp, block_k]
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        s = jnp.where(visible[None, :], s, -jnp.inf)

        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next[:, None])
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        # Slots past the length (stale or re-read pages) may hold NaN, and 0 * NaN is NaN.
        v = jnp.where(visible[:, None], v, jnp.zeros_like(v))
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)             # [Gp, H]
        return m_next, l_next, alpha[:, None] * acc_prev + pv

    init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, H), jnp.float32))
    _, l, acc = lax.fori_loop(0, num_steps, step, init)
    out = acc / jnp.where(l == 0, 1.0, l)[:, None]          # length 0: no step ran, out = 0
    o_ref[...] = out.astype(o_ref.dtype)


def paged_attention(q, k_pages, v_pages, lengths, block_tables, *, sliding_window=None,
                    softcap=None, sm_scale=None, interpret=False, pages_per_block=None,
                    q_rows=None, k_scale=None, v_scale=None):
    """Decode attention of one token per row over paged K/V. q [B, N, H] -> [B, N, H] in q.dtype.

    k_pages, v_pages [P, page_size, K, H] (or int8 / float8_e4m3fn codes with k_scale, v_scale
    [P, page_size, K]); lengths [B] int32 (the new token included); block_tables
    [B, max_pages] int32; reference.py has the contract. pages_per_block and q_rows override the
    block-size table (raised to its floors; powers of two on GPU). Raises ValueError for wrong
    ranks, dtypes, N % K != 0 or an unsupported H.
    """
    if check_inputs(q, k_pages, v_pages, lengths, block_tables, sliding_window, softcap, k_scale,
                    v_scale):
        k_scale = jnp.asarray(k_scale, jnp.float32)
        v_scale = jnp.asarray(v_scale, jnp.float32)
    if pages_per_block is not None and pages_per_block < 1:
        raise ValueError(f"pages_per_block is {pages_per_block}; it must be >= 1")
    G = q.shape[1] // k_pages.shape[2]
    if q_rows is not None and q_rows < G:
        raise ValueError(f"q_rows is {q_rows}; it must be >= {G} query heads per kv head")
    backend = jax.default_backend()
    pages_per_block = block_sizes.pages_per_block_for(backend, k_pages.shape[1],
                                                      block_tables.shape[1], pages_per_block)
    q_rows = block_sizes.q_rows_for(backend, G, q_rows)
    return _paged_attention(q, k_pages, v_pages, lengths, block_tables, k_scale, v_scale,
                            sliding_window=sliding_window, softcap=softcap, sm_scale=sm_scale,
                            interpret=interpret, pages_per_block=pages_per_block, q_rows=q_rows,
                            backend=backend)


@functools.partial(jax.jit, static_argnames=("sliding_window", "softcap", "sm_scale", "interpret",
                                             "pages_per_block", "q_rows", "backend"))
def _paged_attention(q, k_pages, v_pages, lengths, block_tables, k_scale, v_scale, *,
                     sliding_window, softcap, sm_scale, interpret, pages_per_block, q_rows,
                     backend):
    B, N, H = q.shape
    P, page_size, K, _ = k_pages.shape
    max_pages = block_tables.shape[1]
    G = N // K
    if P * page_size * max_pages == 0:              # no key slot at all (zero-size blocks)
        return jnp.zeros_like(q)
    # Quantized pages are dequantized to the query dtype inside the kernel.
    compute_dtype = q.dtype if k_scale is not None else jnp.promote_types(q.dtype, k_pages.dtype)
    qg = q.astype(compute_dtype).reshape(B, K, G, H)
    if q_rows > G:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, q_rows - G), (0, 0)))

    kernel = functools.partial(
        paged_attention_kernel, page_size=page_size, pages_per_block=pages_per_block,
        sm_scale=sm_scale if sm_scale is not None else H ** -0.5, softcap=softcap,
        sliding_window=sliding_window)
    sizes = block_sizes.block_sizes_for(backend)
    pages_spec = pl.BlockSpec((P, page_size, None, H), lambda b, h: (0, 0, h, 0))
    in_specs = [
        pl.BlockSpec((1,), lambda b, h: (b,)),                            # lengths
        pl.BlockSpec((None, max_pages), lambda b, h: (b, 0)),             # block_tables
        pl.BlockSpec((None, None, q_rows, H), lambda b, h: (b, h, 0, 0)),  # q
        pages_spec,                                                       # k_pages
        pages_spec,                                                       # v_pages
    ]
    operands = [lengths, block_tables, qg, k_pages, v_pages]
    if k_scale is not None:
        scale_spec = pl.BlockSpec((P, page_size, None), lambda b, h: (0, 0, h))  # [P, page_size]
        in_specs += [scale_spec, scale_spec]                              # k_scale, v_scale
        operands += [k_scale, v_scale]
    out = pl.pallas_call(
        kernel,
        grid=(B, K),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, q_rows, H), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, K, q_rows, H), q.dtype),
        compiler_params=None if interpret else pl_triton.CompilerParams(
            num_warps=sizes.num_warps, num_stages=sizes.num_stages),
        interpret=interpret,
        name="paged_attention",
    )(*operands)
    return out[:, :, :G].reshape(B, N, H)
