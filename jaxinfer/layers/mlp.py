"""Gated MLPs: down(act(x @ gate) * (x @ up))."""

import jax

from jaxinfer.layers.linear import linear, product

# The gate activations, by the names HF configs give them.
GATES = {"silu": jax.nn.silu, "gelu_tanh": lambda g: jax.nn.gelu(g, approximate=True)}


def gated_mlp(x: jax.Array, w_gate, w_up, w_down, activation: str = "silu", *, backend,
              linear_inputs: dict | None = None) -> jax.Array:
    """x [..., D]; w_gate, w_up [D, F]; w_down [F, D]; activation "silu" (Llama's SwiGLU) or
    "gelu_tanh" (Gemma's GeGLU). The gate and up products come from one backend kernel where
    one serves them (backend.gated_hidden), else from two linears and XLA's gate. linear_inputs, where
    given, receives the hidden activations as "hidden" (the down product's input, for AWQ's
    calibration), from the composition, in x's dtype."""
    if activation not in GATES:
        raise ValueError(f"gated_mlp: activation {activation!r} is not one of {tuple(GATES)}")
    hidden = None if linear_inputs is not None else backend.gated_hidden(x, w_gate, w_up, activation)
    if hidden is None:
        hidden = GATES[activation](linear(x, w_gate, backend=backend)) * linear(
            x, w_up, backend=backend)
    if linear_inputs is not None:
        linear_inputs["hidden"] = hidden
    # The down product reads the hidden activations as they are (bf16 from the kernel: the
    # product rounds its input to the weights' dtype either way).
    return product(hidden, w_down, "...i,io->...o", backend).astype(x.dtype)
