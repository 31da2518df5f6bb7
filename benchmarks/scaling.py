"""Computed scaling of a Llama config over the tensor and sequence degrees, from compiled HLO.

Nothing runs: each step is lowered with abstract, sharded inputs on simulated CPU devices and
compiled, and the per-device program is read for
  - FLOPs and bytes accessed (XLA's cost analysis of the partitioned module),
  - collectives (all-reduce, all-gather, reduce-scatter, collective-permute, all-to-all): the
    bytes of their results and the bytes each device sends under ring algorithms,
  - scratch bytes (XLA's memory analysis); parameters and cache per device come from their
    shardings.
Layers are identical, so every figure is compiled at 1 and 2 layers and extrapolated linearly
to the config's depth (compiling 32 unrolled 8B layers per mesh would take far longer).
A step time is then *computed* from a roofline of an H100 SXM (989 TFLOP/s dense bf16,
3.35 TB/s HBM, 450 GB/s NVLink per direction, an assumed 10 us per collective):
max(compute, weights and cache read once) + collectives, with no overlap assumed. These are
estimates, not measurements.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      python benchmarks/scaling.py --config configs/models/llama-3-8b.json --out /tmp/scaling.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MODELS_DIR = os.path.join(ROOT, "configs", "models")  # HF config.json files of full-size models

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxinfer import sharding  # noqa: E402
from jaxinfer.config import MeshConfig  # noqa: E402
from jaxinfer.device.kv_cache import PagedKVCache  # noqa: E402
from jaxinfer.loading.safetensors import config_from_hf  # noqa: E402
from jaxinfer.models import get_model  # noqa: E402

H100 = {"flops": 989e12, "hbm": 3.35e12, "link": 450e9, "latency": 10e-6}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
                "all-to-all")
_OP = re.compile(r"= (\([^=]*?\)|[a-z0-9]+\[[0-9,]*\][^ ]*) (" + "|".join(_COLLECTIVES)
                 + r")(?:-start)?\((.*)$")
_SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_ITEM = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4,
         "u32": 4, "f64": 8, "s64": 8}


def _group_size(attrs: str, default: int) -> int:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", attrs)
    if m:  # mesh['axis_0'=1,'axis_1'=2] {'axis_1'}: the product of the named axes' sizes
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        return int(np.prod([int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(2))]))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", attrs)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([0-9,]+)\}", attrs)
    if m:
        return len(m.group(1).split(","))
    return default


def collectives(hlo: str, num_devices: int) -> dict:
    """Collective ops of a partitioned HLO module: count, result bytes and per-device bytes
    sent under ring algorithms (all-reduce 2(p-1)/p N, all-gather and all-to-all (p-1)/p N,
    reduce-scatter (p-1) N, collective-permute N), by kind."""
    out = {}
    for line in hlo.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        kind = m.group(2)
        size = sum(_ITEM[t] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                   for t, dims in _SHAPE.findall(m.group(1)))
        p = _group_size(m.group(3), num_devices)
        sent = {"all-reduce": 2 * (p - 1) / p * size, "all-gather": (p - 1) / p * size,
                "all-to-all": (p - 1) / p * size, "reduce-scatter": (p - 1) * size,
                "collective-permute": size}[kind]
        entry = out.setdefault(kind, {"count": 0, "result_bytes": 0, "sent_bytes": 0.0})
        entry["count"] += 1
        entry["result_bytes"] += size
        entry["sent_bytes"] += sent
    return out


def per_device_bytes(part, tree, axes_tree) -> int:
    """Bytes of one device's shards of a pytree of (abstract) arrays, from their logical axes."""
    return sum(jax.tree.leaves(jax.tree.map(
        lambda x, a: int(np.prod(part.sharding(x.shape, a).shard_shape(x.shape)))
        * x.dtype.itemsize, tree, axes_tree)))


def lower_step(cfg, mesh_cfg: MeshConfig, batch: int, tokens: int, capacity: int,
               dtype=jnp.bfloat16):
    """Compiles one forward step of `tokens` new tokens for `batch` rows into a ring cache of
    `capacity` slots (logits of each row's last token), with abstract parameters of cfg's
    family sharded on mesh_cfg: (compiled, partitioner, (params, axes), (cache, axes))."""
    part = sharding.Partitioner(sharding.make_mesh(mesh_cfg))
    model = get_model(cfg.architecture)
    params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0), dtype))
    p_axes = sharding.param_axes(cfg, params, model.param_specs)
    cache = jax.eval_shape(lambda: PagedKVCache.ring(cfg.num_layers, batch, capacity,
                                                     cfg.num_kv_heads, cfg.head_dim, dtype))
    c_axes = cache.logical_axes()
    tok = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
    num = jax.ShapeDtypeStruct((batch,), jnp.int32)
    shard = lambda tree, axes: jax.tree.map(lambda x, a: part.sharding(x.shape, a), tree, axes)
    in_shardings = (shard(params, p_axes), shard(cache, c_axes),
                    part.sharding(tok.shape, ("batch", "tokens")),
                    part.sharding(num.shape, ("batch",)))

    def step(params, cache, tokens, num_new):
        h, cache = model.forward(params, cfg, tokens, cache, num_new)
        logits = model.head(params, h[:, -1])
        return sharding.constrain(logits, ("batch", "vocab")), cache

    fn = jax.jit(step, in_shardings=in_shardings,
                 out_shardings=(part.sharding((batch, cfg.vocab_size), ("batch", "vocab")),
                                in_shardings[1]), donate_argnums=(1,))
    with part.active():
        compiled = fn.lower(params, cache, tok, num).compile()
    return compiled, part, (params, p_axes), (cache, c_axes)


def compile_step(cfg, mesh_cfg: MeshConfig, batch: int, tokens: int, capacity: int,
                 dtype=jnp.bfloat16) -> dict:
    """lower_step's per-device figures: FLOPs, bytes, scratch, parameter and cache shards,
    collectives."""
    compiled, part, (params, p_axes), (cache, c_axes) = lower_step(cfg, mesh_cfg, batch, tokens,
                                                                   capacity, dtype)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    n = mesh_cfg.data * mesh_cfg.tensor * mesh_cfg.sequence
    return {"flops": float(cost.get("flops", 0.0)),
            "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "scratch_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
            "param_bytes": per_device_bytes(part, params, p_axes),
            "cache_bytes": per_device_bytes(part, cache, c_axes),
            "collectives": collectives(compiled.as_text(), n)}


def _extrapolate(one: dict, two: dict, layers: int) -> dict:
    """Figures of a `layers`-deep model from its 1- and 2-layer compiles (per-layer = two - one)."""
    def lin(a, b):
        return a + (layers - 1) * (b - a)
    out = {k: lin(one[k], two[k]) for k in one if k != "collectives"}
    kinds = set(one["collectives"]) | set(two["collectives"])
    zero = {"count": 0, "result_bytes": 0, "sent_bytes": 0.0}
    out["collectives"] = {k: {f: lin(one["collectives"].get(k, zero)[f],
                                     two["collectives"].get(k, zero)[f]) for f in zero}
                          for k in sorted(kinds)}
    sent = sum(c["sent_bytes"] for c in out["collectives"].values())
    count = sum(c["count"] for c in out["collectives"].values())
    t_compute = out["flops"] / H100["flops"]
    # The bytes a step must move: its weights and cache shards, read once. (XLA:CPU's "bytes
    # accessed" sums every unfused op's operands, several times what a fused GPU program
    # reads, so it is reported but not used.)
    t_memory = (out["param_bytes"] + out["cache_bytes"]) / H100["hbm"]
    t_link = sent / H100["link"] + count * H100["latency"]
    out["computed_ms"] = {"compute": 1e3 * t_compute, "memory": 1e3 * t_memory,
                          "collectives": 1e3 * t_link,
                          "step": 1e3 * (max(t_compute, t_memory) + t_link)}
    out["sent_bytes"] = sent
    return out


def measure(cfg, mesh_cfg, batch, tokens, capacity) -> dict:
    t0 = time.perf_counter()
    one = compile_step(cfg.replace(num_layers=1), mesh_cfg, batch, tokens, capacity)
    two = compile_step(cfg.replace(num_layers=2), mesh_cfg, batch, tokens, capacity)
    out = _extrapolate(one, two, cfg.num_layers)
    out["compile_s"] = time.perf_counter() - t0
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(MODELS_DIR, "llama-3-8b.json"),
                    help="an HF config.json (default: configs/models/llama-3-8b.json)")
    ap.add_argument("--degrees", default="1,2,4,8")
    ap.add_argument("--decode_batch", type=int, default=8)
    ap.add_argument("--decode_context", type=int, default=8192)
    ap.add_argument("--prefill_chunk", type=int, default=2048)
    ap.add_argument("--prefill_context", type=int, default=32768)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    with open(args.config) as f:
        cfg = config_from_hf(json.load(f))
    degrees = [int(d) for d in args.degrees.split(",")]
    if max(degrees) > len(jax.devices()):
        raise SystemExit(f"degree {max(degrees)} needs as many devices; set XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={max(degrees)}")
    result = {"config": os.path.basename(args.config), "roofline": H100,
              "decode": {"batch": args.decode_batch, "context": args.decode_context,
                         "tensor": {}},
              "prefill": {"chunk": args.prefill_chunk, "context": args.prefill_context,
                          "sequence": {}}}
    for t in degrees:
        r = measure(cfg, MeshConfig(tensor=t), args.decode_batch, 1, args.decode_context)
        result["decode"]["tensor"][t] = r
        print(f"decode tensor={t}: {r['computed_ms']['step']:.2f} ms computed, "
              f"{(r['param_bytes'] + r['cache_bytes']) / 2**30:.2f} GiB params+cache/device, "
              f"{r['sent_bytes'] / 2**20:.1f} MiB sent/device ({r['compile_s']:.0f} s)",
              flush=True)
    for s in degrees:
        r = measure(cfg, MeshConfig(sequence=s), 1, args.prefill_chunk, args.prefill_context)
        result["prefill"]["sequence"][s] = r
        print(f"prefill sequence={s}: {r['computed_ms']['step']:.2f} ms computed per chunk, "
              f"{r['flops'] / 1e12:.2f} TFLOP/device, "
              f"{r['sent_bytes'] / 2**20:.1f} MiB sent/device ({r['compile_s']:.0f} s)",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
