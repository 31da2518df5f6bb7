"""Compile budget: programs compiled by LLM.warmup(), its time, and the memory maps it leaves.

    python benchmarks/warmup.py [--model smollm2-135m] [--configs plain,ngram] [--json]
                                [--compile_threads 1,2] [--compiler_options on,off]

Each configuration runs in its own fresh process with the persistent compilation cache off
(JAXINFER_COMPILATION_CACHE=0), so every program is compiled from scratch:
  plain   LLM(model) at the defaults (max_seq_len 2048, 16 slots, budget 512)
  ngram   the same with SpeculativeConfig("ngram", num_draft_tokens=4)
  bf16    the defaults with dtype="bfloat16"
It reports
  load_programs    XLA compilations while LLM(...) loads (small placement programs)
  warmup_programs  XLA compilations inside warmup(), and warmup()'s wall time
  maps             lines of /proc/self/maps after warmup, and their share of vm.max_map_count
  after_warmup     XLA compilations while serving a varied workload afterwards (prompts of 1 to
                   700 tokens, 1 to 40 output tokens, greedy and sampled rows, logprobs and
                   prompt logprobs, a stop string, preemption-free): must be 0
--compile_threads 1,2 runs each configuration twice, compiling one program at a time and two
at a time (JAXINFER_COMPILE_THREADS), one right after the other. --compiler_options on,off
runs each configuration with the backend's compiler options (jaxinfer.backends.tuning: XLA:CPU's
fast-compile preset) and with XLA's defaults, one right after the other.
Compilations are counted from JAX's backend-compile events (jax.monitoring), one per XLA
program; `jax_log_compiles` names any after warmup. Targets (SmolLM2 defaults, this CPU): at
most 16 programs plain and 24 with speculation, warmup <= 60 s, maps <= 25% of the limit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

TARGETS = {"programs": {"plain": 16, "ngram": 24, "bf16": 16}, "warmup_s": 60.0,
           "maps_fraction": 0.25}
MARK = "WARMUP_RESULT "


def worker(model: str, config: str, compiler_options: str) -> dict:
    import logging
    import time

    import jax
    import numpy as np

    from jaxinfer.backends import tuning

    if compiler_options == "off":   # XLA's defaults (a device loop keeps its loop options)
        tuning.COMPILER_OPTIONS_JAXLIB = ()

    from jax._src import dispatch

    compiles: list[int] = [0]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_kw: compiles.__setitem__(0, compiles[0] + 1)
        if event == dispatch.BACKEND_COMPILE_EVENT else None)

    import jaxinfer as ji

    kw = {}
    if config == "ngram":
        kw["speculative"] = ji.SpeculativeConfig("ngram", num_draft_tokens=4)
    elif config == "bf16":
        kw["dtype"] = "bfloat16"
    llm = ji.LLM(model, **kw)
    load_programs = compiles[0]
    t = time.perf_counter()
    llm.warmup()
    warmup_s = time.perf_counter() - t
    warmup_programs = compiles[0] - load_programs
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    with open("/proc/sys/vm/max_map_count") as f:
        max_maps = int(f.read())

    # A varied workload: any new compilation now is a defect.
    jax.config.update("jax_log_compiles", True)
    logging.getLogger("jax").setLevel(logging.WARNING)
    before = compiles[0]
    rng = np.random.default_rng(0)
    V = llm.model_config.vocab_size
    prompts, params = [], []
    for i, n in enumerate(list(rng.integers(1, 700, 22)) + [1, 700]):
        prompts.append(rng.integers(100, V, int(n)).tolist())
        params.append(ji.SamplingParams(
            max_tokens=int(rng.integers(1, 41)), temperature=float(i % 3) * 0.5,
            top_p=0.9 if i % 4 == 1 else 1.0, top_k=int(i % 5) * 10, seed=i,
            logprobs=3 if i % 6 == 0 else None, prompt_logprobs=2 if i % 7 == 0 else None))
    llm.generate(prompts, params)
    llm.generate(["The capital of France is"],
                 ji.SamplingParams(max_tokens=24, stop=[" Paris", "."]))
    return {"config": config, "load_programs": load_programs,
            "warmup_programs": warmup_programs, "engine_programs": llm.stats()["model_programs"],
            "warmup_s": warmup_s, "maps": maps, "max_map_count": max_maps,
            "maps_fraction": maps / max_maps, "after_warmup": compiles[0] - before}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--configs", default="plain,ngram")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--compile_threads", default="",
                    help="comma-separated JAXINFER_COMPILE_THREADS values: each config runs with "
                         "each, one after the other (default: the engine's own, 2)")
    ap.add_argument("--compiler_options", default="on",
                    help="comma-separated on/off: the backend's compiler options, or XLA's "
                         "defaults (jaxinfer.backends.tuning.compiler_options)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(MARK + json.dumps(worker(args.model, args.worker, args.compiler_options)),
              flush=True)
        return
    results = []
    threads = args.compile_threads.split(",") if args.compile_threads else [""]
    for config, n, options in [(c, n, o) for c in args.configs.split(",") for n in threads
                               for o in args.compiler_options.split(",")]:
        if options not in ("on", "off"):
            sys.exit(f"--compiler_options takes on and off, got {options!r}")
        env = dict(os.environ, JAXINFER_COMPILATION_CACHE="0")
        if n:
            env["JAXINFER_COMPILE_THREADS"] = n
        r = subprocess.run([sys.executable, __file__, "--model", args.model, "--worker", config,
                            "--compiler_options", options], env=env, capture_output=True,
                           text=True)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith(MARK)]
        if r.returncode != 0 or not lines:
            sys.exit(f"worker {config} failed:\n{r.stderr[-3000:]}")
        results.append(json.loads(lines[0][len(MARK):]))
        results[-1].update(compile_threads=n or "default", compiler_options=options)
        compiled_after = [ln for ln in r.stderr.splitlines() if "Compiling" in ln]
        results[-1]["compiled_after_warmup"] = compiled_after[:10]
    if args.json:
        print(json.dumps(results))
        return
    print(f"{'config':8} {'threads':>7} {'options':>7} {'load':>5} {'warmup progs':>12} "
          f"{'target':>6} {'warmup s':>9} {'maps':>7} {'of limit':>8} {'after warmup':>12}")
    for r in results:
        print(f"{r['config']:8} {r['compile_threads']:>7} {r['compiler_options']:>7} "
              f"{r['load_programs']:5d} {r['warmup_programs']:12d} "
              f"{TARGETS['programs'].get(r['config'], 0):6d} {r['warmup_s']:9.1f} "
              f"{r['maps']:7d} {r['maps_fraction']:8.1%} {r['after_warmup']:12d}")
        for line in r["compiled_after_warmup"]:
            print("   ", line)


if __name__ == "__main__":
    main()
