"""Decode throughput and parameter memory with quantized weights, side by side in one process.

    python benchmarks/quantization.py [--modes none,int8,int4,fp8] [--batch 1] [--tokens 64]

One LLM per mode (warmed up first), then --runs rounds, each timing every mode once in turn
(interleaved, so the machine's noise hits them alike): output tokens/s of `batch` greedy
requests of --tokens tokens (ignore_eos). Prints the median tokens/s, its ratio to float32 and
the parameter bytes of each mode.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

import jaxinfer as ji


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--modes", default="none,int8,int4,fp8")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    modes = [None if m == "none" else m for m in args.modes.split(",")]
    params = ji.SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    prompts = [[1, 2, 3, 4 + i] for i in range(args.batch)]
    llms, rates, sizes = {}, {}, {}
    for mode in modes:
        llm = ji.LLM(args.model, max_seq_len=256, max_num_seqs=max(args.batch, 1),
                     quantization=mode)
        llm.generate(prompts, params)  # compiles what the timed runs use
        llms[mode], rates[mode] = llm, []
        sizes[mode] = sum(x.nbytes for x in jax.tree.leaves(llm._engine.params))
    for _ in range(args.runs):
        for mode, llm in llms.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            rates[mode].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    base = statistics.median(rates[modes[0]])
    result = {}
    for mode in modes:
        rate = statistics.median(rates[mode])
        result[str(mode)] = {"tokens_per_s": rate, "ratio": rate / base, "param_bytes": sizes[mode]}
        print(f"{str(mode):6s} {rate:8.1f} tok/s  x{rate / base:.2f}  "
              f"params {sizes[mode] / 2**20:7.1f} MiB", flush=True)
    return result


if __name__ == "__main__":
    main()
