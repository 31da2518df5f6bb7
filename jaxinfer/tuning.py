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
                             program cost 7-15 s to compile before compiler_options (11
                             programs at factor 2 took 96 s of warmup; 7 at factor 4)
  compiler_options           every engine program (program_jit: the flat step, the decode and
                             speculative loops, prefill, the state updates, the scoring
                             forward) compiles with XLA:CPU's fast-compile preset
                             (xla_cpu_opt_preset CPU_OPT_PRESET_FAST_COMPILE): XLA fuses less
                             eagerly, into more and smaller fusions. Compile time fell by a
                             third (a 64-token step 8.7 -> 5.5 s, a 16-row speculative loop
                             13.9 -> 8.8 s; warmup: docs/architecture.md, "Compiled shapes"),
                             while the programs ran as fast: served
                             throughput 184.5 and 183.7 tok/s against 183.2 and 196.9 on the
                             random workload, 285.1 and 295.4 against 265.0 and 291.1 on the
                             chat one (python benchmarks/throughput.py --peers "" --runs 2, the
                             preset on and off in alternating runs), a 16-row decode step
                             2.30-2.63x its matmul stack against 2.49-2.58x, 512-token prefill
                             614 and 663 tok/s against 531 and 485 (benchmarks/decode.py).
                             Passed per program, on jaxlib 0.10 only (COMPILER_OPTIONS_JAXLIB),
                             and not where XLA_FLAGS names the option (the user's value wins)
  fill_token_buckets         the scheduler trims a prefilling step's chunks down to a token
                             bucket exactly where that bucket is nearer than the next one up
                             (buckets.fill): on CPU a padding token costs what a real one does
  loop_compiler_options      while-loop invariant code motion off in the device loops: it
                             hoisted the float32 copy XLA:CPU makes of a bf16 embedding table to
                             gather from it, once per dispatch (36 ms), where inside the body the
                             convert fuses into the gather of the rows it needs
  pad_single_row_16bit_dots  a one-row bf16 dot takes a path that converts the whole weight
                             matrix per call (45 ms instead of 2.5 for SmolLM2's head), so one
                             row is padded to two
  cpu_kernels                bf16 products of 1 to 64 rows (batch-1 and batched decode) and
                             the attention of decode rows call jaxinfer.cpu_kernels, native
                             kernels built on the machine (docs/cpu_kernels.md): XLA:CPU's
                             one-row bf16 dots streamed the weights at 10-15 GB/s, its few-row
                             bf16 dots repacked the whole weight matrix on every call, and its
                             decode attention took about 0.2 us per key and layer over several
                             fusions. Where they do not build, the padded dot, XLA's dots and
                             the jnp work list serve
  float32_activations        bf16 elementwise work goes through float32 copies of whole
                             arrays, while bf16 dots run at twice the float32 rate: a 16-bit
                             dtype is the matrices' and the KV cache's, activations stay float32
                             and each matmul rounds its input to the weights' dtype
  kv_16bit_as_bits           a scatter into a bf16 array converts the whole array to float32
                             and back (1.2 s a step for SmolLM2's pool); the 16-bit KV cache is
                             kept as uint16 bits (kv_cache.Bits16KV), scattered in place, and
                             halves what attention gathers against a float32 cache
  kv_fp8_as_bits             the same for float8 KV codes: a scatter into a float8 array took
                             0.2 s a layer for SmolLM2's pool (16-row decode steps of 6 s with
                             an fp8 cache); they are kept as uint8 bits (QuantizedKV.code_dtype)
                             and scattered in place
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

One setting is process-wide, an XLA flag, so it cannot wait for a program's backend: importing
jaxinfer adds CPU_XLA_FLAGS to the environment variable XLA_FLAGS (set_cpu_xla_flags), which
XLA reads when jax first starts a backend:
  --xla_cpu_enable_concurrency_optimized_scheduler=false
                             XLA:CPU's default scheduler orders a program for concurrency and
                             keeps every intermediate buffer apart: an unrolled model's 30
                             dequantized int8 weights took 101 MiB of scratch, 30 buffers
                             written and read through memory, where the memory-minimizing
                             scheduler reuses one 3.4 MiB buffer that stays in cache. With it,
                             int8 weights dequantized whole decode faster than float32 at batch 1
                             (docs/quantization.md), and the bf16 engine's serving throughput
                             moved +5% and +7% (python benchmarks/throughput.py, run with and
                             without the flag), within noise of no change.
  It is added only where it was measured: jaxlib 0.10; JAX_PLATFORMS=cpu, or JAX_PLATFORMS
  unset and no accelerator plugin installed (their jaxlibs may not know the flag, and XLA stops
  at an unknown one); no backend started yet; XLA_FLAGS not naming the flag already (set it
  there to keep XLA's default). quant.compute sizes its tiles by whether it is in effect.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import os

import jax


@dataclasses.dataclass(frozen=True)
class StepTuning:
    min_tokens: int = 16
    query_tile: int = 16
    bucket_growth: int = 2
    fill_token_buckets: bool = False
    compiler_options: tuple[tuple[str, str], ...] = ()
    loop_compiler_options: tuple[tuple[str, str], ...] = ()
    pad_single_row_16bit_dots: bool = False
    float32_activations: bool = False
    kv_16bit_as_bits: bool = False
    kv_fp8_as_bits: bool = False
    cpu_kernels: bool = False
    default_dtype: str = "bfloat16"
    default_attention: str = "pallas"
    grouped_matmul: str = "ragged_dot"


TUNING = {
    "cpu": StepTuning(
        min_tokens=16, query_tile=16, bucket_growth=4, fill_token_buckets=True,
        compiler_options=(("xla_cpu_opt_preset", "CPU_OPT_PRESET_FAST_COMPILE"),),
        loop_compiler_options=(("xla_disable_hlo_passes", "while-loop-invariant-code-motion"),),
        pad_single_row_16bit_dots=True, float32_activations=True, kv_16bit_as_bits=True,
        kv_fp8_as_bits=True,
        cpu_kernels=True, default_dtype="bfloat16",
        default_attention="reference", grouped_matmul="tiles"),
    "gpu": StepTuning(),
}


def for_backend(backend: str | None = None) -> StepTuning:
    """The tuning of `backend` (default: JAX's default backend); a backend without an entry
    gets the GPU's (XLA's defaults and the kernels)."""
    return TUNING.get(backend or jax.default_backend(), TUNING["gpu"])


def compiler_options(backend: str, loop: bool) -> dict | None:
    """The XLA options of the engine's programs on `backend`: its compiler_options where this
    jaxlib is one they were measured on (COMPILER_OPTIONS_JAXLIB: XLA refuses an option it does
    not know) and XLA_FLAGS does not name them (the user's setting wins), and for a device loop
    its loop_compiler_options too."""
    tune = for_backend(backend)
    named = os.environ.get("XLA_FLAGS", "")
    options = {k: v for k, v in tune.compiler_options if f"--{k}" not in named} \
        if _jaxlib_version() in COMPILER_OPTIONS_JAXLIB else {}
    if loop:
        options.update(tune.loop_compiler_options)
    return options or None


class program_jit:
    """jax.jit for the engine's device programs, compiled with the backend's compiler options
    (compiler_options above; loop=True: a device loop's too). The jit is made at first use,
    when the backend is known, one per backend; calls and .lower() go to it."""

    def __init__(self, fun=None, *, loop: bool = False, **jit_kwargs):
        self.fun, self.loop, self.jit_kwargs, self.jits = fun, loop, jit_kwargs, {}
        if fun is not None:
            functools.update_wrapper(self, fun)

    def _jitted(self):
        backend = jax.default_backend()
        if backend not in self.jits:
            self.jits[backend] = jax.jit(self.fun, compiler_options=compiler_options(
                backend, self.loop), **self.jit_kwargs)
        return self.jits[backend]

    def __call__(self, *args, **kwargs):
        if _tracing(args, kwargs):
            # Called inside another jit or transformation (the scoring forward under a
            # training step's grad): JAX takes compiler options on top-level jits only, and
            # the outer program's options apply to the whole of it.
            if "nested" not in self.jits:
                self.jits["nested"] = jax.jit(self.fun, **self.jit_kwargs)
            return self.jits["nested"](*args, **kwargs)
        return self._jitted()(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._jitted().lower(*args, **kwargs)


def _tracing(args, kwargs) -> bool:
    """Whether a JAX trace is running around this call (jax's trace state where this jax has
    it, else whether an argument is a tracer)."""
    from jax._src import core

    clean = getattr(core, "trace_state_clean", None)
    if clean is not None:
        return not clean()
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs)))


def loop_jit(fun=None, **jit_kwargs) -> program_jit:
    """program_jit for a device loop (decode_loop, speculative_loop)."""
    return program_jit(fun, loop=True, **jit_kwargs)


_SCHEDULER_FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"
# Process-wide XLA flags for the CPU backend (see the module docstring), by flag name.
CPU_XLA_FLAGS = {_SCHEDULER_FLAG: "false"}
# jaxlib versions (major, minor) the flags were measured on, and so known to exist in.
CPU_XLA_FLAGS_JAXLIB = ((0, 10),)
# The same for the backends' compiler_options.
COMPILER_OPTIONS_JAXLIB = ((0, 10),)


def set_cpu_xla_flags() -> list[str]:
    """Adds CPU_XLA_FLAGS to os.environ["XLA_FLAGS"] where they apply (the module docstring:
    jaxlib 0.10, a CPU-only installation or JAX_PLATFORMS=cpu, no backend started, a
    flag not named there already). Returns the flags added."""
    from jax._src import xla_bridge

    if _jaxlib_version() not in CPU_XLA_FLAGS_JAXLIB or xla_bridge.backends_are_initialized():
        return []
    if not cpu_only():
        return []
    return add_xla_flags(CPU_XLA_FLAGS)


def cpu_only() -> bool:
    """Whether jax will run on the CPU alone: JAX_PLATFORMS=cpu, or JAX_PLATFORMS unset and
    no accelerator plugin installed."""
    platforms = [p for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p]
    return platforms == ["cpu"] or not (platforms or _accelerator_plugin_installed())


def add_xla_flags(flags: dict) -> list[str]:
    """Appends flags (name -> value) to os.environ["XLA_FLAGS"], each one not named there
    already. Returns the flags added."""
    current = os.environ.get("XLA_FLAGS", "")
    added = [f"--{name}={value}" for name, value in flags.items()
             if f"--{name}" not in current]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([current] + added).strip()
    return added


def cpu_keeps_one_scratch_buffer() -> bool:
    """Whether XLA:CPU's memory-minimizing scheduler is in effect (set_cpu_xla_flags, or the
    user's own XLA_FLAGS): scratch buffers are then reused across an unrolled program."""
    flag = f"--{_SCHEDULER_FLAG}="
    flags = os.environ.get("XLA_FLAGS", "")
    if flag not in flags:
        return False
    return flags.rpartition(flag)[2].split(" ")[0].lower() in ("false", "0")


def _jaxlib_version() -> tuple[int, int]:
    return tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2])


def _accelerator_plugin_installed() -> bool:
    """A GPU or other plugin that jax would start (its entry points), or libtpu."""
    return bool(importlib.metadata.entry_points(group="jax_plugins")) or \
        importlib.util.find_spec("libtpu") is not None
