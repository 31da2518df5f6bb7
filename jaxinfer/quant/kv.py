"""Quantized KV cache entries: int8 or float8 e4m3 codes with one float32 scale per slot and
kv head, written as each token's keys and values are quantized (jaxinfer.kv_cache) and read as
codes plus scales, so whatever attends (the reference or the Pallas kernels) dequantizes what it
reads and the cache never holds a float copy.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

KV_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
KV_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


@flax.struct.dataclass
class QuantizedKV:
    """Quantized keys or values: value = codes * scale[..., None], one scale per kv head of
    each slot (symmetric, scale = max |x| over the head dim / the code range's max)."""

    codes: jax.Array  # [..., K, H] int8 | float8_e4m3fn
    scale: jax.Array  # [..., K] float32

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    @property
    def dtype(self):
        return self.codes.dtype

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.codes.astype(jnp.float32) * self.scale[..., None]).astype(dtype)

    @staticmethod
    def logical_axes(axes: tuple) -> "QuantizedKV":
        """The logical axes of codes with `axes` [..., kv_heads, head_dim]: the scales drop the
        head dim and split like the codes (jaxinfer.sharding), so a device holds the scales of
        its own slots and heads."""
        return QuantizedKV(codes=tuple(axes), scale=tuple(axes)[:-1])


def quantize_kv(x: jax.Array, dtype) -> QuantizedKV:
    """x [..., K, H] as codes of `dtype` (int8 or float8_e4m3fn) with per-[..., K] scales."""
    top = KV_MAX[jnp.dtype(dtype)]
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    y = x.astype(jnp.float32) / scale[..., None]
    if jnp.dtype(dtype) == jnp.int8:
        y = jnp.round(y)
    return QuantizedKV(codes=jnp.clip(y, -top, top).astype(dtype), scale=scale)
