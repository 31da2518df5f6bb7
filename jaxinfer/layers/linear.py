"""Linear layers. Weights are stored [in, out] (the layout `x @ w` wants), float or quantized
(jaxinfer.quant.QuantizedWeight): one layer serves both.

Float weights may be narrower than the activations: 16-bit weights with float32 activations
(LLM(dtype="bfloat16") on CPU) multiply the activations rounded to the weights' dtype, with
float32 accumulation. On XLA:CPU such a bf16 dot runs at twice the float32 rate and reads half
the weight bytes, where promoting the weights to float32 would convert the whole matrix each
call.
"""

import math

import jax
import jax.numpy as jnp

from jaxinfer import cpu_kernels, tuning
from jaxinfer.quant import QuantizedWeight, matmul


def linear(x: jax.Array, w, b: jax.Array | None = None) -> jax.Array:
    """x [..., I] @ w [I, O] (+ b [O]) -> [..., O], accumulated in float32."""
    if isinstance(w, QuantizedWeight):
        y = matmul(x, w, "...i,io->...o")
    else:
        y = float_matmul(x, w, "...i,io->...o")
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


def float_matmul(x: jax.Array, w: jax.Array, spec: str) -> jax.Array:
    """einsum(spec, x, w) for a float w, in w's dtype with float32 accumulation (x is rounded to
    w's dtype when it is wider). spec's x operand is "...<contracted>". On CPU bf16 products of
    up to cpu_kernels.MAX_ROWS rows go to jaxinfer.cpu_kernels where they are built (batch-1
    decode: XLA:CPU's one-row bf16 dots stream the weights at 10-15 GB/s; a few rows: XLA:CPU
    repacks the whole weight matrix on every call); otherwise a single 16-bit row is
    padded to two: XLA:CPU hands a one-row dot to a path without 16-bit support, which converts
    the whole weight matrix to float32 on every call (45 ms instead of 2.5 for SmolLM2's
    [49152, 576] head)."""
    if jnp.finfo(x.dtype).bits > jnp.finfo(w.dtype).bits:
        x = x.astype(w.dtype)
    lead = x.shape[:-1]
    rows = math.prod(lead)
    if w.dtype == jnp.bfloat16 and 2 <= rows <= cpu_kernels.MAX_ROWS:
        kernel = _row_kernel(spec, many=True)
        if kernel is not None and cpu_kernels.rows_enabled():
            y = kernel(x.reshape(rows, -1), w)
            return y.reshape(lead + y.shape[-1:])
    if w.dtype.itemsize == 2 and rows == 1:
        kernel = _row_kernel(spec) if w.dtype == jnp.bfloat16 else None
        if kernel is not None and cpu_kernels.enabled():
            y = kernel(x.reshape(-1), w)
            return y.reshape(lead + y.shape[-1:])
        if tuning.for_backend().pad_single_row_16bit_dots:
            x2 = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
            y = jnp.einsum(spec, x2, w, preferred_element_type=jnp.float32)
            return y[:1].reshape(lead + y.shape[-1:])
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)


def _row_kernel(spec: str, many: bool = False):
    """The cpu_kernels product for `spec` of one row (many: of a few rows, [M, K]) against a 2-D
    weight: w [K, N] or w [N, K] with K the row's axis."""
    operands, out = spec.split("->")
    xs, ws = operands.split(",")
    if len(ws) != 2 or not xs.startswith("...") or out != xs[:-1] + ws.replace(xs[-1], ""):
        return None
    if ws[0] == xs[-1]:
        return cpu_kernels.rows_times_matrix if many else cpu_kernels.row_times_matrix
    if ws[1] == xs[-1]:
        return cpu_kernels.matrix_times_rows if many else cpu_kernels.matrix_times_row
    return None
