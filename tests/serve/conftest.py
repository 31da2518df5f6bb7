"""Fixtures for the server's tests: one small LLM and a live server on a free loopback port,
driven by the official openai client and by raw HTTP (http.client) where the client cannot say
what a test needs (malformed bodies, chunked uploads, disconnecting mid-stream)."""

from __future__ import annotations

import http.client
import json
import time

import pytest

MODEL = "smollm2-135m"
JSON = {"Content-Type": "application/json"}
SMALL = dict(max_seq_len=256, max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk=64)


@pytest.fixture(scope="module")
def llm():
    from jaxinfer.llm import LLM

    llm = LLM(MODEL, **SMALL)
    llm.warmup()
    return llm


@pytest.fixture(scope="module")
def server(llm):
    from jaxinfer.serve import ServeConfig, ServerThread

    srv = ServerThread(llm, ServeConfig(MODEL, max_waiting=8)).start()
    yield srv
    srv.stop(timeout_s=60)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


class Raw:
    """Plain HTTP/1.1 to the server."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=120)

    def request(self, method: str, path: str, body=None, headers=None):
        """(status, headers, parsed JSON or text). A body goes as application/json unless
        `headers` are given (then exactly those are sent)."""
        c = self.conn()
        data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
        if headers is None:
            headers = JSON if body is not None else {}
        c.request(method, path, body=data, headers=headers)
        r = c.getresponse()
        raw = r.read().decode()
        c.close()
        try:
            payload = json.loads(raw)
        except json.JSONDecodeError:
            payload = raw
        return r.status, dict(r.getheaders()), payload

    def open_stream(self, path: str, body: dict):
        """Starts a streamed request; returns (connection, response) to read events from."""
        c = self.conn()
        c.request("POST", path, body=json.dumps(body), headers=JSON)
        return c, c.getresponse()


def read_event(response) -> str | None:
    """The next `data:` payload of a server-sent event stream (None at its end)."""
    while True:
        line = response.readline()
        if not line:
            return None
        line = line.decode().strip()
        if line.startswith("data: "):
            return line[len("data: "):]


@pytest.fixture(scope="module")
def raw(server) -> Raw:
    return Raw(server.url)


def wait_for(predicate, timeout_s: float, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    return predicate()


@pytest.fixture
def helpers():
    """Raw, read_event and wait_for, for the test modules."""
    return type("Helpers", (), {"Raw": Raw, "read_event": staticmethod(read_event),
                                "wait_for": staticmethod(wait_for)})
