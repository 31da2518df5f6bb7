"""The ASGI middleware every HTTP request passes (API key or Content-Type rule, metrics count,
a 500 for any exception a handler lets out), and the error responses the app sends.

Without an API key POST /v1/* must be JSON, a type no web page can make a browser send unasked
(no CORS preflight); docs/serving.md says why.
"""

from __future__ import annotations

import hmac
import logging
import re
from typing import Optional

from fastapi.responses import JSONResponse

from jaxinfer import openai_api as oa
from jaxinfer.user_input import show

log = logging.getLogger(__name__)
COUNTED = (oa.COMPLETIONS, oa.CHAT, "/v1/responses", "/v1/models", "/v1/load_lora_adapter",
           "/v1/unload_lora_adapter")
INTERNAL_MESSAGE = "internal error; the server logged it"
# For a client that stopped sending. Answers sent before a body was read keep the connection:
# closing it with the body unread would reset it, and the client could lose the answer.
CLOSE = {"Connection": "close"}
_MAX_MESSAGE_CHARS = 2000  # bounds a message that quotes an exception
# application/json or application/<x>+json, as the type's essence (before any parameters).
_JSON_TYPE = re.compile(r"application/([!#$%&'*.^_`|~0-9a-z-]+\+)?json")


class ApiError(Exception):
    """An HTTP error the app answers with an OpenAI error object."""

    def __init__(self, status: int, message: str, type: str, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.headers = status, headers
        self.body = oa.error_body(message, type, param, code)


def internal_error() -> ApiError:
    """A 500 for a server-side fault: the client learns that much, the log the rest."""
    return ApiError(500, INTERNAL_MESSAGE, "server_error", code="internal_error")


def _encodable(body: dict) -> dict:
    """The error object with its message made UTF-8-encodable and of bounded length."""
    err = dict(body["error"])
    msg = str(err["message"]).encode("utf-8", "backslashreplace").decode("utf-8")
    if len(msg) > _MAX_MESSAGE_CHARS:
        msg = f"{msg[:_MAX_MESSAGE_CHARS - 30]}... ({len(msg)} characters)"
    err["message"] = msg
    if isinstance(err.get("param"), str):
        err["param"] = err["param"].encode("utf-8", "backslashreplace").decode("utf-8")[:64]
    return {"error": err}


def error_response(e) -> JSONResponse:
    if isinstance(e, oa.RequestError):
        return JSONResponse(_encodable(e.body()), status_code=e.status)
    return JSONResponse(_encodable(e.body), status_code=e.status, headers=e.headers)


def _header(scope, name: bytes) -> list[bytes]:
    return [v for k, v in scope["headers"] if k == name]


def _authorized(scope, key: str) -> bool:
    given = (_header(scope, b"authorization") or [b""])[-1]
    return hmac.compare_digest(given, b"Bearer " + key.encode())


def content_type_refusal(scope) -> Optional[ApiError]:
    """415 unless the request has exactly one Content-Type and it is JSON."""
    types = _header(scope, b"content-type")
    essence = types[0].split(b";")[0].strip().lower().decode("latin-1") if types else ""
    if len(types) == 1 and _JSON_TYPE.fullmatch(essence):
        return None
    got = "none" if not types else show(b", ".join(types).decode("latin-1"))
    return ApiError(415, f"unsupported Content-Type {got}: without an API key this server "
                    "takes POST /v1/* only with `Content-Type: application/json` (or "
                    "application/<x>+json), a type a web page cannot make a browser send it "
                    "unasked; text/plain, form and untyped bodies are refused",
                    "invalid_request_error", code="unsupported_media_type")


class Gate:
    """ASGI middleware inside Starlette's error middleware, outside the routes."""

    def __init__(self, app, state):
        self.app, self.state = app, state

    def _refusal(self, scope) -> Optional[ApiError]:
        if not scope["path"].startswith("/v1/"):
            return None
        key = self.state.cfg.api_key
        if key is not None:
            if _authorized(scope, key):
                return None
            return ApiError(401, "missing or wrong API key: send `Authorization: Bearer "
                            "<key>`", "invalid_request_error", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})
        return content_type_refusal(scope) if scope["method"] == "POST" else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status, started = [500], [False]

        async def tracking_send(message):
            if message["type"] == "http.response.start":
                status[0], started[0] = message["status"], True
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                return await error_response(refusal)(scope, receive, tracking_send)
            await self.app(scope, receive, tracking_send)
        except Exception:  # noqa: BLE001 - a fault in one handler: a 500 for its request only
            log.exception("%s %s failed", scope.get("method"), show(path))
            if not started[0]:  # else the response is under way: uvicorn closes the connection
                await error_response(internal_error())(scope, receive, tracking_send)
        finally:
            if path not in ("/health", "/metrics"):
                self.state.metrics.on_response(path if path in COUNTED else "other",
                                               status[0])
