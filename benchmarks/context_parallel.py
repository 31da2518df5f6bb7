"""Ring attention against an all-gather of K/V for a prompt split over the `sequence` axis.

For each sequence degree p, both methods of context_parallel_attention (beside this file) are
compiled for one
prompt and timed interleaved (median of --repeats), with the single-device reference attention
as the baseline; the compiled per-device programs give the bytes each device sends
(benchmarks/scaling.collectives) and its scratch memory.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/context_parallel.py

On one CPU host the simulated devices share its cores, so times compare the methods' overheads
(ppermute steps, copies), not parallel speedup; bytes and scratch memory carry over to a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import context_parallel_attention as context_parallel  # noqa: E402
from jaxinfer import sharding  # noqa: E402
from jaxinfer.backends.attention import reference_attention  # noqa: E402
from jaxinfer.config import MeshConfig  # noqa: E402
from scaling import collectives  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", default="9,3,64", help="query heads, kv heads, head dim")
    ap.add_argument("--degrees", default="2,4,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    N, K, H = (int(x) for x in args.heads.split(","))
    T = args.tokens
    key = jax.random.key(0)
    q, k, v = (jax.random.normal(jax.random.fold_in(key, i), (1, T, n, H))
               for i, n in enumerate((N, K, K)))
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    ref_fn = jax.jit(lambda q, k, v, p: reference_attention(q, p, [(k, v, p)]))
    ref = ref_fn(q, k, v, pos)
    runs = {"reference": (lambda: ref_fn(q, k, v, pos), None)}
    result = {"tokens": T, "heads": [N, K, H], "kv_bytes": 2 * T * K * H * 4, "runs": {}}
    for p in (int(d) for d in args.degrees.split(",")):
        part = sharding.Partitioner(sharding.make_mesh(MeshConfig(sequence=p)))
        place = lambda x, axes: jax.device_put(x, part.sharding(x.shape, axes))
        args_p = (place(q, ("batch", "context", None, None)),
                  place(k, ("batch", "context", None, None)),
                  place(v, ("batch", "context", None, None)),
                  place(pos, ("batch", "context")), place(pos, ("batch", "context")))
        for method in context_parallel.METHODS:
            fn = jax.jit(lambda *a, method=method: context_parallel.sequence_sharded_attention(
                *a, method=method))
            with part.active():
                compiled = fn.lower(*args_p).compile()
                err = float(jnp.max(jnp.abs(compiled(*args_p) - ref)))
            sent = sum(c["sent_bytes"] for c in collectives(compiled.as_text(), p).values())
            name = f"{method} p={p}"
            result["runs"][name] = {"max_abs_err": err, "sent_bytes_per_device": sent,
                                    "scratch_bytes_per_device":
                                        compiled.memory_analysis().temp_size_in_bytes}
            runs[name] = (lambda c=compiled, a=args_p: c(*a), part)
    times = {name: [] for name in runs}
    for _ in range(args.repeats):  # interleaved: the machine's noise hits every variant alike
        for name, (call, _) in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - t0)
    for name in runs:
        entry = result["runs"].setdefault(name, {})
        entry["median_s"] = statistics.median(times[name])
        print(f"{name:16s} {entry['median_s'] * 1e3:8.1f} ms"
              + (f"  sent {entry['sent_bytes_per_device'] / 2**20:6.2f} MiB/device"
                 f"  scratch {entry['scratch_bytes_per_device'] / 2**20:7.1f} MiB/device"
                 f"  err {entry['max_abs_err']:.1e}" if "sent_bytes_per_device" in entry
                 else ""), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
