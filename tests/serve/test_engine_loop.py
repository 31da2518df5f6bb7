"""The engine loop and its Submission hand-over, over a scripted stand-in for the LLM (no model:
fast and exact about which request fails where): a slow reader holds one output however many
arrive, an error wins over outputs, a request whose admission raises fails alone, and a dead
engine thread answers every waiting, running and later request instead of leaving them
hanging."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import threading
import time
import weakref
from typing import Optional

import pytest

from jaxinfer.serve.engine_loop import (ADDED, ERROR, OUTPUT, EngineLoop, EngineStopped,
                                        InternalError, Submission)


@dataclasses.dataclass
class Output:
    """The fields of a RequestOutput the loop reads."""

    request_id: str
    token_ids: list
    finish_reason: Optional[str] = None
    outputs: list = dataclasses.field(default_factory=list)
    prompt_token_ids: list = dataclasses.field(default_factory=lambda: [1])

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class ScriptedLLM:
    """Requests finish after `length` steps. Prompt "bad" is refused (ValueError), "bug" makes
    add_request raise TypeError; `step_hook` runs at the start of every step."""

    def __init__(self, length: int = 3):
        self.length, self.requests, self.step_hook, self.stats_hook = length, {}, None, None

    def stats(self) -> dict:
        if self.stats_hook is not None:
            self.stats_hook()
        return {"running": len(self.requests), "waiting": 0}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, prompt, params, request_id, lora=None):
        if prompt == "bad":
            raise ValueError("prompt is bad")
        if prompt == "bug":
            raise TypeError("secret detail")
        self.requests[request_id] = 0

    def step(self) -> list:
        if self.step_hook is not None:
            self.step_hook()
        outs = []
        for rid in list(self.requests):
            n = self.requests[rid] = self.requests[rid] + 1
            done = n >= self.length
            outs.append(Output(rid, list(range(n)), "length" if done else None))
            if done:
                del self.requests[rid]
        return outs

    def abort(self, request_id):
        self.requests.pop(request_id, None)


async def _collect(sub: Submission, timeout_s: float = 10.0):
    """Admission, then outputs to the finished one: (error or None, last output)."""
    error = await asyncio.wait_for(sub.admitted(), timeout_s)
    if error is not None:
        return error, None
    while True:
        kind, out = await asyncio.wait_for(sub.next(), timeout_s)
        if kind == ERROR:
            return out, None
        if out is None or out.finished:
            return None, out


def _sub(rid: str, prompt="ok") -> Submission:
    return Submission(rid, prompt, None, asyncio.get_running_loop())


class Payload:
    """An output whose lifetime can be watched (weakref)."""


def test_a_slow_reader_holds_only_the_newest_output():
    async def main():
        sub = _sub("r")
        refs = []

        def engine():  # 10,000 cumulative outputs while the reader is busy elsewhere
            for _ in range(10_000):
                p = Payload()
                refs.append(weakref.ref(p))
                sub.put(OUTPUT, p)

        t = threading.Thread(target=engine)
        t.start()
        t.join()
        await asyncio.sleep(0)            # the deliveries run
        kind, out = await sub.next()
        gc.collect()
        alive = [r for r in refs if r() is not None]
        assert kind == OUTPUT and out is refs[-1]()
        assert len(alive) == 1            # every older output is gone
        with pytest.raises(asyncio.TimeoutError):  # taken once: nothing new
            await asyncio.wait_for(sub.next(), 0.05)

    asyncio.run(main())


def test_an_error_wins_over_outputs_and_admission_reports_it():
    async def main():
        sub = _sub("r")
        sub.put(ADDED)
        assert await sub.admitted() is None
        sub.put(OUTPUT, "first")
        sub.put(ERROR, InternalError("r"))
        sub.put(OUTPUT, "after")
        await asyncio.sleep(0)
        kind, value = await sub.next()
        assert kind == ERROR and isinstance(value, InternalError)
        refused = _sub("s")
        refused.put(ERROR, ValueError("no"))
        assert isinstance(await refused.admitted(), ValueError)

    asyncio.run(main())


def test_admission_faults_fail_their_request_only(caplog):
    async def main():
        loop = EngineLoop(ScriptedLLM(), idle_wait_s=0.01).start()
        try:
            subs = [_sub("bug", "bug"), _sub("bad", "bad"), _sub("ok")]
            for s in subs:
                loop.submit(s)
            (bug, _), (bad, _), (ok, out) = [await _collect(s) for s in subs]
        finally:
            loop.stop()
        assert isinstance(bug, InternalError) and "secret" not in str(bug)
        assert isinstance(bad, ValueError) and "bad" in str(bad)
        assert ok is None and out.finish_reason == "length"
        assert loop.failure is None

    asyncio.run(main())
    assert "secret detail" in caplog.text and "Traceback" in caplog.text


# A step's own Exception fails the step's requests and the loop goes on (test_serve_errors);
# these escape the loop: BaseExceptions from a step, any exception from the loop's bookkeeping.
@pytest.mark.parametrize("where,exc", [("step", KeyboardInterrupt), ("step", SystemExit),
                                       ("stats", RuntimeError)])
def test_a_dead_engine_thread_answers_every_request(where, exc):
    llm = ScriptedLLM(length=10 ** 9)  # the running request never ends on its own
    armed, entered, release = threading.Event(), threading.Event(), threading.Event()

    def dying_step():
        if not armed.is_set():  # the request runs until the test arms the failure
            time.sleep(0.001)
            return
        entered.set()
        release.wait(10)
        raise exc("injected")

    setattr(llm, f"{where}_hook", dying_step)

    async def main():
        loop = EngineLoop(llm, idle_wait_s=0.01).start()
        running = _sub("running")
        loop.submit(running)
        assert await asyncio.wait_for(running.admitted(), 10) is None
        armed.set()
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        waiting = _sub("waiting")
        loop.submit(waiting)      # queued behind the step that is about to die
        release.set()
        results = await asyncio.wait_for(asyncio.gather(_collect(running), _collect(waiting)),
                                         10)
        loop.stop(timeout=10)
        later = _sub("later")
        loop.submit(later)        # after death: answered at once, never queued
        late = await asyncio.wait_for(later.admitted(), 1)
        return loop, results, late

    loop, results, late = asyncio.run(main())
    assert all(isinstance(e, EngineStopped) for e, _ in results), results
    assert isinstance(late, EngineStopped) and "restarted" in str(late)
    assert not loop.alive and loop.failure.startswith("the engine thread stopped")
    assert exc.__name__ in loop.failure and "injected" in loop.failure
    assert llm.requests == {}     # what it could, it aborted
    with pytest.raises(EngineStopped):
        loop.call(lambda llm: 1).result(timeout=1)


def test_a_stopped_loop_refuses_instead_of_queueing():
    async def main():
        loop = EngineLoop(ScriptedLLM(), idle_wait_s=0.01).start()
        loop.stop(timeout=10)
        sub = _sub("r")
        loop.submit(sub)
        return loop, await asyncio.wait_for(sub.admitted(), 1)

    loop, error = asyncio.run(main())
    assert isinstance(error, EngineStopped) and "shutting down" in str(error)
    assert loop.failure is None and not loop.alive and loop.pending_adds == 0
