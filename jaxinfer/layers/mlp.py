"""Gated MLPs: down(act(x @ gate) * (x @ up))."""

import jax

from jaxinfer.layers.linear import linear, product
from jaxinfer.lora.weights import LoraWeight, base_of

# The gate activations, by the names HF configs give them.
GATES = {"silu": jax.nn.silu, "gelu_tanh": lambda g: jax.nn.gelu(g, approximate=True)}


def gated_mlp(x: jax.Array, w_gate, w_up, w_down, activation: str = "silu", *, backend,
              linear_inputs: dict | None = None) -> jax.Array:
    """down(act(x @ w_gate) * (x @ w_up)): x [..., D]; w_gate, w_up [D, F]; w_down [F, D] ->
    [..., D]; activation "silu" (SwiGLU) or "gelu_tanh" (GeGLU). The hidden activations come
    from backend.gated_hidden where it serves; linear_inputs (AWQ) receives the composition's
    as "hidden"."""
    if activation not in GATES:
        raise ValueError(f"gated_mlp: activation {activation!r} is not one of {tuple(GATES)}")
    if isinstance(w_gate, LoraWeight) or isinstance(w_up, LoraWeight):
        # Adapters on the gate or up projection: their terms join the products before the
        # activation; a step without adapter rows keeps the fused path.
        def unfused(x):
            return GATES[activation](linear(x, w_gate, backend=backend)) * linear(
                x, w_up, backend=backend)

        def fused(x):
            out = backend.gated_hidden(x, base_of(w_gate), base_of(w_up), activation)
            if out is None:
                out = GATES[activation](linear(x, base_of(w_gate), backend=backend)) * linear(
                    x, base_of(w_up), backend=backend)
            return out.astype(x.dtype)  # the unfused path's dtype (linear returns x's)

        active = (w_gate if isinstance(w_gate, LoraWeight) else w_up).active
        hidden = jax.lax.cond(active, unfused, fused, x)
        return product(hidden, w_down, "...i,io->...o", backend).astype(x.dtype)
    hidden = None if linear_inputs is not None else backend.gated_hidden(x, w_gate, w_up,
                                                                         activation)
    if hidden is None:
        hidden = GATES[activation](linear(x, w_gate, backend=backend)) * linear(
            x, w_up, backend=backend)
    if linear_inputs is not None:
        linear_inputs["hidden"] = hidden
    # The kernel's bf16 hidden goes in as is: the product rounds to the weights' dtype anyway.
    return product(hidden, w_down, "...i,io->...o", backend).astype(x.dtype)
