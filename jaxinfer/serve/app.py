"""The FastAPI app: OpenAI-compatible endpoints over one EngineLoop.

Request bodies are checked and responses built by jaxinfer.openai_api (the contract in
docs/openai_api.md); this module adds HTTP: body size (413), the API key (401), the model name,
backpressure (429), readiness and draining (503), and the metrics endpoint. docs/serving.md is
the user-facing contract.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxinfer import openai_api as oa
from jaxinfer.serve.engine_loop import ERROR, OUTPUT, EngineLoop, Submission
from jaxinfer.serve.metrics import CONTENT_TYPE, ServerMetrics
from jaxinfer.serve.streaming import Deltas, SequenceView, SSEResponse, sse

MODELS = "/v1/models"
COUNTED = (oa.COMPLETIONS, oa.CHAT, MODELS)


@dataclasses.dataclass
class ServeConfig:
    model_name: str                  # the `model` clients name (and /v1/models lists)
    api_key: Optional[str] = None    # when set, /v1/* needs `Authorization: Bearer <key>`
    max_waiting: int = 256           # requests beyond the batch slots; more -> 429
    max_body_bytes: int = 1 << 20    # larger request bodies -> 413
    retry_after_s: int = 1           # the Retry-After of a 429
    # Seconds an idle keep-alive connection stays open. Longer than clients keep idle pooled
    # connections (httpx, and so the openai client: 5 s; aiohttp: 15 s; nginx upstream pools:
    # 60 s), so that a client never reuses a socket the server is closing at that moment
    # (uvicorn's own default, 5 s, equals httpx's and races it under load).
    keep_alive_s: float = 75.0

    def __post_init__(self):
        if not self.keep_alive_s > 0:
            raise ValueError(f"keep_alive_s must be > 0, got {self.keep_alive_s}")


class ServeState:
    """What the app serves: the LLM and its engine loop once loaded, readiness and draining."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.metrics = ServerMetrics()
        self.llm = None
        self.engine: Optional[EngineLoop] = None
        self.ready = False      # loaded and warmed: /health 200 and requests admitted
        self.draining = False   # shutting down: no new requests
        self.failed: Optional[str] = None
        self.outstanding = 0    # requests admitted and not yet answered (event-loop thread)
        self.created = int(time.time())

    def attach(self, llm) -> None:
        """Serves `llm` (loaded, and warmed if it is to be): starts the engine loop and marks
        the server ready."""
        self.llm = llm
        self.engine = EngineLoop(llm, self.metrics).start()
        self.ready = True

    def close(self) -> None:
        self.ready = False
        if self.engine is not None:
            self.engine.stop()


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.headers = status, headers
        self.body = oa.error_body(message, type, param, code)


def _error_response(e) -> JSONResponse:
    if isinstance(e, oa.RequestError):
        return JSONResponse(e.body(), status_code=e.status)
    return JSONResponse(e.body, status_code=e.status, headers=e.headers)


async def _read_json(request: Request, limit: int):
    """The body as JSON: 413 past `limit` bytes (declared or streamed), 400 if not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body has {declared} bytes; the limit is {limit}",
                       "invalid_request_error", code="request_too_large")
    data = bytearray()
    async for part in request.stream():
        data += part
        if len(data) > limit:
            raise ApiError(413, f"the request body exceeds the limit of {limit} bytes",
                           "invalid_request_error", code="request_too_large")
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise oa.RequestError(f"the request body is not valid JSON: {e}") from None


def _available(state: ServeState) -> None:
    if state.draining:
        raise ApiError(503, "the server is shutting down", "service_unavailable",
                       headers={"Retry-After": str(state.cfg.retry_after_s)})
    if not state.ready:
        raise ApiError(503, "the model is still loading" if state.failed is None else
                       f"the model failed to load: {state.failed}", "service_unavailable",
                       headers={"Retry-After": str(state.cfg.retry_after_s)})


async def _generate(state: ServeState, request: Request, endpoint: str):
    _available(state)
    body = await _read_json(request, state.cfg.max_body_bytes)
    req = oa.parse_request(endpoint, body, max_n=state.llm.max_n)
    name = state.cfg.model_name
    if req.model is not None and req.model != name:
        raise oa.RequestError(f"model {req.model!r} is not served here; this server serves "
                              f"{name!r}", "model", code="model_not_found")
    llm, chat = state.llm, endpoint == oa.CHAT
    prompt = _chat_prompt(llm, req.messages) if chat else req.prompt
    limit = llm.max_num_seqs + state.cfg.max_waiting
    if state.outstanding >= limit:
        raise ApiError(429, f"too many requests: {state.outstanding} are running or queued; "
                       f"the limit is {llm.max_num_seqs} running + {state.cfg.max_waiting} "
                       "queued (--max_waiting)", "rate_limit_exceeded",
                       headers={"Retry-After": str(state.cfg.retry_after_s)})
    rid, created = oa.new_id(endpoint), int(time.time())
    sub = Submission(rid, prompt, req.sampling(llm.max_seq_len), asyncio.get_running_loop(),
                     asyncio.Queue())
    state.outstanding += 1
    done = []

    def close(finished: bool) -> None:  # once per request, whatever ends it
        if not done:
            done.append(True)
            state.outstanding -= 1
            if not finished:
                state.engine.abort(rid)

    try:
        state.engine.submit(sub)
        kind, value = await sub.events.get()
        if kind == ERROR:
            close(True)
            if isinstance(value, ValueError):  # the engine's own check (prompt length, ids)
                raise oa.RequestError(str(value), "messages" if chat else "prompt")
            raise ApiError(503, f"the request could not be served: {value}",
                           "service_unavailable")
        deltas = [Deltas(req, llm.tokenizer, response_id=rid, created=created, model=name,
                         index=i) for i in range(req.n)]
        if req.stream:
            return SSEResponse(_stream(sub, deltas), close)
        kind, out = await _final(sub, request)
        close(kind != ERROR and out is not None and out.finish_reason != "abort")
    except BaseException:
        close(False)
        raise
    if kind == ERROR:
        raise ApiError(500, f"the engine failed: {out}", "server_error")
    if out is None or out.finish_reason == "abort":
        raise ApiError(503, "the request was aborted (the server is shutting down)",
                       "service_unavailable")
    return JSONResponse(oa.response_body(req, llm.tokenizer, [out], model=name,
                                         response_id=rid, created=created))


def _latest(sub: Submission, first):
    """The newest of the queued events (outputs are cumulative, so older ones add nothing);
    an error wins."""
    kind, value = first
    while kind != ERROR and not sub.events.empty():
        kind, value = sub.events.get_nowait()
    return kind, value


async def _final(sub: Submission, request: Request):
    """Waits for the finished output: (OUTPUT, output), (OUTPUT, None) if the client
    disconnected (its request is then aborted by the caller) or (ERROR, exception)."""
    while True:
        try:
            kind, out = _latest(sub, await asyncio.wait_for(sub.events.get(), timeout=1.0))
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                return OUTPUT, None
            continue
        if kind == ERROR or out is None or out.finished:
            return kind, out


def _chat_prompt(llm, messages) -> str:
    if llm.tokenizer is None:
        raise oa.RequestError("this model has no tokenizer, so it cannot chat", "messages")
    try:
        return llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:  # the template's own checks (roles, order)
        raise oa.RequestError(f"messages: the model's chat template refused them: {e}",
                              "messages") from None


async def _stream(sub: Submission, deltas: list):
    """The stream of one request: a Deltas per sequence (choice index)."""
    for d in deltas:
        for chunk in d.first():
            yield sse(chunk)
    while True:
        kind, out = _latest(sub, await sub.events.get())
        if kind == ERROR:
            yield sse(oa.error_body(f"the engine failed: {out}", "server_error"))
            return
        if out is None:  # aborted before any output
            for d in deltas:
                yield sse(oa.stream_chunk(d.req, text="", finish="abort", **d.kw))
            break
        for d in deltas:
            for chunk in d.update(SequenceView(out, d.index)):
                yield sse(chunk)
        if out.finished:
            break
    if deltas[0].last is not None:
        usage = deltas[0].usage()
        if usage is not None:
            yield sse(usage)
    yield sse("[DONE]")


class _Gate:
    """ASGI middleware: the API key on /v1/*, and requests counted by endpoint and status."""

    def __init__(self, app, state: ServeState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in ("/health", "/metrics"):
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = [500]

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            key = self.state.cfg.api_key
            if key is not None and path.startswith("/v1/") and not _authorized(scope, key):
                response = JSONResponse(
                    oa.error_body("missing or wrong API key: send `Authorization: Bearer "
                                  "<key>`", "invalid_request_error", code="invalid_api_key"),
                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, counting_send)
            await self.app(scope, receive, counting_send)
        finally:
            self.state.metrics.on_response(path if path in COUNTED else "other", status[0])


def _authorized(scope, key: str) -> bool:
    given = dict(scope["headers"]).get(b"authorization", b"")
    return hmac.compare_digest(given, b"Bearer " + key.encode())


def create_app(state: ServeState) -> FastAPI:
    """The ASGI app serving `state` (attach an LLM to it to become ready)."""
    app = FastAPI(title="jaxinfer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state

    @app.exception_handler(oa.RequestError)
    async def _request_error(request, e):
        return _error_response(e)

    @app.exception_handler(ApiError)
    async def _api_error(request, e):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        return JSONResponse(oa.error_body(f"{request.method} {request.url.path}: {e.detail}",
                                          "invalid_request_error"), status_code=e.status_code)

    @app.post(oa.COMPLETIONS)
    async def completions(request: Request):
        return await _generate(state, request, oa.COMPLETIONS)

    @app.post(oa.CHAT)
    async def chat_completions(request: Request):
        return await _generate(state, request, oa.CHAT)

    @app.get(MODELS)
    async def models():
        _available(state)
        return {"object": "list", "data": [{
            "id": state.cfg.model_name, "object": "model", "created": state.created,
            "owned_by": "jaxinfer", "max_model_len": state.llm.max_seq_len}]}

    @app.get("/health")
    async def health():
        if state.ready and not state.draining and state.engine.alive:
            return {"status": "ok"}
        status = "draining" if state.draining else "loading" if state.failed is None \
            else "failed"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    app.add_middleware(_Gate, state=state)
    return app
