"""A batch job: what it is (JobSpec), its results put in input order and committed in parts
(OrderedCommits), and the local runner, which keeps one LLM's engine full.

The local runner reads a line only while fewer than max_in_flight requests are in the engine
(2 x max_num_seqs by default: the engine always has requests waiting for a free slot, as under
LLM.generate) and fewer than 64 x max_in_flight read lines wait behind an unfinished one, so
its memory is bounded whatever the input's length. Those two bounds depend only on which
requests have finished, never on time, so every process of a multi-process job feeds the
engine the same requests in the same order.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import time
from typing import Callable, Optional

from jaxinfer.batch import inputs
from jaxinfer.batch.engine_loop import EngineFeeder
from jaxinfer.batch.inputs import IdSet, ShardReader, TextDefaults, Work
from jaxinfer.batch.merge import merge
from jaxinfer.batch.records import Result
from jaxinfer.batch.store import ShardStore

# LLM settings that change what a request generates; scheduling settings (max_num_seqs, page
# sizes, chunking, decode_steps) do not, so a job may resume with other values of those.
OUTPUT_SETTINGS = ("model", "dtype", "max_seq_len", "quantization", "kv_cache_dtype",
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

    def __post_init__(self):
        self.model_name = self.model_name or str(self.llm_kwargs.get("model"))
        for name, v, lo in (("num_shards", self.num_shards, 1), ("commit_every",
                            self.commit_every, 1), ("max_lines", self.max_lines, 0),
                            ("max_in_flight", self.max_in_flight, 1)):
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
        """The settings the output depends on, recorded in job.json and checked on resume."""
        fp = {name: self.llm_kwargs.get(name) for name in OUTPUT_SETTINGS}
        if dataclasses.is_dataclass(fp["speculative"]):
            fp["speculative"] = dataclasses.asdict(fp["speculative"])
        fp.update(format=fmt, seed=self.seed, mesh=list(self.mesh) if self.mesh else None)
        if fmt == "text":  # JSONL lines carry their own sampling fields
            fp.update(sampling={k: list(v) if isinstance(v, tuple) else v
                                for k, v in sorted(self.sampling.items())}, chat=self.chat)
        return fp


class OrderedCommits:
    """This shard's input lines in order, each waiting for its Result (or Blank); the leading
    run of finished ones is committed as a part once it holds commit_every lines, once
    commit_interval_s has passed, and at the end."""

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
    """Runs (or resumes) one shard of the job on `llm`; returns its summary (for a one-shard
    job, the merged summary, with DIR/output.jsonl written). `on_commit` sees each manifest
    entry after it is durable."""
    feeder = EngineFeeder(llm, spec.model_name, spec.seed)  # checks the model first
    store, fmt = open_store(spec, writer)
    done = store.completed(spec.max_lines)
    if done is not None:  # finished before: (re)merge a one-shard job, which is idempotent
        return merge(spec.output_dir) if spec.num_shards == 1 and writer else done
    seen = IdSet() if fmt == "jsonl" else None
    lines = inputs.read_lines(spec.input_path)
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
