"""Per-platform tuning of the device step, in one table (docs/architecture.md, "Backend
tuning", gives each CPU entry's reason); the GPU entry keeps XLA's defaults. One XLA flag is
process-wide (set_cpu_xla_flags): XLA:CPU's memory-minimizing scheduler, added before any
backend starts where XLA_FLAGS does not name it."""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import os

import jax


@dataclasses.dataclass(frozen=True)
class StepTuning:
    min_tokens: int = 16               # the smallest token bucket
    query_tile: int = 16               # the jnp attention's queries per tile
    bucket_growth: int = 2             # token and row buckets grow by this factor
    fill_token_buckets: bool = False   # trim prefill chunks to a bucket (padding costs compute)
    compiler_options: tuple[tuple[str, str], ...] = ()       # of every engine program
    loop_compiler_options: tuple[tuple[str, str], ...] = ()  # and of the device loops
    pad_single_row_16bit_dots: bool = False
    float32_activations: bool = False  # 16-bit weights and KV cache, float32 activations
    kv_16bit_as_bits: bool = False     # 16-bit KV cache kept as uint16 bits
    kv_fp8_as_bits: bool = False       # float8 KV codes kept as uint8
    cpu_kernels: bool = False          # backends.cpu_kernels serve where they build
    default_dtype: str = "bfloat16"    # LLM(dtype=None)
    default_attention: str = "pallas"  # attention="auto"
    grouped_matmul: str = "ragged_dot"  # the experts' ("tiles": XLA:CPU's own loop)


TUNING = {
    "cpu": StepTuning(
        min_tokens=16, query_tile=16, bucket_growth=4, fill_token_buckets=True,
        compiler_options=(("xla_cpu_opt_preset", "CPU_OPT_PRESET_FAST_COMPILE"),),
        loop_compiler_options=(("xla_disable_hlo_passes", "while-loop-invariant-code-motion"),),
        pad_single_row_16bit_dots=True, float32_activations=True, kv_16bit_as_bits=True,
        kv_fp8_as_bits=True, cpu_kernels=True, default_dtype="bfloat16",
        default_attention="reference", grouped_matmul="tiles"),
    "gpu": StepTuning(),
}


def for_platform(name: str) -> StepTuning:
    """The tuning of platform `name` (the GPU's where it has no entry)."""
    return TUNING.get(name, TUNING["gpu"])


def compiler_options(backend: str, loop: bool) -> dict | None:
    """The XLA options of the engine's programs on `backend`: its compiler_options on a jaxlib
    known to have them (XLA refuses unknown ones) unless XLA_FLAGS names them, plus for a device
    loop its loop_compiler_options."""
    tune = for_platform(backend)
    named = os.environ.get("XLA_FLAGS", "")
    options = {k: v for k, v in tune.compiler_options if f"--{k}" not in named} \
        if _jaxlib_version() in COMPILER_OPTIONS_JAXLIB else {}
    if loop:
        options.update(tune.loop_compiler_options)
    return options or None


class program_jit:
    """jax.jit with the backend's compiler_options (loop=True: a device loop's too), made at
    first use, once per backend."""

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
            # Inside another trace JAX takes no compiler options; the outer program's apply.
            if "nested" not in self.jits:
                self.jits["nested"] = jax.jit(self.fun, **self.jit_kwargs)
            return self.jits["nested"](*args, **kwargs)
        return self._jitted()(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._jitted().lower(*args, **kwargs)


def _tracing(args, kwargs) -> bool:
    """Whether a JAX trace is running around this call."""
    from jax._src import core

    clean = getattr(core, "trace_state_clean", None)
    if clean is not None:
        return not clean()
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs)))


def loop_jit(fun=None, **jit_kwargs) -> program_jit:
    """program_jit for a device loop (device.loop.decode_loop)."""
    return program_jit(fun, loop=True, **jit_kwargs)


_SCHEDULER_FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"
# Process-wide XLA flags for the CPU backend (see the module docstring), by flag name.
CPU_XLA_FLAGS = {_SCHEDULER_FLAG: "false"}
# jaxlib versions (major, minor) known to have the flags, and the compiler_options.
CPU_XLA_FLAGS_JAXLIB = ((0, 10),)
COMPILER_OPTIONS_JAXLIB = ((0, 10),)


def set_cpu_xla_flags() -> list[str]:
    """Adds CPU_XLA_FLAGS to XLA_FLAGS where they apply (the module docstring). Returns the
    flags added."""
    from jax._src import xla_bridge

    if (_jaxlib_version() not in CPU_XLA_FLAGS_JAXLIB or xla_bridge.backends_are_initialized()
            or not cpu_only()):
        return []
    return add_xla_flags(CPU_XLA_FLAGS)


def cpu_only() -> bool:
    """JAX_PLATFORMS=cpu, or it unset and no accelerator plugin installed."""
    platforms = [p for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p]
    return platforms == ["cpu"] or not (platforms or _accelerator_plugin_installed())


def add_xla_flags(flags: dict) -> list[str]:
    """Appends flags (name -> value) not named in XLA_FLAGS yet; returns those added."""
    current = os.environ.get("XLA_FLAGS", "")
    added = [f"--{name}={value}" for name, value in flags.items()
             if f"--{name}" not in current]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([current] + added).strip()
    return added


def cpu_xla_flags_missing() -> bool:
    """Whether set_cpu_xla_flags would add a flag (applicable here and not yet named)."""
    named = os.environ.get("XLA_FLAGS", "")
    return (_jaxlib_version() in CPU_XLA_FLAGS_JAXLIB and cpu_only()
            and any(f"--{name}" not in named for name in CPU_XLA_FLAGS))


def cpu_keeps_one_scratch_buffer() -> bool:
    """Whether XLA_FLAGS turn XLA:CPU's memory-minimizing scheduler on."""
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
