"""Output records of a batch job, one JSON line per input line in OpenAI's batch output format.
A request the API refuses gets the response the server would send; a line that is no request
gets "response" null and an "error". Records are encoded when made, so writing one never fails.
docs/batch.md shows each kind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import uuid
from typing import Optional

from jaxinfer.openai_api import RequestError, error_body

logger = logging.getLogger(__name__)

# Error kinds, as counted in summary.json's errors_by_kind. The first five are line-level
# (no response); the others are responses: the API refusing the request, or a 500.
INVALID_JSON = "invalid_json"            # not UTF-8, not JSON, or JSON this job refuses
INVALID_LINE = "invalid_line"            # method, url/body fields or custom_id of the wrong kind
MISSING_CUSTOM_ID = "missing_custom_id"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
LINE_TOO_LONG = "line_too_long"          # more than --max_line_bytes bytes
UNKNOWN_URL = "unknown_url"
INVALID_REQUEST = "invalid_request"      # a body field refused by openai_api.parse_request
PROMPT_TOO_LONG = "prompt_too_long"      # LLM.encode_prompt: prompt >= max_seq_len tokens
INVALID_PROMPT = "invalid_prompt"        # LLM.encode_prompt's other refusals, chat templates
INTERNAL_ERROR = "internal_error"        # a bug met while answering this one request (500)
LINE_KINDS = (INVALID_JSON, INVALID_LINE, MISSING_CUSTOM_ID, DUPLICATE_CUSTOM_ID, LINE_TOO_LONG)
ERROR_KINDS = LINE_KINDS + (UNKNOWN_URL, INVALID_REQUEST, PROMPT_TOO_LONG, INVALID_PROMPT,
                            INTERNAL_ERROR)


@dataclasses.dataclass
class Result:
    """What one input line produced: its output line (JSON, no newline) and the counts the
    summary needs. `line` is 0-based; messages name it 1-based, as editors do."""

    line: int
    custom_id: Optional[str]
    record: str
    error_kind: Optional[str] = None     # None: the request succeeded
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class Blank:
    """A blank input line: no request and no output line, counted in the summary."""

    line: int


def _encode(record: dict) -> str:
    """The record as one line of JSON that encodes as UTF-8 (ValueError or TypeError if not)."""
    text = json.dumps(record, ensure_ascii=False, allow_nan=False)
    text.encode("utf-8")  # a lone surrogate anywhere raises UnicodeEncodeError here
    return text


def _usable_id(custom_id) -> Optional[str]:
    """custom_id if it can stand in a record (a str that encodes), else None."""
    if not isinstance(custom_id, str):
        return None
    try:
        custom_id.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return custom_id


def _result(line: int, custom_id: Optional[str], record: dict, kind: Optional[str],
            prompt_tokens: int = 0, completion_tokens: int = 0) -> Result:
    try:
        text = _encode(record)
    except (ValueError, TypeError):  # UnicodeEncodeError is a ValueError
        logger.exception("line %d: its output record does not encode as UTF-8 JSON",
                         line + 1)
        return internal_error(line, custom_id, "its output record did not encode as UTF-8 JSON")
    return Result(line, custom_id, text, kind, prompt_tokens, completion_tokens)


def _record_id() -> str:
    return "batch_req_" + uuid.uuid4().hex


def _request_id() -> str:
    return "req_" + uuid.uuid4().hex


def success(line: int, custom_id: str, body: dict) -> Result:
    """A completed request: `body` is openai_api.response_body's chat.completion or
    text_completion, or responses_api.response_object's response."""
    record = {"id": _record_id(), "custom_id": custom_id,
              "response": {"status_code": 200, "request_id": body["id"], "body": body},
              "error": None}
    usage = body["usage"]
    if "input_tokens" in usage:  # a Responses object's names
        return _result(line, custom_id, record, None, usage["input_tokens"],
                       usage["output_tokens"])
    return _result(line, custom_id, record, None, usage["prompt_tokens"],
                   usage["completion_tokens"])


def request_error(line: int, custom_id: str, error: RequestError, kind: str) -> Result:
    """The API refused the request: the status and error body the server would answer with."""
    record = {"id": _record_id(), "custom_id": custom_id,
              "response": {"status_code": error.status, "request_id": _request_id(),
                           "body": error.body()},
              "error": None}
    return _result(line, custom_id, record, kind)


def line_error(line: int, custom_id: Optional[str], kind: str, message: str) -> Result:
    """A line that is not a batch request: no response, an error naming the line."""
    record = {"id": _record_id(), "custom_id": custom_id, "response": None,
              "error": {"code": kind, "message": f"line {line + 1}: {message}"}}
    return _result(line, custom_id, record, kind)


def internal_error(line: int, custom_id: Optional[str], what: str) -> Result:
    """A bug met while answering this line (the caller logged it): a 500 response, as a
    server would send, with no detail of the failure but where it happened. Never fails."""
    custom_id = _usable_id(custom_id)
    message = f"line {line + 1}: internal error: {what}; the job's log has the details"
    record = {"id": _record_id(), "custom_id": custom_id,
              "response": {"status_code": 500, "request_id": _request_id(),
                           "body": error_body(message, "server_error")},
              "error": None}
    try:
        text = _encode(record)
    except (ValueError, TypeError):  # `what` came from code; still, keep the promise
        record["response"]["body"] = error_body(f"line {line + 1}: internal error",
                                                "server_error")
        text = _encode(record)
    return Result(line, custom_id, text, INTERNAL_ERROR)


def derive_seed(job_seed: Optional[int], custom_id: str) -> int:
    """The seed of a request that names none: a function of (job seed, custom_id) only, so a
    resumed or resharded job samples exactly what an uninterrupted one does. In [0, 2**32)."""
    key = f"{0 if job_seed is None else job_seed}\x00{custom_id}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")
