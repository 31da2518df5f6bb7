import logging
import os

import jax
import pytest

# The golden data (tests/data) are HF transformers float32 outputs, and the tests' tolerances are
# float32's: LLM(dtype=None) means float32 throughout the suite (subprocesses included), where
# users get the backend's default (bf16 weights on CPU). Tests of 16-bit dtypes ask for them.
os.environ.setdefault("JAXINFER_DEFAULT_DTYPE", "float32")

# XLA:CPU flags of the test processes (subprocesses inherit them): most of the suite's time is
# XLA compiling engine programs whose runs are short, so the suite compiles with LLVM's
# optimization level 0 and XLA:CPU's older (loop) fusion emitters. Measured on the 2-core
# development CPU with empty caches (python -m pytest -q, JAXINFER_COMPILATION_CACHE pointed at
# a fresh directory): 1,074 s wall and 1,997 s of CPU without them, 517 s and 929 s with them,
# every test passing both ways; optimization level 0 alone, 760 s and 1,366 s. The programs
# and their code paths are the ones users run; the flags change only the machine code XLA:CPU
# generates for them. They are for tests only: with the older emitters SmolLM2's warmup at
# the defaults took 145 s (130 s at level 1) against 37 s, and at level 1 it decoded one row at
# 33 against 42 tokens/s (benchmarks/warmup.py and decode.py, one run each). They apply only
# to the CPU backend (JAX_PLATFORMS=cpu, or no accelerator plugin installed), never where
# XLA_FLAGS names a flag already, and not with JAXINFER_TEST_XLA_DEFAULTS=1 (XLA's defaults,
# as users compile; CI's slow run).
TEST_CPU_XLA_FLAGS = {"xla_backend_optimization_level": "0",
                      "xla_cpu_use_fusion_emitters": "false"}


def _set_test_xla_flags() -> None:
    from jaxinfer import backends
    from jaxinfer.backends import tuning

    if os.environ.get("JAXINFER_TEST_XLA_DEFAULTS") != "1" and tuning.cpu_only():
        tuning.add_xla_flags(TEST_CPU_XLA_FLAGS)
    # jaxinfer's own process-wide flags, as LLM() sets them: tests that build a model's parts
    # without an LLM compile under the same flags.
    backends.set_xla_flags()


_set_test_xla_flags()


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the real SmolLM2-135M-Instruct GGUF (fetched into the cache on first use)."""
    from jaxinfer.loading.hub import resolve_alias

    return resolve_alias("smollm2-135m")


@pytest.fixture(scope="session")
def data_dir() -> str:
    return os.path.join(os.path.dirname(__file__), "data")


class CompileRecorder:
    """Records compilations and traces, through two channels: jax's log_compiles records
    ("Finished tracing ...", "Compiling ...", "Finished XLA compilation ...") on the "jax"
    loggers, and jax.monitoring's trace/compile duration events."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
              "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        self.logs, self.events = [], []
        rec = self

        class Handler(logging.Handler):
            def emit(self, record):
                msg = record.getMessage()
                if msg.startswith(("Compiling", "Finished tracing", "Finished XLA compilation")):
                    rec.logs.append(msg[:200])

        self.handler = Handler(level=logging.DEBUG)

    def _on_event(self, name, duration, **kwargs):
        if name in self.EVENTS:
            self.events.append(name)

    def __enter__(self):
        self.logger = logging.getLogger("jax")
        self.old_level, self.old_flag = self.logger.level, jax.config.jax_log_compiles
        jax.config.update("jax_log_compiles", True)
        self.logger.setLevel(logging.WARNING)   # log_compiles records are WARNINGs
        self.logger.addHandler(self.handler)
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._on_event)
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.old_level)
        jax.config.update("jax_log_compiles", self.old_flag)

    def clear(self):
        self.logs.clear()
        self.events.clear()

    def armed(self):
        """Enters, proves the recorder sees a fresh compile on both channels, then clears."""
        self.__enter__()
        jax.jit(lambda a: a * 3 + 1)(jax.numpy.ones((3, 5, 7)))
        assert self.logs and self.events, "compile recorder is not receiving events"
        self.clear()
        return self


@pytest.fixture
def compile_recorder():
    """A context manager factory: `with compile_recorder() as rec:` records every trace and
    compile inside the block (rec.logs, rec.events); it is checked to be live on entry."""
    import contextlib

    @contextlib.contextmanager
    def recording():
        rec = CompileRecorder()
        rec.armed()
        try:
            yield rec
        finally:
            rec.__exit__(None, None, None)

    return recording



@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program after each test module. A CPU process may hold only
    vm.max_map_count memory maps (65530 by default) and each compiled program of the real model
    holds about a thousand (three per kernel), so the whole suite's engines together would
    exhaust them (a segfault while loading a program). Modules that come later recompile
    what they need, mostly from the persistent compilation cache."""
    yield
    jax.clear_caches()
