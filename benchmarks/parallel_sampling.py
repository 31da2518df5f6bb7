"""Parallel sampling (n > 1) and beam search on shared pages, side by side in one process.

    python benchmarks/parallel_sampling.py [--prompts 32] [--n 8] [--prompt-len 256]
        [--output-len 64] [--rounds 2] [--beam-prompts 4] [--beam-tokens 16] [--no-hf]
        [--json PATH]

1. n samples: --prompts random prompts of --prompt-len..+64 tokens (seeded, uniform over the
   model's normal tokens), each sampled --n times (temperature 0.8, per-request seeds, EOS
   ignored, --output-len tokens): as one request with SamplingParams(n=N) per prompt, and as
   prompts x N independent requests of n = 1 (prompt repeated; prefix caching on, as by
   default). Both on one LLM (SmolLM2, default dtype, max_num_seqs 16), alternating, --rounds
   each, fresh prompts every round (so no round is served from another's prefix cache).
   Reported: output tokens/s (best round) and the peak of pages in use (llm.stats()
   "peak_pages_used", from a fresh engine for each way). Targets: >= 1.5x the throughput,
   <= 0.5x the peak pages.
2. Beam search: LLM.beam_search(width 4, --beam-tokens, EOS ignored) against HF transformers'
   generate(num_beams=4, no EOS, length_penalty 1, float32, the same GGUF) on --beam-prompts
   prompts, one prompt at a time in both: generated tokens/s (beams x tokens / time) and
   whether the best beams' tokens are identical.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def _prompts(rng, count, lo, hi, vocab):
    return [rng.integers(100, vocab - 100, int(rng.integers(lo, hi + 1))).tolist()
            for _ in range(count)]


def sampling(args, make_llm):
    import jaxinfer as ji

    rng = np.random.default_rng(0)
    rows = {"n": [], "independent": []}
    peaks = {}
    for way in ("n", "independent"):   # peak pages of a fresh engine, one workload each
        llm = make_llm()
        prompts = _prompts(rng, args.prompts, args.prompt_len, args.prompt_len + 64,
                           llm.model_config.vocab_size)
        _serve(llm, way, prompts, args, ji)
        peaks[way] = llm.stats()["peak_pages_used"]
    llm = make_llm()
    _serve(llm, "n", _prompts(rng, 2, 32, 64, llm.model_config.vocab_size), args, ji)  # warm
    for r in range(args.rounds):
        for way in ("n", "independent"):
            prompts = _prompts(rng, args.prompts, args.prompt_len, args.prompt_len + 64,
                               llm.model_config.vocab_size)
            rows[way].append(_serve(llm, way, prompts, args, ji))
    best = {w: max(v) for w, v in rows.items()}
    return {"tok_per_s": best, "runs": rows, "peak_pages": peaks,
            "speedup": best["n"] / best["independent"],
            "pages_ratio": peaks["n"] / peaks["independent"]}


def _serve(llm, way, prompts, args, ji):
    """Output tokens/s of one workload served the given way."""
    sp = lambda seed, n: ji.SamplingParams(max_tokens=args.output_len, temperature=0.8,  # noqa
                                           seed=seed, ignore_eos=True, n=n)
    t = time.perf_counter()
    if way == "n":
        outs = llm.generate(prompts, [sp(1000 * i, args.n) for i in range(len(prompts))])
        tokens = sum(len(o.token_ids) for out in outs for o in out.outputs)
    else:
        reps = [p for p in prompts for _ in range(args.n)]
        outs = llm.generate(reps, [sp(1000 * (i // args.n) + i % args.n, 1)
                                   for i in range(len(reps))])
        tokens = sum(len(o.token_ids) for o in outs)
    return tokens / (time.perf_counter() - t)


def beams(args, llm):
    from jaxinfer.engine.beam_search import BeamSearchParams

    rng = np.random.default_rng(1)
    prompts = _prompts(rng, args.beam_prompts, 24, 48, llm.model_config.vocab_size)
    params = BeamSearchParams(beam_width=4, max_tokens=args.beam_tokens, ignore_eos=True)
    llm.beam_search(prompts[:1], params)  # compile
    t = time.perf_counter()
    ours = [llm.beam_search([p], params)[0].sequences[0].token_ids for p in prompts]
    ours_s = time.perf_counter() - t
    out = {"jaxinfer_tok_per_s": 4 * args.beam_tokens * len(prompts) / ours_s}
    if args.no_hf:
        return out
    import torch
    import transformers

    from jaxinfer.loading.hub import resolve_alias

    torch.set_num_threads(2)
    folder, name = os.path.split(resolve_alias("smollm2-135m"))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32).eval()
    gen = dict(num_beams=4, max_new_tokens=args.beam_tokens, min_new_tokens=args.beam_tokens,
               do_sample=False, length_penalty=1.0, early_stopping=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), **gen)
        t = time.perf_counter()
        theirs = [model.generate(torch.tensor([p]), **gen)[0, len(p):].tolist()
                  for p in prompts]
        hf_s = time.perf_counter() - t
    out.update(hf_tok_per_s=4 * args.beam_tokens * len(prompts) / hf_s,
               identical_best_beams=sum(a == b for a, b in zip(ours, theirs)),
               prompts=len(prompts))
    out["ratio"] = out["jaxinfer_tok_per_s"] / out["hf_tok_per_s"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--beam-prompts", type=int, default=4)
    ap.add_argument("--beam-tokens", type=int, default=16)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    import jaxinfer as ji

    make = lambda: ji.LLM("smollm2-135m", max_seq_len=512, max_num_seqs=16)  # noqa: E731
    res = {"sampling": sampling(args, make)}
    res["beam"] = beams(args, make())
    s, b = res["sampling"], res["beam"]
    print(f"n={args.n} x {args.prompts} prompts of {args.prompt_len}+ tokens, "
          f"{args.output_len} out:")
    print(f"  one request per prompt (n={args.n}): {s['tok_per_s']['n']:.1f} tok/s, peak "
          f"{s['peak_pages']['n']} pages")
    print(f"  independent requests:            {s['tok_per_s']['independent']:.1f} tok/s, "
          f"peak {s['peak_pages']['independent']} pages")
    print(f"  throughput {s['speedup']:.2f}x (target >= 1.5), peak pages "
          f"{s['pages_ratio']:.2f}x (target <= 0.5)")
    print(f"beam search width 4, {args.beam_tokens} tokens: jaxinfer "
          f"{b['jaxinfer_tok_per_s']:.1f} tok/s" + (
              "" if args.no_hf else f", HF {b['hf_tok_per_s']:.1f} tok/s ({b['ratio']:.2f}x), "
              f"identical best beams {b['identical_best_beams']}/{b['prompts']}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
