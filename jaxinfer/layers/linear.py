"""Linear layers. Weights are stored [in, out] (the layout `x @ w` wants), float or quantized
(jaxinfer.quant.QuantizedWeight): one layer serves both, its products from the backend."""

import jax
import jax.numpy as jnp

from jaxinfer.lora.weights import LoraWeight
from jaxinfer.quant import QuantizedWeight, matmul


def linear(x: jax.Array, w, b: jax.Array | None = None, *, backend) -> jax.Array:
    """x [..., I] @ w [I, O] (+ b [O]) -> [..., O] in x's dtype, accumulated in float32."""
    y = product(x, w, "...i,io->...o", backend)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


def product(x: jax.Array, w, spec: str, backend) -> jax.Array:
    """einsum(spec, x, w) for a float or quantized weight, float32 (the head, the experts); a
    LoraWeight (jaxinfer.lora) adds its adapters' low-rank term (spec "...i,io->...o")."""
    if isinstance(w, LoraWeight):
        return product(x, w.base, spec, backend) + w.delta(x, backend)
    if isinstance(w, QuantizedWeight):
        return matmul(x, w, spec, backend)
    return backend.dot(x, w, spec)
