"""Hostile input lines, without a model: whatever bytes a line holds, it becomes one record
that names its problem and encodes as UTF-8 JSON; overlong lines are skipped in bounded reads
and hashed whole; records that would not encode become internal_error records."""

import hashlib
import io
import json
import logging
import random

import pytest
from batch_util import line

from jaxinfer.batch import inputs, records
from jaxinfer.batch.inputs import Blank, LongLine, Work
from jaxinfer.batch.records import Result
from jaxinfer.user_input import MAX_JSON_DEPTH


def strict_json(text):
    """json.loads that refuses what is not JSON (NaN, Infinity)."""
    def refuse(name):
        raise ValueError(f"{name} in a record")
    return json.loads(text, parse_constant=refuse)


def record_of(raw):
    item = inputs.parse_line(9, raw.encode() if isinstance(raw, str) else raw, "jsonl", None)
    assert isinstance(item, Result), item
    strict_json(item.record.encode("utf-8").decode("utf-8"))  # encodes, and is JSON
    return item, strict_json(item.record)


def message_of(rec):
    if rec["response"] is None:
        return rec["error"]["message"]
    return rec["response"]["body"]["error"]["message"]


NEST = "[" * 5000 + "]" * 5000
COMPLETIONS = '"url": "/v1/completions"'
CHAT = '"url": "/v1/chat/completions"'


# (line text, kind, custom_id in the record, words its message holds)
HOSTILE = [
    ('{"custom_id": "s1", %s, "body": {"prompt": "a\\ud800b"}}' % COMPLETIONS,
     "invalid_request", "s1", ["body.prompt", "surrogate", "U+D800"]),
    ('{"custom_id": "x\\udc00", %s, "body": {"prompt": "a"}}' % COMPLETIONS,
     "invalid_json", None, ["custom_id", "surrogate"]),
    ('{"custom_id": "s3", %s, "body": {"prompt": "a", "\\ud800": 1}}' % COMPLETIONS,
     "invalid_request", "s3", ["field name", "surrogate"]),
    ('{"custom_id": "s4", %s, "\\ud800": 1, "body": {"prompt": "a"}}' % COMPLETIONS,
     "invalid_json", "s4", ["field name", "surrogate"]),
    ('{"custom_id": "s5", %s, "body": {"messages": [{"role": "user", "content": "\\udfff"}]}}'
     % CHAT, "invalid_request", "s5", ["messages[0].content", "surrogate"]),
    ('{"custom_id": "s6", %s, "body": {"prompt": "a", "stop": ["\\ud800"]}}' % COMPLETIONS,
     "invalid_request", "s6", ["stop[0]", "surrogate"]),
    ('{"custom_id": "n1", %s, "body": {"prompt": %s}}' % (COMPLETIONS, NEST),
     "invalid_json", None, ["nests", str(MAX_JSON_DEPTH)]),
    ('{"custom_id": "n2", %s, "body": {"prompt": %s}}' % (COMPLETIONS, "[" * 100 + "]" * 100),
     "invalid_request", "n2", ["nests", str(MAX_JSON_DEPTH)]),
    ('{"custom_id": "d1", %s, "body": {"prompt": "a", "max_tokens": %s}}'
     % (COMPLETIONS, "9" * 5000), "invalid_request", "d1", ["not valid JSON", "digits"]),
    ('{"custom_id": "f1", %s, "body": {"prompt": "a", "temperature": NaN}}' % COMPLETIONS,
     "invalid_request", "f1", ["NaN"]),
    ('{"custom_id": "f2", %s, "body": {"prompt": "a", "temperature": 1e999}}' % COMPLETIONS,
     "invalid_request", "f2", ["out of the range"]),
    ('{"custom_id": NaN, %s, "body": {"prompt": "a"}}' % COMPLETIONS,
     "invalid_json", None, ["NaN"]),
    (b'{"custom_id": "u1", "body": "\xff"}', "invalid_json", None, ["not UTF-8"]),
    (line("c" * 513, {"prompt": "a"}), "invalid_line", None, ["513 characters", "512"]),
    (line("k1", {"prompt": "a", "stop": "x" * 2048}), "invalid_request", "k1",
     ["stop[0] has 2048 bytes", "1024"]),
    (line("k2", {"prompt": "a", "\u00e9" * 300: 1}), "invalid_request", "k2",
     ["unknown or unsupported field", "characters)"]),
]


@pytest.mark.parametrize("raw, kind, custom_id, words", HOSTILE)
def test_hostile_lines_get_one_encodable_record_naming_the_problem(raw, kind, custom_id,
                                                                    words):
    item, rec = record_of(raw)
    assert item.error_kind == kind and rec["custom_id"] == item.custom_id == custom_id
    message = message_of(rec)
    if rec["response"] is None:  # not a request at all: the error names the line
        assert message.startswith("line 10: "), message
    else:                        # a request the API refuses: the server's 400
        assert rec["response"]["status_code"] == 400 and rec["error"] is None
    for word in words:
        assert word in message, (word, message)
    assert len(message) < 400  # user values are quoted shortened


def test_a_custom_id_of_the_limit_is_accepted():
    item = inputs.parse_line(0, line("c" * 512, {"prompt": "a"}).encode(), "jsonl", None)
    assert isinstance(item, Work) and item.custom_id == "c" * 512


def test_blank_and_whitespace_lines_are_blank():
    for raw in (b"", b"   ", b" \t \r", "\u00a0\u2003".encode()):
        assert isinstance(inputs.parse_line(0, raw, "jsonl", None), Blank)


def scan(data, limit, chunk=None, monkeypatch=None):
    if chunk is not None:
        monkeypatch.setattr(inputs, "_SKIP_CHUNK", chunk)
    return list(inputs.scan_lines(io.BytesIO(data), limit))


def test_overlong_lines_are_skipped_in_bounded_reads_and_hashed_whole(monkeypatch):
    rng = random.Random(3)
    lines = [b"short", b"x" * 100, b"y" * 64, b"z" * 65, b"", b"w" * 1000 + b"\r",
             bytes(rng.randrange(256) for _ in range(5000)).replace(b"\n", b".")]
    for newline in (b"\n", b"\r\n"):
        data = b"".join(x + newline for x in lines) + b"tail" * 40  # last: no newline
        want = [inputs.strip_newline(x + newline) for x in lines] + [b"tail" * 40]
        for chunk in (1, 7, 64, 1 << 16):
            got = scan(data, 64, chunk, monkeypatch)
            assert sum(taken for _, taken in got) == len(data)
            assert len(got) == len(want)
            for (raw, _), w in zip(got, want):
                if len(w) <= 64:
                    assert raw == w
                else:  # its size and the digest of all its bytes, as a whole line's
                    assert raw == LongLine(len(w), inputs.line_digest(w), 64)


def test_no_read_holds_more_than_the_limit(monkeypatch):
    sizes = []

    class Recording(io.BytesIO):
        def readline(self, size=-1):
            sizes.append(size)
            return super().readline(size)

    monkeypatch.setattr(inputs, "_SKIP_CHUNK", 1000)
    data = b"a" * 10**6 + b"\n" + b"b\n"
    got = list(inputs.scan_lines(Recording(data), 5000))
    assert [r for r, _ in got][1:] == [b"b"] and got[0][0].size == 10**6
    assert 0 < max(sizes) <= 5002


def test_overlong_lines_get_line_too_long_records(tmp_path):
    path = tmp_path / "in.jsonl"
    big = line("big", {"prompt": "p" * 5000})
    path.write_text(line("a", {"prompt": "x"}) + "\n" + big + "\n")
    got = list(inputs.read_lines(str(path), 1000))
    item = inputs.parse_line(1, got[1][1], "jsonl", None)
    assert item.error_kind == "line_too_long" and item.custom_id is None
    assert f"line 2: the line has {len(big)} bytes; the limit is 1000" in item.record
    assert inputs.line_digest(got[1][1]) == inputs.line_digest(big.encode())


def test_a_record_that_would_not_encode_becomes_an_internal_error(caplog):
    body = {"id": "cmpl-1", "choices": [{"text": "a\ud800"}], "logprob": float("nan"),
            "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    with caplog.at_level(logging.ERROR, logger="jaxinfer.batch.records"):
        r = records.success(3, "q\udc00", body)
    rec = strict_json(r.record)
    assert r.error_kind == "internal_error" and rec["custom_id"] is None
    assert rec["response"]["status_code"] == 500
    assert rec["response"]["body"]["error"]["type"] == "server_error"
    assert "line 4: internal error" in rec["response"]["body"]["error"]["message"]
    assert "Traceback" not in r.record and "does not encode" in caplog.text
    assert records.INTERNAL_ERROR in records.ERROR_KINDS
    assert records.LINE_TOO_LONG in records.LINE_KINDS


def test_line_digests_are_blake2b_of_the_line():
    assert inputs.line_digest(b"abc") == hashlib.blake2b(b"abc", digest_size=16).digest()


def test_the_ray_read_tasks_carry_an_overlong_line_as_its_size(tmp_path):
    pytest.importorskip("pyarrow")
    from jaxinfer.batch import JobSpec
    from jaxinfer.batch.ray_runner import _raw_line, _read_range, line_ranges

    lines = [line(f"a{i}", {"prompt": "x" * (3000 * (i % 3))}) for i in range(7)]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    spec = JobSpec(str(path), str(tmp_path / "out"), {"model": "m"}, max_line_bytes=4096)
    ranges = line_ranges(spec.input_path, 1, None, 2, spec.max_line_bytes)
    offsets = [sum(len(x) + 1 for x in lines[:i]) for i in (1, 3, 5)]
    assert ranges == [(1, offsets[0], 2), (3, offsets[1], 2), (5, offsets[2], 2)]
    got = []
    for r in ranges:
        for block in _read_range(spec, "jsonl", *r):
            rows = block.to_pydict()
            got += [_raw_line(raw, digest, too_long, spec.max_line_bytes)
                    for raw, digest, too_long in zip(rows["raw"], rows["digest"],
                                                      rows["too_long"])]
    assert len(got) == 6
    for no, raw in zip(range(1, 7), got):
        want = lines[no].encode()
        assert inputs.line_digest(raw) == inputs.line_digest(want)
        if len(want) > 4096:
            assert raw == LongLine(len(want), inputs.line_digest(want), 4096)
        else:
            assert raw == want
