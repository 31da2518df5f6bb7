"""The FastAPI app: OpenAI-compatible endpoints over one EngineLoop.

jaxinfer.openai_api checks bodies and builds responses; this module adds HTTP (body size and
read time, model name, backpressure, readiness, draining, metrics). Prompts are tokenized on a
small thread pool, never on the event loop or the engine thread. Contract: docs/serving.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from jaxinfer import openai_api as oa
from jaxinfer import responses_api as ra
from jaxinfer.serve.engine_loop import ERROR, OUTPUT, EngineLoop, EngineStopped, Submission
from jaxinfer.serve.gate import CLOSE, ApiError, Gate, error_response, internal_error
from jaxinfer.serve.metrics import CONTENT_TYPE, ServerMetrics
from jaxinfer.serve.streaming import Deltas, SequenceView, SSEResponse, sse
from jaxinfer.user_input import InputError, loads_json, show

log = logging.getLogger(__name__)
MODELS = "/v1/models"
LOAD_LORA, UNLOAD_LORA = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
CONNECTION_HEADROOM = 64  # connections past twice the admissible requests: probes, scrapers
# Tokenizing takes far less time than generating: a small pool keeps the engine fed while
# bounding the CPU requests can take.
ENCODE_WORKERS = 2


@dataclasses.dataclass
class ServeConfig:
    model_name: str                  # the `model` clients name (and /v1/models lists)
    api_key: Optional[str] = None    # when set, /v1/* needs `Authorization: Bearer <key>`
    max_waiting: int = 256           # requests beyond the batch slots; more -> 429
    max_body_bytes: int = 1 << 20    # larger request bodies -> 413
    retry_after_s: int = 1           # the Retry-After of a 429
    # Idle keep-alive seconds: longer than clients keep pooled connections (docs/serving.md),
    # so a client never reuses a socket the server is closing.
    keep_alive_s: float = 75.0
    read_timeout_s: float = 30.0     # to send the headers (else closed) and the body (else 408)
    # Open connections, idle ones included; past them uvicorn answers 503.
    # None: 2 * (max_num_seqs + max_waiting) + CONNECTION_HEADROOM.
    max_connections: Optional[int] = None
    # How chat answers are read (openai_api.ChatFormats): the tool-call format (None: the
    # model's own, else hermes) and the reasoning parser (None: by the chat template).
    tool_call_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None
    # LoRA: adapters to load at start ({name: PEFT directory}; the LLM needs max_loras), and
    # whether POST /v1/load_lora_adapter and /v1/unload_lora_adapter may change them (they
    # read server paths, so they are off unless asked for, as vLLM's are).
    lora_modules: Optional[dict] = None
    allow_runtime_lora: bool = False

    def __post_init__(self):
        for name in ("keep_alive_s", "read_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        oa.ChatFormats.check(self.tool_call_parser, self.reasoning_parser)

    def connection_limit(self, max_num_seqs: int) -> int:
        if self.max_connections is not None:
            return self.max_connections
        return 2 * (max_num_seqs + self.max_waiting) + CONNECTION_HEADROOM


class ServeState:
    """What the app serves: the LLM and its engine loop once loaded, readiness and draining."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.metrics = ServerMetrics()
        self.llm = None
        self.loras: dict = {}
        self.formats = oa.ChatFormats()
        self.engine: Optional[EngineLoop] = None
        self.ready = False      # loaded and warmed: /health 200 and requests admitted
        self.draining = False   # shutting down: no new requests
        self.failed: Optional[str] = None
        self.outstanding = 0    # requests admitted and not yet answered (event-loop thread)
        self.created = int(time.time())
        self.encoder = concurrent.futures.ThreadPoolExecutor(
            ENCODE_WORKERS, thread_name_prefix="jaxinfer-encode")

    def attach(self, llm) -> None:
        """Serves `llm` (loaded, warmed if wanted): starts the engine loop, marks ready."""
        for name, path in (self.cfg.lora_modules or {}).items():
            if name == self.cfg.model_name:
                raise ValueError(f"LoRA adapter {name!r} has the served model's name")
            llm.load_lora(name, path)
        self.llm = llm
        # Adapter names clients may send as `model` (updated on the event-loop thread).
        self.loras = {a["name"]: a["path"] for a in llm.list_loras()}
        self.formats = oa.ChatFormats.for_tokenizer(llm.tokenizer, self.cfg.tool_call_parser,
                                                    self.cfg.reasoning_parser)
        self.engine = EngineLoop(llm, self.metrics).start()
        self.ready = True

    def close(self) -> None:
        self.ready = False
        if self.engine is not None:
            self.engine.stop()
        self.encoder.shutdown(wait=False, cancel_futures=True)


async def _read_json(request: Request, cfg: ServeConfig):
    """The body as JSON: 413 past max_body_bytes (declared or streamed), 408 when it does not
    arrive within read_timeout_s, 400 for anything user_input.loads_json refuses."""
    limit = cfg.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body has {declared} bytes; the limit is {limit} "
                       "(--max_body_bytes)", "invalid_request_error", code="request_too_large")
    data = bytearray()

    async def read() -> None:
        async for part in request.stream():
            data.extend(part)
            if len(data) > limit:
                raise ApiError(413, f"the request body exceeds the limit of {limit} bytes "
                               "(--max_body_bytes)", "invalid_request_error",
                               code="request_too_large")

    try:
        await asyncio.wait_for(read(), cfg.read_timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {cfg.read_timeout_s:g} s "
                       f"(--read_timeout; {len(data)} bytes came)", "invalid_request_error",
                       code="request_timeout", headers=CLOSE) from None
    except ClientDisconnect:  # nobody will read the answer; it must not be a 500
        raise ApiError(400, "the client disconnected before the body ended",
                       "invalid_request_error") from None
    try:
        return loads_json(data)
    except InputError as e:
        raise oa.RequestError(str(e)) from None


def _available(state: ServeState) -> None:
    retry = {"Retry-After": str(state.cfg.retry_after_s)}
    if state.draining:
        raise ApiError(503, "the server is shutting down", "service_unavailable", headers=retry)
    if not state.ready:
        raise ApiError(503, "the model is still loading" if state.failed is None else
                       f"the model failed to load: {state.failed}", "service_unavailable",
                       headers=retry)
    if not state.engine.alive:
        raise ApiError(503, "the engine has stopped after an internal failure (GET /health "
                       "says why); the server must be restarted", "service_unavailable",
                       code="engine_stopped")


def _admit(state: ServeState) -> None:
    limit = state.llm.max_num_seqs + state.cfg.max_waiting
    if state.outstanding >= limit:
        raise ApiError(429, f"too many requests: {state.outstanding} are running or queued; "
                       f"the limit is {state.llm.max_num_seqs} running + "
                       f"{state.cfg.max_waiting} queued (--max_waiting)", "rate_limit_exceeded",
                       headers={"Retry-After": str(state.cfg.retry_after_s)})


def _engine_error(e: BaseException, param: str) -> Exception:
    """What a request's client hears of the engine's error `e`."""
    if isinstance(e, EngineStopped):
        return ApiError(503, f"the request could not be served: {e}", "service_unavailable")
    if isinstance(e, ValueError):  # the engine's own checks (token ids, prompt length)
        return oa.RequestError(str(e), param)
    return internal_error()        # InternalError: logged where it happened


def _failed(out) -> bool:
    """Whether a sequence of the request finished "error" (its bookkeeping raised)."""
    return out.finish_reason == "error" or any(c.finish_reason == "error"
                                               for c in out.outputs or ())


async def _generate(state: ServeState, request: Request, endpoint: str):
    _available(state)
    body = await _read_json(request, state.cfg)
    llm, name = state.llm, state.cfg.model_name
    responses = endpoint == ra.RESPONSES
    if responses:  # the Responses API, served as the chat completion it translates to
        req = oa.parse_request(oa.CHAT, ra.to_chat_body(body), max_n=llm.max_n)
    else:
        req = oa.parse_request(endpoint, body, max_n=llm.max_n)
    chat = req.endpoint == oa.CHAT
    lora = req.model if req.model in state.loras else None
    if req.model is not None and req.model != name and lora is None:
        served = [name] + sorted(state.loras)
        raise oa.RequestError(f"model {show(req.model)} is not served here; this server "
                              f"serves {served}", "model", status=404,
                              code="model_not_found")
    _admit(state)
    param = "messages" if chat else "prompt"
    rid, created, loop = oa.new_id(endpoint), int(time.time()), asyncio.get_running_loop()
    state.outstanding += 1
    done, submitted = [], []

    def close(finished: bool) -> None:  # once per request, whatever ends it
        if not done:
            done.append(True)
            state.outstanding -= 1
            if submitted and not finished:
                state.engine.abort(rid)

    try:
        prompt, params = await loop.run_in_executor(state.encoder, oa.prepare, llm, req,
                                                    state.formats)
        sub = Submission(rid, prompt, params, loop, lora=lora)
        state.engine.submit(sub)
        submitted.append(True)
        error = await sub.admitted()
        if error is not None:
            close(True)
            raise _engine_error(error, param)
        deltas = [Deltas(req, llm.tokenizer, response_id=rid, created=created, model=name,
                         index=i, formats=state.formats) for i in range(req.n)]
        if req.stream:
            chunks = _stream(sub, deltas, close)
            if responses:
                events = ra.ResponseStream(body, ra.new_response_id(), created, name)
                return SSEResponse(_response_events(chunks, events), close)
            return SSEResponse(_chat_sse(chunks), close)
        kind, out = await _final(sub, request)
        close(kind != ERROR and out is not None and out.finish_reason != "abort")
    except BaseException:
        close(False)
        raise
    if kind == ERROR:
        raise _engine_error(out, param)
    if out is None or out.finish_reason == "abort":
        raise ApiError(503, "the request was aborted (the server is shutting down)",
                       "service_unavailable")
    if _failed(out):
        raise internal_error()
    answer = oa.response_body(req, llm.tokenizer, [out], model=name, response_id=rid,
                              created=created, formats=state.formats)
    return JSONResponse(ra.response_object(answer, request_body=body) if responses else answer)


async def _final(sub: Submission, request: Request):
    """Waits for the finished output: (OUTPUT, output), (OUTPUT, None) if the client
    disconnected (its request is then aborted by the caller) or (ERROR, exception)."""
    while True:
        try:
            kind, out = await asyncio.wait_for(sub.next(), timeout=1.0)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                return OUTPUT, None
            continue
        if kind == ERROR or out is None or out.finished:
            return kind, out


def _stream_error(e: Optional[BaseException]) -> dict:
    """The error event of a stream that has started (its status, 200, is sent)."""
    if isinstance(e, EngineStopped):
        return oa.error_body(f"the request could not be finished: {e}", "service_unavailable",
                             code="engine_stopped")
    return internal_error().body


async def _stream(sub: Submission, deltas: list, close):
    """The chat or completion chunks of one request, a Deltas per sequence (choice index), as
    (chunk, None); a failure ends it with (None, error body)."""
    try:
        for d in deltas:
            for chunk in d.first():
                yield chunk, None
        while True:
            kind, out = await sub.next()
            if kind == ERROR or (out is not None and _failed(out)):
                yield None, _stream_error(out if kind == ERROR else None)
                break
            if out is None:  # aborted before any output
                for d in deltas:
                    yield oa.stream_chunk(d.req, text="", finish="abort", **d.kw), None
                break
            for d in deltas:
                for chunk in d.update(SequenceView(out, d.index)):
                    yield chunk, None
            if out.finished:
                usage = deltas[0].usage()
                if usage is not None:
                    yield usage, None
                break
    except Exception:  # noqa: BLE001 - a fault here ends this stream only, with an event
        log.exception("stream %s failed", sub.request_id)
        close(False)  # the request may still be running: abort it
        yield None, internal_error().body


async def _chat_sse(chunks):
    """Chat and completions streams: each chunk (or the error) as `data:`; always ends with
    `data: [DONE]`."""
    async for chunk, error in chunks:
        yield sse(chunk if error is None else error)
    yield sse("[DONE]")


async def _response_events(chunks, events: "ra.ResponseStream"):
    """A Responses stream: the chat chunks as its typed events (`event:` and `data:`), ending
    with response.completed (or .incomplete), or an error event."""
    for ev in events.start():
        yield ra.sse_event(ev)
    async for chunk, error in chunks:
        if error is not None:
            yield ra.sse_event(events.error_event(error["error"]["message"]))
            return
        for ev in events.chunk(chunk):
            yield ra.sse_event(ev)
    for ev in events.finish():
        yield ra.sse_event(ev)


async def _change_lora(state: ServeState, request: Request, load: bool):
    """vLLM's runtime adapter API: {"lora_name", "lora_path"} loads a PEFT directory,
    {"lora_name"} unloads; the change runs on the engine thread, between steps."""
    _available(state)
    if not state.cfg.allow_runtime_lora:
        raise ApiError(403, "loading and unloading LoRA adapters at runtime is off (start the "
                       "server with --allow_runtime_lora)", "invalid_request_error")
    body = await _read_json(request, state.cfg)
    fields = {"lora_name", "lora_path"} if load else {"lora_name"}
    if not isinstance(body, dict) or set(body) - fields or not isinstance(
            body.get("lora_name"), str) or (load and not isinstance(body.get("lora_path"), str)):
        raise oa.RequestError(f"the body must be {sorted(fields)} (strings), got {show(body)}",
                              "lora_name")
    name = body["lora_name"]
    if name == state.cfg.model_name:
        raise oa.RequestError(f"{show(name)} is the served model's name", "lora_name")
    if not load and name not in state.loras:
        raise oa.RequestError(f"no LoRA adapter named {show(name)} is loaded", "lora_name",
                              status=404, code="model_not_found")
    fn = (lambda llm: llm.load_lora(name, body["lora_path"])) if load else \
        (lambda llm: llm.unload_lora(name))
    try:
        await asyncio.wrap_future(state.engine.call(fn, between_steps=True))
    except ValueError as e:
        raise oa.RequestError(str(e), "lora_path" if load else "lora_name") from None
    if load:
        state.loras[name] = body["lora_path"]
    else:
        state.loras.pop(name, None)
    verb = "added" if load else "removed"
    return Response(f"Success: LoRA adapter '{name}' {verb} successfully.",
                    media_type="text/plain")


def create_app(state: ServeState) -> FastAPI:
    """The ASGI app serving `state` (attach an LLM to it to become ready)."""
    app = FastAPI(title="jaxinfer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state

    async def _error(request, e):
        return error_response(e)

    app.add_exception_handler(oa.RequestError, _error)
    app.add_exception_handler(ApiError, _error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        return error_response(ApiError(e.status_code, f"{request.method} {show(request.url.path)}"
                                       f": {e.detail}", "invalid_request_error"))

    @app.post(oa.COMPLETIONS)
    async def completions(request: Request):
        return await _generate(state, request, oa.COMPLETIONS)

    @app.post(oa.CHAT)
    async def chat_completions(request: Request):
        return await _generate(state, request, oa.CHAT)

    @app.post(ra.RESPONSES)
    async def responses(request: Request):
        return await _generate(state, request, ra.RESPONSES)

    @app.get(MODELS)
    async def models():
        _available(state)
        base = state.cfg.model_name
        return {"object": "list", "data": [{
            "id": base, "object": "model", "created": state.created, "owned_by": "jaxinfer",
            "root": base, "parent": None, "max_model_len": state.llm.max_seq_len}] + [{
                "id": n, "object": "model", "created": state.created, "owned_by": "jaxinfer",
                "root": path, "parent": base, "max_model_len": state.llm.max_seq_len}
                for n, path in sorted(state.loras.items())]}

    @app.post(LOAD_LORA)
    async def load_lora_adapter(request: Request):
        return await _change_lora(state, request, load=True)

    @app.post(UNLOAD_LORA)
    async def unload_lora_adapter(request: Request):
        return await _change_lora(state, request, load=False)

    @app.get("/health")
    async def health():
        engine = state.engine
        if state.ready and not state.draining and engine.alive:
            return {"status": "ok"}
        if state.draining:
            body = {"status": "draining"}
        elif state.failed is not None:
            body = {"status": "failed", "reason": f"the model failed to load: {state.failed}"}
        elif engine is not None and engine.failure is not None:
            body = {"status": "failed", "reason": engine.failure}
        else:
            body = {"status": "loading"}
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    app.add_middleware(Gate, state=state)
    return app
