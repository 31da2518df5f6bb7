"""Decode throughput and memory with quantized weights and KV cache, side by side in one process.

    python benchmarks/quantization.py [--configs none,int8,int8@64,int8@0,int4,int4-awq,fp8,none/int8]
                                      [--batch 1] [--tokens 64] [--runs 5] [--dtype float32]
                                      [--tile_elements N] [--golden tests/data/smollm2_greedy.json]
                                      [--json out.json]

A config is WEIGHTS[@GROUP][/KV]: LLM(quantization=WEIGHTS, kv_cache_dtype=KV, dtype=--dtype),
"none" for unquantized weights (float32 at the default --dtype; the LLM's own default on CPU
is bfloat16); @GROUP sets the elements per scale of int8 / int4 for that LLM
(jaxinfer.quant.GROUP_SIZE; @0: per output channel). WEIGHTS may also be a checkpoint written
by `python -m jaxinfer.launch.convert --quantization ...`, loaded as written (e.g. a calibrated
int4-awq). One LLM per config (max_seq_len 256, max_num_seqs 4, compiled by one untimed run),
then --runs rounds, each timing every config once in turn (interleaved, so the machine's noise
hits them alike): output tokens/s of `batch` greedy requests of --tokens tokens (ignore_eos).
Prints the median tokens/s, the median over rounds of its ratio to the first config's rate in
the same round, the parameter bytes and the bytes of the whole LLM's device state: parameters
plus the decode state (KV cache pool, per-row arrays), each the sum of its arrays' nbytes
(`llm_bytes`). With --golden (HF transformers' float32 greedy ids, see
tests/data/README.md), also how many of its prompts each config continues token for token for
--golden_tokens tokens.

argparse, like every script under benchmarks/: they are run from a checkout and take plain
flags; the installed launchers (python -m jaxinfer.launch.*) use absl, whose flags the
library's launch modules share.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


import jaxinfer as ji
from jaxinfer import quant


def llm_bytes(llm: ji.LLM) -> tuple[int, int]:
    """(parameter bytes, decode state bytes) of an LLM that has generated once (the decode
    state, KV cache pool included, is allocated by the first request): llm.stats()'s sizes,
    the nbytes of every array in each pytree, a quantized weight's codes, scales and offsets
    alike."""
    stats = llm.stats()
    if not stats["state_bytes"]:
        raise ValueError("the decode state is allocated by the first request: generate first")
    return stats["parameter_bytes"], stats["state_bytes"]


def _llm(model: str, name: str, batch: int, dtype: str = "float32") -> ji.LLM:
    weights, slash, kv = name.rpartition("/")
    if not slash or kv not in quant.KV_DTYPES:  # no KV part (a path has slashes of its own)
        weights, kv = name, ""
    weights, _, group = weights.partition("@")
    kw = {"quantization": None if weights == "none" else weights}
    if os.path.isdir(weights):  # a converted checkpoint: loaded as written
        model, kw = weights, {}
    saved = dict(quant.GROUP_SIZE)
    if group:
        quant.GROUP_SIZE[weights] = int(group)
    try:
        return ji.LLM(model, dtype=dtype, max_seq_len=256, max_num_seqs=max(batch, 4),
                      kv_cache_dtype=kv or None, **kw)
    finally:
        quant.GROUP_SIZE.update(saved)


def _golden_exact(llm: ji.LLM, path: str, tokens: int) -> tuple[int, int]:
    """How many golden prompts the LLM continues with the golden greedy ids for `tokens`
    tokens (or up to the golden's EOS, which ends both)."""
    with open(path) as f:
        cases = json.load(f)["cases"]
    outs = llm.generate([c["prompt_ids"] for c in cases],
                        ji.SamplingParams(max_tokens=tokens))
    exact = 0
    for case, out in zip(cases, outs):
        want = case["greedy_ids"][:tokens]
        if want and want[-1] == llm.tokenizer.eos_token_id and case["hit_eos"]:
            want = want[:-1]
        exact += out.token_ids == want
    return exact, len(cases)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--configs", default="none,int8,int4,fp8,none/int8")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dtype", default="float32",
                    help="every LLM's dtype (the unquantized weights' and, on CPU, the KV "
                    "cache's unless /KV quantizes it)")
    ap.add_argument("--tile_elements", type=int, default=None,
                    help="elements per dequantized tile on CPU (jaxinfer.backends.products."
                    "tile_elements()); compare sizes across processes, not within one")
    ap.add_argument("--golden", default=None, help="greedy goldens (tests/data/smollm2_greedy.json)")
    ap.add_argument("--golden_tokens", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.tile_elements:
        from jaxinfer.backends import products

        products.TILE_ELEMENTS = args.tile_elements
        products.TILE_ELEMENTS_ONE_BUFFER = args.tile_elements
    configs = args.configs.split(",")
    params = ji.SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    prompts = [[1, 2, 3, 4 + i] for i in range(args.batch)]
    llms, rates = {}, {}
    for name in configs:
        llm = _llm(args.model, name, args.batch, args.dtype)
        llm.generate(prompts, params)  # compiles what the timed runs use
        llms[name], rates[name] = llm, []
    for _ in range(args.runs):
        for name, llm in llms.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            rates[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    base_bytes = None
    result = {}
    for name, llm in llms.items():
        rate = statistics.median(rates[name])
        # Each round's ratio to the first config, then their median: load from outside the
        # process changes between rounds more than within one.
        ratio = statistics.median(r / b for r, b in zip(rates[name], rates[configs[0]]))
        param_bytes, state_bytes = llm_bytes(llm)
        total = param_bytes + state_bytes
        base_bytes = base_bytes or total
        result[name] = {"tokens_per_s": rate, "ratio": ratio, "param_bytes": param_bytes,
                        "llm_bytes": total, "llm_bytes_ratio": total / base_bytes,
                        "rates": rates[name]}
        if args.golden:
            exact, cases = _golden_exact(llm, args.golden, args.golden_tokens)
            result[name]["golden_exact"] = exact
            print(f"{name:12s} {exact} of {cases} golden prompts token-exact for "
                  f"{args.golden_tokens} tokens", flush=True)
        print(f"{name:12s} {rate:8.1f} tok/s  x{ratio:.2f}  params "
              f"{param_bytes / 2**20:7.1f} MiB  LLM {total / 2**20:7.1f} MiB "
              f"x{total / base_bytes:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
