"""Reading a batch job's input: lazily, one line at a time, each line checked on its own.

Two formats: the OpenAI batch format (one JSON object a line: custom_id, method "POST", url,
body) and plain text (one prompt a line, custom_id = the 1-based line number, sampling from the
job's flags). A line that is not a valid request becomes an error Result for that line; nothing
is dropped but blank lines, which are counted.

Sharding: a line belongs to shard blake2b(custom_id) mod num_shards (its line number stands in
when it has no usable custom_id), so every line of a custom_id, duplicates included, lands in the
same shard, and each shard can find duplicates alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Iterator, Optional, Union

import numpy as np

from jaxinfer.batch import records
from jaxinfer.batch.records import Blank, Result
from jaxinfer.engine.request import SamplingParams
from jaxinfer.openai_api import CHAT, COMPLETIONS, ParsedRequest, RequestError, parse_request

FORMATS = ("auto", "jsonl", "text")
_LINE_FIELDS = {"custom_id", "method", "url", "body"}


@dataclasses.dataclass
class Work:
    """A checked request, ready for the engine."""

    line: int                  # 0-based input line
    custom_id: str
    request: ParsedRequest


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
        for raw in f:
            if raw.strip():
                return "jsonl" if raw.lstrip().startswith(b"{") else "text"
    return "jsonl"


def count_lines(path: str) -> int:
    """Lines in the file (a last line without a newline counts), by a byte scan: ~1 GB/s."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")


def strip_newline(raw: bytes) -> bytes:
    return raw[:-2] if raw.endswith(b"\r\n") else raw[:-1] if raw.endswith(b"\n") else raw


def read_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(0-based line number, line without its newline), lazily."""
    with open(path, "rb") as f:
        for no, raw in enumerate(f):
            yield no, strip_newline(raw)


def line_digest(raw: bytes) -> bytes:
    """16 bytes standing for a line's content, to check on resume that the input is unchanged."""
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


def parse_line(line: int, raw: bytes, fmt: str, text: Optional[TextDefaults]) -> Item:
    """One input line -> a Work, an error Result, or Blank. Duplicates are found by the caller
    (IdSet), since that needs the lines before."""
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
        obj = json.loads(s)
    except ValueError as e:
        return records.line_error(line, None, records.INVALID_JSON, f"invalid JSON: {e}")
    if not isinstance(obj, dict):
        return records.line_error(line, None, records.INVALID_JSON,
                                  f"expected a JSON object, got {type(obj).__name__}")
    cid = obj.get("custom_id")
    if cid is None or cid == "":
        return records.line_error(line, None, records.MISSING_CUSTOM_ID,
                                  "missing custom_id (a non-empty string naming the request)")
    if not isinstance(cid, str):
        return records.line_error(line, None, records.INVALID_LINE,
                                  f"custom_id must be a string, got {cid!r}")
    unknown = sorted(set(obj) - _LINE_FIELDS)
    if unknown:
        return records.line_error(line, cid, records.INVALID_LINE,
                                  f"unknown field {unknown[0]!r}; a batch line has "
                                  f"{sorted(_LINE_FIELDS)}")
    if obj.get("method", "POST") != "POST":
        return records.line_error(line, cid, records.INVALID_LINE,
                                  f"method must be \"POST\", got {obj.get('method')!r}")
    url = obj.get("url")
    if not isinstance(url, str):
        return records.line_error(line, cid, records.INVALID_LINE,
                                  f"url must be one of {list((CHAT, COMPLETIONS))}, got {url!r}")
    if "body" not in obj:
        return records.line_error(line, cid, records.INVALID_LINE, "missing body")
    try:
        # n is checked against the engine's limit when the request is submitted.
        request = parse_request(url, obj["body"], max_n=2**31 - 1)
        if request.stream:
            raise RequestError("stream is not supported in a batch job", "stream")
    except RequestError as e:
        kind = records.UNKNOWN_URL if e.status == 404 else records.INVALID_REQUEST
        return records.request_error(line, cid, e, kind)
    return Work(line, cid, request)


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
    """The custom_ids seen so far, as 128-bit hashes in an open-addressing table of 16-byte
    slots kept at most half full: 32 to 64 bytes per id, against ~90 for a Python set of
    strings. The one part of a job's state that grows with its input (JSONL only)."""

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
                              f"duplicate custom_id {item.custom_id!r} (an earlier line has "
                              "it; custom_ids must be unique)")


class ShardReader:
    """This shard's lines of the input, from `start` on, as (line, digest, Item): lazily,
    duplicates turned into errors, at most `max_lines` input lines read (of all shards).
    `position` is the number of input lines consumed so far."""

    def __init__(self, lines: Iterator[tuple[int, bytes]], fmt: str, text: Optional[TextDefaults],
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
