"""Reading tool calls out of a chat model's text (see tool_calls for the formats): the whole
text (`parse_tool_calls`) or streamed deltas (`ToolCallStream`), one incremental scanner under
both, so a stream's content and calls equal the whole text's for any split into deltas. Text
that looks like a call but is not a valid one stays content.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Optional

from jaxinfer.structured.reasoning import partial_suffix

FORMATS = ("hermes", "llama3_json")
DEFAULT_FORMAT = "hermes"

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def _check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return fmt


_JSON_WS = " \t\r\n"
_FAIL = object()


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _as_call(raw: str, fmt: str) -> Optional[tuple]:
    """(name, arguments) when `raw` is a call object of format `fmt`, else None."""
    try:
        obj = json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in ("arguments", "parameters") if k in obj), None)
    if key is None:
        # A bare {"name": ...} inside <tool_call> tags is a call without arguments; outside
        # tags (llama3_json) it is more likely JSON the answer shows.
        return (obj["name"], {}) if fmt == "hermes" else None
    args = obj[key]
    if isinstance(args, str):
        try:
            args = json.loads(args, parse_constant=_reject_constant)
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


class _Scanner:
    """Splits model output into ("text", str) and ("call", name, arguments) events as it
    arrives, holding back only what may still turn out to be part of a call.

    hermes: a call is <tool_call>, a call object, and </tool_call> (the close may be missing at
    the end of the output). llama3_json: a call object after <|python_tag|>, at the start of a
    line, or after a call and a ";". A marker not followed by a valid call is text, and scanning
    resumes right after it, so no text is lost.
    """

    def __init__(self, fmt: str):
        self.fmt = _check_format(fmt)
        self.buf = ""
        self.line_blank = True    # only spaces and tabs since the last newline (llama3_json)
        self.after_call = False   # only whitespace since the last call (llama3_json)
        self._obj: Optional[list] = None  # resumable object scan: [start, pos, depth, in_str, esc]

    def feed(self, text: str, final: bool = False) -> list:
        self.buf += text
        out: list = []
        while self.buf and self._step(out, final):
            pass
        return out

    def _consume(self, n: int) -> None:
        self.buf = self.buf[n:]
        self._obj = None

    def _text(self, out: list, n: int) -> None:
        s = self.buf[:n]
        out.append(("text", s))
        self._consume(n)
        i = s.rfind("\n")
        tail = s[i + 1:]
        if tail.strip(" \t"):
            self.line_blank = False
        elif i >= 0:
            self.line_blank = True
        if s.strip(_JSON_WS):
            self.after_call = False

    def _call(self, out: list, end: int, name: str, args: dict) -> None:
        out.append(("call", name, args))
        self._consume(end)
        self.line_blank = False
        self.after_call = True

    def _step(self, out: list, final: bool) -> bool:
        """Handles the front of the buffer; False when it must wait for more text."""
        if self.fmt == "hermes":
            return self._step_hermes(out, final)
        return self._step_llama3(out, final)

    def _attempt(self, out: list, offset: int, marker_len: int, close: Optional[str],
                 final: bool) -> bool:
        r = self._try_call(offset, close, final)
        if r is None:
            return False
        if r is _FAIL:
            self._text(out, marker_len)
        else:
            self._call(out, *r)
        return True

    def _step_hermes(self, out: list, final: bool) -> bool:
        i = self.buf.find(HERMES_OPEN)
        if i == 0:
            return self._attempt(out, len(HERMES_OPEN), len(HERMES_OPEN), HERMES_CLOSE, final)
        if i < 0:
            i = len(self.buf) - (0 if final else partial_suffix(self.buf, HERMES_OPEN))
        if i == 0:
            return False
        self._text(out, i)
        return True

    def _step_llama3(self, out: list, final: bool) -> bool:
        buf = self.buf
        blank, after = self.line_blank, self.after_call
        for i, ch in enumerate(buf):
            if buf.startswith(PYTHON_TAG, i):
                kind = PYTHON_TAG
            elif (ch == "{" and blank) or (ch == ";" and after):
                kind = ch
            elif not final and ch == "<" and PYTHON_TAG.startswith(buf[i:]):
                kind = ""  # a partial <|python_tag|>: wait for the rest
            else:
                if ch == "\n":
                    blank = True
                elif ch not in " \t":
                    blank = False
                if ch not in _JSON_WS:
                    after = False
                continue
            if i > 0:
                self._text(out, i)
                return True
            if not kind:
                return False
            offset = 0 if kind == "{" else len(kind)
            return self._attempt(out, offset, len(kind), None, final)
        self._text(out, len(buf))
        return True

    def _try_call(self, offset: int, close: Optional[str], final: bool) -> Any:
        """A call starting at buf[offset] (after whitespace): (end, name, arguments), _FAIL, or
        None while the buffer ends before the outcome is known."""
        buf, n = self.buf, len(self.buf)
        j = offset
        while j < n and buf[j] in _JSON_WS:
            j += 1
        if j == n:
            return _FAIL if final else None
        if buf[j] != "{":
            return _FAIL
        end = self._object_end(j)
        if end is None:
            return _FAIL if final else None
        call = _as_call(buf[j:end], self.fmt)
        if call is None:
            return _FAIL
        if close is None:
            return (end, *call)
        k = end
        while k < n and buf[k] in _JSON_WS:
            k += 1
        if buf.startswith(close, k):
            return (k + len(close), *call)
        if close.startswith(buf[k:]):
            # The close is still to come, or (at the end) missing or cut short: the model
            # stopped right after the call.
            return (n, *call) if final else None
        return _FAIL

    def _object_end(self, start: int) -> Optional[int]:
        """The index after the "}" closing the JSON object at buf[start], or None when the
        buffer ends first; the scan resumes where it stopped when more text arrives."""
        if self._obj is None or self._obj[0] != start:
            self._obj = [start, start, 0, False, False]
        _, resume, depth, in_str, esc = self._obj
        buf = self.buf
        for pos in range(resume, len(buf)):
            ch = buf[pos]
            if in_str:
                if esc:
                    esc = False
                elif ch == "\\":
                    esc = True
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return pos + 1
        self._obj = [start, len(buf), depth, in_str, esc]
        return None


class _Content:
    """The content around calls: whitespace next to a call is dropped (the newlines a model
    writes around its calls), and content that is only whitespace is no content. Whitespace is
    held until the next non-space text shows whether a call follows it."""

    def __init__(self) -> None:
        self.pending = ""
        self.started = False     # the current stretch of content has non-space text
        self.after_call = False  # the current stretch follows a call

    def text(self, s: str) -> str:
        body = s.rstrip()
        if not body:
            self.pending += s
            return ""
        head = self.pending + body
        if not self.started and self.after_call:
            head = head.lstrip()
        self.started = True
        self.pending = s[len(body):]
        return head

    def call(self) -> None:
        self.pending, self.started, self.after_call = "", False, True

    def finish(self) -> str:
        out = self.pending if self.started else ""
        self.pending = ""
        return out


class ToolCallStream:
    """Turns streamed text of format `fmt` into OpenAI chat-completion-chunk deltas.

    add(delta) and finish() return lists of delta dicts: {"content": ...} for text outside calls
    (held back only while it may be the start of a call, and whitespace until it is known not to
    border one), and for each call {"tool_calls": [{"index", "id", "type": "function",
    "function": {"name", "arguments": ""}}]} followed by {"tool_calls": [{"index", "function":
    {"arguments": ...}}]} with the arguments as a JSON string. A call is sent whole once its end
    is seen. For any split of a text into deltas the content and calls equal parse_tool_calls's.
    """

    def __init__(self, fmt: str):
        self._scanner = _Scanner(fmt)
        self._content = _Content()
        self.calls = 0

    def add(self, delta: str) -> list:
        return self._deltas(self._scanner.feed(delta))

    def finish(self) -> list:
        deltas = self._deltas(self._scanner.feed("", final=True))
        tail = self._content.finish()
        if tail:
            self._append_content(deltas, tail)
        return deltas

    @staticmethod
    def _append_content(deltas: list, text: str) -> None:
        if deltas and "content" in deltas[-1]:
            deltas[-1]["content"] += text
        else:
            deltas.append({"content": text})

    def _deltas(self, events: list) -> list:
        deltas: list = []
        for event in events:
            if event[0] == "text":
                text = self._content.text(event[1])
                if text:
                    self._append_content(deltas, text)
                continue
            _, name, args = event
            self._content.call()
            index = self.calls
            self.calls += 1
            deltas.append({"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                                           "function": {"name": name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": index, "function": {
                "arguments": json.dumps(args, ensure_ascii=False)}}]})
        return deltas


def parse_tool_calls(text: str, fmt: str) -> tuple:
    """(content, tool_calls) of a whole output of format `fmt`: the text outside the calls
    (None when empty or only whitespace; whitespace next to a call is dropped) and the calls as
    OpenAI tool calls {"id": "call_<24 hex>", "type": "function", "function": {"name",
    "arguments": <JSON string>}}. Text that looks like a call but is not one stays content."""
    stream = ToolCallStream(fmt)
    content: list = []
    calls: list = []
    for delta in stream.add(text) + stream.finish():
        if "content" in delta:
            content.append(delta["content"])
            continue
        part = delta["tool_calls"][0]
        if "id" in part:
            calls.append({"id": part["id"], "type": "function",
                          "function": {"name": part["function"]["name"], "arguments": ""}})
        else:
            calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    joined = "".join(content)
    return (joined if joined.strip() else None), calls
