"""Flash attention for prefill as a portable Pallas kernel (interpret mode on CPU, Triton on GPU).

Shape legend: B batch, T queries, S keys, N query heads, K kv heads, G = N // K, H head dim.

Grid (B, N, cdiv(T, block_q)): program (b, n, i) owns a query tile and the keys of kv head
n // G (picked by the index map, so GQA never repeats K/V). A blocked online softmax in float32
walks only the key blocks the tile can see (bounded by kv_length, causality and the window), in
three loops: masked edge blocks, interior blocks every query sees in full (no mask), masked
edge blocks. Quantized K/V (int8 / float8_e4m3fn codes with k_scale, v_scale [B, S, K]) stay
in their dtype; each block is dequantized after its load.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from .block_sizes import BlockSizes, default_block_sizes
from .reference import check_inputs

_DIMS_QK = (((1,), (1,)), ((), ()))   # [bq, H] x [bk, H] -> [bq, bk]
_DIMS_PV = (((1,), (0,)), ((), ()))   # [bq, bk] x [bk, H] -> [bq, H]


def _cdiv(a, b: int):
    """Ceil division of a non-negative int32 scalar by a positive Python int."""
    return lax.div(a + (b - 1), jnp.int32(b))


def _flash_kernel(q_offset_ref, kv_lengths_ref, q_ref, k_ref, v_ref, *refs, block_q: int,
                  block_k: int, q_len: int, kv_len: int, causal: bool, window: int | None,
                  softcap: float | None, scale: float, precision):
    # q_ref, o_ref: [bq, H]; k_ref, v_ref: [S_pad, H]; q_offset_ref, kv_lengths_ref: [] int32.
    # refs: (o_ref,), or with quantized K/V (k_scale_ref, v_scale_ref, o_ref), scales [S_pad].
    if len(refs) == 3:
        k_scale_ref, v_scale_ref, o_ref = refs
    else:
        (o_ref,), k_scale_ref, v_scale_ref = refs, None, None
    i = pl.program_id(2)
    q_off = q_offset_ref[()]
    length = jnp.clip(kv_lengths_ref[()], 0, kv_len)
    q_first = q_off + i * block_q                                    # position of tile row 0
    q_last = q_off + jnp.minimum((i + 1) * block_q, q_len) - 1       # last real query row
    zero = jnp.int32(0)

    # Key range any query of the tile can see, in blocks: [lo_blk, hi_blk).
    hi = length
    if causal:
        hi = jnp.minimum(hi, jnp.maximum(q_last + 1, zero))
    lo = zero
    if window is not None:
        lo = jnp.maximum(q_first - window + 1, zero)
    lo_blk = lax.div(lo, jnp.int32(block_k))
    hi_blk = jnp.maximum(_cdiv(hi, block_k), lo_blk)
    # Blocks every real query of the tile sees in full: [full_lo, full_hi) within the above.
    full_hi = lax.div(length, jnp.int32(block_k))
    if causal:
        full_hi = jnp.minimum(full_hi, lax.div(jnp.maximum(q_first + 1, zero),
                                               jnp.int32(block_k)))
    full_lo = lo_blk
    if window is not None:
        full_lo = _cdiv(jnp.maximum(q_last - window + 1, zero), block_k)
    full_lo = jnp.clip(full_lo, lo_blk, hi_blk)
    full_hi = jnp.clip(full_hi, full_lo, hi_blk)

    q = q_ref[...]
    rows = q_first + jnp.arange(block_q, dtype=jnp.int32)            # query positions [bq]

    def step(j, carry, masked: bool):
        m, l, acc = carry
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        if k_scale_ref is not None:
            k = (k.astype(jnp.float32) * k_scale_ref[pl.ds(start, block_k)][:, None]
                 ).astype(q.dtype)
        s = lax.dot_general(q, k, _DIMS_QK, precision=precision,
                            preferred_element_type=jnp.float32) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s * (1.0 / softcap))
        if masked:
            cols = start + jnp.arange(block_k, dtype=jnp.int32)      # key positions [bk]
            visible = (cols < length)[None, :]
            if causal:
                visible = visible & (cols[None, :] <= rows[:, None])
            if window is not None:
                visible = visible & (cols[None, :] > rows[:, None] - window)
            s = jnp.where(visible, s, -jnp.inf)
        # m starts finite, so a fully masked row keeps m finite and gets p = exp(-inf) = 0.
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        v = v_ref[pl.ds(start, block_k), :]
        if v_scale_ref is not None:
            v = (v.astype(jnp.float32) * v_scale_ref[pl.ds(start, block_k)][:, None]
                 ).astype(q.dtype)
        if masked:
            # Keys past kv_length may hold anything (a fresh cache page): p = 0 there, but
            # 0 * NaN would still leak into the output.
            v = jnp.where((cols < length)[:, None], v, jnp.zeros((), v.dtype))
        pv = lax.dot_general(p.astype(v.dtype), v, _DIMS_PV, precision=precision,
                             preferred_element_type=jnp.float32)
        return m_new, l, acc * alpha[:, None] + pv

    carry = (jnp.full((block_q,), jnp.finfo(jnp.float32).min, jnp.float32),
             jnp.zeros((block_q,), jnp.float32),
             jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32))
    carry = lax.fori_loop(lo_blk, full_lo, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(full_hi, hi_blk, functools.partial(step, masked=True), carry)
    _, l, acc = carry
    # A row that saw no key has l == 0 and acc == 0: it gives zeros.
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("causal", "sliding_window", "softcap", "sm_scale",
                                             "interpret", "blocks"))
def _flash_attention(q, k, v, q_offset, kv_lengths, k_scale, v_scale, *, causal: bool,
                     sliding_window: int | None, softcap: float | None, sm_scale: float,
                     interpret: bool, blocks: BlockSizes):
    B, T, N, H = q.shape
    _, S, K, _ = k.shape
    G = N // K
    bq, bk = blocks.block_q, blocks.block_k
    if q_offset is None:
        q_offset = jnp.zeros((B,), jnp.int32)
    if kv_lengths is None:
        kv_lengths = jnp.full((B,), S, jnp.int32)

    t_pad, s_pad = pl.cdiv(T, bq) * bq, pl.cdiv(S, bk) * bk
    if t_pad != T:
        q = jnp.pad(q, ((0, 0), (0, t_pad - T), (0, 0), (0, 0)))
    if s_pad != S:
        k = jnp.pad(k, ((0, 0), (0, s_pad - S), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, s_pad - S), (0, 0), (0, 0)))
        if k_scale is not None:
            k_scale = jnp.pad(k_scale, ((0, 0), (0, s_pad - S), (0, 0)))
            v_scale = jnp.pad(v_scale, ((0, 0), (0, s_pad - S), (0, 0)))

    kernel = functools.partial(
        _flash_kernel, block_q=bq, block_k=bk, q_len=T, kv_len=S, causal=causal,
        window=sliding_window, softcap=softcap, scale=sm_scale,
        # f32: full-precision dots (Triton would otherwise use TF32); bf16/f16: native MMA.
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)
    scalar_spec = pl.BlockSpec((None,), lambda b, n, i: (b,))
    q_spec = pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0))
    kv_spec = pl.BlockSpec((None, s_pad, None, H), lambda b, n, i: (b, 0, n // G, 0))
    in_specs = [scalar_spec, scalar_spec, q_spec, kv_spec, kv_spec]
    operands = [q_offset, kv_lengths, q, k, v]
    if k_scale is not None:
        # [S_pad] scales of kv head n // G: the K/V index map with the head axis squeezed.
        scale_spec = pl.BlockSpec((None, s_pad, None), lambda b, n, i: (b, 0, n // G))
        in_specs += [scale_spec, scale_spec]
        operands += [k_scale, v_scale]
    out = pl.pallas_call(
        kernel,
        grid=(B, N, t_pad // bq),
        in_specs=in_specs,
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct((B, t_pad, N, H), q.dtype),
        compiler_params=pl_triton.CompilerParams(num_warps=blocks.num_warps,
                                                 num_stages=blocks.num_stages),
        interpret=interpret,
        name="flash_attention",
    )(*operands)
    return out[:, :T] if t_pad != T else out


def flash_attention(q, k, v, *, causal=True, q_offset=None, kv_lengths=None, sliding_window=None,
                    softcap=None, sm_scale=None, interpret=False, block_q=None, block_k=None,
                    k_scale=None, v_scale=None):
    """Attention of q [B, T, N, H] over k, v [B, S, K, H] -> [B, T, N, H] in q.dtype.

    q_offset [B] int32: q[:, 0]'s position among the keys (None: 0); kv_lengths [B] int32
    (None: S); reference.py has the visibility rule. block_q / block_k override the tile sizes
    (powers of two >= 16 on GPU). Quantized K/V: int8 / float8_e4m3fn codes with k_scale,
    v_scale [B, S, K]. Raises ValueError for bad ranks, dtypes, head counts or head dims.
    """
    B, T, N, H, S, K = check_inputs(q, k, v, q_offset, kv_lengths, sliding_window, softcap,
                                    sm_scale, k_scale, v_scale)
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"{name} must be a positive int or None; got {b!r}")
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if k_scale is not None:
        k_scale = jnp.asarray(k_scale, jnp.float32)
        v_scale = jnp.asarray(v_scale, jnp.float32)
    if B * T * N == 0 or S == 0:
        return jnp.zeros(q.shape, q.dtype)
    blocks = default_block_sizes(jax.default_backend(), H, T, S)
    if block_q is not None:
        blocks = dataclasses.replace(blocks, block_q=block_q)
    if block_k is not None:
        blocks = dataclasses.replace(blocks, block_k=block_k)
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(H)
    return _flash_attention(
        q, k, v, q_offset if q_offset is None else jnp.asarray(q_offset),
        kv_lengths if kv_lengths is None else jnp.asarray(kv_lengths), k_scale, v_scale,
        causal=bool(causal), sliding_window=None if sliding_window is None else int(sliding_window),
        softcap=None if softcap is None else float(softcap), sm_scale=scale,
        interpret=bool(interpret), blocks=blocks)
