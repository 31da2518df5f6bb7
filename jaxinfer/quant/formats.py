"""Quantized weight formats: the QuantizedWeight pytree, int4 packing, the quantizers (numpy,
on the host) and dequantization (jnp, and `dequantize_host`, its numpy twin bit for bit).

A QuantizedWeight holds codes q grouped along the contraction axis `axis` (0 for linear weights
[in, out], 1 for the embedding [V, D]) and per group a scale and optionally an offset:
value = q * scale[g] + offset[g] in float32. For every scheme here and GGUF's blocks q * scale
is exact in float32, so the one rounding is the sum's, as in ggml's `d * q + m`.

int4 codes are nibbles packed two to a byte along `axis`, GGUF's way: in each block of 32
elements, byte j holds element j in its low nibble and element j + 16 in its high nibble.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import flax.struct
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

Array = Union[jax.Array, np.ndarray]
INT4_BLOCK = 32  # elements per int4 packing block
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448; beyond it a cast gives NaN


@flax.struct.dataclass
class QuantizedWeight:
    """A quantized 2-D weight of float shape [.., n, ..] (n on `axis`), n_groups = n //
    group_size (0: one group). q: int8 [float shape] ("int8"), uint8 [.., n / 2, ..] ("int4"),
    float8_e4m3fn ("fp8"); scale: [.., n_groups, ..] float16 (float32 for GGUF's K-quants);
    offset: like scale, or None (symmetric)."""
    q: Array
    scale: Array
    offset: Optional[Array]
    kind: str = flax.struct.field(pytree_node=False)        # "int8" | "int4" | "fp8"
    axis: int = flax.struct.field(pytree_node=False)        # the grouped (contraction) axis
    group_size: int = flax.struct.field(pytree_node=False)  # 0: the whole axis

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape."""
        shape = list(self.q.shape)
        if self.kind == "int4":
            shape[self.axis] *= 2
        return tuple(shape)

    def layout(self) -> dict:
        """The static fields, as a checkpoint's config records them."""
        return {"kind": self.kind, "axis": self.axis, "group_size": self.group_size}


def nbytes(w: QuantizedWeight) -> int:
    """Bytes of q, scale and offset together."""
    return sum(int(a.nbytes) for a in (w.q, w.scale, w.offset) if a is not None)


def _split_axis(shape: Sequence[int], axis: int, parts: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(shape[:axis]) + parts + tuple(shape[axis + 1:])


# -- int4 packing ---------------------------------------------------------------------------------

def pack_int4(q: Array, axis: int) -> np.ndarray:
    """Values 0..15 (any integer dtype) -> uint8 with `axis` halved, packed as the module
    docstring says. The axis size must be a multiple of 32."""
    q = np.asarray(q)
    n = q.shape[axis]
    if n % INT4_BLOCK:
        raise ValueError(f"int4 packing needs axis {axis} to be a multiple of {INT4_BLOCK}, "
                         f"got shape {q.shape}")
    if q.size and (q.min() < 0 or q.max() > 15):
        raise ValueError(f"int4 values must lie in 0..15, got {q.min()}..{q.max()}")
    blocks = q.astype(np.uint8).reshape(_split_axis(q.shape, axis, (n // INT4_BLOCK, 2, 16)))
    lead = (slice(None),) * (axis + 1)
    packed = blocks[lead + (0,)] | (blocks[lead + (1,)] << 4)
    return packed.reshape(_split_axis(q.shape, axis, (n // 2,)))


def unpack_int4(packed: Array, axis: int, xp=jnp):
    """uint8 packed nibbles -> uint8 values 0..15 with `axis` doubled (jit-traceable, no
    gathers)."""
    packed = xp.asarray(packed)
    n2 = packed.shape[axis]
    if n2 % (INT4_BLOCK // 2):
        raise ValueError(f"packed int4 axis {axis} must be a multiple of {INT4_BLOCK // 2}, got "
                         f"shape {packed.shape}")
    blocks = packed.reshape(_split_axis(packed.shape, axis, (n2 // 16, 1, 16)))
    values = xp.concatenate([blocks & 0x0F, blocks >> 4], axis=axis + 1)  # [.., nb, 2, 16, ..]
    return values.reshape(_split_axis(packed.shape, axis, (2 * n2,)))


# -- dequantization -------------------------------------------------------------------------------

def _dequantize(w: QuantizedWeight, xp) -> Array:
    """float32 value of w in array module xp (the same operations, hence the same bits)."""
    q = unpack_int4(w.q, w.axis, xp) if w.kind == "int4" else xp.asarray(w.q)
    a, shape = w.axis, q.shape
    n_groups = w.scale.shape[a]
    grouped = q.reshape(_split_axis(shape, a, (n_groups, shape[a] // n_groups)))
    x = grouped.astype(xp.float32) * xp.expand_dims(xp.asarray(w.scale).astype(xp.float32),
                                                    a + 1)
    if w.offset is not None:
        x = x + xp.expand_dims(xp.asarray(w.offset).astype(xp.float32), a + 1)
    return x.reshape(shape)


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The float weight (its original shape), computed in float32 and cast to `dtype`."""
    return _dequantize(w, jnp).astype(dtype)


_HOST_CHUNK = 1 << 18  # float32 outputs per host step


def dequantize_host(w: QuantizedWeight) -> np.ndarray:
    """`dequantize` in numpy, bit for bit, in chunks of about _HOST_CHUNK elements along the
    leading axis, so each chunk's product is still in cache when its offset is added."""
    q, scale = np.asarray(w.q), np.asarray(w.scale)
    offset = None if w.offset is None else np.asarray(w.offset)
    out = np.empty(w.shape, np.float32)
    if w.axis == 0:  # chunks of groups: q rows, float rows and scale rows in step
        units, q_rows, f_rows = scale.shape[0], q.shape[0] // scale.shape[0], \
            out.shape[0] // scale.shape[0]
    else:            # chunks of rows, each holding all its groups
        units, q_rows, f_rows = q.shape[0], 1, 1
    step = max(_HOST_CHUNK // (f_rows * out.shape[1]), 1)
    for s in range(0, units, step):
        u = slice(s, s + step)
        piece = w.replace(q=q[s * q_rows:(s + step) * q_rows], scale=scale[u],
                          offset=None if offset is None else offset[u])
        out[s * f_rows:(s + step) * f_rows] = _dequantize(piece, np)
    return out


def take_out(w: QuantizedWeight, index: Array) -> QuantizedWeight:
    """w with its output (non-grouped) axis reordered: the quantized form of `x[:, index]`
    (axis 0) or `x[index]` (axis 1). Indices may repeat (kv heads replicated for a mesh)."""
    if w.q.ndim != 2:
        raise ValueError(f"take_out needs a 2-D weight, got shape {w.shape}")
    out_axis = 1 - w.axis

    def take(a):
        if a is None:
            return None
        return (np.take(a, index, axis=out_axis) if isinstance(a, np.ndarray)
                else jnp.take(a, jnp.asarray(index), axis=out_axis))
    return w.replace(q=take(w.q), scale=take(w.scale), offset=take(w.offset))


def logical_axes(w: QuantizedWeight, weight_axes: Sequence[Optional[str]]) -> QuantizedWeight:
    """The QuantizedWeight-shaped tree of logical axes for a weight whose float form has
    `weight_axes`: codes and scales split alike, so a device holds its codes' scales (a single
    group's axis unnamed; int4's packed axis keeps its name)."""
    axes = tuple(weight_axes)
    if len(axes) != len(w.q.shape):
        raise ValueError(f"logical axes {axes} do not match the weight's shape {w.shape}")
    scale_axes = axes
    if w.scale.shape[w.axis] == 1:
        scale_axes = axes[:w.axis] + (None,) + axes[w.axis + 1:]
    return w.replace(q=axes, scale=scale_axes,
                     offset=None if w.offset is None else scale_axes)


# -- quantizers (numpy, on the host) --------------------------------------------------------------
# Scales and offsets are rounded to their stored dtype towards keeping the group in the code
# range, and the codes computed against the stored values: each element then dequantizes within
# scale / 2 of its original (fp8: within its own rounding), whatever the scale dtype.

def _grouped(w: Array, axis: int, group_size: int) -> tuple[np.ndarray, int]:
    """w as float32 [.., n_groups, group, ..] (axis split in two) and the group length."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or axis not in (0, 1):
        raise ValueError(f"quantizers take a 2-D weight and axis 0 or 1, got shape {w.shape} "
                         f"and axis {axis}")
    n = w.shape[axis]
    group = group_size or n
    if group < 0 or n % group:
        raise ValueError(f"axis {axis} of size {n} does not split into groups of {group_size}")
    return w.reshape(_split_axis(w.shape, axis, (n // group, group))), group


def round_up(x: np.ndarray, dtype) -> np.ndarray:
    """The least value of `dtype` >= x (x float32 or float64); inf past its range."""
    with np.errstate(over="ignore"):
        s = x.astype(dtype)
    return np.where(s < x, np.nextafter(s, np.array(np.inf, dtype)), s)


def round_down(x: np.ndarray, dtype) -> np.ndarray:
    with np.errstate(over="ignore"):
        s = x.astype(dtype)
    return np.where(s > x, np.nextafter(s, np.array(-np.inf, dtype)), s)


def check_finite(stored: np.ndarray, what: str, dtype) -> None:
    if not np.all(np.isfinite(stored)):
        raise ValueError(f"{what} are not finite in {np.dtype(dtype).name}: the weight has "
                         "non-finite values or values too large for that scale dtype")


def divide(g: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """g / scale, 0 where the scale is 0 (an all-zero group)."""
    s = scale.astype(np.float32)
    return np.divide(g, s, out=np.zeros_like(g), where=s != 0)


def _finish(grouped_codes: np.ndarray, shape, axis: int, scale, offset, kind: str,
            group_size: int) -> QuantizedWeight:
    q = grouped_codes.reshape(shape)
    if kind == "int4":
        q = pack_int4(q, axis)
    squeeze = lambda a: None if a is None else np.squeeze(a, axis + 1)
    return QuantizedWeight(q=q, scale=squeeze(scale), offset=squeeze(offset), kind=kind,
                           axis=axis, group_size=group_size)


def quantize_int8(w: Array, axis: int = 0, group_size: int = 0,
                  scale_dtype=np.float16) -> QuantizedWeight:
    """Symmetric int8: scale = max|w| / 127 per group, q = round(w / scale) in [-127, 127]."""
    g, _ = _grouped(w, axis, group_size)
    amax = np.abs(g).max(axis=axis + 1, keepdims=True)
    scale = round_up(amax / np.float32(127), scale_dtype)
    check_finite(scale, "int8 scales", scale_dtype)
    q = np.clip(np.rint(divide(g, scale)), -127, 127).astype(np.int8)
    return _finish(q, np.shape(w), axis, scale, None, "int8", group_size)


def quantize_int4(w: Array, axis: int = 0, group_size: int = 32, symmetric: bool = False,
                  scale_dtype=np.float16) -> QuantizedWeight:
    """int4 per group of `group_size` (a multiple of 32) along `axis`, round to nearest.
    Asymmetric: offset = min, scale = (max - min) / 15, q in 0..15. Symmetric: scale =
    max|w| / 7, offset = -8 * scale, q - 8 in [-7, 7] (0 exact)."""
    g, group = _grouped(w, axis, group_size)
    if group % INT4_BLOCK:
        raise ValueError(f"int4 groups must be a multiple of {INT4_BLOCK} elements, got "
                         f"{group}")
    if symmetric:
        amax = np.abs(g).max(axis=axis + 1, keepdims=True)
        scale = round_up(amax / np.float32(7), scale_dtype)
        offset = scale * np.asarray(-8, scale_dtype)  # exact: a power of two
        check_finite(offset, "int4 offsets", scale_dtype)
        q = np.clip(np.rint(divide(g, scale)) + 8, 1, 15).astype(np.uint8)
    else:
        lo = g.min(axis=axis + 1, keepdims=True)
        hi = g.max(axis=axis + 1, keepdims=True)
        offset = round_down(lo, scale_dtype)  # <= every element
        check_finite(offset, "int4 offsets", scale_dtype)
        # offset + 15 * scale >= max: float64 keeps the difference exact
        scale = round_up((hi.astype(np.float64) - offset.astype(np.float64)) / 15, scale_dtype)
        check_finite(scale, "int4 scales", scale_dtype)
        q = np.clip(np.rint(divide(g - offset.astype(np.float32), scale)), 0, 15)
        q = q.astype(np.uint8)
    return _finish(q, np.shape(w), axis, scale, offset, "int4", group_size)


def quantize_fp8(w: Array, axis: int = 0, scale_dtype=np.float16) -> QuantizedWeight:
    """float8_e4m3fn per output channel: scale = max|w| / 448 over `axis`, q = w / scale
    rounded to nearest e4m3."""
    g, _ = _grouped(w, axis, 0)
    amax = np.abs(g).max(axis=axis + 1, keepdims=True)
    scale = round_up(amax / np.float32(FP8_MAX), scale_dtype)
    check_finite(scale, "fp8 scales", scale_dtype)
    q = np.clip(divide(g, scale), -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return _finish(q, np.shape(w), axis, scale, None, "fp8", 0)
