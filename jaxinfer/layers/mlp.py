"""Gated MLPs."""

import jax

from jaxinfer.layers.linear import linear


def swiglu_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """Llama MLP: down(silu(x @ gate) * (x @ up)). x [..., D]; w_gate, w_up [D, F]; w_down [F, D]."""
    return linear(jax.nn.silu(linear(x, w_gate)) * linear(x, w_up), w_down)
