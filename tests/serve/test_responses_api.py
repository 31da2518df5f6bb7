"""The Responses API translation layer (jaxinfer/responses_api.py), without a model or a server:
request bodies to chat bodies (and their refusals), chat completions to response objects, and
chat chunk streams to Responses events, each checked against the official openai SDK's types."""

from __future__ import annotations

import copy
import json

import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from jaxinfer.openai_api import CHAT, RequestError, parse_request
from jaxinfer.responses_api import RESPONSES, ResponseStream, response_object, to_chat_body

EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
# Chat fields being added to the chat layer; until they are, parse_request refuses them.
EXTENDED = ("tools", "tool_choice", "parallel_tool_calls", "response_format", "messages")
TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}, "strict": True}


def chat_checks(chat: dict):
    """parse_request(CHAT, chat); a skip where the chat layer does not take a field of the
    chat API it is being extended with yet (tools, response_format, tool messages)."""
    try:
        return parse_request(CHAT, chat)
    except RequestError as e:
        extended = any(k in chat for k in EXTENDED[:4]) or any(
            m.get("tool_calls") or m["role"] == "tool" for m in chat["messages"])
        if extended and e.param in EXTENDED:
            pytest.skip(f"the chat layer does not take this yet: {e.message}")
        raise


# ---- requests --------------------------------------------------------------------------------

def test_string_input():
    assert RESPONSES == "/v1/responses"
    chat = to_chat_body({"model": "m", "input": "Hello"})
    assert chat == {"model": "m", "messages": [{"role": "user", "content": "Hello"}]}
    assert chat_checks(chat).messages == chat["messages"]


def test_messages_parts_instructions_and_sampling():
    body = {"model": "m", "instructions": "Be brief.", "max_output_tokens": 7,
            "temperature": 0.5, "top_p": 0.9, "seed": 3, "top_k": 4, "min_p": 0.1,
            "repetition_penalty": 1.2, "user": "u1", "metadata": {"k": "v"}, "store": False,
            "truncation": "disabled", "reasoning": None, "include": [],
            "previous_response_id": None, "background": False, "text": {"format": {"type": "text"}},
            "input": [
                {"role": "developer", "content": "Answer in English."},
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": "Hi, "},
                             {"type": "input_text", "text": "there"}]},
                {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                 "content": [{"type": "output_text", "text": "Hello!", "annotations": [],
                              "logprobs": []}]},
                {"role": "user", "content": "And?"}]}
    chat = to_chat_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Answer in English."},
        {"role": "user", "content": "Hi, there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "And?"}]
    assert chat["max_completion_tokens"] == 7 and "max_output_tokens" not in chat
    assert "response_format" not in chat and "store" not in chat and "text" not in chat
    req = chat_checks(chat)
    assert req.max_tokens == 7 and not req.stream
    p = req.params
    assert (p.temperature, p.top_p, p.seed, p.top_k, p.min_p, p.repetition_penalty) == (
        0.5, 0.9, 3, 4, 0.1, 1.2)


def test_stream_asks_for_usage():
    chat = to_chat_body({"input": "x", "stream": True,
                         "stream_options": {"include_obfuscation": False}})
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    req = chat_checks(chat)
    assert req.stream and req.include_usage


def test_function_call_items():
    chat = to_chat_body({"input": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Two calls."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_b", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "18C"},
        {"type": "function_call_output", "call_id": "call_b",
         "output": [{"type": "input_text", "text": "21C"}]},
        {"role": "assistant", "content": "Checking Oslo too."},
        {"type": "function_call", "call_id": "call_c", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_c", "output": "5C"}],
        "tools": [TOOL]})

    def call(cid, city):
        return {"id": cid, "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}

    assert chat["messages"] == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None,
         "tool_calls": [call("call_a", "Paris"), call("call_b", "Rome")]},
        {"role": "tool", "tool_call_id": "call_a", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_b", "content": "21C"},
        {"role": "assistant", "content": "Checking Oslo too.",
         "tool_calls": [call("call_c", "Oslo")]},
        {"role": "tool", "tool_call_id": "call_c", "content": "5C"}]
    chat_checks(chat)


def test_tools_and_tool_choice():
    chat = to_chat_body({"input": "x", "tools": [TOOL, {"type": "function", "name": "noop"}],
                         "tool_choice": {"type": "function", "name": "noop"},
                         "parallel_tool_calls": False})
    assert chat["tools"] == [
        {"type": "function", "function": {
            "name": "get_weather", "description": "Weather of a city",
            "parameters": TOOL["parameters"], "strict": True}},
        {"type": "function", "function": {"name": "noop"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "noop"}}
    assert chat["parallel_tool_calls"] is False
    for choice in ("none", "auto", "required"):
        assert to_chat_body({"input": "x", "tools": [TOOL], "tool_choice": choice}
                            )["tool_choice"] == choice
    chat_checks(chat)


def test_text_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    chat = to_chat_body({"input": "x", "text": {"format": {
        "type": "json_schema", "name": "thing", "schema": schema, "strict": True,
        "description": "A thing"}}})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "thing", "schema": schema, "strict": True, "description": "A thing"}}
    chat = to_chat_body({"input": "x", "text": {"format": {"type": "json_object"}}})
    assert chat["response_format"] == {"type": "json_object"}
    chat_checks(chat)


def test_output_passed_back_as_input():
    """The stateless multi-turn pattern: input += response.output, then a new user turn."""
    chat_response = {"id": "c", "object": "chat.completion", "created": 1, "model": "m",
                     "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                         "role": "assistant", "content": "Let me look.",
                         "reasoning_content": "Need the tool.",
                         "tool_calls": [{"id": "call_9", "type": "function", "function": {
                             "name": "get_weather", "arguments": "{}"}}]}}]}
    body = {"input": "Weather?", "tools": [TOOL]}
    out = response_object(chat_response, request_body=body)["output"]
    chat = to_chat_body({"input": [{"role": "user", "content": "Weather?"}, *out,
                                   {"type": "function_call_output", "call_id": "call_9",
                                    "output": "sunny"}], "tools": [TOOL]})
    assert chat["messages"][1:] == [
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_9", "type": "function",
             "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}]


REFUSED = [  # (body, param, words the message must hold)
    ("hi", None, ["JSON object"]),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id",
     ["resp_1", "keeps no responses"]),
    ({"input": "x", "conversation": "conv_1"}, "conversation", ["conv_1"]),
    ({"input": "x", "store": True}, "store", ["True", "keeps no responses"]),
    ({"input": "x", "background": True}, "background", ["True"]),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include",
     ["reasoning.encrypted_content"]),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", ["high"]),
    ({"input": "x", "truncation": "auto"}, "truncation", ["'auto'", "disabled"]),
    ({"input": "x", "frobnicate": 1}, "frobnicate", ["frobnicate"]),
    ({"input": "x", "prompt": {"id": "p"}}, "prompt", ["prompt"]),
    ({}, "input", ["None"]),
    ({"input": []}, "input", ["non-empty"]),
    ({"input": 3}, "input", ["3"]),
    ({"input": ["hi"]}, "input[0]", ["'hi'"]),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", ["robot"]),
    ({"input": [{"role": "user"}]}, "input[0].content", ["missing"]),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content", ["5"]),
    ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x"}]}]}, "input[1].content[0].type",
     ["input_image", "text parts"]),
    ({"input": [{"role": "user", "content": [{"type": ["input_text"], "text": "a"}]}]},
     "input[0].content[0].type", ["['input_text']"]),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
     "input[0].content[0].text", ["1"]),
    ({"input": [{"role": "user", "content": "x", "name": "bob"}]}, "input[0].name", ["name"]),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type",
     ["item_reference"]),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
     "input[0].arguments", ["None"]),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
     "input[0].call_id", ["c9", "no function_call"]),
    ({"input": "x", "instructions": ["be brief"]}, "instructions", ["be brief"]),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", ["0", "[1,"]),
    ({"input": "x", "max_output_tokens": 2.5}, "max_output_tokens", ["2.5"]),
    ({"input": "x", "stream": "yes"}, "stream", ["'yes'"]),
    ({"input": "x", "stream_options": {"include_obfuscation": True}}, "stream_options",
     ["stream: true"]),
    ({"input": "x", "tools": {"type": "function"}}, "tools", ["list"]),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", ["web_search"]),
    ({"input": "x", "tools": [TOOL, {"type": "file_search", "vector_store_ids": []}]},
     "tools[1].type", ["file_search", "only function"]),
    ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name",
     ["'a b'"]),
    ({"input": "x", "tools": [TOOL, TOOL]}, "tools[1].name", ["get_weather"]),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": "x"}]},
     "tools[0].parameters", ["'x'"]),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "defer_loading": True}]},
     "tools[0].defer_loading", ["defer_loading"]),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice", ["nope"]),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": ["f"]}},
     "tool_choice", ["['f']"]),
    ({"input": "x", "tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice",
     ["sometimes"]),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", ["needs tools"]),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "file_search"}}, "tool_choice",
     ["file_search"]),
    ({"input": "x", "parallel_tool_calls": 1}, "parallel_tool_calls", ["1"]),
    ({"input": "x", "text": "json"}, "text", ["'json'"]),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type", ["xml"]),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}},
     "text.format.name", ["None"]),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": 1}}},
     "text.format.schema", ["1"]),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {},
                                        "strict": "yes"}}}, "text.format.strict", ["'yes'"]),
    ({"input": "x", "text": {"format": {"type": "json_object", "schema": {}}}},
     "text.format.schema", ["schema"]),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity", ["low"]),
    ({"input": "x", "metadata": {"k": 1}}, "metadata", ["16 keys"]),
]


@pytest.mark.parametrize("body,param,words", REFUSED)
def test_refused(body, param, words):
    with pytest.raises(RequestError) as info:
        to_chat_body(body)
    e = info.value
    assert (e.status, e.param, e.type) == (400, param, "invalid_request_error")
    for w in words:
        assert w in e.message, (w, e.message)


def test_long_values_are_shortened():
    with pytest.raises(RequestError) as info:
        to_chat_body({"input": "x", "truncation": "a" * 10_000})
    assert len(info.value.message) < 400


# ---- response objects ------------------------------------------------------------------------

def chat_completion(content="Hello there.", *, finish="stop", reasoning=None, calls=(),
                    usage=(12, 5)) -> dict:
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"id": cid, "type": "function",
                                  "function": {"name": name, "arguments": args}}
                                 for cid, name, args in calls]
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000,
            "model": "smollm2-135m", "choices": [{"index": 0, "message": message,
                                                  "logprobs": None, "finish_reason": finish}],
            "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                      "total_tokens": sum(usage)}}


def test_response_object_text():
    body = {"model": "smollm2-135m", "input": "Hi", "instructions": "Be brief.",
            "temperature": 0.2, "max_output_tokens": 50, "metadata": {"a": "b"},
            "text": {"format": {"type": "json_schema", "name": "n", "schema": {}}},
            "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}}
    obj = response_object(chat_completion(), request_body=body, response_id="resp_abc")
    sdk = Response.model_validate(obj)
    assert sdk.output_text == "Hello there."
    assert "output_text" not in obj
    assert (obj["id"], obj["object"], obj["status"], obj["created_at"], obj["model"]) == (
        "resp_abc", "response", "completed", 1700000000, "smollm2-135m")
    assert obj["incomplete_details"] is None and obj["error"] is None
    assert obj["completed_at"] >= obj["created_at"]
    [msg] = obj["output"]
    assert msg["type"] == "message" and msg["id"].startswith("msg_")
    assert msg["status"] == "completed" and msg["role"] == "assistant"
    assert obj["usage"] == {"input_tokens": 12,
                            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                            "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": 17}
    assert (sdk.instructions, sdk.temperature, sdk.top_p, sdk.max_output_tokens) == (
        "Be brief.", 0.2, 1.0, 50)
    assert (obj["store"], obj["metadata"], obj["parallel_tool_calls"]) == (False, {"a": "b"},
                                                                           True)
    assert obj["text"] == body["text"] and obj["tool_choice"] == body["tool_choice"]
    assert sdk.tools[0].name == "get_weather" and sdk.tools[0].parameters == TOOL["parameters"]


def test_response_object_defaults_and_fresh_ids():
    a = response_object(chat_completion(), request_body={"input": "Hi"})
    b = response_object(chat_completion(), request_body={"input": "Hi"})
    assert a["id"].startswith("resp_") and a["id"] != b["id"]
    assert a["output"][0]["id"] != b["output"][0]["id"]
    assert (a["tools"], a["tool_choice"], a["text"], a["temperature"], a["metadata"]) == (
        [], "auto", {"format": {"type": "text"}}, 1.0, {})
    Response.model_validate(a)


def test_response_object_tool_calls():
    obj = response_object(chat_completion(None, finish="tool_calls", calls=[
        ("call_1", "get_weather", '{"city": "Paris"}'),
        ("call_2", "get_weather", '{"city": "Rome"}')]), request_body={"input": "x",
                                                                       "tools": [TOOL]})
    sdk = Response.model_validate(obj)
    assert obj["status"] == "completed" and sdk.output_text == ""
    assert [o["type"] for o in obj["output"]] == ["function_call", "function_call"]
    first = obj["output"][0]
    assert first["id"].startswith("fc_") and first["status"] == "completed"
    assert (first["call_id"], first["name"], first["arguments"]) == (
        "call_1", "get_weather", '{"city": "Paris"}')
    assert obj["output"][1]["call_id"] == "call_2"


def test_response_object_reasoning_and_text_with_call():
    obj = response_object(chat_completion("Checking.", reasoning="Use the tool.",
                                          finish="tool_calls",
                                          calls=[("call_1", "get_weather", "{}")]),
                          request_body={"input": "x", "tools": [TOOL]})
    sdk = Response.model_validate(obj)
    assert [o["type"] for o in obj["output"]] == ["reasoning", "message", "function_call"]
    rs = obj["output"][0]
    assert rs["id"].startswith("rs_") and rs["summary"] == []
    assert rs["content"] == [{"type": "reasoning_text", "text": "Use the tool."}]
    assert sdk.output_text == "Checking."


def test_response_object_length_is_incomplete():
    obj = response_object(chat_completion("Once upon a", finish="length"),
                          request_body={"input": "x", "max_output_tokens": 3})
    sdk = Response.model_validate(obj)
    assert obj["status"] == "incomplete"
    assert obj["incomplete_details"] == {"reason": "max_output_tokens"}
    assert obj["output"][-1]["status"] == "incomplete" and obj["completed_at"] is None
    assert sdk.output_text == "Once upon a"


def test_response_object_empty_text():
    obj = response_object(chat_completion(""), request_body={"input": "x"})
    assert [o["type"] for o in obj["output"]] == ["message"]
    assert Response.model_validate(obj).output_text == ""


# ---- streams ---------------------------------------------------------------------------------

def chunk(delta=None, finish=None, usage=None) -> dict:
    c = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000,
         "model": "smollm2-135m"}
    if usage is not None:
        return {**c, "choices": [], "usage": usage}
    return {**c, "choices": [{"index": 0, "delta": delta or {}, "logprobs": None,
                              "finish_reason": finish}], "usage": None}


def call_delta(index, *, cid=None, name=None, args=None) -> dict:
    d = {"index": index, "function": {}}
    if cid is not None:
        d.update(id=cid, type="function")
    if name is not None:
        d["function"]["name"] = name
    if args is not None:
        d["function"]["arguments"] = args
    return {"tool_calls": [d]}


REASONING = ["The user ", "wants ", "weather."]
TEXT = ["Let me ", "check ", "that for ", "you."]
ARGS = ['{"ci', 'ty": "Pa', 'ris"}']


def chat_stream(finish="tool_calls", text=TEXT, reasoning=REASONING, args=ARGS) -> list:
    chunks = [chunk({"role": "assistant", "content": ""})]
    chunks += [chunk({"reasoning_content": r}) for r in reasoning]
    chunks += [chunk({"content": t}) for t in text]
    if args:
        chunks.append(chunk(call_delta(0, cid="call_1", name="get_weather", args="")))
        chunks += [chunk(call_delta(0, args=a)) for a in args]
        chunks.append(chunk(call_delta(1, cid="call_2", name="get_weather",
                                       args='{"city": "Rome"}')))
    chunks.append(chunk(finish=finish))
    chunks.append(chunk(usage={"prompt_tokens": 12, "completion_tokens": 20,
                               "total_tokens": 32}))
    return chunks


def run_stream(chunks: list, body: dict) -> list:
    stream = ResponseStream(body, "resp_s", 1700000000, "smollm2-135m")
    events = stream.start()
    for c in chunks:
        events += stream.chunk(c)
    return events + stream.finish()


def without_ids(response: dict) -> dict:
    r = copy.deepcopy(response)
    for key in ("id", "completed_at"):
        r.pop(key)
    for item in r["output"]:
        item.pop("id")
    return r


def check_events(events: list) -> list:
    """Each event valid for the SDK, numbered 0, 1, 2, ...; returns the SDK's objects."""
    parsed = [EVENT.validate_python(ev) for ev in events]
    assert [ev["sequence_number"] for ev in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert events[1]["type"] == "response.in_progress"
    assert events[0]["response"]["status"] == "in_progress"
    return parsed


def test_stream_events():
    body = {"model": "smollm2-135m", "input": "Weather in Paris?", "tools": [TOOL],
            "stream": True}
    events = run_stream(chat_stream(), body)
    check_events(events)
    types = [ev["type"] for ev in events]
    assert types == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        *["response.reasoning_text.delta"] * 3,
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 4,
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", *["response.function_call_arguments.delta"] * 3,
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]

    final = events[-1]["response"]
    by_type = {}
    for ev in events:
        by_type.setdefault(ev["type"], []).append(ev)
    text = "".join(ev["delta"] for ev in by_type["response.output_text.delta"])
    assert text == "".join(TEXT) == by_type["response.output_text.done"][0]["text"]
    assert "".join(ev["delta"] for ev in by_type["response.reasoning_text.delta"]) == \
        "".join(REASONING) == by_type["response.reasoning_text.done"][0]["text"]
    assert "".join(ev["delta"] for ev in by_type["response.function_call_arguments.delta"]
                   [:3]) == "".join(ARGS)
    assert [ev["arguments"] for ev in by_type["response.function_call_arguments.done"]] == [
        '{"city": "Paris"}', '{"city": "Rome"}']

    # Item ids and output indexes agree between an item's events and the final response.
    added = by_type["response.output_item.added"]
    assert [ev["output_index"] for ev in added] == [0, 1, 2, 3]
    assert [ev["item"]["id"] for ev in added] == [o["id"] for o in final["output"]]
    assert [ev["item"]["status"] for ev in added] == ["in_progress"] * 4
    assert added[2]["item"]["arguments"] == "" and added[2]["item"]["call_id"] == "call_1"
    done = by_type["response.output_item.done"]
    assert [ev["item"] for ev in done] == final["output"]
    for ev in events:
        if "item_id" in ev:
            assert ev["item_id"] == final["output"][ev["output_index"]]["id"]

    # The completed response is response_object's for the same generation.
    sdk = Response.model_validate(final)
    assert sdk.output_text == "".join(TEXT) and final["id"] == "resp_s"
    whole = chat_completion("".join(TEXT), reasoning="".join(REASONING), finish="tool_calls",
                            calls=[("call_1", "get_weather", '{"city": "Paris"}'),
                                   ("call_2", "get_weather", '{"city": "Rome"}')],
                            usage=(12, 20))
    assert without_ids(final) == without_ids(response_object(whole, request_body=body))


def test_stream_through_the_sdk_accumulator():
    """The SDK's own stream state machine (client.responses.stream) takes the events."""
    from openai import omit
    from openai.lib.streaming.responses._responses import ResponseStreamState

    body = {"input": "x", "tools": [TOOL]}
    state = ResponseStreamState(input_tools=[TOOL], text_format=omit)
    for ev in check_events(run_stream(chat_stream(), body)):
        out = state.handle_event(ev)
    assert out[-1].type == "response.completed"
    assert out[-1].response.output_text == "".join(TEXT)
    calls = [o for o in out[-1].response.output if o.type == "function_call"]
    assert [c.parsed_arguments for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]


def test_stream_text_only_cut_short():
    body = {"input": "x", "max_output_tokens": 4}
    events = run_stream(chat_stream(finish="length", reasoning=[], args=[]), body)
    check_events(events)
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [o["type"] for o in last["response"]["output"]] == ["message"]
    assert events[-2]["type"] == "response.output_item.done"
    assert events[-2]["item"]["status"] == "incomplete"
    whole = chat_completion("".join(TEXT), finish="length", usage=(12, 20))
    assert without_ids(last["response"]) == without_ids(response_object(whole,
                                                                         request_body=body))


def test_stream_call_only_and_empty():
    events = run_stream(chat_stream(text=[], reasoning=[]), {"input": "x", "tools": [TOOL]})
    check_events(events)
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["function_call"] * 2

    events = run_stream(chat_stream(finish="stop", text=[], reasoning=[], args=[]),
                        {"input": "x"})
    check_events(events)
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message"]
    assert Response.model_validate(final).output_text == ""
    whole = chat_completion("", usage=(12, 20))
    assert without_ids(final) == without_ids(response_object(whole, request_body={"input": "x"}))


def test_stream_error_event():
    stream = ResponseStream({"input": "x"}, "resp_e", 1700000000, "m")
    events = stream.start() + stream.chunk(chunk({"content": "Hi"}))
    err = stream.error_event("the engine stopped")
    assert err["type"] == "error" and err["message"] == "the engine stopped"
    assert err["sequence_number"] == events[-1]["sequence_number"] + 1
    assert EVENT.validate_python(err).type == "error"
