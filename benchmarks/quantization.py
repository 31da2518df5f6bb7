"""Decode throughput and memory with quantized weights and KV cache, side by side in one process.

    python benchmarks/quantization.py [--configs none,int8,int4,int4-awq,fp8,none/int8]
                                      [--batch 1] [--tokens 64] [--runs 3] [--json out.json]

A config is WEIGHTS[/KV]: LLM(quantization=WEIGHTS, kv_cache_dtype=KV), "none" for float32.
One LLM per config (max_seq_len 256, max_num_seqs 4, warmed up first), then --runs rounds,
each timing every config once in turn (interleaved, so the machine's noise hits them alike):
output tokens/s of `batch` greedy requests of --tokens tokens (ignore_eos). Prints the median
tokens/s and its ratio to the first config, the parameter bytes, and the bytes of the whole
LLM's device state: parameters plus the decode state (KV cache pool, per-row arrays).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax

import jaxinfer as ji


def _nbytes(tree) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--configs", default="none,int8,int4,fp8,none/int8")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    configs = args.configs.split(",")
    params = ji.SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    prompts = [[1, 2, 3, 4 + i] for i in range(args.batch)]
    llms, rates = {}, {}
    for name in configs:
        weights, _, kv = name.partition("/")
        llm = ji.LLM(args.model, max_seq_len=256, max_num_seqs=max(args.batch, 4),
                     quantization=None if weights == "none" else weights,
                     kv_cache_dtype=kv or None)
        llm.generate(prompts, params)  # compiles what the timed runs use
        llms[name], rates[name] = llm, []
    for _ in range(args.runs):
        for name, llm in llms.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            rates[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    base = statistics.median(rates[configs[0]])
    base_bytes = None
    result = {}
    for name, llm in llms.items():
        rate = statistics.median(rates[name])
        param_bytes = _nbytes(llm._engine.params)
        total = param_bytes + _nbytes(llm._engine.state)
        base_bytes = base_bytes or total
        result[name] = {"tokens_per_s": rate, "ratio": rate / base, "param_bytes": param_bytes,
                        "llm_bytes": total, "llm_bytes_ratio": total / base_bytes}
        print(f"{name:12s} {rate:8.1f} tok/s  x{rate / base:.2f}  params "
              f"{param_bytes / 2**20:7.1f} MiB  LLM {total / 2**20:7.1f} MiB "
              f"x{total / base_bytes:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
