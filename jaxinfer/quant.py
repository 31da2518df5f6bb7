"""Quantized weights: int8, int4 and fp8 matrices with per-group scales, and GGUF's blocks.

A QuantizedWeight holds the codes q of a float weight, grouped along its contraction axis
`axis` (0 for linear weights [in, out], 1 for the embedding [V, D]), and per group a scale and
optionally an offset:

    value = q * scale[g] + offset[g]      in float32: the product rounded, then the sum

For every scheme here (our quantizers with float16 scales, and GGUF's Q8_0, Q4_0, Q4_1, Q4_K,
Q6_K) q * scale is exact in float32 (at most 4 + 11 or 8 + 17 significant bits), so the one
rounding is that of the sum, as in ggml's `d * q + m`, and a fused multiply-add gives the same
bits.

int4 codes are unsigned nibbles packed two to a byte along `axis`, GGUF's way: in each block of
32 consecutive elements, byte j (j < 16) holds element j in its low nibble and element j + 16
in its high nibble, so the packed axis has half the elements.

Quantizers and `from_gguf` run on the host in numpy (loading does no device work);
`unpack_int4` and `dequantize` are jnp and jit-traceable.
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
    """A quantized 2-D weight. With the float shape [.., n, ..] (n on `axis`) and
    n_groups = n // group_size (group_size 0: one group over the whole axis):

    q:      int8 [float shape] ("int8"), uint8 [.., n / 2, ..] ("int4", packed nibbles),
            float8_e4m3fn [float shape] ("fp8")
    scale:  [.., n_groups, ..], float16 (float32 for GGUF's K-quants, whose d * sc needs it)
    offset: like scale, or None (symmetric: offset 0)
    """
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


def nbytes(w: QuantizedWeight) -> int:
    """Bytes of q, scale and offset together."""
    return sum(int(a.nbytes) for a in (w.q, w.scale, w.offset) if a is not None)


# -- int4 packing ---------------------------------------------------------------------------------

def _split_axis(shape: Sequence[int], axis: int, parts: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(shape[:axis]) + parts + tuple(shape[axis + 1:])


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


def unpack_int4(packed: Array, axis: int) -> jax.Array:
    """uint8 packed nibbles -> uint8 values 0..15 with `axis` doubled (jit-traceable: masks,
    shifts, a concatenate and reshapes, no gathers)."""
    packed = jnp.asarray(packed)
    n2 = packed.shape[axis]
    if n2 % (INT4_BLOCK // 2):
        raise ValueError(f"packed int4 axis {axis} must be a multiple of {INT4_BLOCK // 2}, got "
                         f"shape {packed.shape}")
    blocks = packed.reshape(_split_axis(packed.shape, axis, (n2 // 16, 1, 16)))
    values = jnp.concatenate([blocks & 0x0F, blocks >> 4], axis=axis + 1)  # [.., nb, 2, 16, ..]
    return values.reshape(_split_axis(packed.shape, axis, (2 * n2,)))


# -- dequantization and pytree helpers ------------------------------------------------------------

def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The float weight (its original shape), computed in float32 and cast to `dtype`."""
    q = unpack_int4(w.q, w.axis) if w.kind == "int4" else jnp.asarray(w.q)
    a, shape = w.axis, q.shape
    n_groups = w.scale.shape[a]
    grouped = q.reshape(_split_axis(shape, a, (n_groups, shape[a] // n_groups)))
    x = grouped.astype(jnp.float32) * jnp.expand_dims(jnp.asarray(w.scale, jnp.float32), a + 1)
    if w.offset is not None:
        x = x + jnp.expand_dims(jnp.asarray(w.offset, jnp.float32), a + 1)
    return x.reshape(shape).astype(dtype)


def take_out(w: QuantizedWeight, index: Array) -> QuantizedWeight:
    """w with its output (non-grouped) axis reordered: the quantized form of `x[:, index]`
    (axis 0) or `x[index]` (axis 1)."""
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
    """The QuantizedWeight-shaped tree of logical axes (tuples in place of q, scale, offset)
    for a weight whose float form has `weight_axes`. A single group (per-channel scales) leaves
    the scales' grouped axis unnamed. For int4 the packed axis keeps its name: a mesh that
    splits it must split it at 32-element block boundaries."""
    axes = tuple(weight_axes)
    if len(axes) != w.q.ndim:
        raise ValueError(f"logical axes {axes} do not match the weight's shape {w.shape}")
    scale_axes = axes
    if w.scale.shape[w.axis] == 1:
        scale_axes = axes[:w.axis] + (None,) + axes[w.axis + 1:]
    return w.replace(q=axes, scale=scale_axes,
                     offset=None if w.offset is None else scale_axes)


# -- quantizers (numpy, on the host) --------------------------------------------------------------
# Scales (and offsets) are rounded to their stored dtype in the direction that keeps every value
# of the group inside the code range, and the codes are computed against the stored values: each
# element then dequantizes within scale / 2 of its original (int8, int4), or within fp8's own
# rounding (fp8), whatever the scale dtype, float16 subnormals included.

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


def _round_up(x: np.ndarray, dtype) -> np.ndarray:
    """The least value of `dtype` >= x (x float32 or float64); inf past its range."""
    with np.errstate(over="ignore"):
        s = x.astype(dtype)
    return np.where(s < x, np.nextafter(s, np.array(np.inf, dtype)), s)


def _round_down(x: np.ndarray, dtype) -> np.ndarray:
    with np.errstate(over="ignore"):
        s = x.astype(dtype)
    return np.where(s > x, np.nextafter(s, np.array(-np.inf, dtype)), s)


def _check_finite(stored: np.ndarray, what: str, dtype) -> None:
    if not np.all(np.isfinite(stored)):
        raise ValueError(f"{what} are not finite in {np.dtype(dtype).name}: the weight has "
                         "non-finite values or values too large for that scale dtype")


def _divide(g: np.ndarray, scale: np.ndarray) -> np.ndarray:
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
    scale = _round_up(amax / np.float32(127), scale_dtype)
    _check_finite(scale, "int8 scales", scale_dtype)
    q = np.clip(np.rint(_divide(g, scale)), -127, 127).astype(np.int8)
    return _finish(q, np.shape(w), axis, scale, None, "int8", group_size)


def quantize_int4(w: Array, axis: int = 0, group_size: int = 32, symmetric: bool = False,
                  scale_dtype=np.float16) -> QuantizedWeight:
    """int4 per group of `group_size` (a multiple of 32) along `axis`, round to nearest.

    Asymmetric: offset = min, scale = (max - min) / 15, q = round((w - offset) / scale) in
    0..15. Symmetric: scale = max|w| / 7, offset = -8 * scale, q - 8 = round(w / scale) in
    [-7, 7] (code 0 unused, so the grid is symmetric and 0 is exact)."""
    g, group = _grouped(w, axis, group_size)
    if group % INT4_BLOCK:
        raise ValueError(f"int4 groups must be a multiple of {INT4_BLOCK} elements, got "
                         f"{group}")
    if symmetric:
        amax = np.abs(g).max(axis=axis + 1, keepdims=True)
        scale = _round_up(amax / np.float32(7), scale_dtype)
        offset = scale * np.asarray(-8, scale_dtype)  # exact: a power of two
        _check_finite(offset, "int4 offsets", scale_dtype)
        q = np.clip(np.rint(_divide(g, scale)) + 8, 1, 15).astype(np.uint8)
    else:
        lo = g.min(axis=axis + 1, keepdims=True)
        hi = g.max(axis=axis + 1, keepdims=True)
        offset = _round_down(lo, scale_dtype)  # <= every element
        _check_finite(offset, "int4 offsets", scale_dtype)
        # offset + 15 * scale >= max: float64 keeps the difference exact
        scale = _round_up((hi.astype(np.float64) - offset.astype(np.float64)) / 15, scale_dtype)
        _check_finite(scale, "int4 scales", scale_dtype)
        q = np.clip(np.rint(_divide(g - offset.astype(np.float32), scale)), 0, 15)
        q = q.astype(np.uint8)
    return _finish(q, np.shape(w), axis, scale, offset, "int4", group_size)


def quantize_fp8(w: Array, axis: int = 0, scale_dtype=np.float16) -> QuantizedWeight:
    """float8_e4m3fn per output channel: scale = max|w| / 448 over `axis`, q = w / scale
    rounded to nearest e4m3 (3 mantissa bits: relative error <= 2^-4 for normal values,
    |q| >= 2^-6; absolute error <= 2^-10 * scale below that)."""
    g, _ = _grouped(w, axis, 0)
    amax = np.abs(g).max(axis=axis + 1, keepdims=True)
    scale = _round_up(amax / np.float32(FP8_MAX), scale_dtype)
    _check_finite(scale, "fp8 scales", scale_dtype)
    q = np.clip(_divide(g, scale), -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return _finish(q, np.shape(w), axis, scale, None, "fp8", 0)


# -- GGUF blocks ----------------------------------------------------------------------------------
# ggml type ids (fixed by the format; jaxinfer.loading.gguf_file.GGMLType names them) and block
# layouts, little-endian. Q8_0, Q4_0, Q4_1: 32 values per block, f16 d (and m); Q4_0/Q4_1 pack
# nibbles exactly our int4 way. Q4_K: 256 values in 8 sub-blocks of 32, f16 d and dmin, 12
# bytes of 6-bit sub-scales sc and sub-mins m, value = d*sc*q - dmin*m; its 128 nibble bytes
# are 4 runs of 32, run r holding sub-block 2r in the low nibbles and 2r+1 in the high ones.
# Q6_K: 256 values in 16 sub-blocks of 16, value = d * sc * (q - 32) with 6-bit q split into
# 4 low bits (ql) and 2 high bits (qh), int8 sub-scales sc and a trailing f16 d.
GGUF_Q4_0, GGUF_Q4_1, GGUF_Q8_0, GGUF_Q4_K, GGUF_Q6_K = 2, 3, 8, 12, 14
GGUF_BLOCKS = {
    GGUF_Q4_0: np.dtype([("d", "<f2"), ("qs", "u1", (16,))]),
    GGUF_Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))]),
    GGUF_Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", (32,))]),
    GGUF_Q4_K: np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)),
                         ("qs", "u1", (128,))]),
    GGUF_Q6_K: np.dtype([("ql", "u1", (128,)), ("qh", "u1", (64,)), ("scales", "i1", (16,)),
                         ("d", "<f2")]),
}
_GGUF_NAMES = {GGUF_Q4_0: "Q4_0", GGUF_Q4_1: "Q4_1", GGUF_Q8_0: "Q8_0", GGUF_Q4_K: "Q4_K",
               GGUF_Q6_K: "Q6_K"}


def _oriented(a: np.ndarray, transposed: bool) -> np.ndarray:
    """Per-block data [out, nb, k] -> C-contiguous [out, nb * k], or its transpose
    [nb * k, out] (one copy of the bytes either way)."""
    out, nb, k = a.shape
    if transposed:
        return np.ascontiguousarray(a.transpose(1, 2, 0)).reshape(nb * k, out)
    return np.ascontiguousarray(a).reshape(out, nb * k)


def _q4_k_sub_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[.., 12] bytes -> 6-bit (sc, m), [.., 8] each. Bytes 0-3 / 4-7: sc / m of sub-blocks
    0-3 in their low 6 bits and the top 2 bits of those of 4-7; bytes 8-11: the low 4 bits of
    sc (low nibble) and m (high nibble) of sub-blocks 4-7."""
    sc_lo, m_lo, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([sc_lo & 63, (rest & 15) | ((sc_lo >> 6) << 4)], axis=-1)
    m = np.concatenate([m_lo & 63, (rest >> 4) | ((m_lo >> 6) << 4)], axis=-1)
    return sc, m


def from_gguf(raw: np.ndarray, type_id: int, shape_out_in: tuple[int, int],
              transposed: bool) -> QuantizedWeight:
    """A GGUF matrix of logical shape [out, in] (blocks along `in`) as a QuantizedWeight:
    [in, out] with axis 0 if transposed (linear weights), else [out, in] with axis 1.

    raw: the tensor's bytes. Q8_0 -> int8 / 32, Q4_0 and Q4_1 -> int4 / 32 with float16 scale
    and offset, Q4_K -> int4 / 32 and Q6_K -> int8 / 16 with float32 scale (and offset), each
    dequantizing bit for bit as ggml. Other types raise ValueError."""
    if type_id not in GGUF_BLOCKS:
        raise ValueError(f"ggml type {_type_name(type_id)} has no quantized form here; "
                         f"supported: {', '.join(_GGUF_NAMES.values())}")
    out, n_in = shape_out_in
    block = 256 if type_id in (GGUF_Q4_K, GGUF_Q6_K) else 32
    dtype = GGUF_BLOCKS[type_id]
    if n_in % block:
        raise ValueError(f"{_GGUF_NAMES[type_id]} rows of {n_in} values are not a whole "
                         f"number of {block}-value blocks")
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if raw.size != out * (n_in // block) * dtype.itemsize:
        raise ValueError(f"{_GGUF_NAMES[type_id]} data of shape {shape_out_in} must have "
                         f"{out * (n_in // block) * dtype.itemsize} bytes, got {raw.size}")
    blocks = raw.view(dtype).reshape(out, n_in // block)
    axis = 0 if transposed else 1
    orient = lambda a: _oriented(a, transposed)
    per_block = lambda a: orient(a[..., None])  # [out, nb] -> [out, nb] or [nb, out]

    if type_id == GGUF_Q8_0:
        return QuantizedWeight(q=orient(blocks["qs"]), scale=per_block(blocks["d"]),
                               offset=None, kind="int8", axis=axis, group_size=32)
    if type_id in (GGUF_Q4_0, GGUF_Q4_1):
        d = per_block(blocks["d"]).astype(np.float16)
        if type_id == GGUF_Q4_1:
            offset = per_block(blocks["m"]).astype(np.float16)
        else:
            with np.errstate(over="ignore"):
                offset = d * np.float16(-8)  # exact unless it overflows
            if not np.all(np.isfinite(offset)):
                raise ValueError("Q4_0 scales beyond 8188 overflow a float16 offset -8*d")
        return QuantizedWeight(q=orient(blocks["qs"]), scale=d, offset=offset, kind="int4",
                               axis=axis, group_size=32)
    if type_id == GGUF_Q4_K:
        sc, m = _q4_k_sub_scales(blocks["scales"])  # [out, nb, 8]
        scale = blocks["d"].astype(np.float32)[..., None] * sc  # exact: 11 + 6 bits
        offset = -(blocks["dmin"].astype(np.float32)[..., None] * m)
        qs = blocks["qs"].reshape(out, -1, 4, 32)
        # Run r: sub-block 2r in the low nibbles, 2r + 1 in the high ones -> our packing, where
        # byte j of a sub-block holds its values j (low) and j + 16 (high).
        low = (qs[..., :16] & 0x0F) | (qs[..., 16:] << 4)
        high = (qs[..., :16] >> 4) | (qs[..., 16:] & 0xF0)
        packed = np.stack([low, high], axis=3).reshape(out, -1, 16)  # [out, nb*8, 16]
        return QuantizedWeight(q=orient(packed), scale=per_block(scale.reshape(out, -1)),
                               offset=per_block(offset.reshape(out, -1)), kind="int4",
                               axis=axis, group_size=32)
    # Q6_K. Value e of a block (h = e // 128, r = e % 128): low 4 bits from ql byte
    # 64h + r % 64 (nibble r // 64), high 2 bits from qh byte 32h + r % 32 (bits 2 * (r // 32)).
    ql = blocks["ql"].reshape(out, -1, 2, 1, 64)
    qh = blocks["qh"].reshape(out, -1, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3)  # [out, nb, 2, 2, 64]
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3)  # [out, nb, 2, 4, 32]
    q = (low.reshape(out, -1, 256) | (high.reshape(out, -1, 256) << 4)).astype(np.int8) - 32
    scale = blocks["d"].astype(np.float32)[..., None] * blocks["scales"]  # exact: 11 + 8 bits
    return QuantizedWeight(q=orient(q.reshape(out, -1, 16)),
                           scale=per_block(scale.reshape(out, -1)), offset=None, kind="int8",
                           axis=axis, group_size=16)


def _type_name(type_id: int) -> str:
    from jaxinfer.loading.gguf_file import ggml_type_name  # the loader imports this module

    return ggml_type_name(type_id)


# -- whole models --------------------------------------------------------------------------------

MODES = ("int8", "int4", "int4-awq", "fp8")
_LINEAR_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def contraction_axis(name: str) -> Optional[int]:
    """The grouped axis of a named model weight that is quantized (linear weights [in, out]
    and lm_head [D, V]: 0; the embedding [V, D]: 1), None for the rest (norms, biases)."""
    if name == "embed":
        return 1
    if name == "lm_head" or name.split(".")[-1] in _LINEAR_FIELDS:
        return 0
    return None


def quantize_weights(weights: dict, mode: str, group_size: int = 32) -> dict:
    """Every matrix of a model's host weights (params_from_weights names) quantized by `mode`:
    "int8" per output channel, "int4" round-to-nearest in groups of `group_size` (asymmetric),
    "fp8" per output channel. A weight that is already a QuantizedWeight of the mode's kind
    (GGUF blocks loaded natively: Q4_0/Q4_1/Q4_K as int4, Q8_0/Q6_K as int8; under "int4" the
    int8 ones too) is kept as it is, lossless against the file; any other is dequantized on the
    host and quantized anew. Norms
    and biases stay float. ("int4-awq" needs calibration: see jaxinfer.awq.)"""
    quantizers = {"int8": lambda w, a: quantize_int8(w, axis=a),
                  "int4": lambda w, a: quantize_int4(w, axis=a, group_size=group_size),
                  "fp8": lambda w, a: quantize_fp8(w, axis=a)}
    if mode not in quantizers:
        raise ValueError(f"unknown quantization {mode!r}; available: {tuple(quantizers)}")
    out = {}
    for name, w in weights.items():
        axis = contraction_axis(name)
        if axis is None:
            out[name] = w
            continue
        if isinstance(w, QuantizedWeight):
            # GGUF blocks are kept where they are the mode's kind, and under "int4" also where
            # they are int8 (Q8_0/Q6_K, e.g. SmolLM2's embedding): requantizing those to 4
            # bits would lose what the file holds.
            if w.kind == mode or (mode == "int4" and w.kind == "int8"):
                out[name] = w
                continue
            w = np.asarray(dequantize(w))
        out[name] = quantizers[mode](w, axis)
    return out


# Elements of one dequantized tile in matmul on CPU: 896 KiB of float32, within a core's L2
# (1 MiB here), so the converted tile is still in cache when its dot reads it. Swept on
# SmolLM2 batch-1 decode, int8 against float32 (docs/quantization.md): 2^16 0.62x, 2^17
# 0.93-0.96x, 3 * 2^16 1.00-1.05x, 7 * 2^15 1.04x, 2^19 0.68x.
TILE_ELEMENTS = 7 << 15


def matmul(x: jax.Array, w: QuantizedWeight, spec: str) -> jax.Array:
    """einsum(spec, x, w) with w [2-D] quantized, accumulated in float32; the codes are what
    stays in memory, dequantized inside the jitted step.

    On CPU the weight is dequantized tile by tile (a scan over blocks of its output axis of at
    most TILE_ELEMENTS), each tile's dot reading it while it is in cache: converting the whole
    matrix first writes and re-reads 4 bytes per weight through memory, which made int8
    decode half as fast as float32 (XLA:CPU fuses no convert into a dot). Elsewhere a
    per-channel weight without offsets (int8, fp8) multiplies its codes converted to x's dtype
    and scales the result; a grouped one is dequantized first. fp8 weights on a GPU multiply
    fp8 activations (fp8_activations, _fp8_product)."""
    if w.kind == "fp8" and fp8_activations():
        return _fp8_product(x, w, spec)
    if jax.default_backend() != "cpu":
        if w.group_size == 0 and w.offset is None:
            y = jnp.einsum(spec, x, jnp.asarray(w.q).astype(x.dtype),
                           preferred_element_type=jnp.float32)
            return y * jnp.asarray(w.scale, jnp.float32).reshape(-1)
        return jnp.einsum(spec, x, dequantize(w, x.dtype), preferred_element_type=jnp.float32)
    if w.kind == "fp8":  # as raw bytes: XLA:CPU slices float8 arrays by converting them whole
        w = w.replace(q=jax.lax.bitcast_convert_type(jnp.asarray(w.q), jnp.uint8))
    out_axis = 1 - w.axis
    tile = _tile(w.shape, out_axis)
    if tile is None:
        return _cpu_product(x, w, spec)

    def one_tile(_, j):
        part = jax.tree.map(
            lambda a: jax.lax.dynamic_slice_in_dim(jnp.asarray(a), j * tile, tile, out_axis), w)
        return None, _cpu_product(x, part, spec)
    n = w.shape[out_axis] // tile
    _, ys = jax.lax.scan(one_tile, None, jnp.arange(n, dtype=jnp.int32))  # [n, ..., tile]
    return jnp.moveaxis(ys, 0, -2).reshape(x.shape[:-1] + (n * tile,))


# fp8 weights multiply fp8 activations (W8A8) where the hardware has fp8 matmuls: None = on
# GPUs. Tests set it to check the path on CPU, where XLA runs fp8 dots too (slowly).
FP8_ACTIVATIONS: Optional[bool] = None


def fp8_activations() -> bool:
    if FP8_ACTIVATIONS is not None:
        return FP8_ACTIVATIONS
    return jax.default_backend() == "gpu"


def _fp8_product(x: jax.Array, w: QuantizedWeight, spec: str) -> jax.Array:
    """einsum(spec, x, w) as an fp8 x fp8 dot accumulated in float32: x quantized to e4m3
    per token (its rows, the contraction being x's last axis) with a dynamic scale
    max|x| / 448, w per output channel; both scales applied to the float32 result."""
    if w.group_size != 0 or w.offset is not None:
        raise ValueError(f"fp8 activations need a per-channel symmetric fp8 weight, got group "
                         f"size {w.group_size} with{'out' if w.offset is None else ''} offsets")
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    x_scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    xq = (xf / x_scale).astype(jnp.float8_e4m3fn)
    y = jnp.einsum(spec, xq, jnp.asarray(w.q), preferred_element_type=jnp.float32)
    return y * x_scale * jnp.asarray(w.scale, jnp.float32).reshape(-1)


def _tile(shape: tuple[int, int], out_axis: int) -> Optional[int]:
    """The largest divisor of the output axis whose tile holds at most TILE_ELEMENTS, or None
    when the whole matrix is one tile."""
    n_out, n_in = shape[out_axis], shape[1 - out_axis]
    if n_out * n_in <= TILE_ELEMENTS:
        return None
    tile = max(TILE_ELEMENTS // n_in, 1)
    while n_out % tile:
        tile -= 1
    return tile


def _cpu_product(x: jax.Array, w: QuantizedWeight, spec: str) -> jax.Array:
    """einsum(spec, x, w) with w (fp8 codes as raw bytes) dequantized in forms XLA:CPU
    vectorizes: int4 nibbles are not interleaved back into order (a concatenate in the
    dequantizing loop made it ten times slower); instead x is split into the elements the low
    and the high nibbles hold, and two dots are summed. fp8 is decoded with integer ops (its
    converts are not vectorized)."""
    a = w.axis
    expand = lambda g, n: jnp.repeat(jnp.asarray(g, jnp.float32), n, axis=a)  # noqa: E731
    if w.kind != "int4":
        codes = _fp8_from_bits(w.q) if w.kind == "fp8" else jnp.asarray(w.q).astype(jnp.float32)
        if w.offset is None and w.scale.shape[a] == 1:   # per channel: scale the dot's result
            y = jnp.einsum(spec, x, codes.astype(x.dtype), preferred_element_type=jnp.float32)
            return y * jnp.asarray(w.scale, jnp.float32).reshape(-1)
        scale = expand(w.scale, codes.shape[a] // w.scale.shape[a])
        value = codes * scale if w.offset is None else codes * scale + expand(
            w.offset, codes.shape[a] // w.scale.shape[a])
        return jnp.einsum(spec, x, value.astype(x.dtype), preferred_element_type=jnp.float32)
    packed = jnp.asarray(w.q)
    per_group = packed.shape[a] // w.scale.shape[a]   # packed rows (pairs) per group
    scale = expand(w.scale, per_group)
    offset = None if w.offset is None else expand(w.offset, per_group)
    # Byte j of a 32-element block holds element j (low nibble) and j + 16 (high nibble).
    xb = x.reshape(x.shape[:-1] + (x.shape[-1] // INT4_BLOCK, 2, INT4_BLOCK // 2))
    y = 0.0
    for half, codes in enumerate((packed & 0x0F, packed >> 4)):
        value = codes.astype(jnp.float32) * scale
        if offset is not None:
            value = value + offset
        xs = xb[..., half, :].reshape(x.shape[:-1] + (x.shape[-1] // 2,))
        y = y + jnp.einsum(spec, xs, value.astype(x.dtype), preferred_element_type=jnp.float32)
    return y


def _fp8_from_bits(b: jax.Array) -> jax.Array:
    """float8_e4m3fn raw bytes -> float32, exactly (no NaN codes expected: the quantizer
    never writes them). Normal values get their float32 bits directly (exponent rebiased by
    120), subnormals (exponent field 0) are m * 2^-9."""
    b = b.astype(jnp.uint32)
    mag = b & 0x7F
    normal = jax.lax.bitcast_convert_type((mag << 20) + (120 << 23), jnp.float32)
    value = jnp.where(mag < 8, mag.astype(jnp.float32) * 2.0 ** -9, normal)
    return jnp.where(b >= 0x80, -value, value)


def take_rows(w: QuantizedWeight, index: jax.Array) -> jax.Array:
    """Rows `index` [n] of a quantized [V, D] table grouped along its columns (axis 1), as
    float32 [n, D]: an embedding lookup that dequantizes only the rows it reads."""
    rows = lambda a: None if a is None else jnp.take(jnp.asarray(a), index, axis=0)
    return dequantize(w.replace(q=rows(w.q), scale=rows(w.scale), offset=rows(w.offset)))
