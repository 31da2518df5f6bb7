"""Memory does not grow with the input: a job over the first 48 lines of a generated
1,000,000-line file peaks at the resident memory of the same job over a 48-line file, and
answers the same. Two model launches: slow."""

import json
import time

import pytest
from batch_util import MODEL_FLAGS, PROMPTS, assert_same_output, launch

pytestmark = pytest.mark.slow

LINES = 1_000_000
READ = 48


def request(i):
    return json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 4,
                                "temperature": 0}}) + "\n"


def run(path, out):
    t0 = time.perf_counter()
    proc = launch("--input", str(path), "--output", str(out), *MODEL_FLAGS, "--max_lines",
                  str(READ), "--progress=false")
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    return json.load(open(out / "summary.json")), time.perf_counter() - t0


def test_a_million_line_input_read_in_part_keeps_memory_flat(tmp_path):
    big, small = tmp_path / "big.jsonl", tmp_path / "small.jsonl"
    with open(big, "w") as f:
        for start in range(0, LINES, 10_000):
            f.write("".join(request(i) for i in range(start, start + 10_000)))
    small.write_text("".join(request(i) for i in range(READ)))
    big_summary, big_s = run(big, tmp_path / "big_out")
    small_summary, small_s = run(small, tmp_path / "small_out")
    assert_same_output(tmp_path / "big_out" / "output.jsonl",
                       tmp_path / "small_out" / "output.jsonl")
    assert big_summary["lines"] == small_summary["lines"] == READ
    assert big_summary["requests"] == READ
    print(f"peak resident memory: {big_summary['max_rss_mb']:.0f} MB reading {READ} of "
          f"{LINES} lines ({big.stat().st_size / 2**20:.0f} MiB) in {big_s:.1f} s; "
          f"{small_summary['max_rss_mb']:.0f} MB for a {READ}-line file in {small_s:.1f} s")
    assert abs(big_summary["max_rss_mb"] - small_summary["max_rss_mb"]) < 64
