"""Float products and the gated MLP's hidden activations, per backend.

Activations wider than the weights are rounded to the weights' dtype; products accumulate in
float32. On a batch-invariant CPU backend (native kernels with AVX512-BF16) every bf16 and
float32 product and every bf16 gated MLP goes to the native kernels, whatever its row count,
each output summed in one order (docs/architecture.md, "Batch invariance"). With the kernels
but without AVX512-BF16, one-row products go to them (XLA:CPU streams one-row bf16 dots
slowly); otherwise a single 16-bit row is padded to two, as XLA:CPU's one-row dot converts the
whole weight matrix to float32.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

# Elements of one dequantized tile on CPU (quant.compute): an L2's worth where every copy has
# its own buffer, an L3's where they share one scratch buffer (docs/quantization.md).
TILE_ELEMENTS = 7 << 15
TILE_ELEMENTS_ONE_BUFFER = 1 << 21


def tile_elements(backend) -> int:
    return TILE_ELEMENTS_ONE_BUFFER if backend.one_scratch_buffer else TILE_ELEMENTS


def dot(backend, x: jax.Array, w: jax.Array, spec: str) -> jax.Array:
    """einsum(spec, x, w) -> float32, x rounded to w's dtype when wider; spec's x operand is
    "...<contracted>"."""
    if jnp.finfo(x.dtype).bits > jnp.finfo(w.dtype).bits:
        x = x.astype(w.dtype)
    lead = x.shape[:-1]
    rows = math.prod(lead)
    native = ((w.dtype == jnp.bfloat16 and backend.kernels is not None
               and (rows == 1 or backend.batch_invariant))
              or (w.dtype == x.dtype == jnp.float32 and backend.batch_invariant))
    kernel = _row_kernel(spec) if native else None
    if kernel is not None:
        y = kernel(x.reshape(rows, -1) if rows > 1 else x.reshape(-1), w)
        return y.reshape(lead + y.shape[-1:])
    if rows == 1 and w.dtype.itemsize == 2 and backend.tuning.pad_single_row_16bit_dots:
        x2 = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
        y = jnp.einsum(spec, x2, w, preferred_element_type=jnp.float32)
        return y[:1].reshape(lead + y.shape[-1:])
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)


def _row_kernel(spec: str):
    """The native product for `spec` against a 2-D weight w [K, N] or [N, K], K contracted with
    x's last axis; None for other specs."""
    import functools

    from jaxinfer.backends import cpu_kernels

    operands, out = spec.split("->")
    xs, ws = operands.split(",")
    if len(ws) != 2 or not xs.startswith("...") or out != xs[:-1] + ws.replace(xs[-1], ""):
        return None
    if xs[-1] not in ws:
        return None
    return functools.partial(cpu_kernels.product, w_transposed=ws[1] == xs[-1])


def gated_hidden(backend, x: jax.Array, w_gate, w_up, activation: str) -> Optional[jax.Array]:
    """act(x @ w_gate) * (x @ w_up) [..., F] bf16 from the native kernel (a batch-invariant
    backend, float32 x, 2-D bf16 weights); None otherwise."""
    rows = math.prod(x.shape[:-1])
    if not (backend.batch_invariant and x.dtype == jnp.float32 and rows >= 1
            and all(isinstance(w, jax.Array) and w.ndim == 2 and w.dtype == jnp.bfloat16
                    for w in (w_gate, w_up))):
        return None
    from jaxinfer.backends import cpu_kernels

    hidden = cpu_kernels.gated_rows_times_matrices(
        x.reshape(rows, -1).astype(jnp.bfloat16), w_gate, w_up, activation)
    return hidden.reshape(x.shape[:-1] + hidden.shape[-1:])
