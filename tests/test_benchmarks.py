"""The GPU end-to-end benchmark runs its whole path (random-weight checkpoint written, loaded through
the public API, batch-1 decode and concurrent requests) on a tiny model, so it works when a GPU
machine runs it."""

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_e2e_benchmark_smoke(tmp_path):
    out = tmp_path / "e2e.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "e2e.py"), "--smoke",
                    "--json", str(out)], check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["batch1"]["decode_tokens_per_s"] > 0
    assert result["batch1"]["fraction_of_roofline"] > 0
    (run,) = result["throughput"]
    assert run["requests"] == 4 and run["output_tokens"] == 4 * 8
