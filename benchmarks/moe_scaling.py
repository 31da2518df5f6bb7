"""Computed per-device bytes and collectives of a Mixtral-8x7B-shaped decode step at expert
degrees 1/2/4/8, from compiled HLO (as benchmarks/scaling.py does for Llama-3-8B).

Nothing runs: a decode step (8 rows, one token each, an 8,192-slot ring cache, bf16) is lowered
with abstract, sharded inputs on simulated CPU devices and compiled, at 1 and 2 layers, and the
figures extrapolated to 32 layers. The mesh is (data 1, sequence 1, tensor e): attention is
tensor-parallel e ways and, in the layout jaxinfer uses, the experts split e ways over the same
devices (expert parallelism: each device holds 8 / e whole experts and the MoE block ends in one
psum). For comparison, "tp" keeps every expert on every device with its ffn width split e ways
(Megatron-style experts).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/moe_scaling.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


import scaling  # noqa: E402
from jaxinfer import sharding  # noqa: E402
from jaxinfer.config import MeshConfig, ModelConfig  # noqa: E402

MIXTRAL_8X7B = ModelConfig("mixtral", vocab_size=32000, d_model=4096, num_layers=32,
                           num_heads=32, num_kv_heads=8, head_dim=128, ffn_dim=14336,
                           rope_theta=1e6, num_experts=8, experts_per_token=2,
                           router="topk_softmax", max_position_embeddings=32768)


def compile_decode(cfg: ModelConfig, degree: int, batch: int, capacity: int) -> dict:
    compiled, part, (params, p_axes), (cache, c_axes) = scaling.lower_step(
        cfg, MeshConfig(tensor=degree), batch, 1, capacity)
    expert_bytes = scaling.per_device_bytes(
        part, [lp.w_gate for lp in params.layers] + [lp.w_up for lp in params.layers]
        + [lp.w_down for lp in params.layers],
        [p_axes.layers[0].w_gate] * (3 * cfg.num_layers))
    return {"param_bytes": scaling.per_device_bytes(part, params, p_axes),
            "expert_bytes": expert_bytes,
            "cache_bytes": scaling.per_device_bytes(part, cache, c_axes),
            "collectives": scaling.collectives(compiled.as_text(), degree)}


def measure(cfg: ModelConfig, degree: int, batch: int, capacity: int) -> dict:
    one = compile_decode(cfg.replace(num_layers=1), degree, batch, capacity)
    two = compile_decode(cfg.replace(num_layers=2), degree, batch, capacity)
    lin = lambda a, b: a + (cfg.num_layers - 1) * (b - a)  # noqa: E731
    out = {k: lin(one[k], two[k]) for k in ("param_bytes", "expert_bytes", "cache_bytes")}
    zero = {"count": 0, "result_bytes": 0, "sent_bytes": 0.0}
    kinds = set(one["collectives"]) | set(two["collectives"])
    out["collectives"] = {k: {f: lin(one["collectives"].get(k, zero)[f],
                                     two["collectives"].get(k, zero)[f]) for f in zero}
                          for k in sorted(kinds)}
    out["sent_bytes"] = sum(c["sent_bytes"] for c in out["collectives"].values())
    out["count"] = sum(c["count"] for c in out["collectives"].values())
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--degrees", default="1,2,4,8")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    result = {"config": "mixtral-8x7b shape", "batch": args.batch, "context": args.context,
              "ep": {}, "tp": {}}
    for layout in ("ep", "tp"):
        rules = dict(sharding.RULES)
        if layout == "tp":
            sharding.RULES["experts"] = None  # every expert whole on every device
        try:
            for e in (int(d) for d in args.degrees.split(",")):
                t0 = time.perf_counter()
                r = measure(MIXTRAL_8X7B, e, args.batch, args.context)
                result[layout][e] = r
                print(f"{layout} degree {e}: params {r['param_bytes'] / 2**30:.2f} GiB "
                      f"(experts {r['expert_bytes'] / 2**30:.2f}), cache "
                      f"{r['cache_bytes'] / 2**30:.2f} GiB per device; {r['count']:.0f} "
                      f"collectives, {r['sent_bytes'] / 2**20:.2f} MiB sent per device "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
        finally:
            sharding.RULES.clear()
            sharding.RULES.update(rules)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
