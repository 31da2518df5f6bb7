"""The engine loop: one thread that owns the LLM and steps its request-level API.

The engine is not thread-safe, so nothing but this thread calls add_request / step / abort.
HTTP handlers hand it commands through a thread-safe queue (submit, abort, call) and get each
request's RequestOutputs back on their own asyncio queue (Submission.events), put there with
loop.call_soon_threadsafe. Per-request timings for the metrics are taken here, as outputs come
out of step().
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

# Events put on a Submission's queue: (kind, value).
ADDED, ERROR, OUTPUT = "added", "error", "output"


@dataclasses.dataclass
class Submission:
    """One request on its way through the engine, as its HTTP handler sees it."""

    request_id: str
    prompt: Any                      # str or list[int]
    params: Any                      # SamplingParams
    loop: asyncio.AbstractEventLoop  # the handler's event loop
    events: asyncio.Queue            # (kind, value) from the engine thread
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    first_time: Optional[float] = None
    last_time: Optional[float] = None
    tokens_seen: int = 0
    last_output: Any = None          # the latest RequestOutput (for an abort's partial answer)

    def put(self, kind: str, value: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class EngineLoop:
    """Runs `llm` on a daemon thread. `metrics` (ServerMetrics or None) hears of every
    request's first token, tokens and finish, and gets an llm.stats() snapshot per step."""

    def __init__(self, llm, metrics=None, idle_wait_s: float = 0.05):
        self.llm = llm
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self._commands: queue.Queue = queue.Queue()
        self._subs: dict[str, Submission] = {}
        self._stop = threading.Event()
        self._abort_at: Optional[float] = None   # drain deadline (perf_counter)
        self._thread: Optional[threading.Thread] = None
        self.stats: dict = llm.stats()   # the latest snapshot, replaced (never mutated)
        self._pending = 0                # submitted, not yet handed to the engine
        self._lock = threading.Lock()

    # ---- called from any thread --------------------------------------------------------------

    def start(self) -> "EngineLoop":
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: Optional[float] = None) -> None:
        """Stops the thread; requests still in the engine are aborted (finish_reason
        "abort" on their queues)."""
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def pending_adds(self) -> int:
        return self._pending

    def _count_pending(self, delta: int) -> None:
        with self._lock:
            self._pending += delta

    def submit(self, sub: Submission) -> None:
        self._count_pending(1)
        self._commands.put(("add", sub))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def abort_all_at(self, deadline: float) -> None:
        """From `deadline` (time.perf_counter()) on, every request still in the engine is
        aborted (a graceful shutdown's deadline)."""
        self._abort_at = deadline
        self._commands.put(("wake", None))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Runs fn(llm) on the engine thread once the engine has no unfinished request (the
        requests before it are stepped to their end; commands after it wait). For tests and
        tools that need the engine to themselves, e.g. llm.generate for a reference."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", (fn, fut)))
        return fut

    # ---- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self.llm.has_unfinished_requests()
                handled = self._drain(block=not busy)
                if self._stop.is_set():
                    break
                if self._abort_at is not None and time.perf_counter() >= self._abort_at:
                    for rid in list(self._subs):
                        self._abort(rid)
                if self.llm.has_unfinished_requests():
                    self._step()
                if busy or handled:
                    self._snapshot()
        finally:
            for rid in list(self._subs):
                self._abort(rid)
            self._fail_pending(RuntimeError("the server is shutting down"))
            self._snapshot()

    def _drain(self, block: bool) -> bool:
        """Handles the queued commands (waiting a little for one when `block`); whether
        there were any."""
        try:
            cmd = self._commands.get(timeout=self.idle_wait_s) if block \
                else self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            self._handle(*cmd)
            if self._stop.is_set():
                return True
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, kind: str, value: Any) -> None:
        if kind == "add":
            self._add(value)
        elif kind == "abort":
            self._abort(value)
        elif kind == "call":
            fn, fut = value
            if not fut.set_running_or_notify_cancel():
                return
            try:
                while self.llm.has_unfinished_requests():
                    self._step()
                fut.set_result(fn(self.llm))
            except BaseException as e:  # handed to the caller
                fut.set_exception(e)

    def _add(self, sub: Submission) -> None:
        self._count_pending(-1)
        try:
            self.llm.add_request(sub.prompt, sub.params, sub.request_id)
        except ValueError as e:  # what only the model knows: prompt length, token ids
            sub.put(ERROR, e)
            return
        self._subs[sub.request_id] = sub
        sub.put(ADDED)

    def _abort(self, request_id: str) -> None:
        sub = self._subs.pop(request_id, None)
        if sub is None:
            return
        self.llm.abort(request_id)
        if self.metrics is not None:
            self.metrics.on_finish("abort", time.perf_counter() - sub.arrival)
        last = sub.last_output  # the partial answer, or None when nothing came out yet
        if last is not None:    # every unfinished sequence ends "abort"
            seqs = [c if c.finish_reason is not None else dataclasses.replace(
                c, finish_reason="abort") for c in last.outputs]
            last = dataclasses.replace(last, finish_reason="abort", outputs=seqs)
        sub.put(OUTPUT, last)

    def _step(self) -> None:
        try:
            outs = self.llm.step()
        except Exception as e:  # an engine failure: fail every request rather than hang them
            log.exception("engine step failed; aborting %d requests", len(self._subs))
            for rid, sub in list(self._subs.items()):
                self._subs.pop(rid)
                try:
                    self.llm.abort(rid)
                except Exception:  # noqa: BLE001 - the engine is already broken
                    pass
                sub.put(ERROR, e)
            return
        now = time.perf_counter()
        for out in outs:
            sub = self._subs.get(out.request_id)
            if sub is None:
                continue
            total = sum(len(c.token_ids) for c in out.outputs) if out.outputs \
                else len(out.token_ids)          # every sequence's tokens (n > 1)
            new = total - sub.tokens_seen
            if self.metrics is not None:
                if sub.first_time is None:
                    self.metrics.on_first_token(now - sub.arrival, len(out.prompt_token_ids))
                elif new > 0:
                    self.metrics.on_gap(now - sub.last_time, new)
                self.metrics.on_tokens(new)
            if sub.first_time is None:
                sub.first_time = now
            sub.last_time, sub.tokens_seen, sub.last_output = now, total, out
            if out.finished:
                self._subs.pop(out.request_id)
                if self.metrics is not None:
                    self.metrics.on_finish(out.finish_reason, now - sub.arrival)
            sub.put(OUTPUT, out)

    def _fail_pending(self, error: Exception) -> None:
        while True:
            try:
                kind, value = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._count_pending(-1)
                value.put(ERROR, error)
            elif kind == "call":
                value[1].set_exception(error)

    def _snapshot(self) -> None:
        self.stats = self.llm.stats()
        if self.metrics is not None:
            self.metrics.on_stats(self.stats, self.pending_adds)

    def num_active(self) -> int:
        """Requests handed to the engine and not finished (read from any thread)."""
        return len(self._subs)
