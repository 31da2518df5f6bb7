"""The engine loop: one thread that owns the LLM (which is not thread-safe) and steps it.

Handlers send commands through a queue and hear back through their Submission, which keeps
only the newest output (outputs are cumulative). A request's failure stays that request's; if
the thread itself dies, every request fails with EngineStopped. Contract: docs/serving.md.
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

# Events delivered to a Submission: (kind, value).
ADDED, ERROR, OUTPUT = "added", "error", "output"
# The longest exception text kept in EngineLoop.failure (shown by /health).
_MAX_FAILURE_CHARS = 500


class EngineStopped(RuntimeError):
    """The engine loop is not running (shut down, or its thread died): nothing can be served."""


class InternalError(RuntimeError):
    """A request failed on a server-side fault; the traceback is in the log, not the answer."""


@dataclasses.dataclass(eq=False)
class Submission:
    """One request on its way through the engine, as its HTTP handler sees it. The engine
    thread calls put(); the handler (on `loop`) awaits admitted() once, then next()."""

    request_id: str
    prompt: Any                      # EncodedPrompt, str or list[int]
    params: Any                      # SamplingParams
    loop: asyncio.AbstractEventLoop  # the handler's event loop
    lora: Optional[str] = None       # the LoRA adapter it runs under (None: the base model)
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    # Engine-thread bookkeeping.
    first_time: Optional[float] = None
    last_time: Optional[float] = None
    tokens_seen: int = 0
    last_output: Any = None          # the latest RequestOutput (for an abort's partial answer)
    # What was delivered so far (event-loop thread only).
    added: bool = False
    error: Optional[BaseException] = None
    output: Any = None               # the newest RequestOutput (None: aborted before any)
    fresh: bool = False              # `output` arrived since next() last returned it
    news: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def put(self, kind: str, value: Any = None) -> None:
        """From the engine thread: hands an event to the handler's loop."""
        try:
            self.loop.call_soon_threadsafe(self._deliver, kind, value)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _deliver(self, kind: str, value: Any) -> None:
        if kind == ERROR:
            self.error = self.error or value   # the first error stands, and wins over outputs
        elif kind == ADDED:
            self.added = True
        elif self.error is None:
            self.output, self.fresh = value, True
        self.news.set()

    async def admitted(self) -> Optional[BaseException]:
        """Waits until the engine took the request (None) or refused it (the exception)."""
        while not self.added and self.error is None:
            self.news.clear()
            await self.news.wait()
        return self.error

    async def next(self) -> tuple[str, Any]:
        """Waits for news: (ERROR, exception) once the request failed, else (OUTPUT, the newest
        output), each output at most once (older ones it replaced are skipped)."""
        while self.error is None and not self.fresh:
            self.news.clear()
            await self.news.wait()
        if self.error is not None:
            return ERROR, self.error
        self.fresh = False
        return OUTPUT, self.output


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
        self._lock = threading.Lock()    # guards _pending and _closed
        self._closed = False             # the thread is ending or gone: commands are refused
        self.failure: Optional[str] = None   # why the thread died (None: it did not)

    # ---- called from any thread --------------------------------------------------------------

    def start(self) -> "EngineLoop":
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: Optional[float] = None) -> None:
        """Stops the thread; requests still in the engine are aborted (finish_reason
        "abort"), those not yet in it fail with EngineStopped."""
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the loop takes requests (started, not stopped, not dead)."""
        return self._thread is not None and self._thread.is_alive() and not self._closed

    def stopped_error(self) -> EngineStopped:
        """The error a request gets when the loop no longer runs."""
        if self.failure is None:
            return EngineStopped("the server is shutting down")
        return EngineStopped("the engine stopped after an internal failure (GET /health says "
                             "why); the server must be restarted")

    @property
    def pending_adds(self) -> int:
        return self._pending

    def _count_pending(self, delta: int) -> None:
        with self._lock:
            self._pending += delta

    def _enqueue(self, command: tuple) -> bool:
        """Queues a command unless the loop is closed (then nobody would ever take it)."""
        with self._lock:
            if self._closed:
                return False
            if command[0] == "add":
                self._pending += 1
            self._commands.put(command)
            return True

    def submit(self, sub: Submission) -> None:
        if not self._enqueue(("add", sub)):
            sub.put(ERROR, self.stopped_error())

    def abort(self, request_id: str) -> None:
        self._enqueue(("abort", request_id))

    def abort_all_at(self, deadline: float) -> None:
        """From `deadline` (time.perf_counter()) on, every request still in the engine is
        aborted (a graceful shutdown's deadline)."""
        self._abort_at = deadline
        self._commands.put(("wake", None))

    def call(self, fn: Callable[[Any], Any], between_steps: bool = False
             ) -> concurrent.futures.Future:
        """Runs fn(llm) on the engine thread once the requests before it have finished (for
        tests and tools that need the engine to themselves), or with between_steps at the next
        pause between two steps, requests still running (adapter loads)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self._enqueue(("now" if between_steps else "call", (fn, fut))):
            fut.set_exception(self.stopped_error())
        return fut

    # ---- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - recorded, and every request is answered
            text = f"{type(e).__name__}: {e}"
            self.failure = f"the engine thread stopped: {text[:_MAX_FAILURE_CHARS]}"
            log.critical("%s; failing every request and refusing new ones", self.failure,
                         exc_info=True)
        finally:
            with self._lock:
                self._closed = True
            self._close()

    def _serve(self) -> None:
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

    def _close(self) -> None:
        """Answers every request still held: "abort" at a shutdown, EngineStopped after a
        failure; queued commands fail with EngineStopped."""
        error = self.stopped_error()
        if self.failure is None:
            for rid in list(self._subs):
                self._abort(rid)
        self._fail_all(lambda rid: error)
        self._fail_pending(error)
        try:
            self._snapshot()
        except Exception:  # noqa: BLE001 - a broken engine's stats: keep the last snapshot
            log.debug("no stats snapshot from a stopped engine", exc_info=True)

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
        elif kind in ("call", "now"):
            fn, fut = value
            if not fut.set_running_or_notify_cancel():
                return
            try:
                while kind == "call" and self.llm.has_unfinished_requests():
                    self._step()
                fut.set_result(fn(self.llm))
            except BaseException as e:  # handed to the caller
                fut.set_exception(e)

    def _add(self, sub: Submission) -> None:
        self._count_pending(-1)
        try:
            self.llm.add_request(sub.prompt, sub.params, sub.request_id, lora=sub.lora)
        except ValueError as e:  # what only the model knows: prompt length, token ids
            sub.put(ERROR, e)
            return
        except Exception:  # noqa: BLE001 - a fault of this request's, not the others'
            log.exception("request %s: adding it to the engine failed", sub.request_id)
            try:
                self.llm.abort(sub.request_id)  # whatever part of it got in
            except Exception:  # noqa: BLE001
                log.exception("request %s: aborting it failed too", sub.request_id)
            sub.put(ERROR, InternalError(sub.request_id))
            return
        except BaseException:
            sub.put(ERROR, EngineStopped("the engine stopped while adding this request"))
            raise
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
        except Exception:  # an engine failure: fail every request rather than hang them
            log.exception("engine step failed; failing its %d requests", len(self._subs))
            self._fail_all(InternalError)
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

    def _fail_all(self, error: Callable[[str], BaseException]) -> None:
        """Fails every request in the engine with error(request_id)."""
        for rid, sub in list(self._subs.items()):
            del self._subs[rid]
            try:  # leaves the LLM clean where it still can be
                self.llm.abort(rid)
            except Exception:  # noqa: BLE001 - the engine is already broken
                pass
            sub.put(ERROR, error(rid))

    def _fail_pending(self, error: Exception) -> None:
        while True:
            try:
                kind, value = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._count_pending(-1)
                value.put(ERROR, error)
            elif kind == "call" and value[1].set_running_or_notify_cancel():
                value[1].set_exception(error)

    def _snapshot(self) -> None:
        self.stats = self.llm.stats()
        if self.metrics is not None:
            self.metrics.on_stats(self.stats, self.pending_adds)
