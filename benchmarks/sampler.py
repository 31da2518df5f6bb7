"""The sampler's cost per decode step: jaxinfer.device.sampling.sample (inverse-CDF draw) against
a Gumbel-max draw over the same filtered logits (the draw it replaced), side by side.

    python benchmarks/sampler.py [--rows 16] [--vocab 49152] [--steps 16] [--runs 7]
                                 [--top_p 0.9 --temperature 0.7 --zipf 1.1]

Both run --steps draws in one jitted fori_loop (temperature 1, no top-k / top-p / min-p /
repetition penalty: the decode benchmark's defaults), seeded rows, logits drawn once from a
normal of scale 3. Printed: medians of --runs, in ms per step of --rows rows. The Gumbel
baseline is written here: argmax(filtered + Gumbel(fold_in(key(seed), index))).

With --top_p, two more draws are timed beside them, on logits shaped like a language model's
(log-probabilities of a Zipf law with exponent --zipf over the vocabulary, shuffled per row) at
--temperature: the filter as `sample` runs it (top-p among the lax.top_k candidates, the
default tiers: sampling.NATIVE_SORT_CANDIDATES where the native CPU sort serves the full sort,
else sampling.SORT_CANDIDATES) and the same filter over the fully sorted vocabulary
(candidates=()), each followed by the inverse-CDF draw. On CPU the full sort is the native
kernel's (jaxinfer.cpu_kernels.sort_descending); JAXINFER_CPU_KERNELS=0 times XLA's argsort.

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
    ap.add_argument("--top_p", type=float, default=None, help="also time top-p filtering")
    ap.add_argument("--temperature", type=float, default=0.7, help="with --top_p")
    ap.add_argument("--zipf", type=float, default=1.1, help="with --top_p: the logits' law")
    args = ap.parse_args(argv)

    from jaxinfer.device import sampling

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

    def filtered_draw(candidates):
        def draw(logits, sp, seen, index):
            masked = sampling.filtered_logits(logits, sp, candidates=candidates)
            weights = jnp.exp(masked - jnp.max(masked, axis=-1, keepdims=True))
            return sampling.draw(weights, sampling.uniforms(sp.seed, index))
        return draw

    runs = {"inverse_cdf": (looped(sampling.sample), logits, sp),
            "gumbel_max": (looped(gumbel_max), logits, sp)}
    if args.top_p is not None:
        rng = np.random.default_rng(1)
        law = -args.zipf * np.log(np.arange(1, V + 1))
        zipf = jnp.asarray(np.stack([rng.permutation(law) for _ in range(B)]), jnp.float32)
        sp_p = sp.replace(temperature=jnp.full((B,), args.temperature),
                          top_p=jnp.full((B,), args.top_p))
        runs["top_p_candidates"] = (looped(filtered_draw(None)), zipf, sp_p)
        runs["top_p_full_sort"] = (looped(filtered_draw(())), zipf, sp_p)
    fns = {name: (lambda f=f, x=x, p=p: f(x, p, seen)) for name, (f, x, p) in runs.items()}
    ms = {name: [] for name in fns}
    for f in fns.values():
        f().block_until_ready()
    for _ in range(args.runs):
        for name, f in fns.items():
            t = time.perf_counter()
            f().block_until_ready()
            ms[name].append((time.perf_counter() - t) * 1e3 / args.steps)
    result = {name: statistics.median(v) for name, v in ms.items()}
    print(f"backend {jax.default_backend()}, {B} rows x {V} tokens, median of {args.runs}")
    for name, v in result.items():
        print(f"{name:16s} {v:9.2f} ms per step")
    if args.top_p is not None:
        print(f"top-p {args.top_p} at temperature {args.temperature} (Zipf {args.zipf} logits): "
              f"full sort / candidates = "
              f"{result['top_p_full_sort'] / result['top_p_candidates']:.1f}x")
    return result


if __name__ == "__main__":
    main()
