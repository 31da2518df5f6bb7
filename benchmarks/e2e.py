"""End-to-end engine benchmark on a Llama-3.2-1B-shaped model with random bf16 weights (GPU).

    python benchmarks/e2e.py                 # on the GPU machine
    python benchmarks/e2e.py --smoke         # a tiny model and few requests (any backend)

The real model file does not travel to the GPU machine, so the model is Llama-3.2-1B's shape
(16 layers, d_model 2048, 32 query / 8 KV heads of 64, FFN 8192, vocab 128256, llama3 RoPE
scaling, tied head) with random weights, saved as a jaxinfer (orbax) checkpoint in bfloat16.
Random weights cost exactly what real ones do. Everything goes through the public
API (`ji.LLM(...).generate`), with num_pages=None, so the page pool is sized from device memory.

Measured, each after an untimed run of the same workload (compilation excluded):
  * batch-1 decode tokens/s (a 128-token prompt, --decode-tokens tokens, EOS ignored; the
    tokens after the first), against the HBM roofline: read bandwidth (jitted jnp.sum over
    1 GiB, sampled before and after each run) / bytes read per decode step (every weight once,
    plus the K/V of the context at its mean length over the run);
  * output tokens/s with 64 and 256 requests arriving at once (128-token prompts, 128 output
    tokens each, max_num_seqs = the request count): output tokens / wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode import Bandwidth  # noqa: E402

LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": True,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}
TINY = dict(LLAMA_1B, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)


def write_random_model(path: str, config: dict, seed: int = 0) -> int:
    """A jaxinfer checkpoint of the HF-style config with random bfloat16 weights; returns
    the number of weights (each is read once per decode step; the tied head reads the
    embedding)."""
    import jax.numpy as jnp

    from jaxinfer.loading.checkpoint import save_checkpoint
    from jaxinfer.loading.safetensors import config_from_hf
    from jaxinfer.models import llama

    cfg = config_from_hf(config)
    params = llama.LLAMA.init_params(cfg, jax.random.key(seed), jnp.bfloat16)
    save_checkpoint(path, cfg, params)
    return sum(int(x.size) for x in jax.tree.leaves(params))


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for _ in range(n)]


def batch1_decode(model: str, num_weights: int, dtype: str, args, bandwidth: Bandwidth) -> dict:
    import jaxinfer as ji

    llm = ji.LLM(model, dtype=dtype, max_seq_len=args.prompt_len + args.decode_tokens + 16,
                 max_num_seqs=1)
    cfg = llm.model_config
    sp = ji.SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
    llm.generate(prompts(1, args.prompt_len, cfg.vocab_size, 0), sp)  # compile
    # The LLM holds the weights (and on a GPU its K/V) in `dtype`.
    itemsize = np.dtype(llm.dtype).itemsize
    wbytes = num_weights * itemsize
    # K and V of every layer at the mean context length of the decode steps.
    kv_bytes = (2 * cfg.num_layers * cfg.kv_dim * itemsize
                * (args.prompt_len + args.decode_tokens / 2))
    runs, fractions, bandwidths, walls = [], [], [], []
    for r in range(args.runs):
        before = bandwidth.sample()
        # A new prompt each run: a repeated one would be served from the prefix cache.
        t = time.perf_counter()
        out = llm.generate(prompts(1, args.prompt_len, cfg.vocab_size, r + 1), sp)[0]
        walls.append(time.perf_counter() - t)
        bandwidths.append(statistics.mean([before, bandwidth.sample()]))
        runs.append(out.metrics.decode_tokens_per_s)
        fractions.append(runs[-1] * (wbytes + kv_bytes) / bandwidths[-1])
    return {"weight_bytes": wbytes, "kv_bytes_per_step": kv_bytes,
            "decode_tokens_per_s": statistics.median(runs), "decode_runs": runs,
            "generate_wall_s": walls, "read_bandwidth": bandwidths,
            "fraction_of_roofline": statistics.median(fractions), "fraction_runs": fractions}


def throughput(model: str, dtype: str, n: int, args) -> dict:
    import jaxinfer as ji

    llm = ji.LLM(model, dtype=dtype, max_seq_len=args.prompt_len + args.output_len + 16,
                 max_num_seqs=n)
    sp = ji.SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    vocab = llm.model_config.vocab_size
    llm.generate(prompts(n, args.prompt_len, vocab, 0), sp)  # compile every shape it uses
    t = time.perf_counter()
    outs = llm.generate(prompts(n, args.prompt_len, vocab, 1), sp)
    wall = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    stats = llm.stats()
    return {"requests": n, "output_tokens": tokens, "wall_s": wall,
            "output_tokens_per_s": tokens / wall,
            "ttft_p50_s": float(np.median([o.metrics.ttft_s for o in outs])),
            "num_pages": stats.get("num_pages"), "preemptions": stats["preemptions"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, few requests")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", default="64,256", help="comma-separated request counts")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args()
    config = TINY if args.smoke else LLAMA_1B
    if args.smoke:
        args.runs, args.decode_tokens, args.output_len, args.concurrency = 1, 16, 8, "4"
    dtype = "bfloat16" if jax.default_backend() != "cpu" else "float32"

    result = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
              "dtype": dtype, "model": "tiny" if args.smoke else "Llama-3.2-1B shape"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = os.path.join(tmp, "model")
        t = time.perf_counter()
        num_weights = write_random_model(tmp, config)
        print(f"random weights written in {time.perf_counter() - t:.1f} s", flush=True)
        bandwidth = Bandwidth(0.25 if args.smoke else 1.0)
        b1 = batch1_decode(tmp, num_weights, dtype, args, bandwidth)
        result["batch1"] = b1
        print(f"{result['device']} ({dtype}): read bandwidth {bandwidth.sample() / 1e9:.0f} GB/s")
        print(f"batch-1 decode {b1['decode_tokens_per_s']:.1f} tokens/s, "
              f"{b1['fraction_of_roofline']:.2f} of the HBM roofline (weights "
              f"{b1['weight_bytes'] / 1e9:.2f} GB + KV {b1['kv_bytes_per_step'] / 1e6:.1f} MB "
              f"per step; runs {', '.join(f'{x:.1f}' for x in b1['decode_runs'])})", flush=True)
        result["throughput"] = []
        for n in (int(x) for x in args.concurrency.split(",")):
            r = throughput(tmp, dtype, n, args)
            result["throughput"].append(r)
            print(f"{n:4d} requests: {r['output_tokens_per_s']:.0f} output tokens/s "
                  f"({r['output_tokens']} tokens in {r['wall_s']:.2f} s, TTFT p50 "
                  f"{r['ttft_p50_s']:.2f} s, {r['num_pages']} pages, {r['preemptions']} "
                  "preemptions)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
