"""The cost of structured outputs, side by side in one process.

    python benchmarks/structured.py [--rows 16] [--output-len 96] [--rounds 3] [--json PATH]

One LLM (SmolLM2, default dtype, max_num_seqs 16); every workload is --rows chat prompts
generating exactly --output-len tokens (temperature 0.8, seeded; EOS ignored where
unconstrained, and a schema no row can complete within the budget where constrained, so every
row ends at the length limit and the workloads differ only in the constraint):

  free       all rows unconstrained
  json       all rows under one JSON schema (an array of at least 64 objects)
  free-1     rows - 1 unconstrained rows alone
  mixed      the same rows - 1 unconstrained rows plus one constrained row

The first rows - 1 rows' tokens/s counts their tokens up to the last of them finishing; for
mixed it is compared with the same rows of free (one more free row in its place: what the
constraint costs them) and with free-1 (what the constrained row costs them, its own work
included). The workloads alternate for --rounds; each figure is the best round. Targets: json
>= 0.85x free; mixed's unconstrained rows >= 0.95x. Also reported: the time to check a schema
the first time and from the cache, and the host time per token mask (one row's mask).
"""

from __future__ import annotations

import argparse
import json
import os
import time

SCHEMA = {
    "type": "array", "minItems": 64,
    "items": {"type": "object",
              "properties": {"city": {"type": "string", "maxLength": 24},
                             "country": {"type": "string", "maxLength": 24},
                             "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "country", "population"], "additionalProperties": False},
}
PROMPT = "List as many cities of the world as you can, with their country and population."


def _params(ji, args, seed: int, constrained: bool):
    return ji.SamplingParams(
        max_tokens=args.output_len, temperature=0.8, seed=seed, ignore_eos=not constrained,
        structured_outputs=ji.StructuredOutputs(json=SCHEMA) if constrained else None)


def _run(llm, ji, args, kinds: list[bool], seed: int) -> dict:
    """Serves one workload (kinds: per row, constrained or not); tokens/s of all rows and of
    the first rows - 1 (unconstrained in every workload) up to the last of them finishing."""
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    t0 = time.perf_counter()
    outs = llm.generate([prompt] * len(kinds),
                        [_params(ji, args, seed + i, c) for i, c in enumerate(kinds)])
    wall = time.perf_counter() - t0
    for o, c in zip(outs, kinds):
        assert len(o.token_ids) == args.output_len, (c, len(o.token_ids), o.finish_reason)
    first = outs[:args.rows - 1]
    first_end = max(o.metrics.finished_time for o in first)
    return {"tok_per_s": sum(len(o.token_ids) for o in outs) / wall,
            "first_tok_per_s": sum(len(o.token_ids) for o in first)
            / (first_end - outs[0].metrics.arrival_time)}


def _compile_times(llm, ji) -> dict:
    """Seconds to check a schema never seen, then the same schema again (the cache)."""
    fresh = dict(SCHEMA, minItems=int(time.time()) % 1000 + 1000)  # a schema not yet cached
    spec = ji.StructuredOutputs(json=fresh)
    t = time.perf_counter()
    llm.grammars.compile(spec)
    first = time.perf_counter() - t
    t = time.perf_counter()
    llm.grammars.compile(ji.StructuredOutputs(json=fresh))
    return {"first_s": first, "cached_s": time.perf_counter() - t}


def _median(xs: list) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import jaxinfer as ji

    llm = ji.LLM(args.model, max_num_seqs=args.rows, max_seq_len=1024)
    llm.warmup()
    R = args.rows
    work = {"free": [False] * R, "json": [True] * R, "free-1": [False] * (R - 1),
            "mixed": [False] * (R - 1) + [True]}
    _run(llm, ji, args, [True, False], 0)  # the schema's first check, and any first-use cost
    runs = {k: [] for k in work}
    mask = {}
    for r in range(args.rounds):
        for name, kinds in work.items():
            before = llm.stats()
            runs[name].append(_run(llm, ji, args, kinds, 1000 * r))
            after = llm.stats()
            if name == "json":
                rows = after["guided_rows"] - before["guided_rows"]
                mask.setdefault("per_row_mask_ms", []).append(
                    1e3 * (after["guided_mask_s"] - before["guided_mask_s"]) / max(rows, 1))
    best = {k: max(x["tok_per_s"] for x in v) for k, v in runs.items()}
    first = {k: max(x["first_tok_per_s"] for x in v) for k, v in runs.items()
             if k != "json"}
    result = {
        "rows": R, "output_len": args.output_len, "tok_per_s": best,
        "first_rows_tok_per_s": first,
        "json_vs_free": best["json"] / best["free"],
        "mixed_vs_free": first["mixed"] / first["free"],
        "mixed_vs_free_1": first["mixed"] / first["free-1"],
        # The same ratios within each round (the workloads of a round ran back to back).
        "per_round": {
            "json_vs_free": _median([j["tok_per_s"] / f["tok_per_s"]
                                     for j, f in zip(runs["json"], runs["free"])]),
            "mixed_vs_free": _median([m["first_tok_per_s"] / f["first_tok_per_s"]
                                      for m, f in zip(runs["mixed"], runs["free"])]),
            "mixed_vs_free_1": _median([m["first_tok_per_s"] / f["first_tok_per_s"]
                                        for m, f in zip(runs["mixed"], runs["free-1"])])},
        "per_row_mask_ms": min(mask["per_row_mask_ms"]),
        "schema_check": _compile_times(llm, ji), "runs": runs,
        "jax": __import__("jax").__version__, "decode_steps": llm.engine_config.decode_steps,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
