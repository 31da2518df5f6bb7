"""Tool calling on the host: request validation by OpenAI's rules (each refusal naming its
field), format choice and prompting, parsing both formats from whole texts and from streams
split anywhere (the two always agree), and the grammars for tool_choice "required" and a named
function: valid calls tokenized as SmolLM2 does pass token by token, invalid ones are refused,
and random walks through the grammar's allowed tokens always decode to calls whose arguments
validate against the tool's schema."""

from __future__ import annotations

import copy
import gzip
import json
import os
import re

import jinja2
import jsonschema
import numpy as np
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from llguidance import LLMatcher, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from jaxinfer.structured import tool_calls as tc
from jaxinfer.structured.tool_calls import ToolError, check_tools, parse_tool_calls

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "smollm2_tokenizer")
VOCAB = 49152
EOS = 2


def function(name, parameters=None, description=None):
    fn = {"name": name}
    if description is not None:
        fn["description"] = description
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


WEATHER = function("get_weather", {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}, "The current weather in a city.")
ADD = function("add", {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False})
BOOK = function("book-room", {
    "type": "object",
    "properties": {
        "guest": {"type": "object",
                  "properties": {"name": {"type": "string", "maxLength": 20},
                                 "age": {"type": "integer", "minimum": 18}},
                  "required": ["name", "age"], "additionalProperties": False},
        "rooms": {"type": "array", "minItems": 1, "maxItems": 2,
                  "items": {"type": "object",
                            "properties": {"kind": {"enum": ["single", "double"]},
                                           "nights": {"type": "integer", "minimum": 1,
                                                      "maximum": 30}},
                            "required": ["kind", "nights"], "additionalProperties": False}},
        "note": {"$ref": "#/$defs/note"}},
    "required": ["guest", "rooms"], "additionalProperties": False,
    "$defs": {"note": {"type": "string", "maxLength": 10}}})
NOW = function("now")


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    with gzip.open(os.path.join(DATA, "tokenizer.json.gz"), "rt", encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def lltok(tokenizer_json) -> LLTokenizer:
    return LLTokenizer(tokenizer_json, n_vocab=VOCAB, eos_token=[EOS])


@pytest.fixture(scope="module")
def hf_tok(tokenizer_json) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_str(tokenizer_json)


# ------------------------------------------------------------------ check_tools


def test_defaults_and_normalized_tools():
    req = check_tools([WEATHER, NOW])
    assert (req.choice, req.named, req.parallel, req.forced) == ("auto", None, True, False)
    assert req.tools[0] == {"name": "get_weather", "description": "The current weather in a city.",
                            "parameters": WEATHER["function"]["parameters"]}
    assert req.tools[1] == {"name": "now", "description": "",
                            "parameters": {"type": "object", "properties": {}}}
    assert check_tools(None) == tc.ToolRequest((), "none", None, True)
    assert check_tools(None, "none", False).parallel is False
    named = check_tools([WEATHER, ADD], {"type": "function", "function": {"name": "add"}}, False)
    assert (named.choice, named.named, named.parallel) == ("named", "add", False)
    assert named.forced
    assert check_tools([ADD], "required").forced
    assert named.tool("add")["name"] == "add" and named.tool("nope") is None


def _many(n):
    return [function(f"f{i}") for i in range(n)]


REFUSALS = [
    # (tools, tool_choice, parallel_tool_calls, param at fault)
    ({"type": "function"}, None, None, "tools"),
    ([], None, None, "tools"),
    (_many(129), None, None, "tools"),
    (["get_weather"], None, None, "tools[0]"),
    ([{"type": "code_interpreter"}], None, None, "tools[0].type"),
    ([{"type": "function", "function": {"name": "f"}, "extra": 1}], None, None, "tools[0].extra"),
    ([{"type": "function"}], None, None, "tools[0].function"),
    ([ADD, {"type": "function", "function": {"description": "no name"}}], None, None,
     "tools[1].function.name"),
    ([function("get weather")], None, None, "tools[0].function.name"),
    ([function("x" * 65)], None, None, "tools[0].function.name"),
    ([function("")], None, None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": 7}}], None, None, "tools[0].function.name"),
    ([ADD, NOW, ADD], None, None, "tools[2].function.name"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], None, None,
     "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], None, None,
     "tools[0].function.strict"),
    ([{"type": "function", "function": {"name": "f", "parmeters": {}}}], None, None,
     "tools[0].function.parmeters"),
    ([function("f", [1, 2])], None, None, "tools[0].function.parameters"),
    ([function("f", {"type": "string"})], None, None, "tools[0].function.parameters"),
    ([function("f", {"type": "object", "properties": {"a": {"type": "strin"}}})], None, None,
     "tools[0].function.parameters"),
    ([NOW, function("f", {"type": "object", "properties": {
        "a": {"type": "array", "uniqueItems": True}}})], None, None,
     "tools[1].function.parameters"),
    ([function("f", {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})],
     None, None, "tools[0].function.parameters"),
    ([function("f", {"type": "object", "properties": {"a": {"type": "string",
                                                            "pattern": "[a-"}}})],
     None, None, "tools[0].function.parameters"),
    ([ADD], {"type": "function", "function": {"name": "sub"}}, None, "tool_choice"),
    ([ADD], {"type": "function", "function": "add"}, None, "tool_choice"),
    ([ADD], {"type": "allowed_tools"}, None, "tool_choice"),
    ([ADD], "always", None, "tool_choice"),
    ([ADD], 1, None, "tool_choice"),
    (None, "required", None, "tool_choice"),
    (None, "auto", None, "tool_choice"),
    (None, {"type": "function", "function": {"name": "add"}}, None, "tool_choice"),
    ([ADD], None, "true", "parallel_tool_calls"),
    ([ADD], None, 1, "parallel_tool_calls"),
]


@pytest.mark.parametrize("tools,choice,parallel,param", REFUSALS)
def test_refusals_name_the_field(tools, choice, parallel, param):
    with pytest.raises(ToolError) as e:
        check_tools(tools, choice, parallel)
    assert e.value.param == param
    assert str(e.value).startswith(param + ": ")


def test_refusal_messages_name_value_and_rule():
    with pytest.raises(ToolError, match=r"'get weather' must be 1 to 64 letters"):
        check_tools([function("get weather")])
    with pytest.raises(ToolError, match="uniqueItems"):
        check_tools([function("f", {"type": "object", "properties": {
            "a": {"type": "array", "uniqueItems": True}}})])
    with pytest.raises(ToolError, match="'sub' is not the name of a function"):
        check_tools([ADD], {"type": "function", "function": {"name": "sub"}})
    with pytest.raises(ToolError, match="129 tools; at most 128"):
        check_tools(_many(129))
    assert len(check_tools(_many(128)).tools) == 128
    # llguidance options in a schema are not the client's to set (nor to break).
    check_tools([function("f", {"type": "object", "x-guidance": "lenient"})])


# ------------------------------------------------------------------ formats and prompting

LLAMA3_TEMPLATE = ("{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
                   "{%- if tools %}Respond with {\"name\": function name, \"parameters\": "
                   "dictionary}{% endif %}{%- if message.role == 'ipython' %}x{% endif %}")
QWEN_TEMPLATE = ("{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
                 "{%- for tool in tools %}{{ tool | tojson }}{% endfor %}{%- endif %}"
                 "{%- for message in messages %}{{ message.content }}{% endfor %}")


def smollm2_template() -> str:
    with open(os.path.join(DATA, "chat_template.jinja"), encoding="utf-8") as f:
        return f.read()


def test_pick_format():
    assert tc.pick_format(None) == "hermes"
    assert tc.pick_format(QWEN_TEMPLATE) == "hermes"
    assert tc.pick_format(smollm2_template()) == "hermes"
    assert tc.pick_format(LLAMA3_TEMPLATE) == "llama3_json"
    assert tc.pick_format("{{ '<|python_tag|>' }}") == "llama3_json"
    assert tc.pick_format(LLAMA3_TEMPLATE, "hermes") == "hermes"
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        tc.pick_format(None, "mistral")


def test_template_takes_tools():
    assert tc.template_takes_tools(QWEN_TEMPLATE)
    assert tc.template_takes_tools(LLAMA3_TEMPLATE)
    assert not tc.template_takes_tools(smollm2_template())
    assert not tc.template_takes_tools("{{ 'no tools here' }}{% set tools = [] %}{{ tools }}")
    assert not tc.template_takes_tools(None)
    # A template that does not parse without its extensions is searched for the name.
    assert tc.template_takes_tools("{% generation %}{{ tools }}{% endgeneration %}")


@pytest.mark.parametrize("fmt", tc.FORMATS)
def test_default_system_prompt_lists_tools_and_format(fmt):
    req = check_tools([WEATHER, NOW])
    text = tc.default_tools_system_prompt(req.tools, fmt)
    assert text == tc.default_tools_system_prompt([WEATHER, NOW], fmt)
    listed = [json.loads(line) for line in text.splitlines() if line.startswith('{"type"')]
    assert [t["function"] for t in listed] == list(req.tools)
    if fmt == "hermes":
        assert "<tool_call>\n" in text and "\n</tool_call>" in text and '"arguments"' in text
    else:
        assert '"parameters"' in text and '"; "' in text and "<tool_call>" not in text


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and 2+3?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "add", "arguments": "{not json"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "5"}]},
    {"role": "assistant", "content": "18C and 5."},
]


def test_messages_for_a_template_with_tools():
    original = copy.deepcopy(CONVERSATION)
    out = tc.tool_messages_for_template(CONVERSATION, takes_tools=True)
    assert CONVERSATION == original
    calls = out[1]["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"city": "Paris"}
    assert calls[1]["function"]["arguments"] == "{not json"
    assert out[2:] == CONVERSATION[2:] and out[0] == CONVERSATION[0]


@pytest.mark.parametrize("fmt", tc.FORMATS)
def test_messages_for_a_template_without_tools(fmt):
    out = tc.tool_messages_for_template(CONVERSATION, takes_tools=False, fmt=fmt)
    assert out[0] == CONVERSATION[0] and out[-1] == CONVERSATION[-1]
    assert "tool_calls" not in out[1]
    content, calls = parse_tool_calls(out[1]["content"], fmt)
    assert content is None or "not json" in content
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    if fmt == "hermes":
        assert out[2] == {"role": "user", "content": "<tool_response>\n18C\n</tool_response>\n"
                                                     "<tool_response>\n5\n</tool_response>"}
        assert len(out) == 4
    else:
        assert out[2:4] == [{"role": "ipython", "content": "18C"},
                            {"role": "ipython", "content": "5"}]
    # Results of separate turns stay separate messages.
    again = tc.tool_messages_for_template(CONVERSATION + CONVERSATION[1:4], False, fmt)
    assert again[len(out):] == out[1:-1]
    # A template without tool support renders the result.
    rendered = jinja2.Environment().from_string(smollm2_template()).render(
        messages=out, add_generation_prompt=True)
    assert '{"name": "get_weather"' in rendered


# ------------------------------------------------------------------ parsing

CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def calls_of(text, fmt):
    content, calls = parse_tool_calls(text, fmt)
    for c in calls:
        assert CALL_ID.fullmatch(c["id"]) and c["type"] == "function"
    assert len({c["id"] for c in calls}) == len(calls)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in calls]


HERMES_CASES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris"})]),
    (('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
      '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n'),
     None, [("add", {"a": 1, "b": 2}), ("now", {})]),
    ('Let me check.\n\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
     "Let me check.", [("now", {})]),
    ('<tool_call>{"name":"now","arguments":{"tz":"UTC"}}</tool_call> Done.',
     "Done.", [("now", {"tz": "UTC"})]),
    # Unclosed at the end of the output (stopped right after the call), or cut in the close.
    ('<tool_call>\n{"name": "now", "arguments": {}}', None, [("now", {})]),
    ('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_c', None, [("now", {})]),
    # Markers inside arguments, arguments given as a JSON string, no arguments.
    ('<tool_call>\n{"name": "say", "arguments": {"text": "a </tool_call> b {"}}\n</tool_call>',
     None, [("say", {"text": "a </tool_call> b {"})]),
    ('<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
     None, [("add", {"a": 1})]),
    ('<tool_call>\n{"name": "now"}\n</tool_call>', None, [("now", {})]),
    ('<tool_call>\n{"name": "say", "arguments": {"text": "日本"}}\n</tool_call>',
     None, [("say", {"text": "日本"})]),
]

HERMES_NOT_CALLS = [
    'Hello there.',
    '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>',
    '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>',
    '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',
    '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>',
    '<tool_call>\n{"name": "add", "arguments": {"a": NaN}}\n</tool_call>',
    '<tool_call>\nadd(1, 2)\n</tool_call>',
    '<tool_call>\n{"name": "add", "arguments": {}} trailing\n</tool_call>',
    'Use the <tool_call> tag.',
    '<tool_call',
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_parse_hermes(text, content, calls):
    assert calls_of(text, "hermes") == (content, calls)


@pytest.mark.parametrize("text", HERMES_NOT_CALLS)
def test_hermes_lookalikes_stay_content(text):
    assert calls_of(text, "hermes") == (text, [])


def test_a_bad_call_stays_content_next_to_good_ones():
    good = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "now", "arguments": {oops}}\n</tool_call>'
    content, calls = calls_of(f"{good}\n{bad}\n{good}", "hermes")
    assert content == bad and calls == [("now", {}), ("now", {})]


LLAMA3_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
     None, [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}',
     None, [("add", {"a": 1, "b": 2})]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "now", "parameters": {}}',
     None, [("add", {"a": 1, "b": 2}), ("now", {})]),
    ('<|python_tag|>{"name": "now", "parameters": {}};{"name": "now", "arguments": {"x": 1}}',
     None, [("now", {}), ("now", {"x": 1})]),
    ('I will look it up.\n{"name": "now", "parameters": {}}', "I will look it up.", [("now", {})]),
    ('Looking. <|python_tag|>{"name": "now", "parameters": {}}', "Looking.", [("now", {})]),
    ('{"name": "now", "parameters": {}}\n{"name": "add", "parameters": {"a": 1}}\nThanks',
     "Thanks", [("now", {}), ("add", {"a": 1})]),
]

LLAMA3_NOT_CALLS = [
    'Plain answer.',
    '{"a": 1}',
    '{"name": "Bob"}',
    '{"name": "now", "parameters": {}',
    'The JSON {"name": "now", "parameters": {}} mid-line is not a call.',
    '<|python_tag|>brave_search.call(query="x")',
    '<|python_t',
]


@pytest.mark.parametrize("text,content,calls", LLAMA3_CASES)
def test_parse_llama3(text, content, calls):
    assert calls_of(text, "llama3_json") == (content, calls)


@pytest.mark.parametrize("text", LLAMA3_NOT_CALLS)
def test_llama3_lookalikes_stay_content(text):
    assert calls_of(text, "llama3_json") == (text, [])


def test_a_separator_without_a_call_after_it_is_content():
    assert calls_of('{"name": "now", "parameters": {}}; done', "llama3_json") == (
        "; done", [("now", {})])


def test_whitespace_only_content_is_none():
    assert parse_tool_calls("  \n ", "hermes") == (None, [])
    assert parse_tool_calls("", "llama3_json") == (None, [])
    assert parse_tool_calls(" a \n", "hermes") == (" a \n", [])


@pytest.mark.parametrize("fmt", tc.FORMATS)
def test_render_calls_round_trips(fmt):
    calls = [{"function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
             {"function": {"name": "say", "arguments": {"text": "été"}}}]
    assert calls_of(tc.render_calls(calls, fmt), fmt) == (
        None, [("add", {"a": 1, "b": 2}), ("say", {"text": "été"})])


# ------------------------------------------------------------------ streaming


def run_stream(pieces, fmt):
    """(content or None, [(name, arguments text)], ids) from ToolCallStream over `pieces`,
    checking the deltas' shapes on the way."""
    stream = tc.ToolCallStream(fmt)
    deltas = [d for p in pieces for d in stream.add(p)] + stream.finish()
    content, calls, ids = "", [], []
    for d in deltas:
        assert len(d) == 1
        if "content" in d:
            assert d["content"]
            content += d["content"]
            continue
        (part,) = d["tool_calls"]
        if "id" in part:
            assert part["index"] == len(calls) and CALL_ID.fullmatch(part["id"])
            assert part["type"] == "function" and part["function"]["arguments"] == ""
            calls.append([part["function"]["name"], ""])
            ids.append(part["id"])
        else:
            assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}
            calls[part["index"]][1] += part["function"]["arguments"]
    return content or None, [tuple(c) for c in calls], ids


NAMES = st.sampled_from(["add", "now", "get_weather"])
ARGS = st.dictionaries(st.sampled_from(["a", "b", "text"]),
                       st.one_of(st.integers(-5, 5), st.text("ab {}<>/\"\\;\n", max_size=5)),
                       max_size=2)
NOISE = st.lists(st.sampled_from(
    list("ab {};\n\t\"<>/|") + ["<tool_call>", "</tool_call>", "<tool_", "<|python_tag|>",
                                "<|python", "\n{", '{"name": "x"}', '"}', "; "]),
    max_size=8).map("".join)


@st.composite
def outputs(draw, fmt):
    """Texts of content, well-formed calls and broken ones, in any order."""
    parts = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["noise", "call", "broken"]))
        if kind == "noise":
            parts.append(draw(NOISE))
            continue
        call = tc.render_calls([{"function": {"name": draw(NAMES), "arguments": draw(ARGS)}}], fmt)
        if fmt == "llama3_json":
            call = draw(st.sampled_from(["", "\n", "<|python_tag|>", "; "])) + call
        if kind == "broken":
            cut = draw(st.integers(0, len(call) - 1))
            call = call[:cut] + draw(st.sampled_from(["", "}", "x", "{", '"'])) + call[cut + 1:]
        parts.append(call)
        parts.append(draw(st.sampled_from(["", "\n", " ", "\nok"])))
    return "".join(parts)


def split_text(text, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0] + bounds, bounds + [len(text)])]


@pytest.mark.parametrize("fmt", tc.FORMATS)
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_stream_equals_whole_text(fmt, data):
    text = data.draw(outputs(fmt))
    cuts = data.draw(st.lists(st.integers(0, max(len(text), 1)), max_size=12))
    content, calls = parse_tool_calls(text, fmt)
    streamed, streamed_calls, ids = run_stream(split_text(text, cuts), fmt)
    assert streamed == content
    assert streamed_calls == [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert len(set(ids)) == len(ids)
    # Character by character too, the finest split.
    assert run_stream(list(text), fmt)[:2] == (streamed, streamed_calls)


def test_stream_sends_content_early_and_a_call_at_its_end():
    stream = tc.ToolCallStream("hermes")
    assert stream.add("Sure") == [{"content": "Sure"}]
    assert stream.add(".\n<tool_") == [{"content": "."}]
    assert stream.add('call>\n{"name": "now", "arguments": {}}') == []
    header, arguments = stream.add("\n</tool_call>")
    assert header["tool_calls"][0]["function"] == {"name": "now", "arguments": ""}
    assert arguments == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    assert stream.add("\n") == [] and stream.finish() == []


# ------------------------------------------------------------------ constrained calls


def consume(lltok, grammar, ids):
    """Feeds tokens one at a time: (how many were allowed, accepting at the end)."""
    m = LLMatcher(lltok, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    for n, t in enumerate(ids):
        if not m.consume_token(t):
            return n, False
    return len(ids), m.is_accepting()


TOOL_SETS = {
    "get_weather": ([WEATHER], {"city": "Paris", "unit": "celsius"}),
    "add": ([WEATHER, ADD, NOW], {"a": 2, "b": -3}),
    "book-room": ([BOOK, ADD], {"guest": {"name": "Ann", "age": 30},
                                "rooms": [{"kind": "double", "nights": 2}], "note": "late"}),
    "now": ([ADD, NOW], {}),
}
INVALID = {
    "get_weather": [{"unit": "celsius"}, {"city": 3}, {"city": "Paris", "unit": "kelvin"}],
    "add": [{"a": 2}, {"a": 2, "b": "3"}, {"a": 1.5, "b": 1}, {"a": 1, "b": 2, "c": 3}],
    "book-room": [{"guest": {"name": "Ann", "age": 12}, "rooms": [{"kind": "double", "nights": 2}]},
                  {"guest": {"name": "Ann", "age": 30}, "rooms": []},
                  {"guest": {"name": "Ann", "age": 30},
                   "rooms": [{"kind": "suite", "nights": 2}]},
                  {"guest": {"name": "Ann", "age": 30},
                   "rooms": [{"kind": "double", "nights": 2}], "note": "far too long"}],
    "now": [],
}


def name_of(tool):
    return tool["function"]["name"]


@pytest.mark.parametrize("fmt", tc.FORMATS)
@pytest.mark.parametrize("key", sorted(TOOL_SETS))
def test_grammar_accepts_valid_calls_and_refuses_invalid(lltok, hf_tok, fmt, key):
    tools, args = TOOL_SETS[key]
    named = check_tools(tools, {"type": "function", "function": {"name": key}})
    required = check_tools(tools, "required")
    single = check_tools(tools, "required", parallel_tool_calls=False)
    grammars = {c: tc.call_grammar(r, fmt) for c, r in
                [("named", named), ("required", required), ("single", single)]}
    for g in grammars.values():
        assert LLMatcher.validate_grammar_with_warnings(g, lltok) == (False, [])

    def ids(calls):
        text = tc.render_calls([{"function": {"name": n, "arguments": a}} for n, a in calls], fmt)
        assert parse_tool_calls(text, fmt)[1]
        return hf_tok.encode(text, add_special_tokens=False).ids

    one = ids([(key, args)])
    for g in grammars.values():
        assert consume(lltok, g, one) == (len(one), True)
    two = ids([(key, args), (key, args)])
    assert consume(lltok, grammars["required"], two) == (len(two), True)
    assert consume(lltok, grammars["named"], two)[1] is False
    assert consume(lltok, grammars["single"], two)[1] is False
    other = next(name_of(t) for t in tools if name_of(t) != key) if len(tools) > 1 else None
    for bad in INVALID[key]:
        for g in grammars.values():
            n, accepting = consume(lltok, g, ids([(key, bad)]))
            assert n < len(ids([(key, bad)])) and not accepting, bad
    # A function that is not among the tools, and (for a named choice) another tool.
    unknown = ids([("delete_everything", args)])
    for g in grammars.values():
        assert consume(lltok, g, unknown)[0] < len(unknown)
    if other is not None:
        assert consume(lltok, grammars["named"], ids([(other, {})]))[1] is False


def test_grammar_needs_a_forced_choice():
    with pytest.raises(ValueError, match="not constrained"):
        tc.call_grammar(check_tools([ADD], "auto"), "hermes")


def closing_tokens(lltok):
    """Tokens that end a JSON value or a marker, which a random walk prefers so it finishes."""
    return np.array([any(c in lltok.decode_bytes([i]) for c in b'}]">\n,')
                     for i in range(VOCAB)])


def random_walk(m, closing, rng, steps=400):
    """Samples allowed tokens (closing ones more often, EOS when allowed most of the time)
    until the matcher stops or ends; the tokens, or None at the step bound."""
    mask = allocate_token_bitmask(1, VOCAB)
    tokens = []
    for _ in range(steps):
        if m.is_stopped():
            return tokens
        fill_next_token_bitmask(m, mask)
        allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:VOCAB])
        if EOS in allowed and rng.random() < 0.6:
            return tokens
        allowed = allowed[allowed != EOS]
        assert allowed.size, "no token allowed before the grammar accepts"
        preferred = allowed[closing[allowed]]
        pool = preferred if preferred.size and rng.random() < 0.7 else allowed
        t = int(rng.choice(pool))
        assert m.consume_token(t), m.get_error()
        tokens.append(t)
    return None


@pytest.mark.parametrize("fmt", tc.FORMATS)
def test_random_walks_decode_to_valid_calls(lltok, fmt):
    closing = closing_tokens(lltok)
    rng = np.random.default_rng(0)
    tools = [WEATHER, ADD, BOOK, NOW]
    schemas = {name_of(t): t["function"].get("parameters", {}) for t in tools}
    requests = [check_tools(tools, "required"), check_tools(tools, "required", False),
                check_tools(tools, {"type": "function", "function": {"name": "book-room"}})]
    finished = walks = 0
    for req in requests:
        grammar = tc.call_grammar(req, fmt)
        for _ in range(8):
            walks += 1
            m = LLMatcher(lltok, grammar, log_level=0)
            tokens = random_walk(m, closing, rng)
            if tokens is None:
                continue
            finished += 1
            assert m.is_accepting()
            content, calls = parse_tool_calls(lltok.decode_str(tokens), fmt)
            assert content is None and calls
            if not req.parallel or req.choice == "named":
                assert len(calls) == 1
            for call in calls:
                name = call["function"]["name"]
                assert name == (req.named or name) and name in schemas
                jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
    assert finished >= walks * 3 // 4


def qwen_like_tokenizer(tokenizer_json):
    """SmolLM2's tokenizer with <tool_call> and </tool_call> added as single tokens that are not
    `special` (as in Qwen2.5 and Qwen3)."""
    spec = json.loads(tokenizer_json)
    for k, marker in enumerate(tc.grammar_markers("hermes")):
        spec["added_tokens"].append({"id": VOCAB + k, "content": marker, "single_word": False,
                                     "lstrip": False, "rstrip": False, "normalized": False,
                                     "special": False})
    text = json.dumps(spec)
    return (LLTokenizer(text, n_vocab=VOCAB + 2, eos_token=[EOS]),
            tokenizers.Tokenizer.from_str(text))


def test_markers_that_are_added_tokens(tokenizer_json):
    """Where the markers are added tokens, llguidance never matches them to text: the grammar
    written with special_markers takes the single tokens the model writes (and the decoded text
    parses), while the text-literal grammar refuses them."""
    lt, hf = qwen_like_tokenizer(tokenizer_json)
    req = check_tools([ADD], "required")
    text = tc.render_calls([{"function": {"name": "add", "arguments": {"a": 1, "b": 2}}}] * 2,
                           "hermes")
    ids = hf.encode(text, add_special_tokens=False).ids
    assert ids.count(VOCAB) == ids.count(VOCAB + 1) == 2
    as_tokens = tc.call_grammar(req, "hermes", special_markers=tc.grammar_markers("hermes"))
    assert consume(lt, as_tokens, ids) == (len(ids), True)
    assert calls_of(hf.decode(ids, skip_special_tokens=True), "hermes")[1] == [
        ("add", {"a": 1, "b": 2})] * 2
    assert consume(lt, tc.call_grammar(req, "hermes"), ids) == (0, False)
