"""The hybrid KV cache against every layer in the page pool, side by side in one process.

    python benchmarks/kv_memory.py [--model gemma3-270m] [--max_seq_len 2048]
                                   [--max_num_seqs 16] [--prompt_len 1024] [--num_requests 8]
                                   [--output_len 32] [--runs 2]

Builds the model twice, `LLM(model, hybrid_kv_cache=True)` and `hybrid_kv_cache=False`, at the
same settings (the CPU default dtype unless --dtype), and for each reports:
  * the ring's slots per row (0: no ring) and the pool's pages;
  * the device state's bytes (`llm.stats()["state_bytes"]`: the KV cache plus the per-row
    arrays) and its ratio to the all-pool engine's;
  * generation on prompts longer than the window (--num_requests prompts of --prompt_len
    tokens, --output_len greedy tokens each, EOS ignored): tokens per second over the whole
    request (prefill included), best of --runs timed runs after one untimed warm-up run, the
    two engines alternating, new prompts each run (the hybrid engine has no prefix cache, the
    all-pool one does); and whether both produced the same tokens.
Only models that interleave sliding-window and global layers have a ring (Gemma 3); for others
both rows are the same engine.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _prompts(tokenizer, n: int, length: int, vocab: int, run: int) -> list[list[int]]:
    """n prompts of `length` token ids for timed run `run`: varied English text, cut to
    length, each run's prompts differing from their first tokens (so that the all-pool
    engine's prefix cache, which the hybrid one does not have, finds nothing)."""
    colours = ["red", "green", "blue", "white", "black"]
    out = []
    for r in range(run * n, run * n + n):
        text = f"List {r}. " + " ".join(
            f"Entry {i} of list {r}: the {colours[(i + r) % 5]} box holds "
            f"{(i * 7 + r) % 13} stones." for i in range(length))
        ids = tokenizer.encode(text) if tokenizer is not None else \
            np.random.default_rng(r).integers(3, vocab, size=length).tolist()
        out.append(ids[:length])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--dtype", default=None, help="default: the backend's")
    ap.add_argument("--max_seq_len", type=int, default=2048)
    ap.add_argument("--max_num_seqs", type=int, default=16)
    ap.add_argument("--prompt_len", type=int, default=1024)
    ap.add_argument("--num_requests", type=int, default=8)
    ap.add_argument("--output_len", type=int, default=32)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()

    import jaxinfer as ji

    llms = {name: ji.LLM(args.model, dtype=args.dtype, max_seq_len=args.max_seq_len,
                         max_num_seqs=args.max_num_seqs, hybrid_kv_cache=hybrid)
            for name, hybrid in (("hybrid", True), ("pool", False))}
    first = llms["hybrid"]
    params = ji.SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    best = {name: float("inf") for name in llms}
    tokens = {name: [] for name in llms}
    for run in range(args.runs + 1):
        prompts = _prompts(first.tokenizer, args.num_requests, args.prompt_len,
                           first.model_config.vocab_size, run)
        for name, llm in llms.items():
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - t
            tokens[name] += [o.token_ids for o in outs]
            if run:  # the first run compiles
                best[name] = min(best[name], elapsed)
    total = args.num_requests * (args.prompt_len + args.output_len)
    print(f"model {args.model}, dtype {first.dtype}, max_seq_len {args.max_seq_len}, "
          f"{args.max_num_seqs} slots; {args.num_requests} prompts of {args.prompt_len} tokens, "
          f"{args.output_len} output tokens each, best of {args.runs}")
    pool_bytes = llms["pool"].stats()["state_bytes"]
    print(f"{'cache':8} {'ring slots':>10} {'pool pages':>10} {'state MiB':>10} {'vs pool':>8} "
          f"{'tok/s':>8}")
    for name, llm in llms.items():
        s = llm.stats()
        print(f"{name:8} {s['ring_slots']:>10} {s.get('num_pages', 0):>10} "
              f"{s['state_bytes'] / 2**20:>10.1f} {s['state_bytes'] / pool_bytes:>8.3f} "
              f"{total / best[name]:>8.1f}")
    print("same tokens:", tokens["hybrid"] == tokens["pool"],
          "| prefix-cache hits of the pool engine:",
          llms["pool"].stats().get("prefix_cache_hit_tokens", 0))


if __name__ == "__main__":
    main()
