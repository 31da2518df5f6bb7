"""The sampler's cost per decode step: jaxinfer.sampling.sample (inverse-CDF draw) against a
Gumbel-max draw over the same filtered logits (the draw it replaced), side by side.

    python benchmarks/sampler.py [--rows 16] [--vocab 49152] [--steps 16] [--runs 7]

Both run --steps draws in one jitted fori_loop (temperature 1, no top-k / top-p / min-p /
repetition penalty: the decode benchmark's defaults), seeded rows, logits drawn once from a
normal of scale 3. Printed: medians of --runs, in ms per step of --rows rows. The Gumbel
baseline is written here: argmax(filtered + Gumbel(fold_in(key(seed), index))).

argparse, like every script under benchmarks/.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args(argv)

    from jaxinfer import sampling

    B, V = args.rows, args.vocab
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((B, V)) * 3, jnp.float32)
    sp = sampling.SamplingArrays(
        temperature=jnp.ones(B), top_k=jnp.zeros(B, jnp.int32), top_p=jnp.ones(B),
        min_p=jnp.zeros(B), repetition_penalty=jnp.ones(B),
        seed=jnp.arange(B, dtype=jnp.uint32))
    seen = jnp.zeros((B, V), bool)

    def gumbel_max(logits, sp, seen, index):
        logits = sampling.apply_repetition_penalty(logits, seen, sp.repetition_penalty)
        masked = sampling.filtered_logits(logits, sp)
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(sp.seed, index)
        noise = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
        return jnp.argmax(masked + noise, axis=-1).astype(jnp.int32)

    def looped(draw):
        @jax.jit
        def run(logits, sp, seen):
            def body(i, acc):   # each step's logits depend on the last draw: nothing hoists
                x = logits + acc[:, None].astype(jnp.float32) * 1e-9
                return acc + draw(x, sp, seen, jnp.full((B,), i, jnp.int32))
            return jax.lax.fori_loop(0, args.steps, body, jnp.zeros((B,), jnp.int32))
        return run

    fns = {"inverse_cdf": looped(sampling.sample), "gumbel_max": looped(gumbel_max)}
    ms = {name: [] for name in fns}
    for f in fns.values():
        f(logits, sp, seen).block_until_ready()
    for _ in range(args.runs):
        for name, f in fns.items():
            t = time.perf_counter()
            f(logits, sp, seen).block_until_ready()
            ms[name].append((time.perf_counter() - t) * 1e3 / args.steps)
    result = {name: statistics.median(v) for name, v in ms.items()}
    print(f"backend {jax.default_backend()}, {B} rows x {V} tokens, median of {args.runs}")
    for name, v in result.items():
        print(f"{name:12s} {v:8.2f} ms per step")
    return result


if __name__ == "__main__":
    main()
