"""Gated MLPs."""

import math

import jax
import jax.numpy as jnp

from jaxinfer import cpu_kernels
from jaxinfer.layers.linear import float_matmul, linear


def gated_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
              activation: str = "silu", taps: dict | None = None) -> jax.Array:
    """down(act(x @ gate) * (x @ up)). x [..., D]; w_gate, w_up [D, F]; w_down [F, D]; act
    "silu" (Llama's SwiGLU) or "gelu_tanh" (Gemma's GeGLU: jax.nn.gelu(approximate=True)).

    On CPU, float32 activations of 2 to cpu_kernels.MAX_ROWS rows against bf16 weights take
    cpu_kernels.gated_rows_times_matrices for the gate, up and activation (the same products,
    the hidden activations rounded to bf16 as the down product rounds them). taps, where
    given, receives the hidden activations as "hidden" (the down product's input, for AWQ's
    calibration), from XLA's composition, in x's dtype."""
    if activation not in cpu_kernels.GATED_ACTIVATIONS:
        raise ValueError(f"gated_mlp: activation {activation!r} is not one of "
                         f"{cpu_kernels.GATED_ACTIVATIONS}")
    rows = math.prod(x.shape[:-1])
    if (taps is None and x.dtype == jnp.float32 and 2 <= rows <= cpu_kernels.MAX_ROWS
            and all(isinstance(w, jax.Array) and w.ndim == 2 and w.dtype == jnp.bfloat16
                    for w in (w_gate, w_up, w_down))
            and cpu_kernels.rows_enabled()):
        hidden = cpu_kernels.gated_rows_times_matrices(
            x.reshape(rows, -1).astype(jnp.bfloat16), w_gate, w_up, activation)
        hidden = hidden.reshape(x.shape[:-1] + hidden.shape[-1:])
        y = float_matmul(hidden, w_down, "...i,io->...o")
    else:
        hidden = cpu_kernels.gate_activation(activation, linear(x, w_gate)) * linear(x, w_up)
        y = linear(hidden, w_down)
    if taps is not None:
        taps["hidden"] = hidden
    return y


def swiglu_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """Llama MLP: down(silu(x @ gate) * (x @ up)), gated_mlp with silu."""
    return gated_mlp(x, w_gate, w_up, w_down, "silu")
