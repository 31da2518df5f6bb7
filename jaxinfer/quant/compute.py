"""Products with quantized weights: `matmul` (every linear, the head) and `take_rows` (the
embedding lookup), the one place that dispatches on a QuantizedWeight's kind.

Where the backend asks for tiles (one CPU device), a weight larger than
Backend.tile_elements() is dequantized in tiles along its output axis, each tile's dot reading
it while it is still in cache (XLA:CPU fuses no convert into a dot). Elsewhere, and on a mesh,
it is dequantized whole inside the step for XLA to fuse or partition.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxinfer import sharding
from jaxinfer.quant.formats import FP8_MAX, INT4_BLOCK, QuantizedWeight, dequantize


def matmul(x: jax.Array, w: QuantizedWeight, spec: str, backend) -> jax.Array:
    """einsum(spec, x, w) with a 2-D quantized w, accumulated in float32. Without tiles a
    per-channel symmetric weight multiplies its codes and scales the result, a grouped one is
    dequantized first; fp8 weights multiply fp8 activations where backend.fp8_activations."""
    if w.kind == "fp8" and backend.fp8_activations:
        return _fp8_product(x, w, spec)
    if not backend.quantized_tiles() or sharding.context_mesh_shape() is not None:
        # On a mesh, a tile's dynamic slice of a split output axis would gather the whole
        # matrix on every device; dequantized whole, the codes stay split like the weight.
        if w.group_size == 0 and w.offset is None:
            y = jnp.einsum(spec, x, jnp.asarray(w.q).astype(x.dtype),
                           preferred_element_type=jnp.float32)
            return y * jnp.asarray(w.scale, jnp.float32).reshape(-1)
        return jnp.einsum(spec, x, dequantize(w, x.dtype), preferred_element_type=jnp.float32)
    if w.kind == "fp8":  # as raw bytes: XLA:CPU slices float8 arrays by converting them whole
        w = w.replace(q=jax.lax.bitcast_convert_type(jnp.asarray(w.q), jnp.uint8))
    out_axis = 1 - w.axis
    tile = _tile(w.shape, out_axis, backend.tile_elements())
    if tile is None:
        return _cpu_product(x, w, spec)

    def one_tile(_, j):
        part = jax.tree.map(
            lambda a: jax.lax.dynamic_slice_in_dim(jnp.asarray(a), j * tile, tile, out_axis), w)
        return None, _cpu_product(x, part, spec)
    n = w.shape[out_axis] // tile
    _, ys = jax.lax.scan(one_tile, None, jnp.arange(n, dtype=jnp.int32))  # [n, ..., tile]
    return jnp.moveaxis(ys, 0, -2).reshape(x.shape[:-1] + (n * tile,))


def _fp8_product(x: jax.Array, w: QuantizedWeight, spec: str) -> jax.Array:
    """einsum(spec, x, w) as an fp8 x fp8 dot accumulated in float32: x quantized to e4m3 per
    token with scale max|x| / 448, w per output channel, both scales applied to the result."""
    if w.group_size != 0 or w.offset is not None:
        raise ValueError(f"fp8 activations need a per-channel symmetric fp8 weight, got group "
                         f"size {w.group_size} with{'out' if w.offset is None else ''} offsets")
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    x_scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    xq = (xf / x_scale).astype(jnp.float8_e4m3fn)
    y = jnp.einsum(spec, xq, jnp.asarray(w.q), preferred_element_type=jnp.float32)
    return y * x_scale * jnp.asarray(w.scale, jnp.float32).reshape(-1)


def _tile(shape: tuple[int, int], out_axis: int, limit: int) -> Optional[int]:
    """The largest divisor of the output axis whose tile holds at most `limit` elements, or
    None when the whole matrix is one tile."""
    n_out, n_in = shape[out_axis], shape[1 - out_axis]
    if n_out * n_in <= limit:
        return None
    tile = max(limit // n_in, 1)
    while n_out % tile:
        tile -= 1
    return tile


def _cpu_product(x: jax.Array, w: QuantizedWeight, spec: str) -> jax.Array:
    """einsum(spec, x, w) with w (fp8 codes as raw bytes) dequantized in forms XLA:CPU
    vectorizes: x split into the elements int4's low and high nibbles hold and two dots summed
    (re-interleaving the nibbles is slow in the loop), fp8 decoded with integer ops."""
    a = w.axis
    if w.kind != "int4":
        codes = _fp8_from_bits(w.q) if w.kind == "fp8" else jnp.asarray(w.q).astype(jnp.float32)
        if w.offset is None and w.scale.shape[a] == 1:   # per channel: scale the dot's result
            y = jnp.einsum(spec, x, codes.astype(x.dtype), preferred_element_type=jnp.float32)
            return y * jnp.asarray(w.scale, jnp.float32).reshape(-1)
        value = _grouped_affine(codes, w.scale, w.offset, a)
        return jnp.einsum(spec, x, value.astype(x.dtype), preferred_element_type=jnp.float32)
    packed = jnp.asarray(w.q)
    # Byte j of a 32-element block holds element j (low nibble) and j + 16 (high nibble).
    xb = x.reshape(x.shape[:-1] + (x.shape[-1] // INT4_BLOCK, 2, INT4_BLOCK // 2))
    y = 0.0
    for half, codes in enumerate((packed & 0x0F, packed >> 4)):
        value = _grouped_affine(codes.astype(jnp.float32), w.scale, w.offset, a)
        xs = xb[..., half, :].reshape(x.shape[:-1] + (x.shape[-1] // 2,))
        y = y + jnp.einsum(spec, xs, value.astype(x.dtype), preferred_element_type=jnp.float32)
    return y


def _grouped_affine(codes: jax.Array, scale, offset, a: int) -> jax.Array:
    """codes * scale (+ offset) with scales [.., groups, ..] on axis a, each over a run of
    consecutive codes: the codes viewed as [.., groups, run, ..] times the broadcast scales."""
    groups = scale.shape[a]
    shape = codes.shape
    split = shape[:a] + (groups, shape[a] // groups) + shape[a + 1:]
    widen = lambda g: jnp.expand_dims(jnp.asarray(g, jnp.float32), a + 1)  # noqa: E731
    value = codes.reshape(split) * widen(scale)
    if offset is not None:
        value = value + widen(offset)
    return value.reshape(shape)


def _fp8_from_bits(b: jax.Array) -> jax.Array:
    """float8_e4m3fn raw bytes -> float32 exactly (the quantizer writes no NaN): normals by
    their float32 bits (exponent rebiased by 120), subnormals as m * 2^-9."""
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
