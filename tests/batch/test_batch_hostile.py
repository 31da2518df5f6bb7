"""`python -m jaxinfer.launch.batch` over a file mixing good lines with every kind of hostile
line: the job finishes (exit 0), every non-blank line gets one valid UTF-8 JSON output line
(an error record naming the problem for each hostile one), and rerunning the command changes
nothing. Two launches of the model."""

import json

from batch_util import MODEL_FLAGS, PROMPTS, launch, line

MAX_LINE_BYTES = 65536
COMPLETIONS = '"url": "/v1/completions"'
GOOD = {"max_tokens": 3, "temperature": 0}


def hostile_lines():
    """(raw line, kind or None for a success, words its error message holds)."""
    chat = '"url": "/v1/chat/completions"'
    return [
        (line("g0", {"prompt": PROMPTS[0], **GOOD}), None, []),
        ('{"custom_id": "s1", %s, "body": {"prompt": "a\\ud800"}}' % COMPLETIONS,
         "invalid_request", ["body.prompt", "surrogate"]),
        ('{"custom_id": "\\udc00", %s, "body": {"prompt": "a"}}' % COMPLETIONS,
         "invalid_json", ["custom_id", "surrogate"]),
        ('{"custom_id": "s3", %s, "body": {"prompt": "a", "\\ud800": 1}}' % COMPLETIONS,
         "invalid_request", ["field name", "surrogate"]),
        ('{"custom_id": "s4", %s, "body": {"messages": [{"role": "user", "content": '
         '"\\udfff"}]}}' % chat, "invalid_request", ["messages[0].content", "surrogate"]),
        ('{"custom_id": "s5", %s, "body": {"prompt": "a", "stop": "\\ud800"}}' % COMPLETIONS,
         "invalid_request", ["body.stop", "surrogate"]),
        (line("g1", {"messages": [{"role": "user", "content": PROMPTS[1]}], **GOOD},
              "/v1/chat/completions"), None, []),
        ('{"custom_id": "n1", %s, "body": {"prompt": %s}}'
         % (COMPLETIONS, "[" * 5000 + "]" * 5000), "invalid_json", ["deeper than 64"]),
        ('{"custom_id": "d1", %s, "body": {"prompt": "a", "seed": %s}}'
         % (COMPLETIONS, "7" * 5000), "invalid_request", ["digits"]),
        ('{"custom_id": "f1", %s, "body": {"prompt": "a", "top_p": NaN}}' % COMPLETIONS,
         "invalid_request", ["NaN"]),
        (b'{"custom_id": "u1", "body": {"prompt": "\xc3\x28"}}', "invalid_json",
         ["not UTF-8"]),
        (line("big", {"prompt": "p" * 100_000}), "line_too_long",
         ["bytes; the limit is 65536"]),
        (" \t ", "blank", []),
        (line("k1", {"prompt": "a", "stop": "s" * 2048}), "invalid_request",
         ["stop[0] has 2048 bytes", "limit is 1024"]),
        (line("t1", {"prompt": "word " * 300}), "prompt_too_long",
         ["max_seq_len is 256"]),
        (line("g0", {"prompt": "again"}), "duplicate_custom_id", ["duplicate custom_id 'g0'"]),
        (line("a1", {"prompt": [1] * 10_000}), "prompt_too_long",
         ["prompt has 10000 tokens"]),
        (line("g2", {"prompt": PROMPTS[2], **GOOD}), None, []),
    ]


def strict_json(data: bytes):
    def refuse(name):
        raise ValueError(f"{name} in the output")
    return json.loads(data.decode("utf-8"), parse_constant=refuse)


def run(path, out):
    proc = launch("--input", str(path), "--output", str(out), *MODEL_FLAGS,
                  "--max_line_bytes", str(MAX_LINE_BYTES), "--progress=false")
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    return stdout


def test_hostile_lines_get_error_records_and_the_job_finishes(tmp_path):
    cases = hostile_lines()
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join((raw if isinstance(raw, bytes) else raw.encode()) + b"\n"
                              for raw, _, _ in cases))
    out = tmp_path / "out"
    stdout = run(path, out)
    data = (out / "output.jsonl").read_bytes()
    records = [strict_json(x) for x in data.splitlines()]
    answered = [c for c in cases if c[1] != "blank"]
    assert len(records) == len(answered)
    for (raw, kind, words), rec in zip(answered, records):
        if kind is None:
            assert rec["response"]["status_code"] == 200, rec
            continue
        if rec["response"] is None:
            assert rec["error"]["code"] == kind, (raw[:80], rec)
            message = rec["error"]["message"]
        else:
            assert rec["response"]["status_code"] == 400, (raw[:80], rec)
            message = rec["response"]["body"]["error"]["message"]
        for word in words:
            assert word in message, (word, message)
    summary = json.loads((out / "summary.json").read_text())
    kinds = [k for _, k, _ in answered if k]
    assert summary["errors_by_kind"] == {k: kinds.count(k) for k in sorted(set(kinds))}
    assert (summary["succeeded"], summary["blank_lines"]) == (3, 1)
    assert stdout.startswith(f"batch: {len(answered)} requests, 3 ok, ")

    run(path, out)  # finished: the rerun only merges again
    assert (out / "output.jsonl").read_bytes() == data
    assert json.loads((out / "summary.json").read_text()) == summary
