"""Model load time and peak host memory, one fresh process per configuration.

    python benchmarks/loading.py [--model smollm2-135m] [--configs float,int4,int8,int4-awq]
                                 [--checkpoint DIR ...] [--runs 3] [--json out.json]

A configuration is a quantization mode ("float": none) applied to --model, or a checkpoint
directory given with --checkpoint (written by `python -m jaxinfer.launch.convert`, loaded as
written). Each runs in its own Python process, so peak memory and caches are its own:
  * load_s: `jaxinfer.loading.load_model` to device, the median of --runs loads in that process
    (the first load is included: the file is in the page cache after the first configuration);
  * peak_rss_mib: the process's peak resident memory (getrusage) after the loads, and
    import_rss_mib the same after importing jax and jaxinfer, before any load, so the
    difference is what loading added.
On the CPU backend "device" memory is host memory too: the float32 model's parameters count
in the peak, as the quantized codes do.

argparse, like every script under benchmarks/ (see benchmarks/quantization.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def one(model: str, quantization, runs: int) -> dict:
    """Runs in the child process: the loads, then the figures as one JSON line."""
    import jax

    from jaxinfer.loading import load_model

    imported = _rss_mib()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        loaded = load_model(model, quantization=quantization)
        jax.block_until_ready(jax.tree.leaves(loaded.params))
        times.append(time.perf_counter() - t)
        params_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(loaded.params))
        del loaded
    return {"load_s": statistics.median(times), "load_runs": times,
            "param_mib": params_bytes / 2**20, "import_rss_mib": imported,
            "peak_rss_mib": _rss_mib()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--configs", default="float,int4,int8")
    ap.add_argument("--checkpoint", action="append", default=[])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child's configuration
    args = ap.parse_args(argv)
    if args.one is not None:
        model, _, q = args.one.partition("|")
        print(json.dumps(one(model, q or None, args.runs)))
        return {}
    jobs = [(name, f"{args.model}|{'' if name == 'float' else name}")
            for name in args.configs.split(",") if name]
    jobs += [(path, f"{path}|") for path in args.checkpoint]
    result = {}
    for name, spec in jobs:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", spec,
                               "--runs", str(args.runs)], capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{name}: {proc.stderr[-2000:]}")
        r = result[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{name:24s} load {r['load_s']:7.2f} s (runs "
              f"{', '.join(f'{t:.2f}' for t in r['load_runs'])})  params {r['param_mib']:6.1f} "
              f"MiB  peak RSS {r['peak_rss_mib']:6.0f} MiB (+{r['peak_rss_mib'] - r['import_rss_mib']:.0f} "
              "over the imports)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
