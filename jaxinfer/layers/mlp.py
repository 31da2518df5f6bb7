"""Gated MLPs."""

import math

import jax
import jax.numpy as jnp

from jaxinfer import cpu_kernels
from jaxinfer.layers.linear import float_matmul, linear


def swiglu_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """Llama MLP: down(silu(x @ gate) * (x @ up)). x [..., D]; w_gate, w_up [D, F]; w_down [F, D].

    On CPU, float32 activations of 2 to cpu_kernels.MAX_ROWS rows against bf16 weights take
    cpu_kernels.gated_rows_times_matrices for the gate, up and silu (the same products, the
    hidden activations rounded to bf16 as the down product rounds them)."""
    rows = math.prod(x.shape[:-1])
    if (x.dtype == jnp.float32 and 2 <= rows <= cpu_kernels.MAX_ROWS
            and all(isinstance(w, jax.Array) and w.ndim == 2 and w.dtype == jnp.bfloat16
                    for w in (w_gate, w_up, w_down))
            and cpu_kernels.rows_enabled()):
        hidden = cpu_kernels.gated_rows_times_matrices(
            x.reshape(rows, -1).astype(jnp.bfloat16), w_gate, w_up)
        y = float_matmul(hidden, w_down, "...i,io->...o")
        return y.reshape(x.shape[:-1] + y.shape[-1:])
    return linear(jax.nn.silu(linear(x, w_gate)) * linear(x, w_up), w_down)
