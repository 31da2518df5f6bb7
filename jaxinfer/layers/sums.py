"""Sums in one order per element, whatever the array's shape.

XLA chooses how to order a reduction by the shape of the whole array: on CPU a row of 576
values is summed one way alone and another way among eight or more rows, so the same token's
norm or log-probability would differ with the batch beside it. These sums are written as
element-wise adds instead: the last axis is zero-padded to a power of two and folded in half
until one value is left. Each output's order then depends on nothing but its own values, and
appending zeros (a masked tail, a longer candidate list) does not change it either: a
power-of-two fold of x and of x followed by zeros add the same pairs once the zeros are gone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def fixed_sum(x: jax.Array, keepdims: bool = False) -> jax.Array:
    """The sum over x's last axis, folded in halves (see the module's docstring)."""
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x if keepdims else x[..., 0]


def fixed_mean(x: jax.Array, keepdims: bool = False) -> jax.Array:
    return fixed_sum(x, keepdims) / x.shape[-1]


def fixed_logsumexp(x: jax.Array, keepdims: bool = False) -> jax.Array:
    """log(sum(exp(x))) over the last axis with fixed_sum; -inf for a row of -inf."""
    top = jnp.max(x, axis=-1, keepdims=True)
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    out = jnp.log(fixed_sum(jnp.exp(x - shift), keepdims=True)) + shift
    return out if keepdims else out[..., 0]


def fixed_log_softmax(x: jax.Array) -> jax.Array:
    return x - fixed_logsumexp(x, keepdims=True)
