"""Output records of a batch job: one JSON line per input line, in OpenAI's batch output format.

    {"id": "batch_req_...", "custom_id": "...", "response": {"status_code": 200,
     "request_id": "...", "body": {chat.completion | text_completion}}, "error": null}

A request the API refuses (unknown url, a bad field, a prompt the model cannot take) gets the
response the server would have sent: its status code and an OpenAI error body, "error" null.
A line that is not a batch request at all (not JSON, no custom_id, a custom_id used before) has
no response: "response" is null and "error" is {"code": kind, "message": "line N: ..."}.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
from typing import Optional

from jaxinfer.openai_api import RequestError

# Error kinds, as counted in summary.json's errors_by_kind. The first four are line-level
# (no response); the others are the API refusing the request.
INVALID_JSON = "invalid_json"            # not UTF-8, not JSON, or not a JSON object
INVALID_LINE = "invalid_line"            # method, url/body fields or custom_id of the wrong kind
MISSING_CUSTOM_ID = "missing_custom_id"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
UNKNOWN_URL = "unknown_url"
INVALID_REQUEST = "invalid_request"      # a body field refused by openai_api.parse_request
PROMPT_TOO_LONG = "prompt_too_long"      # LLM.add_request: prompt >= max_seq_len tokens
INVALID_PROMPT = "invalid_prompt"        # LLM.add_request's other refusals, chat template errors
LINE_KINDS = (INVALID_JSON, INVALID_LINE, MISSING_CUSTOM_ID, DUPLICATE_CUSTOM_ID)
ERROR_KINDS = LINE_KINDS + (UNKNOWN_URL, INVALID_REQUEST, PROMPT_TOO_LONG, INVALID_PROMPT)


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


def _dumps(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False)


def _record_id() -> str:
    return "batch_req_" + uuid.uuid4().hex


def success(line: int, custom_id: str, body: dict) -> Result:
    """A completed request: `body` is openai_api.response_body's chat.completion or
    text_completion."""
    record = {"id": _record_id(), "custom_id": custom_id,
              "response": {"status_code": 200, "request_id": body["id"], "body": body},
              "error": None}
    usage = body["usage"]
    return Result(line, custom_id, _dumps(record), None, usage["prompt_tokens"],
                  usage["completion_tokens"])


def request_error(line: int, custom_id: str, error: RequestError, kind: str) -> Result:
    """The API refused the request: the status and error body the server would answer with."""
    record = {"id": _record_id(), "custom_id": custom_id,
              "response": {"status_code": error.status, "request_id": "req_" + uuid.uuid4().hex,
                           "body": error.body()},
              "error": None}
    return Result(line, custom_id, _dumps(record), kind)


def line_error(line: int, custom_id: Optional[str], kind: str, message: str) -> Result:
    """A line that is not a batch request: no response, an error naming the line."""
    record = {"id": _record_id(), "custom_id": custom_id, "response": None,
              "error": {"code": kind, "message": f"line {line + 1}: {message}"}}
    return Result(line, custom_id, _dumps(record), kind)


def derive_seed(job_seed: Optional[int], custom_id: str) -> int:
    """The seed of a request that names none: a function of (job seed, custom_id) only, so a
    resumed or resharded job samples exactly what an uninterrupted one does. In [0, 2**32)."""
    key = f"{0 if job_seed is None else job_seed}\x00{custom_id}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")
