"""--runner=ray: the same job on Ray Data, an actor pool with one LLM per actor.

Read tasks yield this shard's lines of each range of input lines as one block; map_batches hands
blocks to the actors, and the driver alone finds duplicates and commits, through the same
ShardStore as the local runner, so either runner can resume the other's job. Each actor keeps
its LLM full from the blocks it works on at once through one engine thread.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Optional

import numpy as np

from jaxinfer.batch import inputs
from jaxinfer.batch.engine_loop import EngineFeeder
from jaxinfer.batch.inputs import IdSet, Work
from jaxinfer.batch.job import (JobSpec, OrderedCommits, finish, open_store, progress_for,
                                shard_lock)
from jaxinfer.batch.merge import merge
from jaxinfer.batch.records import Blank, Result

CALLS_PER_ACTOR = 4  # batches an actor works on at once


def line_ranges(path: str, start: int, stop: Optional[int], size: int,
                max_line_bytes: int = inputs.MAX_LINE_BYTES) -> list[tuple]:
    """(first line, byte offset, line count) of consecutive ranges of `size` lines covering
    input lines [start, stop): one read task each."""
    ranges, offset = [], 0
    with open(path, "rb") as f:
        for no, (_, taken) in enumerate(inputs.scan_lines(f, max_line_bytes)):
            if stop is not None and no >= stop:
                break
            if no >= start:
                if (no - start) % size == 0:
                    ranges.append([no, offset, 0])
                ranges[-1][2] += 1
            offset += taken
    return [tuple(r) for r in ranges]


def _read_range(spec: JobSpec, fmt: str, first: int, offset: int, count: int):
    """A read task: this shard's lines among `count` lines from byte `offset`, as one block.
    An overlong line travels as its size (too_long), without its bytes."""
    import pyarrow as pa

    text = spec.text_defaults()
    block = {"line": [], "raw": [], "digest": [], "too_long": []}
    with open(spec.input_path, "rb") as f:
        f.seek(offset)
        scan = inputs.scan_lines(f, spec.max_line_bytes)
        for no, (raw, _) in zip(range(first, first + count), scan):
            item = inputs.parse_line(no, raw, fmt, text)
            if inputs.belongs(item, no, spec.num_shards, spec.shard_index):
                long = isinstance(raw, inputs.LongLine)
                block["line"].append(no)
                block["raw"].append(b"" if long else raw)
                block["digest"].append(inputs.line_digest(raw))
                block["too_long"].append(raw.size if long else -1)
    if block["line"]:
        yield pa.Table.from_pydict(block)


def _raw_line(raw, digest, too_long: int, limit: int) -> inputs.RawLine:
    """A block row's line, as _read_range read it."""
    if too_long >= 0:
        return inputs.LongLine(int(too_long), bytes(digest), limit)
    return bytes(raw)


def _datasource(spec: JobSpec, fmt: str, ranges: list[tuple]):
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    size = os.path.getsize(spec.input_path)

    class BatchLines(Datasource):
        """One block per read task, so that each block goes to one actor call (a task's blocks
        would be merged, and one block's batches run one after the other)."""

        def estimate_inmemory_data_size(self) -> Optional[int]:
            return size

        def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
            return [ReadTask(lambda r=r: _read_range(spec, fmt, *r),
                             BlockMetadata(num_rows=None, size_bytes=None,
                                           input_files=[spec.input_path], exec_stats=None))
                    for r in ranges]

    return BatchLines()


class _Call:
    """One map_batches call waiting for its rows' Results."""

    def __init__(self, n: int):
        self.results: list = [None] * n
        self.remaining = n
        self.done = threading.Event()
        if n == 0:
            self.done.set()


class _Generator:
    """A Ray Data actor: one LLM, fed by an engine thread from every concurrent call."""

    def __init__(self, spec: JobSpec, fmt: str, mesh=None):
        from jaxinfer.llm import LLM

        kwargs = dict(spec.llm_kwargs)
        model = kwargs.pop("model")
        self.llm = LLM(model, **kwargs, **({"mesh": mesh} if mesh is not None else {}))
        self.spec, self.fmt, self.text = spec, fmt, spec.text_defaults()
        self.feeder = EngineFeeder(self.llm, spec.model_name, spec.seed)
        self.max_in_flight = spec.max_in_flight or 2 * self.llm.max_num_seqs
        self.queue: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.calls: set = set()
        self.failure: Optional[BaseException] = None
        threading.Thread(target=self._serve, daemon=True, name="engine").start()

    def _deliver(self, tag, result) -> None:
        call, i = tag
        with self.lock:
            call.results[i] = result
            call.remaining -= 1
            if call.remaining == 0:
                call.done.set()

    def _serve(self) -> None:
        try:
            while True:
                block = self.feeder.in_flight == 0  # wait for work only when none runs
                while self.feeder.in_flight < self.max_in_flight:
                    try:
                        work, tag = self.queue.get(block=block)
                    except queue.Empty:
                        break
                    block = False
                    error = self.feeder.submit(work, tag)
                    if error is not None:
                        self._deliver(tag, error)
                if self.feeder.in_flight:
                    for tag, result in self.feeder.step():
                        self._deliver(tag, result)
        except BaseException as e:  # noqa: BLE001 - handed to every waiting call
            with self.lock:
                self.failure = e
                for call in self.calls:
                    call.done.set()

    def __call__(self, batch: dict) -> dict:
        lines = [int(x) for x in batch["line"]]
        call = _Call(len(lines))
        with self.lock:
            if self.failure is not None:
                raise RuntimeError(f"the engine thread failed: {self.failure!r}")
            self.calls.add(call)
        try:
            rows = zip(lines, batch["raw"], batch["digest"], batch["too_long"])
            for i, (no, raw, digest, too_long) in enumerate(rows):
                raw = _raw_line(raw, digest, too_long, self.spec.max_line_bytes)
                item = inputs.parse_line(no, raw, self.fmt, self.text)
                if isinstance(item, Work):
                    self.queue.put((item, (call, i)))
                else:
                    self._deliver((call, i), item)
            call.done.wait()
        finally:
            with self.lock:
                self.calls.discard(call)
        if self.failure is not None:
            raise RuntimeError(f"the engine thread failed: {self.failure!r}") from self.failure
        return _columns(lines, batch["digest"], call.results)


def _columns(lines, digests, results) -> dict:
    """Results as columns ("" for a missing string: custom_ids are never empty)."""
    res = [r if isinstance(r, Result) else None for r in results]
    obj = lambda xs: np.array(xs, dtype=object)  # noqa: E731
    return {"line": np.array(lines, np.int64), "digest": obj([bytes(d) for d in digests]),
            "blank": np.array([r is None for r in res]),
            "custom_id": obj([(r.custom_id or "") if r else "" for r in res]),
            "record": obj([r.record if r else "" for r in res]),
            "error_kind": obj([(r.error_kind or "") if r else "" for r in res]),
            "prompt_tokens": np.array([r.prompt_tokens if r else 0 for r in res], np.int64),
            "completion_tokens": np.array([r.completion_tokens if r else 0 for r in res],
                                          np.int64)}


def _rows(batch: dict):
    for i in range(len(batch["line"])):
        line = int(batch["line"][i])
        if batch["blank"][i]:
            yield line, bytes(batch["digest"][i]), Blank(line)
            continue
        yield line, bytes(batch["digest"][i]), Result(
            line, batch["custom_id"][i] or None, batch["record"][i],
            batch["error_kind"][i] or None, int(batch["prompt_tokens"][i]),
            int(batch["completion_tokens"][i]))


def run_ray(spec: JobSpec, *, num_workers: int = 1, address: Optional[str] = None,
            mesh=None, cpus_per_worker: float = 1.0, gpus_per_worker: float = 0.0,
            on_commit=lambda e: None) -> dict:
    """Runs (or resumes) one shard of the job on Ray Data; the same summary as run_local.
    Starts a local Ray unless one is already initialized (or `address` names a cluster)."""
    if num_workers < 1:
        raise ValueError(f"--num_workers must be >= 1, got {num_workers}")
    with shard_lock(spec):  # the driver alone writes the shard's directory
        return _run_locked(spec, num_workers, address, mesh, cpus_per_worker, gpus_per_worker,
                           on_commit)


def _run_locked(spec: JobSpec, num_workers: int, address: Optional[str], mesh,
                cpus_per_worker: float, gpus_per_worker: float, on_commit) -> dict:
    import ray
    from ray.data import ActorPoolStrategy, DataContext

    store, fmt = open_store(spec, writer=True)
    done = store.completed(spec.max_lines)
    if done is not None:
        return merge(spec.output_dir) if spec.num_shards == 1 else done
    seen = IdSet() if fmt == "jsonl" else None
    store.resume(inputs.read_lines(spec.input_path, spec.max_line_bytes), seen)
    # Ranges of max_num_seqs of this shard's lines on average: an actor works on
    # CALLS_PER_ACTOR of them at once, which keeps 2 x max_num_seqs requests in its engine.
    rows = int(spec.llm_kwargs.get("max_num_seqs") or 16)
    ranges = line_ranges(spec.input_path, store.start_line, spec.max_lines,
                         rows * spec.num_shards, spec.max_line_bytes)
    end = ranges[-1][0] + ranges[-1][2] if ranges else store.start_line
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False)
    ctx = DataContext.get_current()
    ctx.execution_options.preserve_order = True  # results reach the driver in input order
    ctx.enable_progress_bars = False             # the job's own bar reports progress
    ctx.print_on_execution_start = False
    ds = ray.data.read_datasource(_datasource(spec, fmt, ranges),
                                  override_num_blocks=max(1, len(ranges)))
    ds = ds.map_batches(
        _Generator, fn_constructor_kwargs={"spec": spec, "fmt": fmt, "mesh": mesh},
        batch_size=None, batch_format="numpy", num_cpus=cpus_per_worker,
        num_gpus=gpus_per_worker or None,
        compute=ActorPoolStrategy(size=num_workers, max_tasks_in_flight_per_actor=CALLS_PER_ACTOR,
                                  max_concurrent_calls_per_actor=CALLS_PER_ACTOR,
                                  enable_true_multi_threading=True))
    progress = progress_for(spec, store, writer=True)
    order = OrderedCommits(store, spec, progress, on_commit)
    last = store.start_line  # the line after the last one received
    try:
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            for line, digest, item in _rows(batch):
                entry = order.push(line, digest)
                order.fulfill(entry, inputs.check_duplicate(seen, item))
                last = line + 1
            order.maybe_commit(last)
        order.maybe_commit(max(end, store.start_line), final=True)
    finally:
        progress.close()
    return finish(spec, store)
