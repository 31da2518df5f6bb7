"""Reading and checking a batch job's input, line by line: no model needed."""

import json
import random

import pytest
from batch_util import line

from jaxinfer.batch import inputs, records
from jaxinfer.batch.inputs import Blank, IdSet, ShardReader, TextDefaults, Work
from jaxinfer.batch.records import Result
from jaxinfer.engine.request import SamplingParams
from jaxinfer.openai_api import CHAT, COMPLETIONS


def parse(raw, fmt="jsonl", text=None):
    return inputs.parse_line(4, raw if isinstance(raw, bytes) else raw.encode(), fmt, text)


def error_of(item):
    assert isinstance(item, Result), item
    rec = json.loads(item.record)
    return item.error_kind, rec


@pytest.mark.parametrize("raw, kind, needle", [
    ("{nope", "invalid_json", "line 5: the line is not valid JSON"),
    ("[1, 2]", "invalid_json", "expected a JSON object, got list"),
    (b"\xff\xfe{}", "invalid_json", "not UTF-8"),
    ('{"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}',
     "missing_custom_id", "missing custom_id"),
    ('{"custom_id": 7, "url": "/v1/completions", "body": {"prompt": "x"}}',
     "invalid_line", "custom_id must be a string, got 7"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {}, "extra": 1}',
     "invalid_line", "unknown field 'extra'"),
    ('{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}',
     "invalid_line", "method must be \"POST\", got 'GET'"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions"}',
     "invalid_line", "missing body"),
])
def test_line_errors_name_the_line_and_the_problem(raw, kind, needle):
    got_kind, rec = error_of(parse(raw))
    assert got_kind == kind and rec["response"] is None
    assert rec["error"]["code"] == kind and needle in rec["error"]["message"]
    assert rec["error"]["message"].startswith("line 5: ")


@pytest.mark.parametrize("url, body, kind, status, param, needle", [
    ("/v1/embeddings", {"input": "x"}, "unknown_url", 404, "url", "unknown url"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, "invalid_request", 400,
     "temperature", "temperature must be in [0.0, 2.0], got 3"),
    ("/v1/completions", {"prompt": "x", "stream": True}, "invalid_request", 400, "stream",
     "stream is not supported"),
    ("/v1/chat/completions", {"messages": []}, "invalid_request", 400, "messages",
     "messages must be a non-empty list"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "invalid_request", 400, "n",
     "n must be in [1, "),
])
def test_refused_requests_carry_the_api_error_response(url, body, kind, status, param, needle):
    got_kind, rec = error_of(parse(line("c9", body, url)))
    assert got_kind == kind and rec["custom_id"] == "c9" and rec["error"] is None
    assert rec["response"]["status_code"] == status
    err = rec["response"]["body"]["error"]
    assert err["param"] == param and needle in err["message"]


def test_valid_lines_become_work_with_the_body_sampling():
    w = parse(line("a", {"prompt": "hi", "max_tokens": 5, "temperature": 0.5, "seed": 3,
                         "top_k": 4, "stop": ["\n"]}))
    assert isinstance(w, Work) and (w.line, w.custom_id) == (4, "a")
    assert w.request.endpoint == COMPLETIONS and w.request.prompt == "hi"
    assert w.request.params == SamplingParams(max_tokens=5, temperature=0.5, seed=3, top_k=4,
                                              stop=["\n"])
    chat = parse(line("b", {"messages": [{"role": "user", "content": "yo"}]},
                      "/v1/chat/completions"))
    assert chat.request.endpoint == CHAT and chat.request.max_tokens is None  # fills the context
    assert isinstance(parse("   "), Blank)


def test_plain_text_lines_use_the_flags_and_their_line_number():
    text = TextDefaults({"max_tokens": 3, "temperature": 0.2}, chat=False)
    w = parse("  a prompt  ", "text", text)
    assert (w.custom_id, w.request.prompt) == ("5", "  a prompt  ")
    assert w.request.params == SamplingParams(max_tokens=3, temperature=0.2)
    c = parse("hello", "text", TextDefaults({}, chat=True))
    assert c.request.endpoint == CHAT and c.request.messages == [{"role": "user",
                                                                   "content": "hello"}]


def reader(lines, **kw):
    args = dict(fmt="jsonl", text=None, num_shards=1, shard_index=0, seen=IdSet(),
                max_lines=None, start=0)
    args.update(kw)
    return ShardReader(iter(enumerate(x.encode() for x in lines)), **args)


def test_duplicates_become_errors_and_the_first_line_keeps_its_id():
    lines = [line("a", {"prompt": "x", "temperature": 9}),  # refused, but it claims "a"
             line("a", {"prompt": "x"}), line("b", {"prompt": "y"}), line("b", {"prompt": "z"})]
    got = [item for _, _, item in reader(lines)]
    assert got[0].error_kind == "invalid_request" and isinstance(got[2], Work)
    for dup in (got[1], got[3]):
        kind, rec = error_of(dup)
        assert kind == "duplicate_custom_id" and dup.custom_id in rec["error"]["message"]


def test_reading_is_lazy_and_stops_at_max_lines():
    pulled = []

    def lines():  # an endless input
        for i in range(10**9):
            pulled.append(i)
            yield i, line(f"id{i}", {"prompt": "x"}).encode()

    r = ShardReader(lines(), "jsonl", None, 1, 0, IdSet(), max_lines=25, start=0)
    assert [no for no, _, _ in r] == list(range(25))
    assert len(pulled) == 25 and r.position == 25


def test_shards_partition_the_lines_deterministically_and_keep_duplicates_together():
    rng = random.Random(0)
    ids = [f"q{rng.randrange(300)}" for _ in range(600)]  # many duplicates
    lines = [line(c, {"prompt": "p"}) for c in ids] + ["not json", ""] * 20
    per_shard = [[(no, item) for no, _, item in reader(lines, num_shards=3, shard_index=s)]
                 for s in range(3)]
    seen_lines = sorted(no for shard in per_shard for no, _ in shard)
    assert seen_lines == list(range(len(lines)))              # every line in exactly one shard
    assert all(150 < len(s) < 300 for s in per_shard)          # roughly even
    again = [no for no, _, _ in reader(lines, num_shards=3, shard_index=1)]
    assert again == [no for no, _ in per_shard[1]]             # deterministic
    unsharded = {no: item for no, _, item in reader(lines)}
    for shard in per_shard:  # duplicates are found within the shard exactly as unsharded
        for no, item in shard:
            assert getattr(item, "error_kind", None) == getattr(unsharded[no], "error_kind",
                                                                None)


def test_derived_seeds_depend_on_custom_id_and_job_seed_only():
    s = records.derive_seed(5, "abc")
    assert s == records.derive_seed(5, "abc") and 0 <= s < 2**32
    assert len({records.derive_seed(5, f"id{i}") for i in range(1000)}) == 1000
    assert records.derive_seed(6, "abc") != s and records.derive_seed(None, "abc") == \
        records.derive_seed(0, "abc")


def test_id_set_matches_a_python_set_through_growth():
    ids, want = IdSet(capacity=8), set()
    rng = random.Random(1)
    for _ in range(20000):
        cid = f"x{rng.randrange(12000)}"
        assert ids.add(cid) == (cid not in want)
        want.add(cid)
    assert len(ids) == len(want)


def test_format_detection_and_line_count(tmp_path):
    (tmp_path / "a.data").write_text('\n{"custom_id": "x"}\n')
    (tmp_path / "b.data").write_text("hello\nworld")
    assert inputs.resolve_format(str(tmp_path / "a.data"), "auto") == "jsonl"
    assert inputs.resolve_format(str(tmp_path / "b.data"), "auto") == "text"
    assert inputs.resolve_format("x.txt", "auto") == "text"
    assert inputs.count_lines(str(tmp_path / "b.data")) == 2
    assert inputs.count_lines(str(tmp_path / "a.data")) == 2
    with pytest.raises(ValueError, match="--input_format must be one of"):
        inputs.resolve_format("x", "csv")
