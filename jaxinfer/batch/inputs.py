"""Reading a batch job's input lazily, each line checked on its own: OpenAI batch JSONL, or plain
text (one prompt a line, custom_id = its 1-based number). A bad line becomes an error Result for
that line alone; only blank lines get none. A line's shard is blake2b(custom_id) mod num_shards,
so every line of a custom_id lands in one shard. Contract: docs/batch.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Any, BinaryIO, Iterator, Optional, Union

import numpy as np

from jaxinfer.batch import records
from jaxinfer.batch.records import Blank, Result
from jaxinfer.engine.request import SamplingParams
from jaxinfer.openai_api import CHAT, COMPLETIONS, ParsedRequest, RequestError, parse_request
from jaxinfer.responses_api import RESPONSES, to_chat_body
from jaxinfer.user_input import InputError, check_text, loads_json, show

FORMATS = ("auto", "jsonl", "text")
_LINE_FIELDS = {"custom_id", "method", "url", "body"}
# Twice the server's body limit: a line wraps a body in its custom_id, method and url.
MAX_LINE_BYTES = 2 << 20
MAX_CUSTOM_ID_CHARS = 512  # ids are names, not payloads, and each is kept in the manifest
_SKIP_CHUNK = 1 << 16  # bytes read at a time while skipping the rest of an overlong line


@dataclasses.dataclass(frozen=True)
class LongLine:
    """A line longer than `limit` bytes, in place of its bytes: its size and line_digest."""

    size: int
    digest: bytes
    limit: int


RawLine = Union[bytes, LongLine]


@dataclasses.dataclass
class Work:
    """A checked request, ready for the engine."""

    line: int                  # 0-based input line
    custom_id: str
    request: ParsedRequest
    responses_body: Optional[dict] = None  # a /v1/responses line's body (answered in its form)


Item = Union[Work, Result, Blank]


@dataclasses.dataclass(frozen=True)
class TextDefaults:
    """How plain-text lines are sent: completions of the line, or (chat) the line as one user
    message; sampling from the job's flags."""

    sampling: dict
    chat: bool = False


def resolve_format(path: str, fmt: str) -> str:
    """"jsonl" or "text". auto: by extension (.jsonl / .json, .txt), else JSONL when the first
    non-blank line starts with "{"."""
    if fmt not in FORMATS:
        raise ValueError(f"--input_format must be one of {FORMATS}, got {fmt!r}")
    if fmt != "auto":
        return fmt
    ext = os.path.splitext(path)[1].lower()
    if ext in (".jsonl", ".json"):
        return "jsonl"
    if ext == ".txt":
        return "text"
    with open(path, "rb") as f:
        while piece := f.readline(1 << 16):  # bounded, whatever the length of a line
            if piece.strip():
                return "jsonl" if piece.lstrip().startswith(b"{") else "text"
    return "jsonl"


def count_lines(path: str) -> int:
    """Lines in the file (a last line without a newline counts), by a byte scan."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")


def strip_newline(raw: bytes) -> bytes:
    return raw[:-2] if raw.endswith(b"\r\n") else raw[:-1] if raw.endswith(b"\n") else raw


def scan_lines(f: BinaryIO, max_line_bytes: int) -> Iterator[tuple[RawLine, int]]:
    """(line without its newline, or a LongLine past max_line_bytes; its bytes in the file),
    lazily from f's position, never holding more than max_line_bytes + 2 bytes of a line."""
    while raw := f.readline(max_line_bytes + 2):
        if raw.endswith(b"\n") or len(raw) < max_line_bytes + 2:  # whole (or the last line)
            body = strip_newline(raw)
            if len(body) <= max_line_bytes:
                yield body, len(raw)
            else:
                yield LongLine(len(body), line_digest(body), max_line_bytes), len(raw)
        else:
            yield _skip_long_line(f, raw, max_line_bytes)


def _skip_long_line(f: BinaryIO, head: bytes, limit: int) -> tuple[LongLine, int]:
    """Reads the rest of a line that began with `head`, in bounded pieces, hashing it as
    line_digest hashes a whole line (so a resume still sees a change anywhere in it)."""
    digest, size, taken, pending = hashlib.blake2b(digest_size=16), 0, len(head), head
    while not pending.endswith(b"\n"):
        chunk = f.readline(_SKIP_CHUNK)
        if not chunk:
            break
        taken += len(chunk)
        cut = len(pending) - pending.endswith(b"\r")  # a \r may start the \r\n newline
        digest.update(memoryview(pending)[:cut])  # no copy of the (up to limit) head
        size += cut
        pending = pending[cut:] + chunk
    body = strip_newline(pending)
    digest.update(body)
    return LongLine(size + len(body), digest.digest(), limit), taken


def read_lines(path: str, max_line_bytes: int = MAX_LINE_BYTES
               ) -> Iterator[tuple[int, RawLine]]:
    """(0-based line number, line without its newline or a LongLine), lazily."""
    with open(path, "rb") as f:
        for no, (raw, _) in enumerate(scan_lines(f, max_line_bytes)):
            yield no, raw


def line_digest(raw: RawLine) -> bytes:
    """16 bytes standing for a line's content, to check on resume that the input is unchanged."""
    if isinstance(raw, LongLine):
        return raw.digest
    return hashlib.blake2b(raw, digest_size=16).digest()


def shard_of(custom_id: Optional[str], line: int, num_shards: int) -> int:
    key = f"id:{custom_id}" if custom_id is not None else f"line:{line}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(),
                          "little") % num_shards


def belongs(item: Item, line: int, num_shards: int, shard_index: int) -> bool:
    """Whether the parsed line is the shard's. An error line with a custom_id goes where that
    id sends it, like the id's duplicates."""
    if num_shards == 1:
        return True
    cid = None if isinstance(item, Blank) else item.custom_id
    return shard_of(cid, line, num_shards) == shard_index


def parse_line(line: int, raw: RawLine, fmt: str, text: Optional[TextDefaults]) -> Item:
    """One input line -> a Work, an error Result, or Blank. Duplicates are found by the caller
    (IdSet), since that needs the lines before."""
    if isinstance(raw, LongLine):
        return records.line_error(line, None, records.LINE_TOO_LONG,
                                  f"the line has {raw.size} bytes; the limit is {raw.limit} "
                                  "(--max_line_bytes)")
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return records.line_error(line, None, records.INVALID_JSON,
                                  f"not UTF-8 text ({e.reason} at byte {e.start})")
    if not s.strip():
        return Blank(line)
    if fmt == "text":
        return _text_work(line, s, text)
    try:
        obj = loads_json(s, what="the line")
    except InputError as e:
        return _refused_json(line, s, e)
    if not isinstance(obj, dict):
        return records.line_error(line, None, records.INVALID_JSON,
                                  f"expected a JSON object, got {type(obj).__name__}")
    cid = obj.get("custom_id")
    if cid is None or cid == "":
        return records.line_error(line, None, records.MISSING_CUSTOM_ID,
                                  "missing custom_id (a non-empty string naming the request)")
    if not isinstance(cid, str):
        return records.line_error(line, None, records.INVALID_LINE,
                                  f"custom_id must be a string, got {show(cid)}")
    if len(cid) > MAX_CUSTOM_ID_CHARS:
        return records.line_error(line, None, records.INVALID_LINE,
                                  f"custom_id has {len(cid)} characters; the limit is "
                                  f"{MAX_CUSTOM_ID_CHARS}: {show(cid)}")
    unknown = sorted(set(obj) - _LINE_FIELDS)
    if unknown:
        return records.line_error(line, cid, records.INVALID_LINE,
                                  f"unknown field {show(unknown[0])}; a batch line has "
                                  f"{sorted(_LINE_FIELDS)}")
    if obj.get("method", "POST") != "POST":
        return records.line_error(line, cid, records.INVALID_LINE,
                                  f"method must be \"POST\", got {show(obj.get('method'))}")
    url = obj.get("url")
    if not isinstance(url, str):
        return records.line_error(line, cid, records.INVALID_LINE,
                                  f"url must be one of {list((CHAT, COMPLETIONS, RESPONSES))}, "
                                  f"got {show(url)}")
    if "body" not in obj:
        return records.line_error(line, cid, records.INVALID_LINE, "missing body")
    try:
        # n is checked against the engine's limit when the request is submitted.
        responses = url == RESPONSES
        request = parse_request(CHAT if responses else url,
                                to_chat_body(obj["body"]) if responses else obj["body"],
                                max_n=2**31 - 1)
        if request.stream:
            raise RequestError("stream is not supported in a batch job", "stream")
    except RequestError as e:
        kind = records.UNKNOWN_URL if e.status == 404 else records.INVALID_REQUEST
        return records.request_error(line, cid, e, kind)
    return Work(line, cid, request, obj["body"] if responses else None)


_REFUSED = object()  # a number the strict parse refuses (NaN, Infinity, out of range)


def _lenient(parse):
    def parse_or_refuse(s: str):
        try:
            v = parse(s)
        except ValueError:  # an integer past Python's digit limit
            return _REFUSED
        return _REFUSED if isinstance(v, float) and not math.isfinite(v) else v
    return parse_or_refuse


def _strict_scalar(v: Any) -> bool:
    """Whether the strict parse takes `v` as it is: a number it accepts, None, a bool, or a
    string without a lone surrogate."""
    if isinstance(v, str):
        try:
            check_text(v, "")
        except InputError:
            return False
        return True
    return v is not _REFUSED and isinstance(v, (int, float, type(None)))


def _refused_json(line: int, s: str, error: InputError) -> Result:
    """A line loads_json refused, parsed again leniently to find its custom_id. A fault in the
    body alone is the API's refusal of the request (invalid_request under its custom_id, as the
    server would answer); any other is invalid_json, with the custom_id when usable."""
    try:
        obj = json.loads(s, parse_constant=lambda _: _REFUSED, parse_int=_lenient(int),
                         parse_float=_lenient(float))
    except (ValueError, RecursionError):
        obj = None
    if not isinstance(obj, dict):
        return records.line_error(line, None, records.INVALID_JSON, str(error))
    cid = obj.get("custom_id")
    if not (isinstance(cid, str) and cid and _strict_scalar(cid)
            and len(cid) <= MAX_CUSTOM_ID_CHARS):
        cid = None
    wrapper = [x for k, v in obj.items() if k != "body" for x in (k, v)]
    if cid is not None and "body" in obj and all(map(_strict_scalar, wrapper)):
        return records.request_error(line, cid, RequestError(str(error)),
                                     records.INVALID_REQUEST)
    return records.line_error(line, cid, records.INVALID_JSON, str(error))


def _text_work(line: int, s: str, text: TextDefaults) -> Work:
    params = SamplingParams(**text.sampling)
    chat = text.chat
    request = ParsedRequest(endpoint=CHAT if chat else COMPLETIONS, prompt=None if chat else s,
                            messages=[{"role": "user", "content": s}] if chat else None,
                            params=params, max_tokens=params.max_tokens, n=1, echo=False,
                            logprobs=params.logprobs, stream=False, include_usage=False,
                            model=None)
    return Work(line, str(line + 1), request)


class IdSet:
    """The custom_ids seen so far, as 128-bit hashes in a half-full open-addressing table: far
    smaller than a set of strings, as the one part of a job's state that grows with its input."""

    def __init__(self, capacity: int = 1 << 10):
        self._table = np.zeros((capacity, 2), np.uint64)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    @staticmethod
    def _key(custom_id: str) -> tuple[int, int]:
        d = hashlib.blake2b(custom_id.encode(), digest_size=16).digest()
        return int.from_bytes(d[:8], "little") | 1, int.from_bytes(d[8:], "little")  # 0 = empty

    def add(self, custom_id: str) -> bool:
        """Adds the id; False when it was already there."""
        hi, lo = self._key(custom_id)
        if not self._insert(self._table, hi, lo):
            return False
        self._len += 1
        if 2 * self._len > len(self._table):
            grown = np.zeros((2 * len(self._table), 2), np.uint64)
            for h, low in self._table[self._table[:, 0] != 0].tolist():
                self._insert(grown, h, low)
            self._table = grown
        return True

    @staticmethod
    def _insert(table: np.ndarray, hi: int, lo: int) -> bool:
        mask = len(table) - 1
        i = hi & mask
        while True:  # linear probing; the table is at most half full, so this ends quickly
            h = int(table[i, 0])
            if h == 0:
                table[i] = (hi, lo)
                return True
            if h == hi and int(table[i, 1]) == lo:
                return False
            i = (i + 1) & mask


def check_duplicate(seen: Optional[IdSet], item: Item) -> Item:
    """The item, or a duplicate_custom_id error when its custom_id was seen before (the
    first line with a custom_id keeps it, whether or not that line was a valid request)."""
    if seen is None or isinstance(item, Blank) or item.custom_id is None \
            or seen.add(item.custom_id):
        return item
    return records.line_error(item.line, item.custom_id, records.DUPLICATE_CUSTOM_ID,
                              f"duplicate custom_id {show(item.custom_id)} (an earlier line "
                              "has it; custom_ids must be unique)")


class ShardReader:
    """This shard's (line, digest, Item) from input line `start` on, duplicates made errors,
    up to input line `max_lines`; `position` counts the input lines consumed."""

    def __init__(self, lines: Iterator[tuple[int, RawLine]], fmt: str, text: Optional[TextDefaults],
                 num_shards: int, shard_index: int, seen: Optional[IdSet],
                 max_lines: Optional[int], start: int):
        self._lines, self.fmt, self.text = lines, fmt, text
        self.num_shards, self.shard_index = num_shards, shard_index
        self.seen, self.max_lines = seen, max_lines
        self.position = start

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, bytes, Item]:
        while self.max_lines is None or self.position < self.max_lines:
            no, raw = next(self._lines)
            self.position = no + 1
            item = parse_line(no, raw, self.fmt, self.text)
            if not belongs(item, no, self.num_shards, self.shard_index):
                continue
            return no, line_digest(raw), check_duplicate(self.seen, item)
        raise StopIteration
