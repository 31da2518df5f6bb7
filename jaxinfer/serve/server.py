"""The app under uvicorn: in the foreground with a graceful SIGTERM drain (launch.serve), or on
a background thread (ServerThread). Connections are bounded in number and in the time a request
may take to arrive. docs/serving.md describes shutdown and the limits.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from typing import Callable, Optional

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxinfer.serve.app import ServeConfig, ServeState, create_app

log = logging.getLogger(__name__)
# Past the drain deadline, time for the aborted requests' last chunks before uvicorn cancels.
_CLOSE_GRACE_S = 5.0


class Server(uvicorn.Server):
    """uvicorn.Server whose exit signal first drains the engine."""

    def __init__(self, config: uvicorn.Config, state: ServeState, drain_timeout_s: float):
        super().__init__(config)
        self.state, self.drain_timeout_s = state, drain_timeout_s

    def handle_exit(self, sig, frame) -> None:
        self.begin_drain()
        super().handle_exit(sig, frame)

    def begin_drain(self) -> None:
        if self.state.draining:
            return
        log.warning("shutting down: no new requests; aborting those still running in %.0f s",
                    self.drain_timeout_s)
        self.state.draining = True
        if self.state.engine is not None:
            self.state.engine.abort_all_at(time.perf_counter() + self.drain_timeout_s)

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        self.state.close()


class ReadDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's arrival, which uvicorn lacks:
    headers not in within read_timeout_s close the connection (the body's deadline is the
    app's 408), and so does an unwanted body still arriving then."""

    serve_state: ServeState  # set on the per-server subclass (make_server)

    def connection_made(self, transport) -> None:
        self._read_deadline = None
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        if self._read_deadline is None:
            self._read_deadline = self.loop.call_later(
                self.serve_state.cfg.read_timeout_s, self._deadline_passed)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is not h11.DONE:  # a request is arriving
            self._arm()
        super().data_received(data)
        if self.conn.their_state is h11.DONE:      # all of it came
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _deadline_passed(self) -> None:
        self._read_deadline = None
        state = self.conn.their_state
        if state is h11.DONE or self.transport.is_closing():
            return
        if state is h11.SEND_BODY and self.cycle is not None \
                and not self.cycle.response_complete:
            self._arm()  # the app reads this body under its own deadline (408)
            return
        self.transport.close()


def make_server(state: ServeState, host: str = "127.0.0.1", port: int = 8000,
                drain_timeout_s: float = 30.0, log_level: str = "warning",
                max_num_seqs: int = 16) -> Server:
    """The uvicorn server for `state`; `max_num_seqs` (the LLM's, which may not be loaded
    yet) sizes the default connection limit."""
    protocol = type("ServeH11", (ReadDeadlineH11,), {"serve_state": state})
    # uvicorn counts the connection a request arrives on among those at the limit.
    limit = state.cfg.connection_limit(max_num_seqs) + 1
    config = uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=drain_timeout_s + _CLOSE_GRACE_S,
                            timeout_keep_alive=state.cfg.keep_alive_s,
                            limit_concurrency=limit, access_log=False, lifespan="off",
                            http=protocol)
    return Server(config, state, drain_timeout_s)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """The server on a daemon thread, for in-process use (`with ServerThread(llm, cfg) as srv`,
    then srv.url). The engine loop owns `llm` meanwhile: call it through srv.state.engine.call."""

    def __init__(self, llm, cfg: ServeConfig, host: str = "127.0.0.1",
                 port: Optional[int] = None, drain_timeout_s: float = 30.0):
        self.state = ServeState(cfg)
        self.server = make_server(self.state, host, port or free_port(host), drain_timeout_s,
                                  max_num_seqs=llm.max_num_seqs if llm is not None else 16)
        self.url = f"http://{host}:{self.server.config.port}"
        self.llm = llm
        self._thread: Optional[threading.Thread] = None

    def start(self, timeout_s: float = 30.0) -> "ServerThread":
        if self.llm is not None:
            self.state.attach(self.llm)
        self._thread = threading.Thread(target=self.server.run, name="jaxinfer-http",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: Optional[float] = None) -> None:
        """A graceful shutdown, as on SIGTERM; returns when the server has exited."""
        self.server.begin_drain()
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.state.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(load: Callable[[], object], cfg: ServeConfig, host: str, port: int,
                  drain_timeout_s: float, max_num_seqs: int = 16) -> int:
    """Listens at once (/health 503 until `load()` returns on a thread), serves until a signal,
    drains; returns the exit code (1 when the model failed to load)."""
    state = ServeState(cfg)
    server = make_server(state, host, port, drain_timeout_s, log_level="info",
                         max_num_seqs=max_num_seqs)

    def loader():
        try:
            llm = load()
        except BaseException as e:  # noqa: BLE001 - reported, and the server stops
            log.error("the model failed to load: %s", e)
            state.failed = str(e) or type(e).__name__
            server.should_exit = True
            return
        if server.should_exit:
            return
        state.attach(llm)
        log.warning("ready: serving %s on http://%s:%d", cfg.model_name, host, port)

    # uvicorn re-raises the signal it caught once it has shut down, under the handler that was
    # there before it: make that a no-op so that a drained server exits with its own code.
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
    threading.Thread(target=loader, name="jaxinfer-load", daemon=True).start()
    server.run()
    state.close()
    return 1 if state.failed is not None else 0
