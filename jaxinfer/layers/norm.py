"""RMSNorm."""

import jax
import jax.numpy as jnp

from jaxinfer.layers.sums import fixed_mean


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., D] normalised by its root mean square (computed in float32), times weight [D]."""
    xf = x.astype(jnp.float32)
    var = fixed_mean(xf * xf, keepdims=True)  # the same bits whatever the batch
    return (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype) * weight.astype(x.dtype)
