"""The server's bounds on a live loopback server: a client that stops reading costs no memory
while others are served; a long stop string keeps /health prompt; a fault in one request is a
500 `internal_error` for it alone (the traceback in the log, not in the answer); a stalled
sender is cut off (408 for a body, a closed connection for headers) while idle keep-alive
connections live on; connections past the limit get 503; and an engine thread that dies makes
every waiting and later request a 503 and /health say why."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time

import pytest

from jaxinfer.serve import ServeConfig, ServerThread

MODEL = "smollm2-135m"
C = "/v1/completions"
STORY = {"prompt": "Once upon a time", "temperature": 0, "ignore_eos": True}


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _post(url_host, url_port, body: dict, read: bool = True, rcvbuf: int = 0):
    """A raw streaming-capable POST on a socket of our own; returns the socket."""
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(30)
    s.connect((url_host, url_port))
    data = json.dumps(body).encode()
    s.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (C.encode(), len(data), data))
    return s


def _read_all(s: socket.socket, timeout_s: float = 30) -> bytes:
    s.settimeout(timeout_s)
    out = bytearray()
    while not out.endswith(b"\r\n0\r\n\r\n") and (chunk := s.recv(1 << 16)):  # the last chunk
        out += chunk
    return bytes(out)


def test_a_stalled_reader_costs_no_memory(server, raw, client):
    """A stream nobody reads for 8 s (its socket's receive buffer small): the server keeps
    generating into one slot, so its memory stays flat, and another client is served."""
    rss0 = _rss_bytes()
    stalled = _post(raw.host, raw.port, dict(STORY, max_tokens=240, stream=True), rcvbuf=4096)
    t0 = time.monotonic()
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason == "length" and time.monotonic() - t0 < 8
    time.sleep(max(0.0, 8 - (time.monotonic() - t0)))
    grown = _rss_bytes() - rss0
    print(f"\nRSS growth over an 8 s stalled stream: {grown / 2**20:.1f} MiB (bound 50)")
    assert grown < 50 << 20, f"the server grew by {grown >> 20} MiB"
    text = _read_all(stalled).decode()
    stalled.close()
    assert text.startswith("HTTP/1.1 200") and '"finish_reason":"length"' in text
    assert text.endswith("data: [DONE]\n\n\r\n0\r\n\r\n")


def test_a_long_stop_string_keeps_health_prompt(server, raw, client, helpers):
    """A 1,024-byte repetitive stop string that the text keeps half-matching: the stream is
    held back and released correctly (equal to the same request unstreamed) and /health,
    polled alongside, answers within 1 s each time."""
    stop = ("a " * 512)[:1023] + "b"
    body = {"prompt": "a " * 30, "max_tokens": 64, "temperature": 0, "ignore_eos": True,
            "stop": [stop]}
    expected = raw.request("POST", C, body)[2]["choices"][0]["text"]
    slowest, done = [0.0], threading.Event()

    def poll():
        for _ in range(10_000):
            if done.is_set():
                return
            t0 = time.monotonic()
            assert raw.request("GET", "/health")[0] == 200
            slowest[0] = max(slowest[0], time.monotonic() - t0)
            time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        conn, resp = raw.open_stream(C, dict(body, stream=True))
        text = ""
        while (e := helpers.read_event(resp)) not in (None, "[DONE]"):
            text += json.loads(e)["choices"][0]["text"]
        conn.close()
    finally:
        done.set()
        poller.join(30)
    assert text == expected
    assert slowest[0] < 1.0, f"/health took {slowest[0]:.2f} s"


def test_a_fault_in_one_request_is_a_500_for_it_alone(server, raw, llm, monkeypatch, caplog):
    real_add, real_encode = llm.add_request, llm.encode_prompt
    faults = {"add": 1, "encode": 1}

    def add_request(prompt, params, request_id, lora=None):
        if faults["add"]:
            faults["add"] -= 1
            raise TypeError("secret add detail")
        return real_add(prompt, params, request_id, lora=lora)

    def encode_prompt(prompt):
        if prompt == "boom" and faults["encode"]:
            faults["encode"] -= 1
            raise TypeError("secret encode detail")
        return real_encode(prompt)

    monkeypatch.setattr(llm, "add_request", add_request)     # on the engine thread
    monkeypatch.setattr(llm, "encode_prompt", encode_prompt)  # on the encoder pool
    ok = {"prompt": "Hello", "max_tokens": 2}
    for body in (ok, dict(ok, prompt="boom")):
        status, _, reply = raw.request("POST", C, body)
        assert status == 500 and reply["error"]["code"] == "internal_error", reply
        assert "secret" not in json.dumps(reply) and "Traceback" not in json.dumps(reply)
        assert raw.request("POST", C, ok)[0] == 200           # the next one is served
    assert "secret add detail" in caplog.text and "secret encode detail" in caplog.text
    assert caplog.text.count("Traceback") >= 2
    assert server.state.outstanding == 0 and raw.request("GET", "/health")[0] == 200


def test_a_request_finishing_error_is_a_500_or_an_error_event(server, raw, llm, helpers,
                                                              monkeypatch):
    """finish_reason "error" (the engine's bookkeeping of that request raised)."""
    real_step, armed = llm.step, [0]

    def step():
        outs = real_step()
        if armed[0] and outs:
            armed[0] = 0
            o = outs[0]
            seqs = [dataclasses.replace(c, finish_reason="error") for c in o.outputs]
            outs[0] = dataclasses.replace(o, finish_reason="error", outputs=seqs)
        return outs

    monkeypatch.setattr(llm, "step", step)
    body = {"prompt": "Hello", "max_tokens": 4}
    armed[0] = 1
    status, _, reply = raw.request("POST", C, body)
    assert status == 500 and reply["error"]["code"] == "internal_error"
    # That request runs on in the engine (only its output was changed): let it end first.
    server.state.engine.call(lambda llm: None).result(timeout=60)
    armed[0] = 1
    conn, resp = raw.open_stream(C, dict(body, stream=True))
    events = []
    while (e := helpers.read_event(resp)) is not None:
        events.append(e)
    conn.close()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "internal_error"
    assert raw.request("POST", C, body)[0] == 200


def test_stalled_senders_are_cut_off_and_idle_connections_kept(server, raw):
    server.state.cfg.read_timeout_s = 1.0
    try:
        # A body that stops arriving: 408, then the connection closes.
        s = socket.create_connection((raw.host, raw.port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        t0 = time.monotonic()
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply, reply
        assert time.monotonic() - t0 < 5
        s.close()
        # Headers that never end, one byte every 0.3 s: closed at the deadline.
        s = socket.create_connection((raw.host, raw.port), timeout=10)
        t0 = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
        with pytest.raises((ConnectionError, BrokenPipeError)):
            for _ in range(30):
                s.sendall(b"X")
                time.sleep(0.3)
                s.setblocking(False)
                try:
                    if s.recv(1) == b"":
                        raise ConnectionError("closed")
                except BlockingIOError:
                    pass
                finally:
                    s.setblocking(True)
        assert time.monotonic() - t0 < 5
        s.close()
        # A connection that sends nothing is closed too.
        s = socket.create_connection((raw.host, raw.port), timeout=10)
        assert s.recv(1) == b""
        s.close()
        # An idle keep-alive connection is not a stalled request: it outlives the deadline.
        c = raw.conn()
        c.request("GET", "/health")
        c.getresponse().read()
        time.sleep(2.0)
        c.request("GET", "/health")
        assert c.getresponse().status == 200
        c.close()
    finally:
        server.state.cfg.read_timeout_s = 30.0


def test_connections_past_the_limit_get_503(helpers):
    with ServerThread(None, ServeConfig(MODEL, max_connections=2)) as srv:
        r = helpers.Raw(srv.url)
        idle = [socket.create_connection((r.host, r.port), timeout=10) for _ in range(2)]
        try:
            status, headers, body = r.request("GET", "/health")
            assert (status, body) == (503, "Service Unavailable")   # uvicorn's own answer
            idle.pop().close()
            assert helpers.wait_for(lambda: r.request("GET", "/health")[2] == {
                "status": "loading"}, 10)                            # the app's again
        finally:
            for s in idle:
                s.close()


def test_a_dead_engine_thread_is_a_503_and_health_says_why(server, llm, helpers,
                                                            monkeypatch):
    """Last in the module: stops the module's server and serves `llm` again from a server
    whose engine thread then dies (a KeyboardInterrupt out of a step, which the loop's
    per-step handler does not catch)."""
    server.stop(timeout_s=60)
    entered, release = threading.Event(), threading.Event()

    def dying_step():
        entered.set()
        release.wait(30)
        raise KeyboardInterrupt("injected")

    with ServerThread(llm, ServeConfig(MODEL, max_waiting=8)) as srv:
        raw = helpers.Raw(srv.url)
        monkeypatch.setattr(llm, "step", dying_step)
        results = {}

        def send(name, body):
            results[name] = raw.request("POST", C, body)

        body = {"prompt": "Hello", "max_tokens": 4}
        threads = [threading.Thread(target=send, args=("running", body))]
        threads[0].start()
        assert entered.wait(30)
        for name, b in (("waiting", body), ("waiting-stream", dict(body, stream=True))):
            threads.append(threading.Thread(target=send, args=(name, b)))
            threads[-1].start()
        assert helpers.wait_for(lambda: srv.state.engine.pending_adds == 2, 30)
        release.set()
        for t in threads:
            t.join(30)
        assert {k: v[0] for k, v in results.items()} == {
            "running": 503, "waiting": 503, "waiting-stream": 503}, results
        t0 = time.monotonic()
        status, _, reply = raw.request("POST", C, body)
        assert status == 503 and reply["error"]["code"] == "engine_stopped"
        assert time.monotonic() - t0 < 1
        status, _, health = raw.request("GET", "/health")
        assert status == 503 and health["status"] == "failed"
        assert "KeyboardInterrupt" in health["reason"] and "injected" in health["reason"]
