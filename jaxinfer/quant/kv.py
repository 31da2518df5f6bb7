"""Quantized KV cache entries: int8 or float8 e4m3 codes with one float32 scale per slot and
kv head, quantized as they are written and dequantized by whatever reads them, so the cache
never holds a float copy. Where XLA scatters into a float8 array by converting it whole
(XLA:CPU), float8 codes are kept as their uint8 bits (code_dtype names what they are).
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

KV_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
KV_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


@flax.struct.dataclass
class QuantizedKV:
    """Quantized keys or values: value = codes * scale[..., None], one scale per kv head of
    each slot (symmetric, scale = max |x| over the head dim / the code range's max)."""

    codes: jax.Array  # [..., K, H] int8 | float8_e4m3fn (| uint8: the bits of code_dtype)
    scale: jax.Array  # [..., K] float32
    # Set where codes holds the raw uint8 bits of float8 codes: their dtype's name.
    code_dtype: Optional[str] = flax.struct.field(pytree_node=False, default=None)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    @property
    def dtype(self):
        """The codes' dtype (int8 or float8_e4m3fn), however they are stored."""
        return jnp.dtype(self.code_dtype) if self.code_dtype else self.codes.dtype

    @property
    def typed_codes(self) -> jax.Array:
        """The codes as their dtype (a bitcast of stored bits: take it after a gather, not of a
        whole pool)."""
        if not self.code_dtype:
            return self.codes
        return jax.lax.bitcast_convert_type(self.codes, self.code_dtype)

    def stored(self, q: "QuantizedKV") -> jax.Array:
        """q's codes as this buffer stores them (as bits where it keeps bits)."""
        if not self.code_dtype:
            return q.codes
        return jax.lax.bitcast_convert_type(q.codes, self.codes.dtype)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.typed_codes.astype(jnp.float32) * self.scale[..., None]).astype(dtype)

    @staticmethod
    def logical_axes(axes: tuple, code_dtype: Optional[str] = None) -> "QuantizedKV":
        """The logical axes of codes with `axes` [..., kv_heads, head_dim]; the scales drop the
        head dim and split like the codes. code_dtype: the buffer's, so the trees match."""
        return QuantizedKV(codes=tuple(axes), scale=tuple(axes)[:-1], code_dtype=code_dtype)


def quantize_kv(x: jax.Array, dtype) -> QuantizedKV:
    """x [..., K, H] as codes of `dtype` (int8 or float8_e4m3fn) with per-[..., K] scales."""
    top = KV_MAX[jnp.dtype(dtype)]
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    y = x.astype(jnp.float32) / scale[..., None]
    if jnp.dtype(dtype) == jnp.int8:
        y = jnp.round(y)
    return QuantizedKV(codes=jnp.clip(y, -top, top).astype(dtype), scale=scale)
