"""The OpenAI Responses API (`POST /v1/responses`), stateless, as a translation layer over chat
completions: a Responses request body is checked and turned into the equivalent
chat-completions body (which openai_api then checks and runs as any chat request), and the
chat layer's `chat.completion` or its stream of `chat.completion.chunk`s is turned back into a
Responses `response` object or its stream of events. One generation path serves both APIs, so
both mean the same thing by a prompt, a tool or a sampling field.

Stateless: the server keeps no responses, so a conversation is sent whole in `input` each turn
(the earlier turns' output items may be passed back as input items as they are), and what
needs stored state (`previous_response_id`, `conversation`, `store: true`, `background: true`)
is refused. As in openai_api every field is understood or refused, never ignored, and a refusal
is a RequestError naming the Responses field (`input[2].content`, `text.format`, ...).

Translation rules worth knowing:
- `instructions` becomes a leading system message; a `developer` message becomes a `system`
  one (chat templates know system messages; OpenAI treats the two alike).
- `function_call` input items become an assistant message's `tool_calls` (consecutive calls,
  and an assistant message right before them, make one message, as the model produced them);
  `function_call_output` items become `role: "tool"` messages.
- `reasoning` input items (an earlier turn's thinking, passed back with its output) are
  accepted and left out of the prompt: chat templates leave earlier turns' thinking out too.
- The output is a `reasoning` item when the model thought, a `message` item when it wrote
  text or called no tool, and a `function_call` item per tool call. A response cut at
  `max_output_tokens` is `incomplete` and so is its last item.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from jaxinfer.openai_api import RequestError
from jaxinfer.user_input import check_tree, show

RESPONSES = "/v1/responses"
MAX_METADATA_KEYS = 16            # OpenAI's limits on `metadata`
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# OpenAI's rule for function and json_schema names.
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")

# Passed to the chat layer unchanged: it checks them under the same names.
_PASS_THROUGH = ("model", "temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty",
                 "user", "metadata")
# Known fields that need what a stateless server lacks; null (or false, or empty) means absent.
_STATEFUL = ("previous_response_id", "conversation", "background", "include", "reasoning",
             "truncation")
_FIELDS = set(_PASS_THROUGH) | set(_STATEFUL) | {
    "input", "instructions", "max_output_tokens", "stream", "stream_options", "tools",
    "tool_choice", "parallel_tool_calls", "text", "store"}

_MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}
_PART_KEYS = {"input_text": {"type", "text"},
              "output_text": {"type", "text", "annotations", "logprobs"}}
_CALL_KEYS = {"type", "call_id", "name", "arguments", "id", "status"}
_OUTPUT_KEYS = {"type", "call_id", "output", "id", "status"}
_REASONING_KEYS = {"type", "id", "summary", "content", "encrypted_content", "status"}
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
_SCHEMA_KEYS = {"type", "name", "schema", "strict", "description"}


# ---- requests --------------------------------------------------------------------------------

def _fail(message: str, param: str):
    raise RequestError(message, param)


def _unknown(obj: dict, allowed: set, where: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        _fail(f"{where}: unknown or unsupported field {show(extra[0])}", f"{where}.{extra[0]}"[:64])


def _opt_str(obj: dict, key: str, where: str) -> Optional[str]:
    v = obj.get(key)
    if v is not None and not isinstance(v, str):
        _fail(f"{where} must be a string, got {show(v)}", where)
    return v


def _opt_bool(obj: dict, key: str, where: str) -> Optional[bool]:
    v = obj.get(key)
    if v is not None and not isinstance(v, bool):
        _fail(f"{where} must be true or false, got {show(v)}", where)
    return v


def _text_parts(content: Any, where: str) -> str:
    """A message's content: a string, or a list of input_text / output_text parts (joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        _fail(f"{where} must be a string or a list of input_text parts, got {show(content)}",
              where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            _fail(f"{at} must be an object, got {show(part)}", at)
        kind = part.get("type")
        if not isinstance(kind, str) or kind not in _PART_KEYS:
            _fail(f"{at}.type: only text parts (input_text, output_text) are supported, got "
                  f"{show(kind)}", f"{at}.type")
        _unknown(part, _PART_KEYS[kind], at)
        if not isinstance(part.get("text"), str):
            _fail(f"{at}.text must be a string, got {show(part.get('text'))}", f"{at}.text")
        for key in ("annotations", "logprobs"):  # an earlier output's, passed back: no effect
            if part.get(key) is not None and not isinstance(part[key], list):
                _fail(f"{at}.{key} must be a list, got {show(part[key])}", f"{at}.{key}")
        texts.append(part["text"])
    return "".join(texts)


def _input_messages(items: Any) -> list:
    """`input` -> chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        _fail(f"input must be a string or a non-empty list of items, got {show(items)}", "input")
    messages: list = []
    call_ids: set = set()
    merge = False  # the last message is an assistant turn that function calls may join
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            _fail(f"{at} must be an object, got {show(item)}", at)
        kind = item.get("type", "message")
        if kind == "message":
            _unknown(item, _MESSAGE_KEYS, at)
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                _fail(f"{at}.role must be one of user, system, developer, assistant; got "
                      f"{show(role)}", f"{at}.role")
            if "content" not in item:
                _fail(f"{at}.content is missing", f"{at}.content")
            text = _text_parts(item["content"], f"{at}.content")
            messages.append({"role": "system" if role == "developer" else role, "content": text})
            merge = role == "assistant"
        elif kind == "function_call":
            _unknown(item, _CALL_KEYS, at)
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    _fail(f"{at}.{key} must be a string, got {show(item.get(key))}",
                          f"{at}.{key}")
            if not item["call_id"]:
                _fail(f"{at}.call_id must not be empty", f"{at}.call_id")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            call_ids.add(item["call_id"])
            if merge:
                last = messages[-1]
                if not last.get("content"):
                    last["content"] = None
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                merge = True
        elif kind == "function_call_output":
            _unknown(item, _OUTPUT_KEYS, at)
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                _fail(f"{at}.call_id must be a string, got {show(call_id)}", f"{at}.call_id")
            if call_id not in call_ids:
                _fail(f"{at}: no function_call item before it has call_id {show(call_id)}",
                      f"{at}.call_id")
            if "output" not in item:
                _fail(f"{at}.output is missing", f"{at}.output")
            output = _text_parts(item["output"], f"{at}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            merge = False
        elif kind == "reasoning":  # checked, and left out of the prompt
            _unknown(item, _REASONING_KEYS, at)
            for key in ("summary", "content"):
                if item.get(key) is not None and not isinstance(item[key], list):
                    _fail(f"{at}.{key} must be a list, got {show(item[key])}", f"{at}.{key}")
        else:
            _fail(f"{at}.type {show(kind)} is not supported (only message, function_call, "
                  "function_call_output and reasoning items)", f"{at}.type")
    if not messages:
        _fail("input holds no message", "input")
    return messages


def _tools(tools: Any) -> list:
    """Responses function tools -> chat tools."""
    if not isinstance(tools, list):
        _fail(f"tools must be a list, got {show(tools)}", "tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            _fail(f"{at} must be an object, got {show(tool)}", at)
        if tool.get("type") != "function":
            _fail(f"{at}.type {show(tool.get('type'))} is not supported (only function tools)",
                  f"{at}.type")
        _unknown(tool, _TOOL_KEYS, at)
        name = tool.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            _fail(f"{at}.name must be 1 to 64 letters, digits, '_' or '-', got {show(name)}",
                  f"{at}.name")
        if name in names:
            _fail(f"{at}.name {show(name)} names an earlier tool too", f"{at}.name")
        names.add(name)
        function = {"name": name}
        if _opt_str(tool, "description", f"{at}.description") is not None:
            function["description"] = tool["description"]
        params = tool.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                _fail(f"{at}.parameters must be a JSON schema object, got {show(params)}",
                      f"{at}.parameters")
            function["parameters"] = params
        if _opt_bool(tool, "strict", f"{at}.strict") is not None:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any, names: set) -> Any:
    if choice in ("none", "auto"):
        return choice
    if choice == "required":
        if not names:
            _fail("tool_choice \"required\" needs tools", "tool_choice")
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {
            "type", "name"}:
        if not isinstance(choice["name"], str) or choice["name"] not in names:
            _fail(f"tool_choice names {show(choice['name'])}, which is not in tools",
                  "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    _fail("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
          f"\"name\": ...}}, got {show(choice)}", "tool_choice")


def _response_format(text: Any) -> Optional[dict]:
    """`text` -> the chat `response_format` (None for plain text)."""
    if not isinstance(text, dict):
        _fail(f"text must be an object, got {show(text)}", "text")
    _unknown(text, {"format", "verbosity"}, "text")
    if text.get("verbosity") is not None:
        _fail(f"text.verbosity {show(text['verbosity'])} is not supported", "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        _fail(f"text.format must be an object, got {show(fmt)}", "text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        _unknown(fmt, {"type"}, "text.format")
        return None if kind == "text" else {"type": "json_object"}
    if kind != "json_schema":
        _fail(f"text.format.type must be text, json_object or json_schema, got {show(kind)}",
              "text.format.type")
    _unknown(fmt, _SCHEMA_KEYS, "text.format")
    if not isinstance(fmt.get("name"), str) or not _NAME.match(fmt["name"]):
        _fail("text.format.name must be 1 to 64 letters, digits, '_' or '-', got "
              f"{show(fmt.get('name'))}", "text.format.name")
    if not isinstance(fmt.get("schema"), dict):
        _fail(f"text.format.schema must be a JSON schema object, got {show(fmt.get('schema'))}",
              "text.format.schema")
    spec = {"name": fmt["name"], "schema": fmt["schema"]}
    if _opt_bool(fmt, "strict", "text.format.strict") is not None:
        spec["strict"] = fmt["strict"]
    if _opt_str(fmt, "description", "text.format.description") is not None:
        spec["description"] = fmt["description"]
    return {"type": "json_schema", "json_schema": spec}


def _metadata(v: Any) -> None:
    if not isinstance(v, dict) or len(v) > MAX_METADATA_KEYS or not all(
            isinstance(val, str) and len(k) <= MAX_METADATA_KEY_CHARS
            and len(val) <= MAX_METADATA_VALUE_CHARS for k, val in v.items()):
        _fail(f"metadata must map at most {MAX_METADATA_KEYS} keys of up to "
              f"{MAX_METADATA_KEY_CHARS} characters to strings of up to "
              f"{MAX_METADATA_VALUE_CHARS}, got {show(v)}", "metadata")


def _stateless(body: dict) -> None:
    """Refuses what needs stored responses or a feature this server lacks."""
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            _fail(f"{name} is not supported: this server keeps no responses; send the whole "
                  f"conversation in input (got {show(body[name])})", name)
    if body.get("store") not in (None, False):
        _fail(f"store must be false or absent, got {show(body['store'])}: this server keeps "
              "no responses", "store")
    if body.get("background") not in (None, False):
        _fail(f"background must be false or absent, got {show(body['background'])}: "
              "responses are returned as they are made", "background")
    if body.get("include") not in (None, []):
        _fail(f"include {show(body['include'])} is not supported (no extra output data)",
              "include")
    if body.get("reasoning") is not None:
        _fail(f"reasoning {show(body['reasoning'])} is not supported: the model's reasoning "
              "is not configurable", "reasoning")
    if body.get("truncation") not in (None, "disabled"):
        _fail(f"truncation must be \"disabled\", got {show(body['truncation'])}: input longer "
              "than the model's context is refused, never truncated", "truncation")


def to_chat_body(body: Any) -> dict:
    """Checks a Responses request body; returns the equivalent chat-completions body (for
    openai_api.parse_request(CHAT, ...), which checks the fields passed through unchanged).
    RequestError (400) naming the Responses field for anything unknown, wrong or stateful."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        check_tree(body)
    except ValueError as e:
        raise RequestError(str(e)) from None
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        _fail(f"unknown or unsupported field {show(unknown[0])}", unknown[0][:64])
    _stateless(body)

    messages = _input_messages(body.get("input"))
    instructions = _opt_str(body, "instructions", "instructions")
    if instructions is not None:
        messages.insert(0, {"role": "system", "content": instructions})
    chat: dict = {"messages": messages}
    for name in _PASS_THROUGH:
        if name in body:
            chat[name] = body[name]
    if body.get("metadata") is not None:
        _metadata(body["metadata"])

    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) \
                or not 1 <= max_tokens < 2**31:
            _fail(f"max_output_tokens must be an integer in [1, {2**31 - 1}], got "
                  f"{show(max_tokens)}", "max_output_tokens")
        chat["max_completion_tokens"] = max_tokens

    if _opt_bool(body, "stream", "stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # the final event carries usage
    options = body.get("stream_options")
    if options is not None:
        if not body.get("stream"):
            _fail("stream_options needs stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_obfuscation"} \
                or not isinstance(options.get("include_obfuscation", False), bool):
            _fail(f"stream_options must be {{\"include_obfuscation\": bool}}, got "
                  f"{show(options)}", "stream_options")

    names: set = set()
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
        names = {t["function"]["name"] for t in chat["tools"]}
        if not chat["tools"]:
            del chat["tools"]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"], names)
    if _opt_bool(body, "parallel_tool_calls", "parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("text") is not None:
        fmt = _response_format(body["text"])
        if fmt is not None:
            chat["response_format"] = fmt
    return chat


# The answers, in their own module: the request side above, the response side there.
from jaxinfer.responses_output import (ResponseStream, new_response_id,  # noqa: E402
                                       response_object, sse_event)

__all__ = ["RESPONSES", "to_chat_body", "response_object", "ResponseStream", "new_response_id",
           "sse_event"]
