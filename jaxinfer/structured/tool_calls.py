"""OpenAI function calling (`tools`, `tool_choice`, `parallel_tool_calls`) on the host.

Chat models are fine-tuned to write tool calls as text in a family-specific format; this module
holds everything about those formats that needs no device:

- `check_tools` validates a request's tool fields by OpenAI's rules (every refusal a `ToolError`
  naming the request field at fault, as the server's 400 answers report it) and checks each
  function's parameters schema with llguidance, so a schema the grammar engine cannot enforce is
  refused up front rather than when a constrained request starts.
- The formats: `hermes` (Hermes 2 Pro, Qwen2.5, Qwen3: `<tool_call>` blocks holding
  `{"name": ..., "arguments": {...}}`) and `llama3_json` (Llama 3.1/3.2: bare
  `{"name": ..., "parameters": {...}}` objects separated by `; `, optionally after
  `<|python_tag|>`). `pick_format` chooses one from the chat template; hermes is the default,
  since most open models that call tools use it.
- Prompting: templates that take `tools` get them as Hugging Face passes them; for the others
  `default_tools_system_prompt` describes the functions and the format, and
  `tool_messages_for_template` rewrites the conversation's calls and results as plain messages.
- Parsing the output: `parse_tool_calls` for a whole text, `ToolCallStream` for streamed deltas.
  Both run the same incremental scanner, so a stream's content and calls equal the whole text's
  for any split into deltas. Text that looks like a call but is not a valid one stays content.
- `call_grammar`: a llguidance grammar for `tool_choice` "required" or a named function, which
  makes the output one or more calls in the format's exact text with arguments valid against the
  function's schema.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Any, Collection, Iterable, Optional, Sequence

from jaxinfer.structured.reasoning import partial_suffix
from jaxinfer.user_input import show

FORMATS = ("hermes", "llama3_json")
DEFAULT_FORMAT = "hermes"

MAX_TOOLS = 128
NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

# Arguments in constrained output use json.dumps's separators, as the chat templates render calls
# (Jinja's tojson) and as the models write them; fixed whitespace also keeps a sampler from
# spending its tokens on spaces.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolError(ValueError):
    """An invalid tool field of a request; `param` names the field at fault, as OpenAI's error
    objects do ("tools", "tools[2].function.name", "tool_choice", "parallel_tool_calls")."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


# ------------------------------------------------------------------ request validation


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """A request's validated tool fields.

    tools: the function tools, each normalized to {"name", "description", "parameters"}
        (description "" when absent, parameters a JSON schema of an object).
    choice: "none", "auto", "required" or "named".
    named: the function tool_choice names, when choice is "named".
    parallel: whether the model may make several calls in one answer.
    """

    tools: tuple = ()
    choice: str = "none"
    named: Optional[str] = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """Whether the answer must be tool calls (constrained by `call_grammar`)."""
        return self.choice in ("required", "named")

    def tool(self, name: str) -> Optional[dict]:
        for t in self.tools:
            if t["name"] == name:
                return t
        return None


_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


def _check_parameters(params: Any, where: str) -> dict:
    if params is None:
        return dict(EMPTY_PARAMETERS)
    if not isinstance(params, dict):
        raise ToolError(where, f"{show(params)} is not a JSON object (a JSON schema is expected)")
    kind = params.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise ToolError(where, f'the schema\'s type is {show(kind)}; function parameters must be '
                               'a schema of "type": "object"')
    params = dict(params)
    params["type"] = "object"
    error = schema_error(params)
    if error:
        raise ToolError(where, f"the schema cannot be enforced: {error}")
    return params


def schema_error(params: dict) -> str:
    """llguidance's error for an arguments schema ("" when it compiles): an invalid schema or
    one using a keyword llguidance does not implement (uniqueItems, for one)."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(_arguments_schema(params))
    except ValueError as e:
        return str(e)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return "; ".join(messages) if is_error else ""


def _arguments_schema(params: dict) -> dict:
    # llguidance's options replace any the schema carries: a client does not set them.
    return {**params, "x-guidance": dict(JSON_OPTIONS)}


def _check_tool(i: int, tool: Any) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise ToolError(where, f"{show(tool)} is not an object")
    unknown = sorted(set(tool) - _TOOL_KEYS)
    if unknown:
        raise ToolError(f"{where}.{unknown[0]}", "unknown parameter")
    if tool.get("type") != "function":
        raise ToolError(f"{where}.type", f'{show(tool.get("type"))} is not supported; '
                                         'only "function" tools are')
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ToolError(f"{where}.function", f"{show(fn)} is not an object")
    unknown = sorted(set(fn) - _FUNCTION_KEYS)
    if unknown:
        raise ToolError(f"{where}.function.{unknown[0]}", "unknown parameter")
    name = fn.get("name")
    if name is None:
        raise ToolError(f"{where}.function.name", "missing; every function needs a name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ToolError(f"{where}.function.name",
                        f"{show(name)} must be 1 to 64 letters, digits, underscores or dashes")
    description = fn.get("description", "")
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise ToolError(f"{where}.function.description", f"{show(description)} is not a string")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolError(f"{where}.function.strict", f"{show(strict)} is not a boolean")
    parameters = _check_parameters(fn.get("parameters"), f"{where}.function.parameters")
    return {"name": name, "description": description, "parameters": parameters}


def check_tools(tools: Any, tool_choice: Any = None,
                parallel_tool_calls: Any = None) -> ToolRequest:
    """Validates a chat request's `tools`, `tool_choice` and `parallel_tool_calls` (None: absent)
    by OpenAI's rules; raises ToolError naming the field at fault."""
    normalized: list = []
    if tools is not None:
        if not isinstance(tools, list):
            raise ToolError("tools", f"{show(tools)} is not an array")
        if not tools:
            raise ToolError("tools", "empty array; give at least one tool or leave tools out")
        if len(tools) > MAX_TOOLS:
            raise ToolError("tools", f"{len(tools)} tools; at most {MAX_TOOLS} are allowed")
        seen: set = set()
        for i, tool in enumerate(tools):
            t = _check_tool(i, tool)
            if t["name"] in seen:
                raise ToolError(f"tools[{i}].function.name",
                                f"{show(t['name'])} names two tools; function names must be unique")
            seen.add(t["name"])
            normalized.append(t)

    if parallel_tool_calls is None:
        parallel = True
    elif isinstance(parallel_tool_calls, bool):
        parallel = parallel_tool_calls
    else:
        raise ToolError("parallel_tool_calls", f"{show(parallel_tool_calls)} is not a boolean")

    named = None
    if tool_choice is None:
        choice = "auto" if normalized else "none"
    elif isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ToolError("tool_choice", f'{show(tool_choice)} is not "none", "auto", "required" '
                                           "or a function")
        choice = tool_choice
    elif isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function":
            raise ToolError("tool_choice", f'{show(tool_choice)}: only {{"type": "function", '
                                           '"function": {"name": ...}} is supported')
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ToolError("tool_choice", f"{show(tool_choice)} names no function "
                                           '(expected "function": {"name": ...})')
        if not any(t["name"] == name for t in normalized):
            raise ToolError("tool_choice", f"{show(name)} is not the name of a function in tools")
        choice, named = "named", name
    else:
        raise ToolError("tool_choice", f"{show(tool_choice)} is not a string or an object")
    if not normalized and choice != "none":
        raise ToolError("tool_choice", f"{show(tool_choice)} is only allowed when tools are given")
    return ToolRequest(tools=tuple(normalized), choice=choice, named=named, parallel=parallel)


def _function_tools(tools: Iterable[dict]) -> list:
    """Normalized tools from either form: {"name", ...} or OpenAI's {"type", "function"}."""
    return [t.get("function", t) for t in tools]


# ------------------------------------------------------------------ formats and prompting


def _check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return fmt


def pick_format(chat_template: Optional[str], override: Optional[str] = None) -> str:
    """The tool-call format of a model: `override` when given; llama3_json for Llama 3 templates
    (they mention <|python_tag|>, the ipython role, or "parameters" with Llama 3's headers);
    otherwise hermes, which most tool-calling open models use and which is the default."""
    if override is not None:
        return _check_format(override)
    t = chat_template or ""
    if PYTHON_TAG in t or "ipython" in t or ('"parameters"' in t and "<|start_header_id|>" in t):
        return "llama3_json"
    return DEFAULT_FORMAT


def template_takes_tools(chat_template: Optional[str]) -> bool:
    """Whether a Jinja chat template reads a `tools` variable; the caller then renders it with
    tools=[{"type": "function", "function": {...}}, ...], as Hugging Face does."""
    if not chat_template:
        return False
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(chat_template))
    except jinja2.TemplateSyntaxError:
        # Templates using extensions (a {% generation %} tag, say) do not parse without them.
        return re.search(r"\btools\b", chat_template) is not None


def _tools_json(tools: Iterable[dict]) -> str:
    return "\n".join(json.dumps({"type": "function", "function": {
        "name": f["name"], "description": f.get("description") or "",
        "parameters": f.get("parameters") or EMPTY_PARAMETERS}}, ensure_ascii=False)
        for f in _function_tools(tools))


def default_tools_system_prompt(tools: Iterable[dict], fmt: str) -> str:
    """The system prompt text that offers `tools` (normalized or OpenAI's form) to a model whose
    template does not take tools: the functions as JSON, one a line, and the exact output format
    of `fmt`. The caller puts it in (or before) the conversation's system message."""
    listing = _tools_json(tools)
    if _check_format(fmt) == "hermes":
        return ("# Tools\n\n"
                "You can call functions to help with the user's request. The functions are "
                "listed as JSON, one per line, between <tools></tools> tags:\n"
                f"<tools>\n{listing}\n</tools>\n\n"
                "To call a function, write its name and arguments as a JSON object between "
                "<tool_call></tool_call> tags, exactly like this:\n"
                f"{HERMES_OPEN}\n"
                '{"name": <function name>, "arguments": <arguments as a JSON object>}\n'
                f"{HERMES_CLOSE}\n"
                "To make several calls, write one such block for each, one after the other.")
    return ("You can call functions to help with the user's request. The functions are listed "
            f"as JSON, one per line:\n{listing}\n\n"
            "To call a function, answer with nothing but a JSON object of the form "
            '{"name": <function name>, "parameters": <arguments as a JSON object>}. '
            'To make several calls, separate the objects with "; ". Call only the functions '
            "listed, with arguments that match their parameters.")


def _arguments_text(arguments: Any) -> str:
    """A call's arguments as JSON text: a dict, or OpenAI's JSON string (kept as written when it
    is not a JSON object, so a conversation replays as it was)."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        if not isinstance(parsed, dict):
            return arguments
        arguments = parsed
    return json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)


def render_calls(tool_calls: Sequence[dict], fmt: str) -> str:
    """OpenAI tool calls ({"function": {"name", "arguments"}}) as the text of format `fmt`, as
    the model would write them."""
    key = "arguments" if _check_format(fmt) == "hermes" else "parameters"
    objects = []
    for call in tool_calls:
        fn = call.get("function", call)
        objects.append(f'{{"name": {json.dumps(fn.get("name", ""), ensure_ascii=False)}, '
                       f'"{key}": {_arguments_text(fn.get("arguments"))}}}')
    if fmt == "hermes":
        return "\n".join(f"{HERMES_OPEN}\n{o}\n{HERMES_CLOSE}" for o in objects)
    return "; ".join(objects)


def _text_of(content: Any) -> str:
    """A message's text: a string, None, or a list of OpenAI content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def tool_messages_for_template(messages: Sequence[dict], takes_tools: bool,
                               fmt: str = DEFAULT_FORMAT) -> list:
    """The conversation as a chat template can render it.

    Templates that take tools get assistant tool calls with their arguments parsed to dicts (as
    Hugging Face templates expect; unparsable arguments stay strings) and tool messages as they
    are. For the others, an assistant message's calls become its content in `fmt`'s text, and
    tool results become a user message of <tool_response> blocks (consecutive results in one
    message, as Qwen's template does) for hermes, or ipython messages for llama3_json.
    """
    _check_format(fmt)
    out: list = []
    responses = None  # the user message holding the latest run of hermes tool results
    for message in messages:
        role = message.get("role")
        calls = message.get("tool_calls") if role == "assistant" else None
        if takes_tools:
            if calls:
                message = {**message, "tool_calls": [_parsed_call(c) for c in calls]}
        elif calls:
            text = _text_of(message.get("content"))
            rest = {k: v for k, v in message.items() if k not in ("tool_calls", "content")}
            calls_text = render_calls(calls, fmt)
            message = {**rest, "content": f"{text}\n{calls_text}" if text else calls_text}
        elif role == "tool":
            result = _text_of(message.get("content"))
            if fmt == "llama3_json":
                message = {"role": "ipython", "content": result}
            else:
                block = f"<tool_response>\n{result}\n</tool_response>"
                if responses is not None:
                    responses["content"] += "\n" + block
                    continue
                message = responses = {"role": "user", "content": block}
                out.append(message)
                continue
        responses = None
        out.append(message)
    return out


def _parsed_call(call: dict) -> dict:
    call = dict(call)
    fn = call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            args = None
        if isinstance(args, dict):
            call["function"] = {**fn, "arguments": args}
    return call


# ------------------------------------------------------------------ parsing the output

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


# ------------------------------------------------------------------ constrained calls


def grammar_markers(fmt: str) -> tuple:
    """The marker texts `call_grammar` writes for `fmt`. A caller whose tokenizer has one of
    them as a single added token passes it in special_markers."""
    return (HERMES_OPEN, HERMES_CLOSE) if _check_format(fmt) == "hermes" else ()


def _lark_string(text: str) -> str:
    return json.dumps(text)  # JSON's escapes are Lark's


def call_grammar(req: ToolRequest, fmt: str, special_markers: Collection[str] = ()) -> str:
    """A grammar in llguidance's Lark (StructuredOutputs(grammar=...)) that makes the output
    tool calls in `fmt`'s exact text: for tool_choice "required", one or more calls of any of
    the tools (exactly one when parallel_tool_calls is false); for a named function, one call
    of it. The arguments are
    JSON valid against the function's parameters (with json.dumps's separators, and object
    properties in the schema's order, as llguidance writes them), so the output always parses
    with parse_tool_calls.

    Markers are matched as text by default. llguidance treats every added token of a tokenizer
    as a special token that text never matches, so where a marker is an added token (Qwen's
    <tool_call> and </tool_call>, say) a text literal would make the model spell it out of
    byte-level pieces it was never trained to write. Markers named in `special_markers` are
    written as the token instead (<tool_call> in llguidance's Lark); the tokenizer must have
    them, and must decode them as text (Qwen's are not `special`, so they survive
    skip_special_tokens). llama3_json calls need no markers: the optional <|python_tag|> is
    left out.
    """
    _check_format(fmt)
    if req.choice == "named":
        tools = [t for t in req.tools if t["name"] == req.named]
    elif req.choice == "required":
        tools = list(req.tools)
    else:
        raise ValueError(f"tool_choice {req.choice!r} is not constrained; only \"required\" and "
                         "a named function are")
    if not tools:
        raise ValueError("no tool to call")
    key = "arguments" if fmt == "hermes" else "parameters"
    lines = []
    for k, t in enumerate(tools):
        head = _lark_string(f'{{"name": "{t["name"]}", "{key}": ')
        lines.append(f"fn_{k}: {head} %json {json.dumps(_arguments_schema(t['parameters']))} "
                     '"}"')

    def marker(text: str) -> str:
        return text if text in special_markers else _lark_string(text)

    if fmt == "hermes":
        call = f'{marker(HERMES_OPEN)} "\\n" body "\\n" {marker(HERMES_CLOSE)}'
        separator = '"\\n"'
    else:
        call = "body"
        separator = '"; "'
    many = req.choice == "required" and req.parallel
    lark = "\n".join([f"start: call ({separator} call)*" if many else "start: call",
                      f"call: {call}",
                      "body: " + " | ".join(f"fn_{k}" for k in range(len(tools))),
                      *lines])
    return lark
