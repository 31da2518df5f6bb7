"""Slow server tests: a bounded load test (200 concurrent streaming requests through the
official async client, loopback only, with a time limit) and the real launch script's SIGTERM
drain in a subprocess."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import openai
import pytest

MODEL = "smollm2-135m"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def load_server():
    from jaxinfer.llm import LLM
    from jaxinfer.serve import ServeConfig, ServerThread

    llm = LLM(MODEL, max_seq_len=256, max_num_seqs=8, max_num_batched_tokens=128,
              prefill_chunk=64)
    llm.warmup()
    srv = ServerThread(llm, ServeConfig(MODEL, max_waiting=64)).start()
    yield srv, llm
    srv.stop(timeout_s=60)


def _count(server, status: int) -> float:
    return server.state.metrics.requests.labels(endpoint="/v1/completions",
                                                status=str(status))._value.get()


def test_200_concurrent_streams(load_server):
    srv, llm = load_server
    n, max_tokens, limit_s = 200, 8, 600
    ok_before, busy_before = _count(srv, 200), _count(srv, 429)
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0,
                                timeout=limit_s)
    rejected, failures = [0], []

    async def one(i: int):
        for _ in range(100):  # bounded retries on 429, after Retry-After
            try:
                stream = await client.completions.create(
                    model=MODEL, prompt=f"Request {i}: count to ten.", max_tokens=max_tokens,
                    temperature=0.7, seed=i, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            except openai.RateLimitError as e:
                rejected[0] += 1
                await asyncio.sleep(float(e.response.headers["retry-after"]))
                continue
            finish, usage = None, None
            async for chunk in stream:
                usage = chunk.usage or usage
                for c in chunk.choices:
                    finish = c.finish_reason or finish
            return finish, usage.completion_tokens
        failures.append(i)

    async def run_all():
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), limit_s)
        finally:
            await client.close()

    t0 = time.monotonic()
    results = asyncio.run(run_all())
    wall = time.monotonic() - t0
    assert not failures
    assert results == [("length", max_tokens)] * n
    assert rejected[0] > 0, "the load should have met --max_waiting"
    assert _count(srv, 200) - ok_before == n
    assert _count(srv, 429) - busy_before == rejected[0]
    others = {k: v for k, v in _statuses(srv).items() if k not in ("200", "429")}
    assert not others, others
    stats = srv.state.engine.call(lambda l: l.stats()).result(timeout=60)
    assert (stats["running"], stats["waiting"], stats["pages_used"]) == (0, 0, 0)
    assert srv.state.outstanding == 0
    print(f"\n{n} streams in {wall:.1f} s, {rejected[0]} answered 429 first")


def _statuses(srv) -> dict:
    out = {}
    for metric in srv.state.metrics.requests.collect():
        for s in metric.samples:
            if s.name.endswith("_total") and s.value:
                out[s.labels["status"]] = out.get(s.labels["status"], 0) + s.value
    return out


def test_launch_script_drains_on_sigterm(helpers):
    from jaxinfer.serve import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "jaxinfer.launch.serve", "--model", MODEL,
           "--max_seq_len", "256", "--max_num_seqs", "4", "--max_num_batched_tokens", "64",
           "--prefill_chunk", "64", "--port", str(port), "--drain_timeout", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        raw = helpers.Raw(f"http://127.0.0.1:{port}")

        def health():
            try:
                return raw.request("GET", "/health")[0]
            except OSError:
                return None

        assert helpers.wait_for(lambda: health() == 503 or proc.poll() is not None, 60)
        assert helpers.wait_for(lambda: health() == 200 or proc.poll() is not None, 300, 0.5)
        assert health() == 200
        body = {"prompt": "Once upon a time", "max_tokens": 230, "temperature": 0,
                "ignore_eos": True, "stream": True}
        conn, resp = raw.open_stream("/v1/completions", body)
        assert helpers.read_event(resp)
        os.kill(proc.pid, signal.SIGTERM)
        events = []
        while (e := helpers.read_event(resp)) is not None:
            events.append(e)
        conn.close()
        assert events[-1] == "[DONE]" and '"finish_reason":"abort"' in events[-2]
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_launch_script_refuses_sampling_flags():
    out = subprocess.run([sys.executable, "-m", "jaxinfer.launch.serve", "--temperature", "0.5"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "per request" in out.stderr
