"""Compiled model programs kept on disk across processes, so a warm start skips tracing and
lowering as well as XLA compilation.

JAX's persistent compilation cache (jaxinfer.llm.enable_compilation_cache) skips XLA's
compilation, but finding an entry takes its key, which is computed from the lowered program:
every process still traces and lowers each step program before the cache can answer (about
0.5-1 s for SmolLM2's flat step on the development CPU, more than the rest of the first token
but the executable's load). This cache keys a compiled program by what decides it without
tracing anything:
- the program (the jitted function's module and name) and the static arguments' repr (the
  model config, attention implementation, step sizes);
- the abstract dynamic arguments: their tree structure (static dataclass fields included) and
  each leaf's shape, dtype, weak type and placement;
- a fingerprint of the code that traces it (every .py file of jaxinfer and pallas_kernels),
  of jax and jaxlib's versions, XLA_FLAGS, the backend and its devices, and the jax options
  that change lowering (x64, default matmul precision).
An entry holds the serialized executable (jax.experimental.serialize_executable) and the
pickled input and output trees; a hit loads it and calls it with the dynamic arguments. Any
change to the code or the environment misses, and a miss compiles through jit as before (the
XLA cache still serves the compilation) and writes the entry. An entry that fails to load is
removed and compiled anew.

Used by the Runner for its flat steps and decode loops on a single device when the XLA cache
is on; entries live in <compilation cache>/programs. docs/architecture.md, "Compiled shapes",
has the measured effect.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import pickle
import tempfile
import threading
from typing import Callable, Optional

import jax

_FINGERPRINT: Optional[str] = None
_LOCK = threading.Lock()


def code_fingerprint() -> str:
    """sha256 of every .py file under the jaxinfer and pallas_kernels packages (path and
    bytes), with the versions, flags and devices a compiled program depends on."""
    global _FINGERPRINT
    if _FINGERPRINT is None:
        import jaxinfer
        import pallas_kernels

        h = hashlib.sha256()
        for package in (jaxinfer, pallas_kernels):
            root = os.path.dirname(package.__file__)
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames.sort()
                for name in sorted(filenames):
                    if name.endswith(".py"):
                        path = os.path.join(dirpath, name)
                        h.update(os.path.relpath(path, root).encode() + b"\0")
                        with open(path, "rb") as f:
                            h.update(f.read() + b"\0")
        devices = jax.devices()
        for part in (jax.__version__, importlib.metadata.version("jaxlib"),
                     os.environ.get("XLA_FLAGS", ""), jax.default_backend(),
                     repr([(d.platform, d.device_kind) for d in devices]),
                     repr(jax.config.jax_enable_x64),
                     repr(jax.config.jax_default_matmul_precision)):
            h.update(part.encode() + b"\0")
        _FINGERPRINT = h.hexdigest()
    return _FINGERPRINT


def _leaf_signature(x) -> str:
    sharding = getattr(x, "sharding", None)
    return f"{getattr(x, 'shape', ())}|{getattr(x, 'dtype', type(x).__name__)}|" \
           f"{getattr(x, 'weak_type', False)}|{sharding}"


def program_key(fn, args: tuple, kwargs: dict, static: tuple) -> str:
    """The cache key of fn(*args, **kwargs) whose keyword arguments `static` are static."""
    dynamic = (args, {k: v for k, v in kwargs.items() if k not in static})
    leaves, tree = jax.tree.flatten(dynamic)
    h = hashlib.sha256()
    name = getattr(fn, "__wrapped__", fn)
    for part in (code_fingerprint(), f"{name.__module__}.{name.__qualname__}",
                 repr(sorted((k, repr(kwargs[k])) for k in static)), str(tree),
                 *map(_leaf_signature, leaves)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


class ProgramCache:
    """Compiled programs by program_key: in this process (loaded once), and on disk under
    `directory` (None: in this process only)."""

    def __init__(self, directory: Optional[str]):
        self.directory = directory
        self.loaded: dict = {}   # caller's key -> callable(args, kwargs)
        self.hits = self.misses = 0

    def get(self, name, call: tuple) -> Callable:
        """The program of call = (jitted, args, kwargs) as a callable(args, kwargs), loaded or
        compiled once under the caller's `name` (which must fix every argument's shape)."""
        program = self.loaded.get(name)
        if program is None:
            program = self._load_or_compile(*call)
            with _LOCK:
                self.loaded[name] = program
        return program

    def _load_or_compile(self, fn, args, kwargs) -> Callable:
        from jax.experimental import serialize_executable as se

        static = tuple(k for k in kwargs if k in static_argnames(fn))
        path = None
        if self.directory is not None:
            path = os.path.join(self.directory, program_key(fn, args, kwargs, static) + ".bin")
            compiled = self._read(path)
            if compiled is not None:
                self.hits += 1
                return _calling(compiled, static)
        self.misses += 1
        compiled = fn.lower(*args, **kwargs).compile()
        if path is not None:
            payload, in_tree, out_tree = se.serialize(compiled)
            _write(path, pickle.dumps((payload, in_tree, out_tree)))
        return _calling(compiled, static)

    @staticmethod
    def _read(path: str):
        from jax.experimental import serialize_executable as se

        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            return se.deserialize_and_load(payload, in_tree, out_tree)
        except FileNotFoundError:
            return None
        except Exception:  # a partial or foreign entry: compile anew, and replace it
            try:
                os.remove(path)
            except OSError:
                pass
            return None


def static_argnames(fn) -> tuple:
    """The static keyword arguments of a jax.jit function or a tuning.loop_jit."""
    if hasattr(fn, "jit_kwargs"):
        return tuple(fn.jit_kwargs.get("static_argnames", ()))
    info = fn._jit_info
    if info.static_argnums:
        raise ValueError("programs take their static arguments by name")
    return tuple(info.static_argnames)


def _calling(compiled, static: tuple) -> Callable:
    def call(args, kwargs):
        return compiled(*args, **{k: v for k, v in kwargs.items() if k not in static})
    return call


def _write(path: str, data: bytes) -> None:
    """Writes atomically (a temporary file renamed), so a reader never sees half an entry."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
