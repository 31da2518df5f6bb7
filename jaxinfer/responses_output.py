"""The Responses API's answers (see responses_api): a `chat.completion` turned into a Responses
`response` object, and a stream of `chat.completion.chunk`s into the Responses event stream
(`response.created` ... `response.completed`), numbered by sequence_number.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Optional

def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def new_response_id() -> str:
    return _id("resp")


def sse_event(event: dict) -> bytes:
    """One server-sent event of a Responses stream: its type, then its JSON."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n" \
        .encode()


def _echo_tools(body: dict) -> list:
    return [{"type": "function", "name": t["name"], "description": t.get("description"),
             "parameters": t.get("parameters"), "strict": t.get("strict")}
            for t in body.get("tools") or []]


def _skeleton(body: dict, response_id: str, created_at: int, model: str) -> dict:
    """A response object with the request's settings echoed, before any output."""
    temperature, top_p = body.get("temperature"), body.get("top_p")
    return {
        "id": response_id, "object": "response", "created_at": created_at,
        "status": "in_progress", "background": False, "completed_at": None, "error": None,
        "incomplete_details": None, "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"), "max_tool_calls": None,
        "model": model, "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "previous_response_id": None, "reasoning": None, "store": False,
        "temperature": 1.0 if temperature is None else temperature,
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto", "tools": _echo_tools(body),
        "top_p": 1.0 if top_p is None else top_p, "truncation": "disabled", "usage": None,
        "user": body.get("user"), "metadata": body.get("metadata") or {}}


def _status(finish_reason: Optional[str]) -> tuple:
    """chat finish_reason -> (response status, incomplete_details)."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    if finish_reason == "abort":  # cancelled before it finished
        return "incomplete", None
    return "completed", None


def _usage(chat_usage: Optional[dict]) -> Optional[dict]:
    if not chat_usage:
        return None
    prompt = chat_usage.get("prompt_tokens", 0)
    completion = chat_usage.get("completion_tokens", 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": chat_usage.get("total_tokens", prompt + completion)}


def _finish(response: dict, finish_reason: Optional[str], usage: Optional[dict]) -> dict:
    """Sets the final status (the last item's too, when cut short) and usage."""
    status, details = _status(finish_reason)
    response["status"], response["incomplete_details"] = status, details
    response["completed_at"] = int(time.time()) if status == "completed" else None
    response["usage"] = _usage(usage)
    if status == "incomplete" and response["output"]:
        response["output"][-1]["status"] = "incomplete"
    return response


def _reasoning_item(item_id: str, text: Optional[str], status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [] if text is None else [{"type": "reasoning_text", "text": text}],
            "status": status}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: Optional[str], status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if text is None else [_text_part(text)]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response_object(chat_response: dict, *, request_body: dict,
                    response_id: Optional[str] = None) -> dict:
    """A `chat.completion` (one choice) -> the Responses `response` object, the request's
    settings (request_body, as to_chat_body took it) echoed back."""
    choice = chat_response["choices"][0]
    message = choice.get("message") or {}
    response = _skeleton(request_body, response_id or _id("resp"), chat_response["created"],
                         chat_response["model"])
    output = response["output"]
    if message.get("reasoning_content"):
        output.append(_reasoning_item(_id("rs"), message["reasoning_content"], "completed"))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        output.append(_message_item(_id("msg"), message.get("content") or "", "completed"))
    for call in calls:
        fn = call.get("function") or {}
        output.append(_call_item(_id("fc"), call.get("id") or _id("call"), fn.get("name", ""),
                                 fn.get("arguments", ""), "completed"))
    return _finish(response, choice.get("finish_reason"), chat_response.get("usage"))


class ResponseStream:
    """The Responses event stream of one request, made from its chat.completion.chunk stream:
    start() first, chunk() for each chat chunk, finish() after the last; each returns the
    events to send (`event: {type}` / `data: {event}`), numbered by sequence_number. An item
    opens at its first delta and closes when the next one opens or the stream finishes; the
    final response.completed (or response.incomplete) event carries the whole response."""

    def __init__(self, request_body: dict, response_id: str, created_at: int, model: str):
        self.response = _skeleton(request_body, response_id, created_at, model)
        self._seq = 0
        self._open: Optional[dict] = None   # the item being streamed
        self._kind: Optional[str] = None    # its kind: "reasoning", "message" or a call index
        self._text = ""                     # its text (or arguments) so far
        self._calls: set = set()            # chat tool-call indexes seen
        self._finish_reason: Optional[str] = None
        self._usage: Optional[dict] = None

    def _event(self, type_: str, **fields) -> dict:
        event = {"type": type_, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _snapshot(self) -> dict:
        return {**self.response, "output": [dict(item) for item in self.response["output"]]}

    def start(self) -> list:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    # -- items --

    def _add(self, kind: str, item: dict) -> list:
        events = self._close("completed")
        self._open, self._kind, self._text = item, kind, ""
        index = len(self.response["output"])
        self.response["output"].append(item)
        events.append(self._event("response.output_item.added", output_index=index,
                                  item=dict(item)))
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else (
            _text_part("") if kind == "message" else None)
        if part is not None:
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=index, content_index=0, part=part))
        return events

    def _close(self, status: str) -> list:
        item = self._open
        if item is None:
            return []
        index, text = len(self.response["output"]) - 1, self._text
        where = {"item_id": item["id"], "output_index": index}
        events = []
        if self._kind == "reasoning":
            item.update(_reasoning_item(item["id"], text, status))
            events += [self._event("response.reasoning_text.done", **where, content_index=0,
                                   text=text),
                       self._event("response.content_part.done", **where, content_index=0,
                                   part={"type": "reasoning_text", "text": text})]
        elif self._kind == "message":
            item.update(_message_item(item["id"], text, status))
            events += [self._event("response.output_text.done", **where, content_index=0,
                                   text=text, logprobs=[]),
                       self._event("response.content_part.done", **where, content_index=0,
                                   part=_text_part(text))]
        else:
            item.update(arguments=text, status=status)
            events.append(self._event("response.function_call_arguments.done", **where,
                                      arguments=text))
        events.append(self._event("response.output_item.done", output_index=index,
                                  item=dict(item)))
        self._open = self._kind = None
        return events

    def _open_text(self, kind: str) -> list:
        """Opens a reasoning or message item unless one of that kind is open."""
        if self._kind == kind:
            return []
        item = _reasoning_item(_id("rs"), None, "in_progress") if kind == "reasoning" \
            else _message_item(_id("msg"), None, "in_progress")
        return self._add(kind, item)

    def _delta(self, kind: str, text: str) -> list:
        events = self._open_text(kind)
        self._text += text
        where = {"item_id": self._open["id"], "output_index": len(self.response["output"]) - 1,
                 "content_index": 0, "delta": text}
        if kind == "reasoning":
            events.append(self._event("response.reasoning_text.delta", **where))
        else:
            events.append(self._event("response.output_text.delta", **where, logprobs=[]))
        return events

    def _call_delta(self, delta: dict) -> list:
        index = delta.get("index", 0)
        fn = delta.get("function") or {}
        events = []
        if self._kind != ("call", index):
            if index in self._calls:
                raise ValueError(f"a delta of tool call {index} came after a later item began")
            self._calls.add(index)
            item = _call_item(_id("fc"), delta.get("id") or _id("call"), fn.get("name") or "",
                              "", "in_progress")
            events += self._add(("call", index), item)
        elif fn.get("name"):  # a name sent in pieces
            self._open["name"] += fn["name"]
        if fn.get("arguments"):
            self._text += fn["arguments"]
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=self._open["id"],
                                      output_index=len(self.response["output"]) - 1,
                                      delta=fn["arguments"]))
        return events

    # -- chat chunks --

    def chunk(self, chat_chunk: dict) -> list:
        """The events for one chat.completion.chunk (none for a role-only or empty delta)."""
        events = []
        if chat_chunk.get("usage"):
            self._usage = chat_chunk["usage"]
        for choice in chat_chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._delta("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._delta("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call_delta(call)
            if choice.get("finish_reason") is not None:
                self._finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list:
        """The closing events: the open item's, then response.completed (or
        response.incomplete) with the whole response."""
        events = []
        if not any(item["type"] in ("message", "function_call")
                   for item in self.response["output"]):
            # No text and no call: an empty message, as response_object gives.
            events += self._open_text("message")
        status, _ = _status(self._finish_reason)
        events += self._close(status)
        response = _finish(self._snapshot(), self._finish_reason, self._usage)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        events.append(self._event(kind, response=response))
        return events

    def error_event(self, message: str, code: Optional[str] = "server_error",
                    param: Optional[str] = None) -> dict:
        """The `error` event for a failure mid-stream (the stream ends after it)."""
        return self._event("error", code=code, message=message, param=param)
