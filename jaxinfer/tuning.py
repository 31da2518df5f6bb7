"""Per-backend tuning of the device step, in one table (as the kernels' block_sizes.py).

Every setting here was measured on the backend it applies to; a backend repeats another's
workaround only where it was measured to help there too. Until a GPU run measures them, the
GPU entry keeps XLA's defaults and the kernels. The backend is looked up when a program is
first traced or dispatched, never at import: multi-process runs must start jax.distributed
before anything touches a backend.

CPU (XLA:CPU, jax 0.10.2, the 2-core development machine), the reasons for each entry:
  min_tokens, query_tile     the smallest token bucket of a flat step and the queries per tile
                             of its jnp attention (docs/architecture.md, "Compiled shapes")
  bucket_growth              token and row buckets grow by this factor: 4 on CPU, where each
                             program costs 7-15 s to compile (11 programs at factor 2 took
                             96 s of warmup; 7 at factor 4)
  fill_token_buckets         the scheduler trims a prefilling step's chunks down to a token
                             bucket exactly, so no padding token reaches the matmuls: on CPU a
                             padding token costs what a real one does
  loop_compiler_options      while-loop invariant code motion off in the device loops: it
                             hoisted the float32 copy XLA:CPU makes of a bf16 embedding table to
                             gather from it, once per dispatch (36 ms), where inside the body the
                             convert fuses into the gather of the rows it needs
  pad_single_row_16bit_dots  a one-row bf16 dot takes a path that converts the whole weight
                             matrix per call (45 ms instead of 2.5 for SmolLM2's head), so one
                             row is padded to two
  float32_activations        bf16 elementwise work goes through float32 copies of whole
                             arrays, while bf16 dots run at twice the float32 rate: a 16-bit
                             dtype is the matrices' and the KV cache's, activations stay float32
                             and each matmul rounds its input to the weights' dtype
  kv_16bit_as_bits           a scatter into a bf16 array converts the whole array to float32
                             and back (1.2 s a step for SmolLM2's pool); the 16-bit KV cache is
                             kept as uint16 bits (kv_cache.Bits16KV), scattered in place, and
                             halves what attention gathers against a float32 cache
  default_dtype              dtype=None. CPU: bfloat16 weights (float32 activations, a bf16
                             KV cache kept as bits, above): 1.40x float32's serving throughput
                             on the random workload and 1.41x on the chat one (python
                             benchmarks/throughput.py --dtypes float32,bfloat16), GPL-3
                             perplexity +0.02%. The environment variable JAXINFER_DEFAULT_DTYPE
                             overrides it
  default_attention          attention="auto": the jnp path (the kernels would run interpreted)
  grouped_matmul             the experts' grouped matmul (jaxinfer.models.moe): "tiles" on CPU,
                             whose lax.ragged_dot multiplies every row by every expert
                             (a dense all-experts product), jax.lax.ragged_dot elsewhere
"""

from __future__ import annotations

import dataclasses
import functools

import jax


@dataclasses.dataclass(frozen=True)
class StepTuning:
    min_tokens: int = 16
    query_tile: int = 16
    bucket_growth: int = 2
    fill_token_buckets: bool = False
    loop_compiler_options: tuple[tuple[str, str], ...] = ()
    pad_single_row_16bit_dots: bool = False
    float32_activations: bool = False
    kv_16bit_as_bits: bool = False
    default_dtype: str = "bfloat16"
    default_attention: str = "pallas"
    grouped_matmul: str = "ragged_dot"


TUNING = {
    "cpu": StepTuning(
        min_tokens=16, query_tile=16, bucket_growth=4, fill_token_buckets=True,
        loop_compiler_options=(("xla_disable_hlo_passes", "while-loop-invariant-code-motion"),),
        pad_single_row_16bit_dots=True, float32_activations=True, kv_16bit_as_bits=True,
        default_dtype="bfloat16",
        default_attention="reference", grouped_matmul="tiles"),
    "gpu": StepTuning(),
}


def for_backend(backend: str | None = None) -> StepTuning:
    """The tuning of `backend` (default: JAX's default backend); a backend without an entry
    gets the GPU's (XLA's defaults and the kernels)."""
    return TUNING.get(backend or jax.default_backend(), TUNING["gpu"])


class loop_jit:
    """jax.jit for the device loops, compiled with the backend's loop_compiler_options. The jit
    is made at first use, when the backend is known, one per backend; calls and .lower() go
    to it."""

    def __init__(self, fun=None, **jit_kwargs):
        self.fun, self.jit_kwargs, self.jits = fun, jit_kwargs, {}
        if fun is not None:
            functools.update_wrapper(self, fun)

    def _jitted(self):
        backend = jax.default_backend()
        if backend not in self.jits:
            options = dict(for_backend(backend).loop_compiler_options) or None
            self.jits[backend] = jax.jit(self.fun, compiler_options=options, **self.jit_kwargs)
        return self.jits[backend]

    def __call__(self, *args, **kwargs):
        return self._jitted()(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._jitted().lower(*args, **kwargs)
