"""Expert parallelism's exchange, measured: jaxinfer's psum design against an all-to-all
dispatch, for one MoE block on simulated CPU devices.

Both run the same block (route, the routed experts, the weighted sum) under shard_map over p
devices, each holding E / p whole experts, with the step's tokens x [T, D] on every device (as
the engine has them: attention is tensor-parallel, so activations are replicated):
  psum        jaxinfer's models.moe._local_experts: every device routes all T tokens, runs the
              assignments to its own experts, and one psum of [T, D] adds the partial outputs.
  all_to_all  each device routes its own T / p tokens, sends each assignment's row to the
              device holding its expert (a [p, C, D] buffer, C = T / p * min(k, E / p): the most
              one device's tokens can send one device, so nothing is dropped), runs what it
              received, sends the results back (a second all_to_all), weights and sums them per
              token, and an all_gather of [T / p, D] restores every token on every device.
The all-to-all output is checked against the psum's (float32, 1e-5) before timing.

Reported per token count T: each design's collectives from the compiled HLO (ops, and the
bytes of their results per device: an all-reduce's result is the whole [T, D], of which a ring
moves 2 (p - 1) / p per device; an all-to-all's or all-gather's, what the device receives,
its own share included) and the block's wall time on the simulated devices (median of --runs,
the two designs interleaved). The simulated devices share this machine's cores and exchange through
memory, so the times show the designs' compute and copies, not a GPU interconnect's latency.

  python benchmarks/moe_dispatch.py [--devices 8] [--tokens 16,512] [--d_model 1024]
                                    [--ffn 1024] [--experts 8] [--top_k 2] [--runs 20]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--tokens", default="16,512")
    ap.add_argument("--d_model", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top_k", type=int, default=2)
    ap.add_argument("--runs", type=int, default=20)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = _args(argv)
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    if "jax" not in sys.modules and flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from jaxinfer.config import ModelConfig
    from jaxinfer.models import moe

    p, E, k, D, F = args.devices, args.experts, args.top_k, args.d_model, args.ffn
    if len(jax.devices()) < p:
        raise SystemExit(f"{len(jax.devices())} devices; run with XLA_FLAGS={flag}")
    if E % p:
        raise SystemExit(f"--experts {E} is not a multiple of --devices {p}")
    El = E // p
    mesh = jax.make_mesh((p,), ("x",), devices=jax.devices()[:p])
    cfg = ModelConfig("mixtral", vocab_size=256, d_model=D, num_layers=1, num_heads=8,
                      num_kv_heads=8, head_dim=D // 8, ffn_dim=F, num_experts=E,
                      experts_per_token=k, router="topk_softmax")
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) * s[-2] ** -0.5, jnp.float32)  # noqa: E731
    router, w_gate, w_up, w_down = w(D, E), w(E, D, F), w(E, D, F), w(E, F, D)

    def psum_block(x, router, w_gate, w_up, w_down):
        weights, experts = moe.route(x @ router, cfg)
        return moe._local_experts(x, weights, experts, w_gate, w_up, w_down, axes=("x",), k=k,
                                  num_experts=E)

    def a2a_block(x, router, w_gate, w_up, w_down):
        T = x.shape[0]
        Tl = T // p
        d = jax.lax.axis_index("x")
        xl = jax.lax.dynamic_slice_in_dim(x, d * Tl, Tl)                     # [Tl, D]
        weights, experts = moe.route(xl @ router, cfg)                        # [Tl, k]
        C = Tl * min(k, El)
        dest = (experts // El).reshape(-1)                                    # [Tl k]
        onehot = dest[:, None] == jnp.arange(p)[None]                         # [Tl k, p]
        slot = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=1) - 1      # rank within dest
        token = jnp.arange(Tl * k) // k
        send = jnp.zeros((p, C, D), x.dtype).at[dest, slot].set(xl[token])
        send_e = jnp.full((p, C), El, jnp.int32).at[dest, slot].set(
            (experts % El).reshape(-1))                                       # El: empty row
        recv = jax.lax.all_to_all(send, "x", 0, 0, tiled=False)               # [p, C, D]
        recv_e = jax.lax.all_to_all(send_e, "x", 0, 0, tiled=False)           # [p, C]
        key = recv_e.reshape(-1)
        order = jnp.argsort(key, stable=True)
        sizes = jnp.zeros((El + 1,), jnp.int32).at[key].add(1)[:El]
        ys = moe._cpu_ffn(recv.reshape(-1, D)[order], sizes, w_gate, w_up, w_down,
                          rows=Tl * k)  # a balanced step's rows for this device's experts
        back = jnp.zeros_like(ys).at[order].set(ys).reshape(p, C, D)
        back = jax.lax.all_to_all(back, "x", 0, 0, tiled=False)              # [p, C, D]
        rows = back[dest, slot] * weights.reshape(-1)[:, None]                # [Tl k, D]
        yl = jnp.zeros((Tl, D), jnp.float32).at[token].add(rows).astype(x.dtype)
        return jax.lax.all_gather(yl, "x", tiled=True)                        # [T, D]

    specs = dict(in_specs=(P(), P(), P("x"), P("x"), P("x")), out_specs=P(), check_vma=False)
    designs = {name: jax.jit(jax.shard_map(fn, mesh=mesh, **specs))
               for name, fn in (("psum", psum_block), ("all_to_all", a2a_block))}
    put = lambda a, spec: jax.device_put(a, jax.NamedSharding(mesh, spec))  # noqa: E731
    weights_in = (put(router, P()), put(w_gate, P("x")), put(w_up, P("x")), put(w_down, P("x")))

    result = {}
    for T in (int(t) for t in args.tokens.split(",")):
        if T % p:
            raise SystemExit(f"--tokens {T} is not a multiple of --devices {p}")
        x = put(jnp.asarray(rng.standard_normal((T, D)), jnp.float32), P())
        outs = {n: np.asarray(f(x, *weights_in)) for n, f in designs.items()}
        np.testing.assert_allclose(outs["all_to_all"], outs["psum"], rtol=1e-5, atol=1e-5)
        row = {}
        for name, f in designs.items():
            hlo = f.lower(x, *weights_in).compile().as_text()
            row[name] = {"collectives": _collectives(hlo), "ms": []}
        for _ in range(args.runs):
            for name, f in designs.items():
                t0 = time.perf_counter()
                f(x, *weights_in).block_until_ready()
                row[name]["ms"].append(1e3 * (time.perf_counter() - t0))
        print(f"T = {T} tokens, {p} devices, {E} experts (top {k}), D {D}, F {F}, float32")
        for name, r in row.items():
            r["ms"] = statistics.median(r["ms"])
            ops = ", ".join(f"{op} x{n} {b / 1024:.0f} KiB" for op, (n, b) in
                            sorted(r["collectives"].items()))
            print(f"  {name:11s} {r['ms']:8.2f} ms   collectives' results per device: {ops}")
        result[T] = row
    return result


def _collectives(hlo: str) -> dict:
    """{op: (count, bytes of the results per device)} of the collectives in compiled HLO."""
    sizes = {"f32": 4, "bf16": 2, "s32": 4, "f16": 2, "u32": 4, "pred": 1}
    out: dict = {}
    ops = "all-reduce|all-to-all|all-gather|reduce-scatter|collective-permute"
    for line in hlo.splitlines():
        m = re.match(rf"\s*(?:ROOT )?%\S+ = (.*?) ({ops})(?:-start)?\(", line)
        if m is None:
            continue
        total = 0
        for dt, dims in re.findall(r"([a-z]+[0-9]*)\[([0-9,]*)\]", m.group(1)):
            n = 1
            for x in filter(None, dims.split(",")):
                n *= int(x)
            total += n * sizes.get(dt, 4)
        count, b = out.get(m.group(2), (0, 0))
        out[m.group(2)] = (count + 1, b + total)
    return out


if __name__ == "__main__":
    main()
