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
- Parsing the output (structured/tool_parser.py, re-exported here): `parse_tool_calls` for a
  whole text, `ToolCallStream` for streamed deltas. Both run the same incremental scanner, so a
  stream's content and calls equal the whole text's for any split into deltas. Text that looks
  like a call but is not a valid one stays content.
- `call_grammar`: a llguidance grammar for `tool_choice` "required" or a named function, which
  makes the output one or more calls in the format's exact text with arguments valid against the
  function's schema.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Collection, Iterable, Optional, Sequence

from jaxinfer.structured.tool_parser import (DEFAULT_FORMAT, FORMATS, HERMES_CLOSE,  # noqa: F401
                                             HERMES_OPEN, PYTHON_TAG, ToolCallStream,
                                             _check_format, new_call_id, parse_tool_calls)
from jaxinfer.user_input import show

MAX_TOOLS = 128
NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}

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
