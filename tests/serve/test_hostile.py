"""Hostile request bodies against one live server: whatever bytes arrive, the request gets an
answer (a 4xx with an OpenAI error object naming the problem, or a 200 for the odd body that is
a valid request), never a 5xx or a hang, and the server keeps serving: a greedy request answers
the same before and after all of them and /health stays 200.

Hand-written cases cover the known traps (lone surrogates, deep nesting, huge numbers, NaN,
bad UTF-8, wrong types, extremes, Unicode oddities, long arrays, Content-Type, sizes); generated
ones (hypothesis, derandomized) throw arbitrary JSON at the request schema."""

from __future__ import annotations

import http.client
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxinfer.openai_api import COMPLETIONS, _FIELDS, CHAT

MODEL = "smollm2-135m"
TIMEOUT_S = 10        # each call answers within this, or the test fails (a hang)
JSON = {"Content-Type": "application/json"}
GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
COUNT = {"cases": 0}  # hostile requests sent by this module


def _send(raw, path, body: bytes, headers=None, method="POST"):
    """(status, content type, body bytes) of one raw request, within TIMEOUT_S."""
    c = http.client.HTTPConnection(raw.host, raw.port, timeout=TIMEOUT_S)
    try:
        c.request(method, path, body=body, headers=JSON if headers is None else headers)
        r = c.getresponse()
        return r.status, r.getheader("content-type") or "", r.read()
    finally:
        c.close()


def _check(status, ctype, data, expect):
    """The answer is `expect` (a status, or "4xx"/"<500") and, when an error, an OpenAI error
    object with a short message that is valid Unicode."""
    COUNT["cases"] += 1
    text = data.decode("utf-8")   # raises on invalid UTF-8
    if expect == "4xx":
        assert 400 <= status < 500, (status, text[:300])
    elif expect == "<500":
        assert status < 500, (status, text[:300])
    else:
        assert status == expect, (status, text[:300])
    if status >= 400:
        assert ctype.startswith("application/json"), ctype
        err = json.loads(text)["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert isinstance(err["message"], str) and 0 < len(err["message"]) <= 2000
        assert isinstance(err["type"], str)
        assert err["param"] is None or isinstance(err["param"], str)
        err["message"].encode("utf-8")  # no lone surrogate
    elif ctype.startswith("application/json"):
        assert json.loads(text)["choices"]
    else:
        assert text.rstrip().endswith("data: [DONE]"), text[-200:]


def _greedy(raw) -> str:
    status, _, data = _send(raw, COMPLETIONS, json.dumps(GREEDY).encode())
    assert status == 200, data[:300]
    return json.loads(data)["choices"][0]["text"]


@pytest.fixture(scope="module")
def before(server, raw):
    assert _send(raw, "/health", None, {}, "GET")[0] == 200
    return _greedy(raw)


C, H = COMPLETIONS, CHAT
DEEP_ARRAY = b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
DEEP_OBJECT = b'{"prompt": "a", "user": ' + b'{"a":' * 10_000 + b"1" + b"}" * 10_000 + b"}"
BIG_INT = "9" * 5000
UNICODE = {"nul": "a\u0000b", "bom": "\ufeffhello", "rtl": "\u202eabc\u202c", "emoji": "hi 😀",
           "combining": "e" + "\u0301" * 40, "u+ffff": "a\uffffb", "nonchar": "\U0010ffff"}


def _j(**fields) -> bytes:
    return json.dumps(fields).encode()


def _msgs(content) -> list:
    return [{"role": "user", "content": content}]


# (id, path, body bytes, expected status)
CASES = [
    ("surrogate-prompt", C, b'{"prompt": "a \\ud800 b"}', 400),
    ("low-surrogate-prompt", C, b'{"prompt": "\\udc00"}', 400),
    ("surrogate-in-list-prompt", C, b'{"prompt": ["x\\ud800"]}', 400),
    ("surrogate-chat-content", H, b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', 400),
    ("surrogate-chat-role", H, b'{"messages": [{"role": "\\udfff", "content": "hi"}]}', 400),
    ("surrogate-chat-part", H, b'{"messages": [{"role": "user", "content": '
                               b'[{"type": "text", "text": "\\ud800"}]}]}', 400),
    ("surrogate-stop", C, b'{"prompt": "a", "stop": ["\\ud800"]}', 400),
    ("surrogate-field-name", C, b'{"prompt": "a", "\\ud800": 1}', 400),
    ("surrogate-model", C, b'{"prompt": "a", "model": "\\ud800"}', 400),
    ("surrogate-user", C, b'{"prompt": "a", "user": "\\udbff"}', 400),
    ("nested-10000-arrays", C, DEEP_ARRAY, 400),
    ("nested-10000-objects", C, DEEP_OBJECT, 400),
    ("5000-digit-max-tokens", C, b'{"prompt": "a", "max_tokens": ' + BIG_INT.encode() + b"}", 400),
    ("5000-digit-token-id", C, b'{"prompt": [' + BIG_INT.encode() + b"]}", 400),
    ("nan", C, b'{"prompt": "a", "temperature": NaN}', 400),
    ("infinity", C, b'{"prompt": "a", "temperature": Infinity}', 400),
    ("-infinity", C, b'{"prompt": "a", "top_p": -Infinity}', 400),
    ("1e999", C, b'{"prompt": "a", "temperature": 1e999}', 400),
    ("not-utf8", C, b'{"prompt": "\xff\xfe"}', 400),
    ("bad-utf8-continuation", C, b'{"prompt": "\xc3\x28"}', 400),
    ("utf8-bom-before-body", C, b'\xef\xbb\xbf{"prompt": "a"}', 400),
    ("empty-body", C, b"", 400),
    ("null", C, b"null", 400),
    ("array", C, b'[{"prompt": "a"}]', 400),
    ("string", H, b'"hello"', 400),
    ("number", C, b"42", 400),
    ("truncated", C, b'{"prompt": "a"', 400),
    ("prompt-int", C, _j(prompt=42), 400),
    ("prompt-object", C, _j(prompt={}), 400),
    ("prompt-bool", C, _j(prompt=True), 400),
    ("prompt-floats", C, _j(prompt=[1.5, 2.0]), 400),
    ("prompt-batch", C, _j(prompt=["a", "b"]), 400),
    ("prompt-empty", C, _j(prompt=""), 400),
    ("prompt-empty-list", C, _j(prompt=[]), 400),
    ("prompt-negative-id", C, _j(prompt=[-1]), 400),
    ("max-tokens-string", C, _j(prompt="a", max_tokens="8"), 400),
    ("max-tokens-2**63", C, _j(prompt="a", max_tokens=2**63), 400),
    ("max-tokens-negative", C, _j(prompt="a", max_tokens=-1), 400),
    ("max-tokens-float", C, _j(prompt="a", max_tokens=1.5), 400),
    ("max-tokens-1e308", C, _j(prompt="a", max_tokens=1e308), 400),
    ("max-tokens-bool", C, _j(prompt="a", max_tokens=True), 400),
    ("n-huge", C, _j(prompt="a", n=10**30), 400),
    ("n-negative", C, _j(prompt="a", n=-1), 400),
    ("temperature-string", C, _j(prompt="a", temperature="hot"), 400),
    ("temperature-list", C, _j(prompt="a", temperature=[]), 400),
    ("seed-negative", C, _j(prompt="a", seed=-1), 400),
    ("seed-2**64", C, _j(prompt="a", seed=2**64), 400),
    ("top-k-huge", C, _j(prompt="a", top_k=2**70), 400),
    ("logprobs-string", C, _j(prompt="a", logprobs="x"), 400),
    ("echo-string", C, _j(prompt="a", echo="yes"), 400),
    ("stream-string", C, _j(prompt="a", stream="true"), 400),
    ("stream-options-without-stream", C, _j(prompt="a", stream_options={}), 400),
    ("stop-int", C, _j(prompt="a", stop=42), 400),
    ("stop-empty", C, _j(prompt="a", stop=[""]), 400),
    ("stop-ints", C, _j(prompt="a", stop=[1, 2]), 400),
    ("stop-2KiB", C, _j(prompt="a", stop="x" * 2048), 400),
    ("stop-10000", C, _j(prompt="a", stop=["a"] * 10_000), 400),
    ("prompt-10000-ids", C, _j(prompt=[1] * 10_000), 400),
    ("logit-bias-10000", C, _j(prompt="a", logit_bias={str(i): 1 for i in range(10_000)}), 400),
    ("messages-string", H, _j(messages="hi"), 400),
    ("messages-null-item", H, _j(messages=[None]), 400),
    ("messages-role-int", H, _j(messages=[{"role": 1, "content": "hi"}]), 400),
    ("messages-content-int", H, _j(messages=_msgs(42)), 400),
    ("messages-image-part", H, _j(messages=_msgs([{"type": "image_url", "image_url": {}}])), 400),
    ("messages-10000", H, _j(messages=_msgs("hi") * 10_000), 400),
    ("messages-10000-parts", H, _j(messages=_msgs([{"type": "text", "text": "a"}] * 10_000)), 400),
    ("model-int", C, _j(prompt="a", model=42), 400),
    ("model-100k", C, _j(prompt="a", model="x" * 100_000), 404),  # no such model
    ("field-name-10k", C, json.dumps({"prompt": "a", "y" * 10_000: 1}).encode(), 400),
    ("unknown-deep-field", C, _j(prompt="a", extra={"a": {"b": {"c": [1, [2, [3]]]}}}), 400),
    ("underflow-and-empty-prompt", C, b'{"prompt": "", "temperature": 1e-400}', 400),
    ("body-over-limit", C, _j(prompt="x" * (1 << 20)), 413),
] + [(f"model-{k}", C, _j(prompt="a", model=v), 404) for k, v in UNICODE.items()] \
  + [(f"prompt-{k}", C, _j(prompt=v, max_tokens=1, temperature=0), 200)
     for k, v in UNICODE.items()] \
  + [(f"chat-{k}", H, _j(messages=_msgs(v), max_tokens=1), 200) for k, v in UNICODE.items()] \
  + [("stop-nul", C, _j(prompt="a", stop="\u0000", max_tokens=1), 200)]


@pytest.mark.parametrize("name,path,body,expect", CASES, ids=[c[0] for c in CASES])
def test_hostile_body(before, raw, name, path, body, expect):
    _check(*_send(raw, path, body), expect)


# (id, headers, expected status): the Content-Type rule without an API key.
TYPES = [
    ("text-plain", {"Content-Type": "text/plain"}, 415),
    ("text-plain-charset", {"Content-Type": "text/plain; charset=utf-8"}, 415),
    ("form", {"Content-Type": "application/x-www-form-urlencoded"}, 415),
    ("multipart", {"Content-Type": "multipart/form-data; boundary=x"}, 415),
    ("none", {}, 415),
    ("json-in-a-parameter", {"Content-Type": "text/plain; x=application/json"}, 415),
    ("json-list", {"Content-Type": "application/json, text/plain"}, 415),
    ("json-charset", {"Content-Type": "application/json; charset=utf-8"}, 200),
    ("json-upper", {"Content-Type": "Application/JSON"}, 200),
    ("plus-json", {"Content-Type": "application/vnd.api+json"}, 200),
]


@pytest.mark.parametrize("name,headers,expect", TYPES, ids=[t[0] for t in TYPES])
def test_content_type_rule(before, raw, name, headers, expect):
    status, ctype, data = _send(raw, C, _j(prompt="a", max_tokens=1), headers)
    _check(status, ctype, data, expect)
    if status == 415:
        message = json.loads(data)["error"]["message"]
        assert "application/json" in message and "Content-Type" in message


def test_with_an_api_key_any_content_type_is_taken(before, server, raw):
    """A cross-site page cannot send the Authorization header unasked either."""
    server.state.cfg.api_key = "sekrit"
    try:
        auth = {"Authorization": "Bearer sekrit"}
        body = _j(prompt="a", max_tokens=1)
        _check(*_send(raw, C, body, {**auth, "Content-Type": "text/plain"}), 200)
        _check(*_send(raw, C, body, auth), 200)
        _check(*_send(raw, C, body, {"Content-Type": "text/plain"}), 401)
    finally:
        server.state.cfg.api_key = None


def test_sizes_and_methods(before, server, raw):
    c = http.client.HTTPConnection(raw.host, raw.port, timeout=TIMEOUT_S)
    c.request("POST", C, body=iter([b'{"prompt": "', b"y" * (1 << 20), b'"}']),
              encode_chunked=True, headers={**JSON, "Transfer-Encoding": "chunked"})
    r = c.getresponse()
    _check(r.status, r.getheader("content-type"), r.read(), 413)
    c.close()
    # A declared length over the limit is refused before any byte of the body is read.
    c = http.client.HTTPConnection(raw.host, raw.port, timeout=TIMEOUT_S)
    c.putrequest("POST", C)
    for k, v in {**JSON, "Content-Length": str(1 << 30)}.items():
        c.putheader(k, v)
    c.endheaders()
    r = c.getresponse()
    _check(r.status, r.getheader("content-type"), r.read(), 413)
    c.close()
    for method in ("GET", "PUT", "DELETE"):
        _check(*_send(raw, C, None, {}, method), 405)
    _check(*_send(raw, "/v1/nowhere%E2%80%AE%ED%A0%80", b"{}"), 404)
    # A prompt of 1 MiB - 1 characters is refused by the character count, before tokenizing.
    server.state.cfg.max_body_bytes = 2 << 20
    try:
        status, ctype, data = _send(raw, C, _j(prompt="z" * ((1 << 20) - 1)))
        _check(status, ctype, data, 400)
        assert "characters" in json.loads(data)["error"]["message"]
    finally:
        server.state.cfg.max_body_bytes = 1 << 20


# ---- generated bodies -----------------------------------------------------------------------

# Any code point, lone surrogates included (made common: the default alphabet rarely draws
# them), and a few that tokenizers and JSON writers trip on.
TEXT = st.text(st.characters(codec=None, exclude_categories=())
               | st.sampled_from("\ud800\udbff\udc00\udfff\x00\ufeff\u202e\uffff"), max_size=12)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | TEXT
JSON_VALUES = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(TEXT, kids, max_size=4), max_leaves=12)
# Values that cannot be a token budget (or a small one): a generated request that happens to
# be valid stays quick.
BUDGET = st.integers(1, 2) | JSON_VALUES.filter(lambda v: not isinstance(v, int) or v < 1)
FIELDS = sorted(_FIELDS[COMPLETIONS] | _FIELDS[CHAT])
GENERATED = dict(max_examples=60, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow,
                                        HealthCheck.function_scoped_fixture])


def _post_generated(raw, path: str, value) -> None:
    body = json.dumps(value, ensure_ascii=True).encode()   # NaN and Infinity go as literals
    _check(*_send(raw, path, body), "<500")


@settings(**GENERATED)
@given(path=st.sampled_from([C, H]), value=JSON_VALUES)
def test_generated_json_values(before, raw, path, value):
    _post_generated(raw, path, value)


@settings(**GENERATED)
@given(path=st.sampled_from([C, H]),
       fields=st.fixed_dictionaries(
           {"max_tokens": BUDGET},
           optional={**{f: JSON_VALUES for f in FIELDS if "max" not in f},
                     "max_completion_tokens": BUDGET,
                     "prompt": st.just("Hi") | JSON_VALUES,
                     "messages": st.just(_msgs("Hi")) | JSON_VALUES}))
def test_generated_schema_fields(before, raw, path, fields):
    _post_generated(raw, path, fields)


def test_server_unharmed(before, server, raw):
    """Last in the module: the same greedy answer as before every hostile request, /health
    200, nothing left admitted."""
    assert _greedy(raw) == before
    assert _send(raw, "/health", None, {}, "GET")[0] == 200
    assert server.state.outstanding == 0 and server.state.engine.alive
    print(f"\nhostile requests answered without harm: {COUNT['cases']}")
    assert COUNT["cases"] >= len(CASES) + len(TYPES) + 120
