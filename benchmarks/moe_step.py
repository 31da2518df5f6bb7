"""A 16-row decode step of a tiny mixture-of-experts model against the dense model with the
same active parameters, on this machine's backend.

The MoE model has E experts of width F, k per token; the dense one a single MLP of width k * F,
the same attention, embedding and depth: per token both multiply the same number of weights.
Each step feeds one token to each of 16 rows (a ring cache holding `context` tokens per row)
and computes their logits; times are medians of interleaved runs. The MoE step is timed with
each grouped matmul ("tiles", "ragged_dot") and with a dense all-experts product for reference.
Every round (--repeats of them) times each variant once, one after the other; a variant's
figure is the median over rounds of its time divided by the dense model's in the same round,
with the quartiles of those ratios.

  python benchmarks/moe_step.py [--experts 8 --top_k 2 --ffn 512 --d_model 512 --layers 4]
                                [--dtype float32|bfloat16]

--dtype bfloat16 stores both models' matrices (experts, router, attention, embedding) in
bfloat16 and keeps activations and the cache in float32, as LLM(dtype="bfloat16") does on CPU
(the CPU default dtype).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import dataclasses  # noqa: E402

from jaxinfer import backends  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.device.kv_cache import PagedKVCache  # noqa: E402
from jaxinfer.models import get_model, moe  # noqa: E402


def step_fn(cfg: ModelConfig, backend):
    model = get_model(cfg.architecture)

    @jax.jit
    def step(params, cache, tokens):
        h, cache = model.forward(params, cfg, tokens, cache,
                                 jnp.ones((tokens.shape[0],), jnp.int32), backend=backend)
        return model.head(params, h[:, 0], backend), cache
    return model, step


def dense_experts(x, lp, cfg):
    """Every token through every expert, weighted by its routing (zero for unchosen ones)."""
    weights, experts = moe.route(backends.default().dot(x, lp.router, "TD,DE->TE"), cfg)
    dense_w = jnp.zeros((x.shape[0], cfg.num_experts)).at[
        jnp.arange(x.shape[0])[:, None], experts].set(weights)
    g = jnp.einsum("TD,EDF->TEF", x, lp.w_gate)
    u = jnp.einsum("TD,EDF->TEF", x, lp.w_up)
    y = jnp.einsum("TEF,EFD->TED", jax.nn.silu(g) * u, lp.w_down)
    return jnp.einsum("TED,TE->TD", y, dense_w).astype(x.dtype)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top_k", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--d_model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args(argv)
    common = dict(vocab_size=8192, d_model=args.d_model, num_layers=args.layers, num_heads=8,
                  num_kv_heads=2, head_dim=64, max_position_embeddings=4096)
    moe_cfg = ModelConfig("mixtral", ffn_dim=args.ffn, num_experts=args.experts,
                          experts_per_token=args.top_k, router="topk_softmax", **common)
    dense_cfg = ModelConfig("llama", ffn_dim=args.ffn * args.top_k, **common)
    tokens = jax.random.randint(jax.random.key(1), (args.rows, 1), 0, 8192)
    runs = {}
    base = backends.default()
    variants = {"dense model": (dense_cfg, None), "moe, tiles": (moe_cfg, "tiles"),
                "moe, ragged_dot": (moe_cfg, "ragged_dot"), "moe, all experts": (moe_cfg, "all")}
    original_ffn = moe.expert_ffn
    for name, (cfg, grouped) in variants.items():
        backend = base
        if grouped in ("tiles", "ragged_dot"):
            backend = dataclasses.replace(base, tuning=dataclasses.replace(
                base.tuning, grouped_matmul=grouped))
        model, step = step_fn(cfg, backend)
        params = model.init_params(cfg, jax.random.key(0))
        if args.dtype == "bfloat16":
            params = model.with_float32_activations(jax.tree.map(
                lambda a: a.astype(jnp.bfloat16) if a.ndim >= 2 else a, params))
        cache = PagedKVCache.ring(cfg.num_layers, args.rows, args.context, cfg.num_kv_heads,
                                  cfg.head_dim, jnp.float32)
        cache = cache.replace(lengths=jnp.full((args.rows,), args.context // 2, jnp.int32))
        moe.expert_ffn = dense_experts if grouped == "all" else original_ffn
        step(params, cache, tokens)[0].block_until_ready()  # compile (the cache is not donated)
        runs[name] = (step, params, cache)
        moe.expert_ffn = original_ffn
    times = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, (step, params, cache) in runs.items():
            t0 = time.perf_counter()
            step(params, cache, tokens)[0].block_until_ready()
            times[name].append(time.perf_counter() - t0)
    # Each round times every variant back to back, so a round's ratios share the machine's
    # state of the moment: the medians of the per-round ratios are steadier than the ratio of
    # the medians on a noisy machine.
    dense = times["dense model"]
    result = {}
    for name, t in times.items():
        ratios = sorted(a / b for a, b in zip(t, dense))
        q = lambda f: ratios[min(len(ratios) - 1, int(f * len(ratios)))]  # noqa: E731
        result[name] = statistics.median(ratios)
        print(f"{name:18s} {1e3 * statistics.median(t):7.2f} ms   "
              f"{result[name]:.2f}x the dense model "
              f"(per-round ratios, quartiles {q(0.25):.2f}-{q(0.75):.2f})")
    return result


if __name__ == "__main__":
    main()
