"""The OpenAI completions / chat-completions protocol, shared by the server and batch jobs:
request bodies checked and turned into SamplingParams, and response bodies, stream chunks and
error objects built from RequestOutputs. Every field is understood or refused, never ignored;
defaults follow OpenAI's. The contract is docs/openai_api.md.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
import uuid
from typing import Any, Optional, Sequence

from jaxinfer.engine.request import RequestOutput, SamplingParams
from jaxinfer.structured import StructuredOutputs, tool_calls
from jaxinfer.structured.chat import (ChatFormats, ChatStream, assistant_message,  # noqa: F401
                                      chat_prompt)
from jaxinfer.structured.tool_calls import ToolError, ToolRequest, check_tools
from jaxinfer.device.sampling import MAX_LOGPROBS
from jaxinfer.user_input import check_tree, show

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT)
MAX_STOP = 4                   # OpenAI's limit on stop sequences
MAX_STOP_BYTES = 1024          # the longest stop sequence, in UTF-8 bytes
MAX_COMPLETION_LOGPROBS = 5    # OpenAI's limit on the completions API's `logprobs`
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

# Fields accepted and not acted on: they change nothing about the tokens generated.
_INERT = ("user", "stream", "stream_options", "model", "metadata", "store", "service_tier")
# vLLM's structured-output extensions, on both endpoints (docs/structured_outputs.md).
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
_COMMON = ("max_tokens", "temperature", "top_p", "seed", "stop", "n", "presence_penalty",
           "frequency_penalty", "logit_bias", "top_k", "min_p", "repetition_penalty",
           "ignore_eos", "structured_outputs") + tuple(GUIDED) + _INERT
_FIELDS = {COMPLETIONS: {"prompt", "logprobs", "echo", "best_of", "suffix"} | set(_COMMON),
           CHAT: {"messages", "logprobs", "top_logprobs", "max_completion_tokens",
                  "response_format", "tools", "tool_choice", "parallel_tool_calls"}
           | set(_COMMON)}
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class RequestError(ValueError):
    """A request the API refuses: HTTP `status`, OpenAI error `type`, the field at fault
    (`param`) and a message naming the value and the limit."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 type: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = (
            message, param, status, type, code)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclasses.dataclass
class ParsedRequest:
    """A checked request: what to prompt with and how to sample."""

    endpoint: str                    # COMPLETIONS or CHAT
    prompt: Any                      # completions: str or list[int]; chat: None
    messages: Optional[list]         # chat: the conversation
    params: SamplingParams           # max_tokens None = as many as fit (set by the caller)
    max_tokens: Optional[int]
    n: int
    echo: bool                       # completions: prompt text (and logprobs) before the answer
    logprobs: Optional[int]          # top logprobs per token, or None
    stream: bool
    include_usage: bool              # stream_options.include_usage
    model: Optional[str]
    structured_param: Optional[str] = None  # the field that set params.structured_outputs
    tools: Optional[ToolRequest] = None     # chat: tools offered (None: none, or tool_choice none)

    def sampling(self, max_seq_len: int) -> SamplingParams:
        """The SamplingParams to submit: max_tokens None becomes max_seq_len (the engine stops
        a request at max_seq_len anyway)."""
        if self.max_tokens is not None:
            return self.params
        return dataclasses.replace(self.params, max_tokens=max_seq_len)


def _number(body: dict, name: str, lo: float, hi: float, *, integer: bool = False,
            lo_open: bool = False, default=None):
    v = body.get(name, default)
    if v is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)) \
            or (isinstance(v, float) and not math.isfinite(v)):
        raise RequestError(f"{name} must be {kind}, got {show(v)}", name)
    if v < lo or v > hi or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise RequestError(f"{name} must be in {left}{lo}, {hi}], got {show(v)}", name)
    return v


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"{name} must be true or false, got {show(v)}", name)
    return v


def _stop(body: dict) -> Optional[list[str]]:
    stop = body.get("stop")
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop must be a non-empty string or a list of them, got "
                           f"{show(stop)}", "stop")
    if len(stops) > MAX_STOP:
        raise RequestError(f"stop has {len(stops)} sequences; the limit is {MAX_STOP}", "stop")
    for i, s in enumerate(stops):
        size = len(s.encode("utf-8"))
        if size > MAX_STOP_BYTES:
            raise RequestError(f"stop[{i}] has {size} bytes (UTF-8); the limit is "
                               f"{MAX_STOP_BYTES}", "stop")
    return stops or None


def _messages(body: dict) -> list:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list of {role, content} objects",
                           "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string role", "messages")
        extra = {}
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            extra["tool_calls"] = _tool_calls(m["tool_calls"], i)
        if m["role"] == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise RequestError(f"messages[{i}].tool_call_id must be a string (the call the "
                                   f"result answers), got {show(m.get('tool_call_id'))}",
                                   "messages")
            extra["tool_call_id"] = m["tool_call_id"]
        content = m.get("content")
        if content is None and extra.get("tool_calls"):
            content = ""  # an assistant turn of calls alone
        if isinstance(content, list):  # content parts: only text ones
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise RequestError(f"messages[{i}].content: only text parts are supported, "
                                       f"got {show(part)}", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or a list of text "
                               f"parts, got {show(content)}", "messages")
        out.append({"role": m["role"], "content": content, **extra})
    return out


def _tool_calls(calls: Any, i: int) -> list:
    """An assistant message's tool_calls, checked: [{id, type: function, function: {name,
    arguments (a JSON string)}}]."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise RequestError(f"{where} must be a list, got {show(calls)}", "messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments"), str) \
                or call.get("type", "function") != "function":
            raise RequestError(f"{where}[{j}] must be {{\"id\", \"type\": \"function\", "
                               f"\"function\": {{\"name\", \"arguments\"}}}} with string name "
                               f"and arguments, got {show(call)}", "messages")
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


def _tools(body: dict) -> Optional[ToolRequest]:
    """tools, tool_choice and parallel_tool_calls checked (tool_calls.check_tools); None when
    no tool may be called."""
    try:
        req = check_tools(body.get("tools"), body.get("tool_choice"),
                          body.get("parallel_tool_calls"))
    except ToolError as e:
        raise RequestError(str(e), e.param) from None
    return req if req.tools and req.choice != "none" else None


def _structured(body: dict) -> tuple[Optional[StructuredOutputs], Optional[str]]:
    """The output constraint of response_format, a guided_* field or structured_outputs (at
    most one of them) and the field that gave it. RequestError naming the field."""
    given = {}
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        given["response_format"] = _response_format(fmt)
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            given[name] = {kind: body[name]}
    extra = body.get("structured_outputs")
    if extra is not None:
        if not isinstance(extra, dict) or not extra:
            raise RequestError(f"structured_outputs must be an object with one of "
                               f"{_STRUCTURED_KEYS}, got {show(extra)}", "structured_outputs")
        unknown = sorted(set(extra) - set(_STRUCTURED_KEYS))
        if unknown:
            raise RequestError(f"structured_outputs.{show(unknown[0])} is not supported; "
                               f"supported: {_STRUCTURED_KEYS}", "structured_outputs")
        given["structured_outputs"] = {k: v for k, v in extra.items() if v is not None}
    if not given:
        return None, None
    if len(given) > 1:
        raise RequestError(f"at most one output constraint per request; got {sorted(given)}",
                           sorted(given)[1])
    (param, kw), = given.items()
    try:
        return StructuredOutputs(**kw), param
    except ValueError as e:
        raise RequestError(f"{param}: {e}", param) from None


_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object",
                    "disable_any_whitespace")


def _response_format(fmt: Any) -> dict:
    """OpenAI's response_format as StructuredOutputs arguments."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object" and set(fmt) == {"type"}:
        return {"json_object": True}
    if kind != "json_schema":
        raise RequestError(f"response_format must be {{\"type\": \"text\"}}, {{\"type\": "
                           f"\"json_object\"}} or {{\"type\": \"json_schema\", "
                           f"\"json_schema\": {{...}}}}, got {show(fmt)}", "response_format")
    spec = fmt.get("json_schema")
    if set(fmt) != {"type", "json_schema"} or not isinstance(spec, dict):
        raise RequestError(f"response_format json_schema needs a json_schema object (name, "
                           f"schema, strict, description), got {show(fmt)}", "response_format")
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise RequestError(f"response_format.json_schema.{show(unknown[0])} is not supported",
                           "response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise RequestError(f"response_format.json_schema.name must be 1-64 letters, digits, "
                           f"_ or -, got {show(name)}", "response_format")
    if spec.get("strict") not in (None, True, False):
        raise RequestError(f"response_format.json_schema.strict must be a boolean, got "
                           f"{show(spec['strict'])}", "response_format")
    schema = spec.get("schema", {})  # OpenAI: no schema is any JSON object's
    if not isinstance(schema, dict):
        raise RequestError(f"response_format.json_schema.schema must be an object, got "
                           f"{show(schema)}", "response_format")
    return {"json": schema} if schema else {"json_object": True}


def _prompt(body: dict):
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1:
        raise RequestError("prompt: a batch of several prompts in one request is not supported; "
                           "send one request per prompt", "prompt")
    raise RequestError(f"prompt must be a non-empty string or a list of token ids, got "
                       f"{show(prompt)}", "prompt")


def parse_request(endpoint: str, body: Any, *, max_n: int = 1) -> ParsedRequest:
    """Checks a request body for `endpoint` (COMPLETIONS or CHAT). RequestError (status 400,
    naming the field and the limit) for anything out of range, unknown or unsupported."""
    if endpoint not in ENDPOINTS:
        raise RequestError(f"unknown url {show(endpoint)}; expected one of {ENDPOINTS}", "url",
                           status=404)
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    try:  # done by user_input.loads_json already; again for bodies built in Python
        check_tree(body)
    except ValueError as e:
        raise RequestError(str(e)) from None
    unknown = sorted(set(body) - _FIELDS[endpoint])
    if unknown:
        raise RequestError(f"unknown or unsupported field {show(unknown[0])}",
                           unknown[0][:64])
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, -2.0, 2.0, default=0.0) != 0:
            raise RequestError(f"{name} is not supported (use repetition_penalty); got "
                               f"{show(body[name])}", name)
    if body.get("logit_bias"):
        raise RequestError("logit_bias is not supported", "logit_bias")
    if body.get("suffix") is not None:
        raise RequestError("suffix is not supported", "suffix")
    if body.get("best_of") not in (None, 1):
        raise RequestError(f"best_of must be 1, got {show(body['best_of'])}", "best_of")
    structured, structured_param = _structured(body)
    tools = _tools(body) if endpoint == CHAT else None
    if tools is not None and tools.forced and structured is not None:
        raise RequestError(f"tool_choice {show(body.get('tool_choice'))} constrains the output "
                           f"to tool calls; it cannot be combined with {structured_param}",
                           "tool_choice")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise RequestError(f"model must be a string, got {show(body['model'])}", "model")

    chat = endpoint == CHAT
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _number(body, name, 1, 2**31 - 1, integer=True,
                         default=None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS)
    n = _number(body, "n", 1, 2**31 - 1, integer=True, default=1)
    if n > max_n:
        raise RequestError(f"n={n} exceeds the limit of {max_n} sequences per request", "n")
    echo = False
    if chat:
        if _bool(body, "logprobs"):
            logprobs = _number(body, "top_logprobs", 0, MAX_LOGPROBS, integer=True, default=0)
        elif body.get("top_logprobs") is not None:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        else:
            logprobs = None
    else:
        logprobs = _number(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS, integer=True)
        echo = _bool(body, "echo")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise RequestError("stream_options needs stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise RequestError(f"stream_options must be {{\"include_usage\": bool}}, got "
                               f"{show(options)}", "stream_options")
    include_usage = _bool(options or {}, "include_usage")

    try:
        params = SamplingParams(
            max_tokens=max_tokens or 1,
            temperature=_number(body, "temperature", 0.0, 2.0, default=1.0),
            top_p=_number(body, "top_p", 0.0, 1.0, lo_open=True, default=1.0),
            top_k=_number(body, "top_k", 0, 2**31 - 1, integer=True, default=0),
            min_p=_number(body, "min_p", 0.0, 1.0, default=0.0),
            repetition_penalty=_number(body, "repetition_penalty", 0.0, 1e6, lo_open=True,
                                       default=1.0), n=n,
            seed=_number(body, "seed", 0, 2**32 - 1, integer=True),
            stop=_stop(body), ignore_eos=_bool(body, "ignore_eos"), logprobs=logprobs,
            prompt_logprobs=logprobs if echo and logprobs is not None else None,
            structured_outputs=structured)
    except RequestError:
        raise
    except ValueError as e:  # SamplingParams' own limits (min_p < 1, ...)
        field = str(e).split()[0].split(".")[-1]
        raise RequestError(str(e), field if field in body else None) from None
    return ParsedRequest(endpoint=endpoint, prompt=None if chat else _prompt(body),
                         messages=_messages(body) if chat else None, params=params,
                         max_tokens=max_tokens, n=n, echo=echo, logprobs=logprobs,
                         stream=stream, include_usage=include_usage, model=body.get("model"),
                         structured_param=structured_param, tools=tools)


# ---- from a checked request to a prompt --------------------------------------------------------

def prepare(llm, req: ParsedRequest, formats: ChatFormats):
    """A checked request made ready to submit, on any thread: the prompt rendered (chat) and
    tokenized, the tool-call grammar where tool_choice forces a call, and the output
    constraint checked against the tokenizer. Returns (EncodedPrompt, SamplingParams);
    RequestError naming the field (messages, prompt, the constraint's) otherwise."""
    chat = req.endpoint == CHAT
    param = "messages" if chat else "prompt"
    params = req.sampling(llm.max_seq_len)
    prompt = req.prompt
    if chat:
        if llm.tokenizer is None:
            raise RequestError("this model has no tokenizer, so it cannot chat", param)
        try:
            prompt = chat_prompt(llm.tokenizer, req, formats)
        except Exception as e:  # noqa: BLE001 - the template's own checks (roles, order)
            raise RequestError(f"messages: the model's chat template refused them: "
                               f"{show(str(e))}", param) from None
    try:
        encoded = llm.encode_prompt(prompt)
    except ValueError as e:  # too long, lone surrogates, ids outside the vocabulary
        raise RequestError(f"{param}: {e}" if chat else str(e), param) from None
    where = req.structured_param
    if req.tools is not None and req.tools.forced:
        grammar = tool_calls.call_grammar(req.tools, formats.tool_format,
                                          formats.special_markers)
        params = dataclasses.replace(params, structured_outputs=StructuredOutputs(
            grammar=grammar))
        where = "tools"
    try:
        llm.check_structured(params)
    except ValueError as e:
        raise RequestError(f"{where}: {e}", where) from None
    return encoded, params


# ---- responses -------------------------------------------------------------------------------

def new_id(endpoint: str) -> str:
    return ("chatcmpl-" if endpoint == CHAT else "cmpl-") + uuid.uuid4().hex


def _completions(out: RequestOutput) -> list:
    """A request's sequences (CompletionOutputs), index order."""
    return list(out.outputs) if out.outputs else [out]


def usage(outputs: Sequence[RequestOutput]) -> dict:
    """Prompt tokens once, completion tokens summed over every sequence (n of them)."""
    prompt = len(outputs[0].prompt_token_ids) if outputs else 0
    completion = sum(len(c.token_ids) for o in outputs for c in _completions(o))
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer, token_ids: Sequence[int], logprobs: Sequence[dict], top: int
                  ) -> dict:
    """Chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    content = []
    for tok, lp in zip(token_ids, logprobs):
        ranked = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
        text = _token_text(tokenizer, tok)
        content.append({"token": text, "logprob": lp[tok], "bytes": list(text.encode()),
                        "top_logprobs": [{"token": (t := _token_text(tokenizer, i)),
                                          "logprob": v, "bytes": list(t.encode())}
                                         for i, v in ranked]})
    return {"content": content}


def completion_logprobs(tokenizer, token_ids: Sequence[int], logprobs: Sequence[Optional[dict]],
                        top: int, offset: int = 0) -> dict:
    """Completions `logprobs`: {tokens, token_logprobs, top_logprobs, text_offset}; an entry of
    None (the first prompt token under echo) has no logprob."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tok, lp in zip(token_ids, logprobs):
        text = _token_text(tokenizer, tok)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(lp[tok])
        ranked = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
        tops.append({_token_text(tokenizer, i): v for i, v in ranked})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def _choice(req: ParsedRequest, tokenizer, out: RequestOutput, seq, index: int,
            formats: ChatFormats) -> dict:
    """The choice of sequence `seq` (a CompletionOutput, or out itself) of request `out`."""
    if req.endpoint == CHAT:
        lp = None if req.logprobs is None else chat_logprobs(
            tokenizer, seq.token_ids, seq.logprobs or [], req.logprobs)
        message, finish = assistant_message(req, formats, out.prompt, seq.text,
                                            seq.finish_reason)
        return {"index": index, "message": message, "logprobs": lp, "finish_reason": finish}
    text, lp = seq.text, None
    if req.echo:
        prompt_text = out.prompt if out.prompt is not None else tokenizer.decode(
            out.prompt_token_ids)
        text = prompt_text + text
    if req.logprobs is not None:
        ids, lps = list(seq.token_ids), list(seq.logprobs or [])
        if req.echo:
            ids = list(out.prompt_token_ids) + ids
            lps = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + lps
        lp = completion_logprobs(tokenizer, ids, lps, req.logprobs)
    return {"index": index, "text": text, "logprobs": lp, "finish_reason": seq.finish_reason}


def response_body(req: ParsedRequest, tokenizer, outputs: Sequence[RequestOutput], *,
                  model: str, response_id: Optional[str] = None,
                  created: Optional[int] = None, formats: Optional[ChatFormats] = None) -> dict:
    """A whole (non-streamed) chat.completion or text_completion: one choice per sequence of
    each output (n per request), indexed in order."""
    seqs = [(o, c) for o in outputs for c in _completions(o)]
    return {"id": response_id or new_id(req.endpoint),
            "object": "chat.completion" if req.endpoint == CHAT else "text_completion",
            "created": int(time.time()) if created is None else created, "model": model,
            "choices": [_choice(req, tokenizer, o, c, i, formats or ChatFormats())
                        for i, (o, c) in enumerate(seqs)],
            "usage": usage(outputs)}


def stream_chunk(req: ParsedRequest, *, response_id: str, created: int, model: str,
                 index: int = 0, text: Optional[str] = None, role: bool = False,
                 finish: Optional[str] = None, logprobs: Optional[dict] = None,
                 usage_: Optional[dict] = None, delta: Optional[dict] = None) -> dict:
    """One server-sent event's payload. Chat: a delta (the role first, then content, or the
    given delta's fields: reasoning_content, tool_calls); the last chunk of a choice carries
    its finish_reason. With usage_ (include_usage), the final chunk with no choices."""
    obj = "chat.completion.chunk" if req.endpoint == CHAT else "text_completion"
    chunk = {"id": response_id, "object": obj, "created": created, "model": model}
    if usage_ is not None:
        chunk["choices"], chunk["usage"] = [], usage_
        return chunk
    if req.endpoint == CHAT:
        given, delta = delta, {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        delta.update(given or {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs,
                  "finish_reason": finish}
    chunk["choices"] = [choice]
    if req.include_usage:
        chunk["usage"] = None
    return chunk
