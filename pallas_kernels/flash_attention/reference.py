"""Pure-jnp reference for flash attention, and the input checks shared with the kernel.

Shape legend: B batch, T queries, S keys, N query heads, K kv heads, G = N // K, H head dim.

Key j is visible to query t of row b iff j < kv_lengths[b], and (causal) j <= q_offset[b] + t,
and (with a window, causal or not) j > q_offset[b] + t - sliding_window. Logits are
softcap * tanh(sm_scale * q.k / softcap), softcap before masking; a query that sees no key gets
zeros. Quantized K/V: int8 or float8_e4m3fn codes with k_scale, v_scale [B, S, K] (value =
code * scale).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def _as_array(x):
    return x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)


def check_scales(k, v, k_scale, v_scale, *, k_name="k", v_name="v"):
    """k_scale and v_scale are given together, exactly when k and v hold codes of one dtype,
    shaped as k less its last axis, floating. Returns True for quantized k, v."""
    k_dtype, v_dtype = jnp.dtype(k.dtype), jnp.dtype(v.dtype)
    quantized = k_dtype in QUANTIZED_DTYPES or v_dtype in QUANTIZED_DTYPES
    if (k_scale is None) != (v_scale is None):
        raise ValueError(f"k_scale and v_scale must be given together; got k_scale "
                         f"{'None' if k_scale is None else 'given'}, v_scale "
                         f"{'None' if v_scale is None else 'given'}")
    if not quantized:
        if k_scale is not None:
            raise ValueError(f"k_scale / v_scale are given but {k_name}, {v_name} are not "
                             f"quantized ({k_dtype}, {v_dtype}); scales go with int8 or "
                             f"float8_e4m3fn codes only")
        return False
    if k_dtype != v_dtype or k_dtype not in QUANTIZED_DTYPES:
        raise ValueError(f"quantized {k_name} and {v_name} must both hold int8 or both "
                         f"float8_e4m3fn codes; got {k_dtype}, {v_dtype}")
    if k_scale is None:
        raise ValueError(f"{k_name}, {v_name} hold {k_dtype} codes: k_scale and v_scale are "
                         f"required")
    for name, x in (("k_scale", _as_array(k_scale)), ("v_scale", _as_array(v_scale))):
        if tuple(x.shape) != tuple(k.shape[:-1]):
            raise ValueError(f"{name} must have the shape of {k_name} without its last axis, "
                             f"{tuple(k.shape[:-1])}; got {tuple(x.shape)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} dtype must be floating (float32); got {x.dtype}")
    return True


def check_inputs(q, k, v, q_offset, kv_lengths, sliding_window, softcap, sm_scale,
                 k_scale=None, v_scale=None):
    """Validates shapes, dtypes and static options (raises ValueError). Reads only shapes and
    dtypes, so it costs no device work."""
    q, k, v = _as_array(q), _as_array(k), _as_array(v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 ([B, T, N, H] / [B, S, K, H]); "
                             f"got shape {tuple(x.shape)}")
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype must be float32, bfloat16 or float16; got {q.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if not check_scales(k, v, k_scale, v_scale):
        for name, x in (("k", k), ("v", v)):
            if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
                raise ValueError(f"{name} dtype must be float32, bfloat16 or float16 (or int8 / "
                                 f"float8_e4m3fn codes with k_scale, v_scale); got {x.dtype}")
        if not (q.dtype == k.dtype == v.dtype):
            raise ValueError(f"q, k, v dtypes must match; got {q.dtype}, {k.dtype}, {v.dtype}")
    B, T, N, H = q.shape
    Bk, S, K, Hk = k.shape
    if Bk != B:
        raise ValueError(f"batch of q ({B}) and k/v ({Bk}) differ")
    if Hk != H:
        raise ValueError(f"head dim of q ({H}) and k/v ({Hk}) differ")
    if H not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {H} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
    if K == 0 or N % K != 0:
        raise ValueError(f"query heads ({N}) must be a multiple of kv heads ({K})")
    for name, x in (("q_offset", q_offset), ("kv_lengths", kv_lengths)):
        if x is None:
            continue
        x = _as_array(x)
        if x.ndim != 1 or x.shape[0] != B:
            raise ValueError(f"{name} must have shape [B] = [{B}]; got {tuple(x.shape)}")
        if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
            raise ValueError(f"{name} dtype must be int32; got {x.dtype}")
    if sliding_window is not None and (isinstance(sliding_window, bool)
                                       or not isinstance(sliding_window, (int, np.integer))
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None; got {sliding_window!r}")
    if softcap is not None and not (isinstance(softcap, (int, float, np.number))
                                    and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive float or None; got {softcap!r}")
    if sm_scale is not None and not (isinstance(sm_scale, (int, float, np.number))
                                     and math.isfinite(sm_scale)):
        raise ValueError(f"sm_scale must be a finite float or None; got {sm_scale!r}")
    return B, T, N, H, S, K


def dequantize(x, scale):
    """int8 / float8_e4m3fn codes [..., H] times per-row scales [...] -> float32 [..., H]."""
    return jnp.asarray(x).astype(jnp.float32) * jnp.asarray(scale).astype(jnp.float32)[..., None]


def flash_attention_reference(q, k, v, *, causal=True, q_offset=None, kv_lengths=None,
                              sliding_window=None, softcap=None, sm_scale=None, k_scale=None,
                              v_scale=None):
    """Dense attention with flash_attention's contract, in float32: q [B, T, N, H]; k, v
    [B, S, K, H] (codes with scales dequantized first) -> [B, T, N, H] in q.dtype."""
    B, T, N, H, S, K = check_inputs(q, k, v, q_offset, kv_lengths, sliding_window, softcap,
                                    sm_scale, k_scale, v_scale)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if k_scale is not None:
        k, v = dequantize(k, k_scale), dequantize(v, v_scale)
    if S == 0:
        return jnp.zeros(q.shape, q.dtype)
    G = N // K
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(H)
    hi = jax.lax.Precision.HIGHEST
    q_offset = (jnp.zeros((B,), jnp.int32) if q_offset is None else jnp.asarray(q_offset))
    kv_lengths = (jnp.full((B,), S, jnp.int32) if kv_lengths is None
                  else jnp.asarray(kv_lengths))

    qg = q.astype(jnp.float32).reshape(B, T, K, G, H)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(jnp.float32), precision=hi) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)

    qpos = q_offset[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]       # [B, T]
    kpos = jnp.arange(S, dtype=jnp.int32)[None, None, :]                      # [1, 1, S]
    visible = kpos < kv_lengths[:, None, None]                                # [B, 1, S]
    if causal:
        visible = visible & (kpos <= qpos[:, :, None])                        # [B, T, S]
    if sliding_window is not None:
        visible = visible & (kpos > qpos[:, :, None] - sliding_window)
    s = jnp.where(visible[:, None, None], s, -jnp.inf)                        # [B, K, G, T, S]

    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)                 # rows that see no key
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("bkgts,bskh->btkgh", p, v.astype(jnp.float32), precision=hi)
    return out.reshape(B, T, N, H).astype(q.dtype)
