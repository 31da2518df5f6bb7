"""Structured outputs, tool calls, reasoning and /v1/responses through a live server, driven
by the official openai client: parsed pydantic objects, tool calls whose arguments validate
with `jsonschema`, streamed tool-call deltas that add up to the whole call, the Responses API
(created and streamed), and every bad constraint or tool a 400 naming its field before any
device work."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

MODEL = "smollm2-135m"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 30},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "string", "maxLength": 20}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "The weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time",
                                           "description": "The time in a time zone",
                                           "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def llm():
    """Room for the tools' system prompt (~300 tokens)."""
    from jaxinfer.llm import LLM

    llm = LLM(MODEL, max_seq_len=768, max_num_seqs=4, max_num_batched_tokens=128,
              prefill_chunk=128)
    llm.warmup()
    return llm


@pytest.fixture(scope="module")
def think_server(llm):
    """The module's server reads <think>...</think> into reasoning_content (SmolLM2's template
    does not mention it, so the parser is chosen by name)."""
    from jaxinfer.serve import ServeConfig, ServerThread

    srv = ServerThread(llm, ServeConfig(MODEL, max_waiting=8,
                                        reasoning_parser="deepseek_r1")).start()
    yield srv
    srv.stop(timeout_s=60)


@pytest.fixture(scope="module")
def api(think_server):
    import openai

    return openai.OpenAI(base_url=think_server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _generated(srv) -> int:
    return srv.state.engine.call(lambda llm: llm.stats()["generated_tokens"]).result(60)


def test_parse_returns_a_pydantic_object(api):
    import pydantic

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        age: int = pydantic.Field(ge=0, le=150)

    r = api.chat.completions.parse(
        model=MODEL, max_tokens=60,
        messages=[{"role": "user", "content": "Alice is 30 years old. Give her as JSON."}],
        response_format=Person)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), Person.model_json_schema())


def test_json_object_and_the_guided_extensions(api):
    short = [{"role": "user", "content": 'Reply with a JSON object like {"city": "Rome"}.'}]
    r = api.chat.completions.create(model=MODEL, messages=short, max_tokens=60,
                                    response_format={"type": "json_object"}, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    pattern = r"[A-Z][a-z]{2,10}, [A-Z][a-z]{2,10}"
    r = api.completions.create(model=MODEL, prompt="A city and its country:", max_tokens=20,
                               extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, r.choices[0].text)
    r = api.completions.create(model=MODEL, prompt="Is fire hot?", max_tokens=5,
                               extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_forced_tool_calls_validate(api, choice):
    r = api.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80,
                                    tool_choice=choice, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"


def test_streamed_tool_call_deltas_add_up_to_the_call(api):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80,
              parallel_tool_calls=False, temperature=0)
    whole = api.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    name, args, ids, finish = None, "", set(), None
    for chunk in api.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                assert tc.index == 0
                ids |= {tc.id} - {None}
                name = tc.function.name or name
                args += tc.function.arguments or ""
    assert (name, json.loads(args)) == (whole.function.name,
                                        json.loads(whole.function.arguments))
    assert len(ids) == 1 and finish == "tool_calls"


def test_auto_tool_choice_reads_calls_from_text(api):
    """tool_choice auto: a call the model writes (here forced by a regex) comes back as
    tool_calls, the text around it as content."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    r = api.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60,
                                    extra_body={"guided_regex": "Let me check\\.\n" +
                                                re.escape(call)})
    m = r.choices[0].message
    assert m.content == "Let me check."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == \
        [("get_time", {"zone": "UTC"})]
    assert r.choices[0].finish_reason == "tool_calls"


def test_tool_results_go_back_through_the_template(api):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = api.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=30,
                                    tool_choice="none")
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_reasoning_is_split_streamed_and_not(api):
    pattern = r"<think>[a-z ]{3,30}</think>[A-Z][a-z ]{2,30}\."
    kw = dict(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
              extra_body={"guided_regex": pattern})
    m = api.chat.completions.create(**kw).choices[0].message
    text = "<think>" + m.reasoning_content + "</think>" + m.content
    assert re.fullmatch(pattern, text), (m.reasoning_content, m.content)
    reasoning, content = "", ""
    for chunk in api.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (m.reasoning_content, m.content)


def test_responses_create_and_stream(api):
    schema = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 20}}}
    kw = dict(model=MODEL, instructions="Answer in JSON.", input="Name a city in France.",
              max_output_tokens=40, temperature=0,
              text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    r = api.responses.create(**kw)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    with api.responses.stream(**kw) as stream:
        deltas = "".join(ev.delta for ev in stream if ev.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == r.output_text
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    r = api.responses.create(model=MODEL, input="Weather in Rome?", tools=tools,
                             tool_choice="required", parallel_tool_calls=False,
                             max_output_tokens=80)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "response_format", "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format",
     "uniqueItems"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed"),
    ({"guided_grammar": "start: foo"}, "guided_grammar", "foo"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex", "at most one"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0].function.name", "name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}]},
     "tools[0].function.parameters", "uniqueItems"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined"),
]


@pytest.mark.parametrize("extra, param, words", BAD)
def test_bad_constraints_and_tools_are_400s_before_device_work(think_server, helpers, extra,
                                                               param, words):
    raw = helpers.Raw(think_server.url)
    before = _generated(think_server)
    status, _, body = raw.request("POST", "/v1/chat/completions",
                                  dict({"model": MODEL, "messages": ASK}, **extra))
    assert status == 400, body
    assert body["error"]["param"] == param and words in body["error"]["message"], body
    assert _generated(think_server) == before


def test_bad_responses_fields_are_400s(think_server, helpers):
    raw = helpers.Raw(think_server.url)
    for body, param in [({"input": "x", "previous_response_id": "resp_1"},
                         "previous_response_id"),
                        ({"input": "x", "store": True}, "store"),
                        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                                            "schema": {"type": "strin"}}}},
                         "response_format"),
                        ({"input": 3}, "input")]:
        status, _, got = raw.request("POST", "/v1/responses", body)
        assert status == 400 and got["error"]["param"] == param, got
