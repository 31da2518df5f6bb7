"""The process-wide XLA flags jaxinfer sets on CPU (backends.set_xla_flags, called by LLM()):
when they are added, that importing jaxinfer adds none, and what the scheduler flag does to a
compiled program's scratch memory."""

import os
import subprocess
import sys

import pytest

from jaxinfer.backends import tuning

FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"

# An unrolled chain of 6 products with int8 weights dequantized inside the program (as
# quant.matmul does for a linear that is one tile); prints the compiled program's scratch bytes.
_CHAIN = """
import os, sys
import jaxinfer
jaxinfer.backends.set_xla_flags()   # as LLM() does, before any backend starts
import jax, jax.numpy as jnp, numpy as np
from jaxinfer import quant
ws = [jax.tree.map(jnp.asarray, quant.quantize_int8(
          np.random.default_rng(i).standard_normal((256, 1024)).astype(np.float32), 0, 32))
      for i in range(6)]
def chain(x, ws):
    for w in ws:
        x = x + jnp.einsum("nd,df->nf", x, quant.dequantize(w))[:, :256]
    return x
x = jnp.zeros((1, 256), jnp.float32)
print(os.environ.get("XLA_FLAGS", ""))
print(jax.jit(chain).lower(x, ws).compile().memory_analysis().temp_size_in_bytes)
"""


def _chain(xla_flags):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    out = subprocess.run([sys.executable, "-c", _CHAIN], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout.splitlines()
    return out[-2], int(out[-1])


def test_importing_jaxinfer_leaves_xla_flags_as_the_user_set_them():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    code = "import jaxinfer, os; print(os.environ.get('XLA_FLAGS'))"
    for given in (None, "--xla_force_host_platform_device_count=2"):
        run_env = dict(env) if given is None else {**env, "XLA_FLAGS": given}
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True,
                             text=True, timeout=120, check=True).stdout.split()
        assert out == [str(given)]


def test_scheduler_flag_reuses_one_scratch_buffer():
    """With set_xla_flags called first, XLA:CPU's memory-minimizing scheduler runs, and the six
    dequantized [256, 1024] float32 copies (1 MiB each) share one scratch buffer; with the flag
    set back to XLA's default by the user (which jaxinfer leaves alone) each has its own."""
    one_mib = 256 * 1024 * 4
    flags, temp = _chain(None)
    assert flags == f"{FLAG}=false"
    assert one_mib <= temp < 2 * one_mib
    flags, temp = _chain(f"{FLAG}=true")
    assert flags == f"{FLAG}=true"
    assert temp >= 6 * one_mib


@pytest.fixture
def clean_env(monkeypatch):
    """set_cpu_xla_flags as on a fresh process: no backend started, no XLA_FLAGS."""
    from jax._src import xla_bridge

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setattr(tuning, "_accelerator_plugin_installed", lambda: False)
    monkeypatch.setattr(tuning, "CPU_XLA_FLAGS_JAXLIB", (tuning._jaxlib_version(),))
    return monkeypatch


def test_flags_added_once_and_recognised(clean_env):
    clean_env.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    assert tuning.set_cpu_xla_flags() == [f"{FLAG}=false"]
    assert os.environ["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=4 {FLAG}=false"
    assert tuning.cpu_keeps_one_scratch_buffer()
    assert tuning.set_cpu_xla_flags() == []   # named already: not added twice
    clean_env.setenv("XLA_FLAGS", f"{FLAG}=true")
    assert tuning.set_cpu_xla_flags() == [] and not tuning.cpu_keeps_one_scratch_buffer()
    clean_env.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    assert not tuning.cpu_keeps_one_scratch_buffer()


@pytest.mark.parametrize("case", ["backend started", "gpu platform", "plugin", "jaxlib"])
def test_flags_left_out_where_not_measured(clean_env, case):
    from jax._src import xla_bridge

    if case == "backend started":   # XLA has read XLA_FLAGS already
        clean_env.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    elif case == "gpu platform":
        clean_env.setenv("JAX_PLATFORMS", "cuda")
    elif case == "plugin":         # a GPU jaxlib might not know the flag, and XLA stops at it
        clean_env.setattr(tuning, "_accelerator_plugin_installed", lambda: True)
    else:
        clean_env.setattr(tuning, "CPU_XLA_FLAGS_JAXLIB", ((0, 1),))
    assert tuning.set_cpu_xla_flags() == []
    assert "XLA_FLAGS" not in os.environ


def test_flags_added_for_cpu_platform_even_with_a_plugin(clean_env):
    clean_env.setenv("JAX_PLATFORMS", "cpu")
    clean_env.setattr(tuning, "_accelerator_plugin_installed", lambda: True)
    assert tuning.set_cpu_xla_flags() == [f"{FLAG}=false"]


PRESET = {"xla_cpu_opt_preset": "CPU_OPT_PRESET_FAST_COMPILE"}
LOOP = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def test_program_options_by_backend_loop_and_jaxlib(monkeypatch):
    """The engine's programs compile with the CPU's fast-compile preset, loops also without
    loop-invariant code motion; a GPU keeps XLA's defaults; a jaxlib the preset was not measured
    on gets only the loop option (XLA refuses an option it does not know)."""
    monkeypatch.setattr(tuning, "COMPILER_OPTIONS_JAXLIB", (tuning._jaxlib_version(),))
    assert tuning.compiler_options("cpu", loop=False) == PRESET
    assert tuning.compiler_options("cpu", loop=True) == {**PRESET, **LOOP}
    assert tuning.compiler_options("gpu", loop=False) is None
    assert tuning.compiler_options("gpu", loop=True) is None
    monkeypatch.setattr(tuning, "COMPILER_OPTIONS_JAXLIB", ((0, 1),))
    assert tuning.compiler_options("cpu", loop=False) is None
    assert tuning.compiler_options("cpu", loop=True) == LOOP


def test_program_jit_hands_its_options_to_xla(monkeypatch):
    """program_jit's options reach XLA's compiler: an unknown preset is refused by name, the
    real one compiles, and the program computes what jax.jit's does."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    def f(x, w):
        return jax.nn.softmax(jnp.tanh(x @ w) * 3.0, axis=-1).sum(axis=0)

    if jax.default_backend() != "cpu":
        pytest.skip("the preset is an XLA:CPU option")
    rng = np.random.default_rng(0)
    x, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((64, 96), (96, 128)))
    monkeypatch.setattr(tuning, "COMPILER_OPTIONS_JAXLIB", (tuning._jaxlib_version(),))
    backend = jax.default_backend()
    real = tuning.for_platform(backend)
    bad = dataclasses.replace(real, compiler_options=(("xla_cpu_opt_preset", "NO_SUCH_PRESET"),))
    monkeypatch.setitem(tuning.TUNING, backend, bad)
    with pytest.raises(Exception, match="NO_SUCH_PRESET"):
        tuning.program_jit(f)(x, w)
    monkeypatch.setitem(tuning.TUNING, backend, real)
    got = tuning.program_jit(f)(x, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(f)(x, w)), rtol=1e-6,
                               atol=1e-6)


def test_program_options_yield_to_xla_flags(monkeypatch):
    """A preset the user names in XLA_FLAGS is theirs: the engine does not pass its own."""
    monkeypatch.setattr(tuning, "COMPILER_OPTIONS_JAXLIB", (tuning._jaxlib_version(),))
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_opt_preset=CPU_OPT_PRESET_DEFAULT")
    assert tuning.compiler_options("cpu", loop=False) is None
    assert tuning.compiler_options("cpu", loop=True) == LOOP


def test_program_jit_inside_another_jit_and_grad():
    """A program_jit called inside a user's jit or under grad (the scoring forward in a draft
    training step) runs as a nested jit without options, which JAX takes on top-level jits
    only, and computes what it computes alone."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    inner = tuning.program_jit(lambda x: jnp.sum(jnp.tanh(x) ** 2))
    x = jnp.linspace(-1.0, 1.0, 32, dtype=jnp.float32)
    alone = float(inner(x))
    assert abs(float(jax.jit(lambda x: inner(x) * 1.0)(x)) - alone) <= 1e-6
    grad = jax.grad(inner)(x)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(
        2 * jnp.tanh(x) * (1 - jnp.tanh(x) ** 2)), rtol=1e-5, atol=1e-6)
