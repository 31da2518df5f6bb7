"""Shared by the batch-job tests: request files and output comparison."""

import json
import os
import subprocess
import sys

import pytest

PROMPTS = ["The capital of France is", "1, 2, 3,", "Once upon a time", "Water boils at",
           "The largest planet is", "My favourite food is", "In 1969, astronauts",
           "A haiku about rain:", "def fibonacci(n):", "The opposite of hot is",
           "Colors of the rainbow:", "Dear diary,"]
# Small settings: the engine of every test that loads the model.
LLM_KWARGS = {"model": "smollm2-135m", "max_seq_len": 256, "max_num_seqs": 4}
MODEL_FLAGS = ["--max_seq_len", "256", "--max_num_seqs", "4"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def line(custom_id, body, url="/v1/completions"):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def mixed_requests(n, max_tokens=8):
    """n request lines cycling through: greedy completion, seeded sampling, sampling with no
    seed (the job derives one), greedy chat, seeded chat with logprobs.

    The tests compare sampled tokens across runs whose batches differ (resumed, sharded, on
    Ray), where float32 logits differ by about 1e-5: a draw whose uniform lies within about
    1e-6 of a boundary of the cumulative distribution may flip to the neighbouring token. The
    chat seeds were 7 * i until r24's first draw turned out to be such a case (u 4.9e-7 from
    the boundary between tokens 52 and 53, in float64); they are 7 * i + 3 now."""
    out = []
    for i in range(n):
        p = PROMPTS[i % len(PROMPTS)]
        kind = i % 5
        if kind == 0:
            out.append(line(f"r{i}", {"prompt": p, "max_tokens": max_tokens, "temperature": 0}))
        elif kind == 1:
            out.append(line(f"r{i}", {"prompt": p, "max_tokens": max_tokens, "temperature": 0.9,
                                      "seed": 1000 + i}))
        elif kind == 2:
            out.append(line(f"r{i}", {"prompt": p, "max_tokens": max_tokens, "top_k": 20}))
        elif kind == 3:
            out.append(line(f"r{i}", {"messages": [{"role": "user", "content": p}],
                                      "max_tokens": max_tokens, "temperature": 0},
                            "/v1/chat/completions"))
        else:
            out.append(line(f"r{i}", {"messages": [{"role": "user", "content": p}],
                                      "max_completion_tokens": max_tokens, "temperature": 0.7,
                                      "seed": 7 * i + 3, "logprobs": True, "top_logprobs": 2},
                            "/v1/chat/completions"))
    return out


def write_lines(path, lines):
    path.write_text("".join(x + "\n" for x in lines))
    return str(path)


_FRESH = ("id", "call_id", "created", "created_at", "completed_at")


def _without_fresh(x):
    """x without the keys that are fresh per response (ids of it, its items and its tool calls,
    and its times)."""
    if isinstance(x, dict):
        return {k: _without_fresh(v) for k, v in x.items() if k not in _FRESH}
    if isinstance(x, list):
        return [_without_fresh(v) for v in x]
    return x


def strip_ids(record):
    """A record without the fields that differ between runs by design: ids and times."""
    record = json.loads(json.dumps(record))
    record.pop("id")
    if record["response"] is not None:
        record["response"].pop("request_id")
        record["response"]["body"] = _without_fresh(record["response"]["body"])
    return record


def load_output(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(x) for x in f]


def _floats(x, out):
    """x with every float (only logprobs are floats) replaced by a marker, collected in out."""
    if isinstance(x, float):
        out.append(x)
        return "<float>"
    if isinstance(x, dict):
        return {k: _floats(v, out) for k, v in x.items()}
    if isinstance(x, list):
        return [_floats(v, out) for v in x]
    return x


def assert_same_output(got_path, want_path, logprob_tol=1e-4):
    """Equal record by record but for ids and `created`: exactly, except logprobs, which are
    equal to logprob_tol (a request's float32 sums depend on its batch neighbours: ~1e-5)."""
    got, want = load_output(got_path), load_output(want_path)
    assert len(got) == len(want), (len(got), len(want))
    assert len({r["id"] for r in got}) == len(got)  # ids are fresh per record
    for g, w in zip(got, want):
        gf, wf = [], []
        assert _floats(strip_ids(g), gf) == _floats(strip_ids(w), wf), (g, w)
        assert gf == pytest.approx(wf, abs=logprob_tol), (g, w)


def launch(*args, timeout=600, **kwargs):
    """python -m jaxinfer.launch.batch, started in its own process group."""
    return subprocess.Popen([sys.executable, "-m", "jaxinfer.launch.batch", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)


def session_pids(sid):
    """Processes of session `sid` (a launch() is its own session), by /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:  # fields after the name: state ppid pgrp session
                pids.append(int(entry))
    return pids


def kill_session(proc, wait_s=30.0):
    """SIGKILL the launch's process group, then wait for the rest of its session (Ray's worker
    processes, in groups of their own, exit once their raylet is gone); any still there after
    wait_s are killed by pid."""
    import signal
    import time

    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    deadline = time.monotonic() + wait_s
    while session_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in session_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
