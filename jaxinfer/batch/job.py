"""A batch job: its spec (JobSpec), its results committed in input order (OrderedCommits), and
the local runner, which keeps one LLM's engine full. The runner's memory is bounded whatever the
input's length, and its choices depend only on which requests finished, never on time, so every
process of a multi-process job feeds its engine the same requests. Contract: docs/batch.md.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import time
from typing import Callable, Optional

from jaxinfer.batch import inputs
from jaxinfer.batch.engine_loop import EngineFeeder
from jaxinfer.batch.inputs import IdSet, ShardReader, TextDefaults, Work
from jaxinfer.batch.merge import merge
from jaxinfer.batch.records import Result
from jaxinfer.batch.store import ShardStore, read_json, sha256_file, write_atomic
from jaxinfer.batch.store import shard_lock as _shard_dir_lock

# LLM settings that change what a request generates; scheduling settings (max_num_seqs, page
# sizes, chunking, decode_steps) do not, so a job may resume with other values of those.
OUTPUT_SETTINGS = ("dtype", "max_seq_len", "quantization", "kv_cache_dtype",
                   "attention", "speculative")
WINDOW_PER_REQUEST = 64  # read lines waiting behind an unfinished one, per request in flight


@dataclasses.dataclass
class JobSpec:
    """Everything a job's command line says. `model_name` is what response bodies report."""

    input_path: str
    output_dir: str
    llm_kwargs: dict                       # LLM(model, **rest): the model and engine
    model_name: str = ""
    input_format: str = "auto"             # auto | jsonl | text
    sampling: dict = dataclasses.field(default_factory=dict)  # plain text: SamplingParams kwargs
    chat: bool = False                     # plain text: each line is one user message
    seed: Optional[int] = None             # derives the seed of a request that names none
    mesh: Optional[tuple] = None           # (data, tensor, sequence), None for one device
    num_shards: int = 1
    shard_index: int = 0
    max_lines: Optional[int] = None        # read only the first max_lines input lines
    commit_every: int = 256                # output lines per part ...
    commit_interval_s: float = 30.0        # ... or what is ready after this many seconds
    max_in_flight: Optional[int] = None    # requests in the engine (None: 2 x max_num_seqs)
    progress: bool = True
    max_line_bytes: int = inputs.MAX_LINE_BYTES  # a longer line is answered line_too_long
    # LoRA adapters lines may name as `model`: {name: PEFT directory} (the LLM needs max_loras).
    lora_modules: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.model_name = self.model_name or str(self.llm_kwargs.get("model"))
        for name, v, lo in (("num_shards", self.num_shards, 1), ("commit_every",
                            self.commit_every, 1), ("max_lines", self.max_lines, 0),
                            ("max_in_flight", self.max_in_flight, 1),
                            ("max_line_bytes", self.max_line_bytes, 1)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
                raise ValueError(f"--{name} must be an integer >= {lo}, got {v!r}")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"--shard_index {self.shard_index} is outside [0, "
                             f"{self.num_shards}) (--num_shards {self.num_shards})")
        if not self.commit_interval_s > 0:
            raise ValueError(f"--commit_interval must be > 0 seconds, got "
                             f"{self.commit_interval_s}")

    def text_defaults(self) -> TextDefaults:
        return TextDefaults(dict(self.sampling), self.chat)

    def fingerprint(self, fmt: str) -> dict:
        """The settings the output depends on, recorded in job.json and checked on resume. The
        model is {"name": as given, "sha256": model_sha256}; only the digest is compared."""
        fp = {"model": {"name": self.llm_kwargs.get("model"),
                        "sha256": model_sha256(self.llm_kwargs.get("model"))}}
        fp.update((name, self.llm_kwargs.get(name)) for name in OUTPUT_SETTINGS)
        if dataclasses.is_dataclass(fp["speculative"]):
            fp["speculative"] = dataclasses.asdict(fp["speculative"])
        fp.update(format=fmt, seed=self.seed, mesh=list(self.mesh) if self.mesh else None,
                  max_line_bytes=self.max_line_bytes)
        if self.lora_modules:  # an adapter is part of the model its lines run
            fp["lora_modules"] = {n: model_sha256(p) for n, p in sorted(
                self.lora_modules.items())}
        if fmt == "text":  # JSONL lines carry their own sampling fields
            fp.update(sampling={k: list(v) if isinstance(v, tuple) else v
                                for k, v in sorted(self.sampling.items())}, chat=self.chat)
        return fp


# Files of an HF model directory that decide what it generates (besides *.safetensors).
_HF_FILES = ("config.json", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
             "special_tokens_map.json", "adapter_config.json")
FRESH_S = 2.0  # a file changed this recently may change again within its timestamp's tick


def model_sha256(model) -> str:
    """A digest of the model's content, whatever path or alias names it: a file's sha256, or a
    sha256 over (relative path, sha256) of a directory's files that decide the output."""
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be an alias or a path, got {model!r}")
    path = os.path.expanduser(os.fspath(model))
    if not os.path.exists(path):
        from jaxinfer.loading.hub import is_alias, resolve_alias

        if not is_alias(path):
            raise ValueError(f"model {os.fspath(model)!r}: no such file or directory, and not "
                             "a known alias")
        path = resolve_alias(path)
    if not os.path.isdir(path):
        return file_sha256(path)
    if os.path.exists(os.path.join(path, "jaxinfer_config.json")):  # a checkpoint
        names = sorted(os.path.relpath(os.path.join(d, f), path)
                       for d, _, files in os.walk(path) for f in files)
    else:
        names = sorted(f for f in os.listdir(path)
                       if f in _HF_FILES or f.endswith(".safetensors"))
    listing = [[name, file_sha256(os.path.join(path, name))] for name in names]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


def file_sha256(path: str) -> str:
    """sha256 of a file, remembered in a stamp (jaxinfer cache dir, digests/) keyed by its real
    path, size, times and inode; a file changed in the last FRESH_S seconds is not stamped."""
    from jaxinfer.loading.hub import cache_dir

    real, st = os.path.realpath(path), os.stat(path)
    key = {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
           "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}
    stamp = os.path.join(cache_dir(), "digests",
                         hashlib.blake2b(real.encode(), digest_size=16).hexdigest() + ".json")
    try:
        recorded = read_json(stamp)
        if isinstance(recorded, dict) and recorded.get("key") == key:
            return recorded["sha256"]
    except (OSError, ValueError, KeyError):  # no stamp yet, or a damaged one
        pass
    sha = sha256_file(path)
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > FRESH_S * 1e9:
        try:
            os.makedirs(os.path.dirname(stamp), mode=0o700, exist_ok=True)
            write_atomic(stamp, json.dumps({"key": key, "sha256": sha}).encode())
        except OSError:  # a read-only cache: hash again next time
            pass
    return sha


class OrderedCommits:
    """This shard's input lines in order, each waiting for its Result (or Blank); the leading
    finished run is committed at commit_every lines, after commit_interval_s, and at the end."""

    def __init__(self, store: ShardStore, spec: JobSpec,
                 on_result: Callable[[object], None] = lambda r: None,
                 on_commit: Callable[[dict], None] = lambda e: None):
        self.store, self.spec = store, spec
        self.on_result, self.on_commit = on_result, on_commit
        self._entries: collections.deque = collections.deque()  # [line, digest, result]
        self._ready = 0
        self._since = time.perf_counter()

    def push(self, line: int, digest: bytes) -> list:
        entry = [line, digest, None]
        self._entries.append(entry)
        return entry

    def fulfill(self, entry: list, result) -> None:
        entry[2] = result
        self.on_result(result)
        while self._ready < len(self._entries) and self._entries[self._ready][2] is not None:
            self._ready += 1

    @property
    def unresolved(self) -> int:
        """Lines read and not yet in the committable run: in the engine or behind one that is."""
        return len(self._entries) - self._ready

    def maybe_commit(self, position: int, final: bool = False) -> None:
        """position: input lines consumed so far (the end of a part that empties the queue)."""
        now = time.perf_counter()
        due = self._ready >= self.spec.commit_every or (
            self._ready and now - self._since >= self.spec.commit_interval_s)
        if not (due or (final and position > self.store.start_line)):
            return
        part = [tuple(self._entries.popleft()) for _ in range(self._ready)]
        self._ready = 0
        end = self._entries[0][0] if self._entries else position
        entry = self.store.commit(part, end, now - self._since)
        self._since = now
        self.on_commit(entry)


class Progress:
    """The tqdm bar on stderr: lines done (of the total when it is known), tokens/s, ETA."""

    def __init__(self, enabled: bool, total: Optional[int], initial: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="line", file=sys.stderr,
                        disable=not enabled, dynamic_ncols=True, smoothing=0.1)
        self.tokens, self.start, self.shown = 0, time.perf_counter(), 0.0

    def __call__(self, result) -> None:
        if isinstance(result, Result):
            self.tokens += result.completion_tokens
        self.bar.update(1)
        now = time.perf_counter()
        if now - self.shown > 0.5:
            self.shown = now
            self.bar.set_postfix_str(f"{self.tokens / (now - self.start):.1f} tok/s",
                                     refresh=False)

    def close(self) -> None:
        self.bar.close()


def shard_lock(spec: JobSpec):
    """The lock a run holds on its shard directory (store.dir_lock), created if missing."""
    return _shard_dir_lock(spec.output_dir, spec.shard_index, spec.num_shards)


def open_store(spec: JobSpec, writer: bool) -> tuple[ShardStore, str]:
    fmt = inputs.resolve_format(spec.input_path, spec.input_format)
    return ShardStore(spec.output_dir, spec.shard_index, spec.num_shards, spec.fingerprint(fmt),
                      spec.input_path, writer), fmt


def progress_for(spec: JobSpec, store: ShardStore, writer: bool) -> Progress:
    total = None
    if spec.num_shards == 1:  # a shard's share of the lines is known only once read
        total = inputs.count_lines(spec.input_path)
        total = total if spec.max_lines is None else min(total, spec.max_lines)
    initial = store.start_line if total is not None else store.totals.records
    return Progress(spec.progress and writer, total, min(initial, total or initial))


def finish(spec: JobSpec, store: ShardStore) -> dict:
    """The shard's summary.json, and for a one-shard job the merged output.jsonl."""
    summary = store.finish(spec.max_lines)
    if spec.num_shards == 1 and store.writer:
        return merge(spec.output_dir)
    return summary


def run_local(llm, spec: JobSpec, *, writer: bool = True,
              on_commit: Callable[[dict], None] = lambda e: None) -> dict:
    """Runs (or resumes) one shard of the job on `llm`; returns its summary (a one-shard job's
    merged one). `on_commit` sees each manifest entry once it is durable."""
    loaded = {a["name"] for a in llm.list_loras()}
    for name, path in spec.lora_modules.items():
        if name not in loaded:
            llm.load_lora(name, path)
    feeder = EngineFeeder(llm, spec.model_name, spec.seed)  # checks the model first
    with shard_lock(spec) if writer else contextlib.nullcontext():
        return _run_local(llm, spec, feeder, writer, on_commit)


def _run_local(llm, spec: JobSpec, feeder: EngineFeeder, writer: bool,
               on_commit: Callable[[dict], None]) -> dict:
    store, fmt = open_store(spec, writer)
    done = store.completed(spec.max_lines)
    if done is not None:  # finished before: (re)merge a one-shard job, which is idempotent
        return merge(spec.output_dir) if spec.num_shards == 1 and writer else done
    seen = IdSet() if fmt == "jsonl" else None
    lines = inputs.read_lines(spec.input_path, spec.max_line_bytes)
    store.resume(lines, seen)
    _check_processes_agree(store)
    reader = ShardReader(lines, fmt, spec.text_defaults(), spec.num_shards, spec.shard_index,
                         seen, spec.max_lines, store.start_line)
    progress = progress_for(spec, store, writer)
    order = OrderedCommits(store, spec, progress, on_commit)
    max_in_flight = spec.max_in_flight or 2 * llm.max_num_seqs
    window = WINDOW_PER_REQUEST * max_in_flight
    exhausted = False
    try:
        while True:
            while not exhausted and feeder.in_flight < max_in_flight \
                    and order.unresolved < window:
                item = next(reader, None)
                if item is None:
                    exhausted = True
                    break
                line, digest, parsed = item
                entry = order.push(line, digest)
                error = feeder.submit(parsed, entry) if isinstance(parsed, Work) else parsed
                if error is not None:
                    order.fulfill(entry, error)
            if feeder.in_flight:
                for entry, result in feeder.step():
                    order.fulfill(entry, result)
            done = exhausted and not feeder.in_flight
            order.maybe_commit(reader.position, final=done)
            if done:
                break
    except BaseException:
        feeder.abort_all()  # the LLM stays usable; the lost requests are redone on resume
        raise
    finally:
        progress.close()
    return finish(spec, store)


def _check_processes_agree(store: ShardStore) -> None:
    """Every process of a multi-process job must resume from the same commit (the output
    directory must be one all of them see), or their engines would run different requests."""
    import jax

    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        multihost_utils.assert_equal(
            np.array([store.start_line, store.next_part]),
            f"processes resume {store.dir} from different commits: --output must be a "
            "directory every process reads")
