"""The sampler's reductions over a vocabulary, per backend: argmax, the descending sort and
its first k. The native kernels' order (Backend.native_sort) puts equal values by index,
-0.0 equal to 0.0 and NaN last; lax.top_k and argsort put NaN first and 0.0 above -0.0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ARGMAX_BLOCK = 1024  # vocabulary entries per block of the two-level argmax


def argmax(backend, x: jax.Array, block: int = ARGMAX_BLOCK) -> jax.Array:
    """jnp.argmax(x, -1) as int32, equal on every input. On CPU, rows longer than a block take
    the native kernel or two levels (block maxima, then the index within the winning block),
    as XLA:CPU does not vectorise argmax's (value, index) reduction."""
    V = x.shape[-1]
    if V > block and x.dtype == jnp.float32 and backend.kernels is not None:
        from jaxinfer.backends import cpu_kernels
        return cpu_kernels.argmax(x)
    if backend.platform != "cpu" or V <= block or not jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    C = -(-V // block)
    xp = x
    if C * block != V:                   # -inf padding never beats a real entry at index < V
        xp = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, C * block - V)],
                     constant_values=-jnp.inf)
    xb = xp.reshape(x.shape[:-1] + (C, block))
    m = jnp.max(xb, axis=-1)                                              # [..., C]
    c = jnp.argmax(m, axis=-1)                                            # [...]: the block
    within = jnp.take_along_axis(xb, c[..., None, None], axis=-2)[..., 0, :]
    fast = (c * block + jnp.argmax(within, axis=-1)).astype(jnp.int32)
    # XLA:CPU's vectorised max need not propagate NaN; a sum does. With a NaN (or +inf) among
    # the logits, a broken model's, the plain argmax decides.
    special = jnp.any(jnp.isnan(jnp.sum(xb, axis=-1)) | (m == jnp.inf))
    return jax.lax.cond(special, lambda: jnp.argmax(x, axis=-1).astype(jnp.int32),
                        lambda: fast)


def sort_descending(backend, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row of x [B, V] by descending value: (values, indices) [B, V]."""
    if backend.native_sort(x):
        from jaxinfer.backends import cpu_kernels
        return cpu_kernels.sort_descending(x)
    order = jnp.argsort(-x, axis=-1)
    return jnp.take_along_axis(x, order, axis=-1), order


def top(backend, x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The first k of sort_descending: (values, indices) [B, k]."""
    if backend.native_sort(x):
        from jaxinfer.backends import cpu_kernels
        return cpu_kernels.top_k(x, k)
    return jax.lax.top_k(x, k)
