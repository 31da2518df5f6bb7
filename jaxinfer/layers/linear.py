"""Linear layers. Weights are stored [in, out] (the layout `x @ w` wants)."""

import jax
import jax.numpy as jnp


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """x [..., I] @ w [I, O] (+ b [O]) -> [..., O], accumulated in float32."""
    y = jnp.einsum("...i,io->...o", x, w, preferred_element_type=jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)
