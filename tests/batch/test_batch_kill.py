"""`python -m jaxinfer.launch.batch` killed with SIGKILL at three random points, rerun with the
same command until it finishes: the output equals an uninterrupted run's, field by field (but
ids and `created`), greedy and sampled (seeds given, and derived from custom_id and --seed;
OpenAI's default temperature 1 among them). The job runs at the defaults (bf16 weights on CPU),
and where the backend is batch invariant logprobs must be equal exactly too. Each launch loads
the model, so this is slow."""

import json
import os
import random
import signal
import statistics
import threading
import time

import pytest
from batch_util import MODEL_FLAGS, assert_same_output, launch, line, mixed_requests, write_lines

pytestmark = pytest.mark.slow

# The launches run at jaxinfer's defaults: without the suite's float32 override.
DEFAULTS = {k: v for k, v in os.environ.items() if k != "JAXINFER_DEFAULT_DTYPE"}


def _logprob_tol() -> float:
    from jaxinfer import backends
    return 0.0 if backends.resolve(num_devices=1).batch_invariant else 1e-4


def finish(proc, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def finish_timed(proc, out_dir, timeout=600):
    """finish(), also returning the times (since launch) at which the manifest gained lines."""
    t0, times, done = time.monotonic(), [], threading.Event()

    def watch():
        seen = 0
        while True:
            stop = done.is_set()  # set once the job has exited: this last read sees every line
            now = commits(out_dir)
            times.extend([time.monotonic() - t0] * (now - seen))
            seen = now
            if stop:
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        return (*finish(proc, timeout), times)
    finally:
        done.set()
        watcher.join()


def commits(out_dir):
    path = os.path.join(out_dir, "shard-00000-of-00001", "manifest.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        return f.read().count(b"\n")


def kill_after(proc, out_dir, min_commits, delay_s):
    """SIGKILL (the whole process group) `delay_s` after the manifest holds min_commits parts.
    Returns the commits there were at the kill, or None when the job ended first."""
    while commits(out_dir) < min_commits:
        if proc.poll() is not None:
            return None
        time.sleep(0.02)
    time.sleep(delay_s)
    if proc.poll() is not None:
        return None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    return commits(out_dir)


def test_kill_at_three_random_points_then_resume(tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    lines = mixed_requests(30, max_tokens=8)
    lines[11:11] = ["{torn", line("r2", {"prompt": "again"}), ""]
    path = write_lines(tmp_path / "requests.jsonl", lines)
    want, out = str(tmp_path / "want"), str(tmp_path / "out")

    def command(output):
        return ["--input", path, "--output", output, *MODEL_FLAGS, "--seed", "5",
                "--commit_every", "2", "--progress=false", "--fail_on_error"]

    code, stdout, stderr, times = finish_timed(launch(*command(want), env=DEFAULTS), want)
    assert code == 1, stderr  # --fail_on_error: two lines got error records
    assert "2 line(s) got an error record" in stderr
    assert stdout.startswith("batch: 32 requests, 30 ok, 2 failed (1 duplicate_custom_id, "
                             "1 invalid_json)"), stdout
    total = commits(want)
    assert total >= 8 and len(times) == total, (total, times)
    # A second uninterrupted run, with the caches the first one filled (as the resumed runs
    # will have them): the same output, exactly where the engine is batch invariant. The kill
    # delays are sized by its pace (a first run that compiles takes several times longer to
    # start): its start-up (the time to the first commit) and the median time between commits.
    again = str(tmp_path / "again")
    code, _, stderr, times = finish_timed(launch(*command(again), env=DEFAULTS), again)
    assert code == 1, stderr
    assert_same_output(os.path.join(again, "output.jsonl"), os.path.join(want, "output.jsonl"),
                       logprob_tol=_logprob_tol())
    assert len(times) == total, (total, times)
    startup_s, part_s = times[0], statistics.median(b - a for a, b in zip(times, times[1:]))

    points = []
    # 1: any time in the start-up of an uninterrupted run (often before the first commit, while
    # the model loads; after it when this launch starts faster).
    proc = launch(*command(out), env=DEFAULTS)
    time.sleep(rng.uniform(0.05, 1.0) * startup_s)
    assert proc.poll() is None, f"the job ended before the kill point (seed {seed})"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    points.append(("time", commits(out)))
    # 2 and 3: a random moment within one part's time after a random number of further commits
    # (at least three parts are left to write then).
    for _ in range(2):
        target = rng.randint(commits(out) + 1, max(commits(out) + 1, total - 3))
        got = kill_after(launch(*command(out), env=DEFAULTS), out, target,
                         rng.uniform(0, 1.0) * part_s)
        assert got is not None, f"the job ended before the kill point (seed {seed})"
        points.append((target, got))
    code, stdout, stderr = finish(launch(*command(out), env=DEFAULTS))
    assert code == 1, stderr
    assert_same_output(os.path.join(out, "output.jsonl"), os.path.join(want, "output.jsonl"),
                       logprob_tol=_logprob_tol())

    with open(os.path.join(out, "shard-00000-of-00001", "manifest.jsonl")) as f:
        entries = [json.loads(x) for x in f]
    answered = [n for e in entries for n in e["lines"]]
    assert answered == sorted(set(answered)) and len(answered) == 32, (seed, points)
    assert [e["first_line"] for e in entries[1:]] == [e["end_line"] for e in entries[:-1]]
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["runs"] >= 2, (seed, points)  # resumed runs committed parts too
    print(f"seed {seed}: start-up {startup_s:.1f} s, {part_s:.2f} s a part; kill points (after commits, commits at kill) {points}; "
          f"{summary['runs']} runs committed parts")
