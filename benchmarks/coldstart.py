"""Process start to first token, with an empty and with a filled compilation cache.

    python benchmarks/coldstart.py [--model smollm2-135m] [--max_seq_len 512] [--max_num_seqs 1]
                                   [--runs 3] [--json]

Each run is a fresh `python -c` child that imports jaxinfer, builds `LLM(model, ...)` and
generates one short prompt with max_tokens=1, reporting its timestamps as one JSON line.

  * cold: JAXINFER_COMPILATION_CACHE points at a new, empty directory for every run, so the
    child compiles every program it needs;
  * warm: the same command with one directory that a cold run has already filled (JAX's
    cache and, inside it, jaxinfer's programs cache: docs/architecture.md, Programs cache).

Cold and warm runs alternate so that machine noise hits both alike. Phases, from the parent's
clock reading just before it spawns the child (CLOCK_MONOTONIC, shared by both processes):
  startup      spawn to the child's first statement (interpreter start)
  import       `import jaxinfer` (includes importing jax)
  backend      first device query (XLA client creation); part of "load" in a plain program
  load         `LLM(...)`: model file read, dequantization, parameters to device, engine setup
               (warm: with the step program loading from the programs cache beside it)
  first_token  `generate(max_tokens=1)`: tracing, compiling (or cache loading) and running
Targets on CPU: cold <= 10 s, warm <= 3 s (medians of the totals). The model file itself is
already in the model cache and likely in the OS page cache; only the compiled programs are
cold.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

COLD_TARGET_S = 10.0
WARM_TARGET_S = 3.0
PHASES = ("startup", "import", "backend", "load", "first_token")
MARK = "COLDSTART_RESULT "

# Runs in the child. argv[1] is a JSON dict of the LLM arguments and the prompt.
CHILD = r"""
import time
_t = {"child_start": time.perf_counter()}
import json, sys
args = json.loads(sys.argv[1])
import jaxinfer
_t["imported"] = time.perf_counter()
import jax
backend = jax.default_backend()
_t["backend"] = time.perf_counter()
llm = jaxinfer.LLM(args["model"], max_seq_len=args["max_seq_len"],
                   max_num_seqs=args["max_num_seqs"])
_t["loaded"] = time.perf_counter()
out = llm.generate(args["prompt"], jaxinfer.SamplingParams(max_tokens=1, temperature=0.0))[0]
_t["first_token"] = time.perf_counter()
_t["backend_name"] = backend
_t["cache_dir"] = jax.config.jax_compilation_cache_dir
_t["tokens"] = len(out.token_ids)
_t["jaxinfer"] = jaxinfer.__file__
print(%r + json.dumps(_t), flush=True)
""" % MARK


def dir_size(path: str) -> tuple[int, int]:
    """(bytes, files) under path."""
    total = files = 0
    for root, _, names in os.walk(path):
        for n in names:
            try:
                total += os.path.getsize(os.path.join(root, n))
                files += 1
            except OSError:
                pass
    return total, files


def run_child(args, cache: str, timeout: float) -> dict:
    env = dict(os.environ)
    env["JAXINFER_COMPILATION_CACHE"] = cache
    # A cache directory configured through JAX itself would win over ours; keep runs isolated.
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    payload = json.dumps({"model": args.model, "max_seq_len": args.max_seq_len,
                          "max_num_seqs": args.max_num_seqs, "prompt": args.prompt})
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, payload], env=env, capture_output=True,
                          text=True, timeout=timeout)
    t_exit = time.perf_counter()
    lines = [l for l in proc.stdout.splitlines() if l.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"child failed (exit {proc.returncode}):\n{tail}")
    t = json.loads(lines[-1][len(MARK):])
    if os.path.realpath(t["cache_dir"] or "") != os.path.realpath(cache):
        raise RuntimeError(f"child used compilation cache {t['cache_dir']!r}, not {cache!r}")
    marks = [t0, t["child_start"], t["imported"], t["backend"], t["loaded"], t["first_token"]]
    phases = {p: b - a for p, a, b in zip(PHASES, marks, marks[1:])}
    phases["total"] = t["first_token"] - t0
    phases["exit"] = t_exit - t["first_token"]  # teardown after the token; not in the total
    phases["backend_name"] = t["backend_name"]
    phases["jaxinfer"] = t["jaxinfer"]
    return phases


def median_phases(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in PHASES + ("total", "exit")}


def fmt_row(name: str, r: dict) -> str:
    return f"{name:<10}" + "".join(f"{r[k]:>12.2f}" for k in PHASES + ("total",))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max_seq_len", type=int, default=512)
    ap.add_argument("--max_num_seqs", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per child")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of text")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be >= 1")

    root = tempfile.mkdtemp(prefix="jaxinfer-coldstart-")
    cold, warm = [], []
    try:
        filled = None
        size_after_cold = None
        for i in range(args.runs):
            cache = os.path.join(root, f"cold{i}")
            os.makedirs(cache)
            cold.append(run_child(args, cache, args.timeout))
            if filled is None:
                filled = cache
                size_after_cold = dir_size(cache)
            if not args.json:
                print(fmt_row(f"cold {i}", cold[-1]), flush=True)
            warm.append(run_child(args, filled, args.timeout))
            if not args.json:
                print(fmt_row(f"warm {i}", warm[-1]), flush=True)
        size_after_warm = dir_size(filled)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    cold_m, warm_m = median_phases(cold), median_phases(warm)
    result = {
        "model": args.model, "max_seq_len": args.max_seq_len, "max_num_seqs": args.max_num_seqs,
        "runs": args.runs, "backend": cold[0]["backend_name"], "cpus": os.cpu_count(),
        "jaxinfer": cold[0]["jaxinfer"],
        "cold_median_s": cold_m, "warm_median_s": warm_m,
        "cold_runs_s": [r["total"] for r in cold], "warm_runs_s": [r["total"] for r in warm],
        "cache_bytes_after_cold": size_after_cold[0], "cache_files_after_cold": size_after_cold[1],
        "cache_bytes_after_warm": size_after_warm[0],
        "cold_target_s": COLD_TARGET_S, "warm_target_s": WARM_TARGET_S,
        "cold_ok": cold_m["total"] <= COLD_TARGET_S, "warm_ok": warm_m["total"] <= WARM_TARGET_S,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'median':<10}" + "".join(f"{k:>12}" for k in PHASES + ("total",)))
    print(fmt_row("cold", cold_m))
    print(fmt_row("warm", warm_m))
    print(f"compilation cache after the first cold run: {size_after_cold[0] / 2**20:.1f} MiB "
          f"in {size_after_cold[1]} files (after the warm runs: "
          f"{size_after_warm[0] / 2**20:.1f} MiB)")
    for name, m, target in (("cold", cold_m, COLD_TARGET_S), ("warm", warm_m, WARM_TARGET_S)):
        verdict = "ok" if m["total"] <= target else "OVER"
        print(f"{name}: {m['total']:.2f} s vs target {target:.0f} s -> {verdict}")
    print(f"jaxinfer: {result['jaxinfer']}")
    print(f"({result['backend']}, {result['cpus']} CPUs, {args.runs} runs each; process exit "
          f"after the token, not counted: cold {cold_m['exit']:.2f} s, warm {warm_m['exit']:.2f} s)")


if __name__ == "__main__":
    main()
