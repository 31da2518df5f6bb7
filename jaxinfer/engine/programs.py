"""Compiled model programs kept on disk across processes, so that a warm start skips tracing
and lowering as well as XLA compilation (JAX's persistent cache keys on the lowered program).

A program is keyed without tracing: the jitted function, its static arguments' repr, its
dynamic arguments' tree and abstract leaves, and a fingerprint of the code, jax, its
configuration, the XLA flags and the devices. Only programs XLA compiled in this process are
written (one JAX's cache loaded serializes incompletely). Monkeypatched code is not in the key
(set JAXINFER_PROGRAM_CACHE=0). Entries are unpickled, so they and their directory must be
private to this user. docs/architecture.md ("Programs cache") has the rules.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import pickle
import threading
import weakref
import zlib
from typing import Callable, Optional

import jax

from jaxinfer.loading.hub import ensure_private_dir, not_private, write_atomic

log = logging.getLogger(__name__)
_FINGERPRINT: Optional[str] = None
_LOCK = threading.Lock()
# jax's configuration values that do not change a traced program (logging, caching, dumps):
# left out of the key so that turning them on keeps the entries.
_CONFIG_NOT_IN_KEY = ("jax_log_compiles", "jax_explain_cache_misses", "jax_logging_level",
                      "jax_debug_log_modules", "jax_pprint_use_color",
                      "jax_compiler_detailed_logging_min_ops", "jax_raise_persistent_cache_errors")
_CONFIG_PREFIXES_NOT_IN_KEY = ("jax_compilation_cache", "jax_persistent_cache", "jax_dump_",
                               "jax_transfer_guard")
# jax.monitoring events, seen on the compiling thread: XLA compiled, JAX's cache answered.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_watch = threading.local()
_listening = False


def code_fingerprint() -> str:
    """sha256 of jaxinfer's and pallas_kernels' .py and .cc files, jax's versions and
    backends.signature()."""
    global _FINGERPRINT
    if _FINGERPRINT is None:
        h = hashlib.sha256()
        for package in ("jaxinfer", "pallas_kernels"):
            # Found without importing: importing pallas_kernels loads Pallas.
            root = importlib.util.find_spec(package).submodule_search_locations[0]
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames.sort()
                for name in sorted(filenames):
                    if name.endswith((".py", ".cc")):
                        path = os.path.join(dirpath, name)
                        h.update(os.path.relpath(path, root).encode() + b"\0")
                        with open(path, "rb") as f:
                            h.update(f.read() + b"\0")
        from jaxinfer import backends

        for part in (jax.__version__, importlib.metadata.version("jaxlib"),
                     backends.signature()):
            h.update(part.encode() + b"\0")
        _FINGERPRINT = h.hexdigest()
    return _FINGERPRINT


def _settings() -> str:
    """jax's configuration values that can change a traced program, read at each key: they may
    change during a process."""
    values = sorted((k, repr(v)) for k, v in jax.config.values.items()
                    if k not in _CONFIG_NOT_IN_KEY
                    and not k.startswith(_CONFIG_PREFIXES_NOT_IN_KEY))
    return repr(values)


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
    for part in (code_fingerprint(), _settings(), f"{name.__module__}.{name.__qualname__}",
                 repr(sorted((k, repr(kwargs[k])) for k in static)), str(tree),
                 *map(_leaf_signature, leaves)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def _on_event(event: str, *_args, **_kwargs) -> None:
    if getattr(_watch, "active", False):
        if event == _CACHE_HIT_EVENT:
            _watch.hit = True
        elif event == _COMPILE_EVENT:
            _watch.compiled = True


def _compile_fresh_or_loaded(fn, args, kwargs):
    """fn's program compiled through jit's lowering: (compiled, fresh), fresh when this thread
    saw a compile event and no cache hit (a renamed event makes nothing fresh: nothing written)."""
    global _listening
    with _LOCK:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _listening = True
    _watch.active, _watch.hit, _watch.compiled = True, False, False
    try:
        compiled = fn.lower(*args, **kwargs).compile()
    finally:
        _watch.active = False
    return compiled, _watch.compiled and not _watch.hit


def directory() -> Optional[str]:
    """<JAX's compilation cache>/programs (created 0700), or None: off in multi-process runs,
    without JAX's cache, with JAXINFER_PROGRAM_CACHE=0, or where not private to this user."""
    cache = jax.config.jax_compilation_cache_dir
    if os.environ.get("JAXINFER_PROGRAM_CACHE", "1") == "0" or not cache \
            or jax.process_count() != 1:
        return None
    if not isinstance(getattr(jax.config, "values", None), dict):
        return None  # a jax whose configuration values the key cannot read: off
    root = os.path.join(cache, "programs")
    with _LOCK:
        if root in _REFUSED:
            return None
        problem = ensure_private_dir(root)
        if problem is not None:
            _REFUSED.add(root)
            log.warning("jaxinfer programs cache off for this process: %s", problem)
            return None
    return root


# Programs directories refused (not private to this user): off until the process ends.
_REFUSED: set[str] = set()


# Prefetched programs: key -> Future of the loaded program (None: no entry).
_PREFETCH: dict[str, concurrent.futures.Future] = {}
# How many of an index's programs prefetch loads: the first step programs a new LLM runs.
PREFETCH_PROGRAMS = 2
# Program keys an index keeps, in order of first use.
INDEX_LIMIT = 64


def startup_key(parts) -> str:
    """The key of an index of programs: the code fingerprint, the settings, and `parts` (an
    LLM's arguments), which decide the programs its engine will run."""
    h = hashlib.sha256()
    for part in (code_fingerprint(), _settings(), repr(parts)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def _index_path(root: str, index_key: str) -> str:
    return os.path.join(root, f"index-{index_key}.json")


def _read_index(root: str, index_key: str) -> list:
    try:
        with open(_index_path(root, index_key)) as f:
            keys = json.load(f)
        return [k for k in keys if isinstance(k, str)] if isinstance(keys, list) else []
    except (OSError, ValueError):
        return []


def prefetch(root: str, index_key: str, limit: int = PREFETCH_PROGRAMS) -> int:
    """Starts loading the first `limit` programs an engine of this index used, on background
    threads that overlap the weights' loading (XLA releases the GIL); returns how many."""
    started = 0
    for key in _read_index(root, index_key)[:limit]:
        with _LOCK:
            if key in _PREFETCH or key in _IN_PROCESS:  # loading, or this process has it
                continue
            future: concurrent.futures.Future = concurrent.futures.Future()
            _PREFETCH[key] = future

        def load(key=key, future=future):
            try:
                future.set_result(ProgramCache._read(_entry_path(root, key)))
            except BaseException as e:  # noqa: BLE001  (handed to the taker)
                future.set_exception(e)
        threading.Thread(target=load, name="jaxinfer-prefetch", daemon=True).start()
        started += 1
    return started


def _take_prefetched(key: str):
    """The prefetched program of `key` (waiting for its load), or None."""
    with _LOCK:
        future = _PREFETCH.pop(key, None)
    if future is None:
        return None
    try:
        return future.result()
    except Exception:  # noqa: BLE001  a failed load: read or compile it as without prefetch
        return None


# Programs loaded or compiled, by key, for another engine of the same shapes (weak).
_IN_PROCESS: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _entry_path(root: str, key: str) -> str:
    return os.path.join(root, key + ".bin")


class ProgramCache:
    """Compiled programs by program_key, in this process and on disk under `directory`.
    index_key: the startup_key recording them in order of first use for prefetch, or None."""

    def __init__(self, directory: str, index_key: Optional[str] = None):
        self.directory = directory
        self.index_key = index_key
        self.index = _read_index(directory, index_key) if index_key else []
        self.loaded: dict = {}   # caller's name -> (callable(args, kwargs), key or None)
        self.ran: set = set()    # names run (and so recorded in the index)
        self.hits = self.misses = self.written = 0
        self.writers: list[threading.Thread] = []

    def _record(self, key: str) -> None:
        """Adds key to this cache's index (once), rewriting the index file."""
        if self.index_key is None:
            return
        with _LOCK:
            if key in self.index or len(self.index) >= INDEX_LIMIT:
                return
            self.index.append(key)
            data = json.dumps(self.index).encode()
        try:
            write_atomic(_index_path(self.directory, self.index_key), data)
        except OSError:  # a read-only or full disk: the programs still run, unrecorded
            pass

    def get(self, name, call: tuple, run: bool = True) -> Callable:
        """The program of call = (jitted, args, kwargs) as a callable(args, kwargs), loaded or
        compiled once under `name` (which must fix every argument's shape, dtype and placement).
        run: the caller runs it now, which records it in the index in first-run order."""
        entry = self.loaded.get(name)
        if entry is None:
            entry = self._load_or_compile(*call)
            with _LOCK:
                entry = self.loaded.setdefault(name, entry)
        program, key = entry
        if run and key is not None and name not in self.ran:
            self.ran.add(name)
            self._record(key)
        return program

    def _load_or_compile(self, fn, args, kwargs) -> tuple[Callable, Optional[str]]:
        """(callable(args, kwargs), the program's key: None where it has no entry)."""
        try:
            static = tuple(k for k in kwargs if k in static_argnames(fn))
        except (AttributeError, ValueError):  # a jit whose static arguments are not known here
            return (lambda args, kw: fn(*args, **kw)), None
        key = program_key(fn, args, kwargs, static)
        path = _entry_path(self.directory, key)
        with _LOCK:
            compiled = _IN_PROCESS.get(key)
        if compiled is None:
            compiled = _take_prefetched(key)
        if compiled is None:
            compiled = self._read(path)
        if compiled is not None:
            with _LOCK:
                self.hits += 1
                _IN_PROCESS[key] = compiled
            return _calling(compiled, static), key
        with _LOCK:
            self.misses += 1
        compiled, fresh = _compile_fresh_or_loaded(fn, args, kwargs)
        with _LOCK:
            _IN_PROCESS[key] = compiled
        if not fresh:
            return _calling(compiled, static), None
        # Written beside the first run; the interpreter waits for the thread at exit.
        writer = threading.Thread(target=self._store, args=(compiled, path),
                                  name="jaxinfer-program-writer")
        with _LOCK:
            self.writers.append(writer)
        writer.start()
        return _calling(compiled, static), key

    def _store(self, compiled, path: str) -> None:
        from jax.experimental import serialize_executable as se

        try:
            payload, in_tree, out_tree = se.serialize(compiled)
        except (ValueError, NotImplementedError):  # not serializable: jit alone serves it
            return
        # Its devices: loaded onto all, a one-device program would expect a shard per device.
        shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
        devices = sorted({d.id for s in shardings for d in s.device_set})
        try:
            data = pickle.dumps((payload, in_tree, out_tree, devices))
            write_atomic(path, zlib.compress(data, 1))
        except OSError:  # a read-only or full disk: this process has the program anyway
            return
        with _LOCK:
            self.written += 1

    def flush(self) -> None:
        """Waits for the entries being written."""
        with _LOCK:
            writers, self.writers = self.writers, []
        for w in writers:
            w.join()

    @staticmethod
    def _read(path: str):
        from jax.experimental import serialize_executable as se

        try:
            with open(path, "rb") as f:
                if problem := not_private(f.fileno()):
                    log.warning("jaxinfer programs cache: not loading %s (%s)", path, problem)
                    return None  # a miss: the program is compiled and its entry replaced
                payload, in_tree, out_tree, ids = pickle.loads(zlib.decompress(f.read()))
            by_id = {d.id: d for d in jax.devices()}
            return se.deserialize_and_load(payload, in_tree, out_tree,
                                           execution_devices=[by_id[i] for i in ids])
        except FileNotFoundError:
            return None
        except Exception:  # a partial or foreign entry: compile anew, and replace it
            try:
                os.remove(path)
            except OSError:
                pass
            return None


def static_argnames(fn) -> tuple:
    """The static keyword arguments of a jax.jit function or a backends.tuning.program_jit."""
    if hasattr(fn, "jit_kwargs"):
        return tuple(fn.jit_kwargs.get("static_argnames", ()))
    info = fn._jit_info  # jax's record of a jit's arguments (AttributeError where it is not)
    if info.static_argnums:
        raise ValueError("programs take their static arguments by name")
    return tuple(info.static_argnames)


def _calling(compiled, static: tuple) -> Callable:
    def call(args, kwargs):
        return compiled(*args, **{k: v for k, v in kwargs.items() if k not in static})
    return call
