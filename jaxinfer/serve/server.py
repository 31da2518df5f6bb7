"""Running the app under uvicorn: in the foreground with graceful SIGTERM handling
(launch.serve), or on a background thread (tests, benchmarks, notebooks).

Shutdown (SIGTERM or SIGINT, or `stop()`): /health turns 503 and new requests are refused
(503), uvicorn stops accepting connections, requests already admitted run to their end until
`drain_timeout_s`; then every request still in the engine is aborted (streams end with
finish_reason "abort" and `data: [DONE]`), the engine loop stops and the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from typing import Callable, Optional

import uvicorn

from jaxinfer.serve.app import ServeConfig, ServeState, create_app

log = logging.getLogger(__name__)
# Past the drain deadline uvicorn waits this much longer for connections to close (the
# aborted requests' last chunks) before it cancels what is left.
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


def make_server(state: ServeState, host: str = "127.0.0.1", port: int = 8000,
                drain_timeout_s: float = 30.0, log_level: str = "warning") -> Server:
    config = uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=drain_timeout_s + _CLOSE_GRACE_S,
                            timeout_keep_alive=state.cfg.keep_alive_s,
                            access_log=False, lifespan="off", http="h11")
    return Server(config, state, drain_timeout_s)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """The server on a daemon thread, for in-process use:

        with ServerThread(llm, ServeConfig("smollm2-135m")) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="-")

    `llm` is taken over by the engine loop while the server runs: call it only through
    `srv.state.engine.call(fn)`."""

    def __init__(self, llm, cfg: ServeConfig, host: str = "127.0.0.1",
                 port: Optional[int] = None, drain_timeout_s: float = 30.0):
        self.state = ServeState(cfg)
        self.server = make_server(self.state, host, port or free_port(host), drain_timeout_s)
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
                  drain_timeout_s: float) -> int:
    """Listens at once (/health 503), loads the model with `load()` on a thread (ready when it
    returns), serves until a signal, drains, returns the exit code (0, or 1 when the model
    failed to load)."""
    state = ServeState(cfg)
    server = make_server(state, host, port, drain_timeout_s, log_level="info")

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
