"""Linear layers. Weights are stored [in, out] (the layout `x @ w` wants), float or quantized
(jaxinfer.quant.QuantizedWeight): one layer serves both."""

import jax
import jax.numpy as jnp

from jaxinfer.quant import QuantizedWeight, matmul


def linear(x: jax.Array, w, b: jax.Array | None = None) -> jax.Array:
    """x [..., I] @ w [I, O] (+ b [O]) -> [..., O], accumulated in float32."""
    if isinstance(w, QuantizedWeight):
        y = matmul(x, w, "...i,io->...o")
    else:
        y = jnp.einsum("...i,io->...o", x, w, preferred_element_type=jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)
