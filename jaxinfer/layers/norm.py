"""RMSNorm."""

import jax
import jax.numpy as jnp



def mean_square(xf: jax.Array, backend=None) -> jax.Array:
    """mean(xf * xf) over the last axis, keepdims: backend.row_sum's order (one per row,
    whatever the batch) where a backend is given, else XLA's."""
    if backend is None:
        return jnp.mean(xf * xf, axis=-1, keepdims=True)
    return backend.row_sum(xf, squares=True)[..., None] / xf.shape[-1]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, backend=None) -> jax.Array:
    """x [..., D] normalised by its root mean square (computed in float32), times weight [D]."""
    xf = x.astype(jnp.float32)
    var = mean_square(xf, backend)
    return (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype) * weight.astype(x.dtype)
