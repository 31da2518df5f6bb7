"""Where a many-row decode step's attention time goes on this backend: the jnp page-loop
attention (jaxinfer.attention.paged_loop_attention, the CPU path) for every layer of a model's
shapes, against the page gather it does alone. Where the native CPU kernels are built
(docs/cpu_kernels.md), paged_loop_attention sends these decode rows to the native decode
kernel; JAXINFER_CPU_KERNELS=0 times the jnp work list instead.

    python benchmarks/attention_gather.py [--rows 16] [--context_min 128] [--context_max 384]
                                          [--layers 30] [--heads 9] [--kv_heads 3] [--head_dim 64]
                                          [--num_pages 2049] [--runs 5]

Defaults are SmolLM2-135M's shapes and benchmarks/decode.py's 16-row step (contexts drawn
seeded from 128..384 tokens, pages of 16 tokens shuffled over a pool of --num_pages pages).
Both programs are jitted over all layers and timed --runs times after one compile; printed
medians, in ms per step:
  * attention: the page loop for every layer (one query per row);
  * gather: pages gathered for every layer (pool[layer, pages], K and V, in blocks of
    SINGLE_PAGES_PER_BLOCK pages as the loop reads them, every row up to the longest row's
    page count) and accumulated elementwise, nothing else. The loop walks a work list of each
    row's own blocks, so this reads at least as much as the attention does.

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
    ap.add_argument("--context_min", type=int, default=128)
    ap.add_argument("--context_max", type=int, default=384)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv_heads", type=int, default=3)
    ap.add_argument("--head_dim", type=int, default=64)
    ap.add_argument("--num_pages", type=int, default=2049)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)

    from jaxinfer import attention

    L, P, Z = args.layers, args.num_pages, 16
    N, K, H, B = args.heads, args.kv_heads, args.head_dim, args.rows
    M = -(-args.context_max // Z)
    if B * M > P - 1:
        raise ValueError(f"--num_pages {P} cannot hold {B} rows of {M} pages")
    rng = np.random.default_rng(0)
    pool = lambda: jnp.asarray(rng.standard_normal((L, P * Z, K, H)), jnp.float32)  # noqa: E731
    k_all, v_all = pool(), pool()
    host_lengths = rng.integers(args.context_min, args.context_max + 1, B)
    lengths = jnp.asarray(host_lengths, jnp.int32)
    need = -(-int(host_lengths.max()) // Z)          # pages of the longest row
    tables = jnp.asarray(rng.permutation(P - 1)[:B * M].reshape(B, M), jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, N, H)), jnp.float32)
    starts, ones = jnp.arange(B, dtype=jnp.int32), jnp.ones((B,), jnp.int32)

    @jax.jit
    def attend(q, k_all, v_all, tables, lengths):
        meta = attention.ragged_meta(starts, ones, lengths, num_tokens=B, query_tile=1,
                                     num_tiles=B, page_size=Z)
        out = q
        for layer in range(L):
            out = out + attention.paged_loop_attention(out, k_all, v_all, layer, tables, meta,
                                                       page_size=Z)
        return out

    @jax.jit
    def gather(q, k_all, v_all, tables, lengths):
        pages = tables[:, :need]
        view = lambda a: a.reshape(L, P, Z, K * H)  # noqa: E731  as the loop views the pool
        # As the loop reads them: blocks of SINGLE_PAGES_PER_BLOCK pages per row in a fori_loop,
        # added elementwise into one block-sized buffer, reduced once at the end (an earlier
        # version reduced each layer's gathered pages over (pages, slots), and that reduction,
        # not the gather, took most of its time).
        pb = attention.SINGLE_PAGES_PER_BLOCK
        acc = jnp.zeros((B, pb, Z, K * H), jnp.float32)
        for layer in range(L):
            def body(i, acc, layer=layer):
                block = jnp.take(pages, i * pb + jnp.arange(pb), axis=1, mode="clip")
                return acc + view(k_all)[layer, block] + view(v_all)[layer, block]
            acc = jax.lax.fori_loop(0, -(-need // pb), body, acc)
        return q + 1e-3 * acc.sum((1, 2)).reshape(B, K, H)[:, :1]

    result = {}
    for name, fn in (("attention", attend), ("gather", gather)):
        fn(q, k_all, v_all, tables, lengths).block_until_ready()
        ms = []
        for _ in range(args.runs):
            t = time.perf_counter()
            fn(q, k_all, v_all, tables, lengths).block_until_ready()
            ms.append((time.perf_counter() - t) * 1e3)
        result[name] = statistics.median(ms)
    gathered = 2 * L * B * -(-need // attention.SINGLE_PAGES_PER_BLOCK) * attention.SINGLE_PAGES_PER_BLOCK * Z * K * H * 4
    print(f"backend {jax.default_backend()}, {B} rows of {args.context_min}-{args.context_max} "
          f"tokens, {L} layers, {N} heads / {K} kv heads x {H}")
    print(f"attention (page loop)  {result['attention']:8.1f} ms per step (median of {args.runs})")
    print(f"page gather alone      {result['gather']:8.1f} ms per step, "
          f"{gathered / 1e6:.0f} MB gathered: {gathered / result['gather'] / 1e6:.1f} GB/s")
    return result


if __name__ == "__main__":
    main()
