"""Multi-LoRA serving cost, side by side in one process.

    python benchmarks/lora.py [--rows 16] [--output-len 96] [--rounds 3] [--rank 16]
        [--adapters 4] [--json PATH]

Two engines of SmolLM2 at the defaults: one without LoRA (max_loras 0), one with --adapters
slots of rank --rank holding as many random adapters (PEFT files written to a temporary
directory, every projection adapted: q, k, v, o, gate, up, down). Workloads, alternating for
--rounds, each --rows chat prompts generating exactly --output-len tokens (temperature 0.8,
seeded, EOS ignored):

  off        the engine without LoRA
  base       the LoRA engine, every row on the base model
  adapters   the LoRA engine, rows spread round-robin over the adapters

Reported: output tokens/s (best round) and the ratios adapters/off (target >= 0.8) and
base/off (target >= 0.95); the time to read and check a PEFT adapter (load_lora) and to write
it into a slot (a swap).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
MODULES = {"q_proj": ("self_attn", "wq"), "k_proj": ("self_attn", "wk"),
           "v_proj": ("self_attn", "wv"), "o_proj": ("self_attn", "wo"),
           "gate_proj": ("mlp", "w_gate"), "up_proj": ("mlp", "w_up"),
           "down_proj": ("mlp", "w_down")}


def write_adapters(llm, directory: str, count: int, rank: int) -> dict:
    """count random PEFT adapters of rank `rank` shaped for llm's model: {name: path}."""
    from safetensors.numpy import save_file

    paths = {}
    for k in range(count):
        rng = np.random.default_rng(k)
        tensors = {}
        for i, lp in enumerate(llm.params.layers):
            for module, (kind, field) in MODULES.items():
                fan_in, fan_out = getattr(lp, field).shape
                name = f"base_model.model.model.layers.{i}.{kind}.{module}"
                tensors[name + ".lora_A.weight"] = (rng.standard_normal((rank, fan_in)) *
                                                    0.02).astype(np.float32)
                tensors[name + ".lora_B.weight"] = (rng.standard_normal((fan_out, rank)) *
                                                    0.02).astype(np.float32)
        path = os.path.join(directory, f"adapter{k}")
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                       "target_modules": sorted(MODULES), "bias": "none"}, f)
        paths[f"adapter{k}"] = path
    return paths


def _run(llm, ji, args, loras, seed: int) -> float:
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a long story about the sea."}])
    params = [ji.SamplingParams(max_tokens=args.output_len, temperature=0.8, seed=seed + i,
                                ignore_eos=True) for i in range(args.rows)]
    t0 = time.perf_counter()
    outs = llm.generate([prompt] * args.rows, params, lora=loras)
    wall = time.perf_counter() - t0
    assert all(len(o.token_ids) == args.output_len for o in outs)
    return args.rows * args.output_len / wall


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import jaxinfer as ji

    off = ji.LLM(args.model, max_num_seqs=args.rows, max_seq_len=512)
    on = ji.LLM(args.model, max_num_seqs=args.rows, max_seq_len=512,
                max_loras=args.adapters, max_lora_rank=args.rank)
    off.warmup()
    on.warmup()
    tmp = tempfile.mkdtemp()
    paths = write_adapters(on, tmp, args.adapters + 1, args.rank)
    names = list(paths)[:args.adapters]
    load_s = []
    for name in names:
        t = time.perf_counter()
        on.load_lora(name, paths[name])
        load_s.append(time.perf_counter() - t)
    spread = [names[i % len(names)] for i in range(args.rows)]
    _run(on, ji, args, spread, 0)  # every adapter into its slot; first-use costs
    runner = on._engine.runner
    spare = on._engine.loras.adapters[names[0]]
    swap_s = []
    for _ in range(3):
        t = time.perf_counter()
        runner.write_lora(0, spare)
        __import__("jax").block_until_ready(runner.lora)
        swap_s.append(time.perf_counter() - t)
    runner.write_lora(0, on._engine.loras.adapters[on._engine.loras.slot_holder[0]])
    runs = {"off": [], "base": [], "adapters": []}
    for r in range(args.rounds):
        runs["off"].append(_run(off, ji, args, None, 1000 * r))
        runs["base"].append(_run(on, ji, args, None, 1000 * r))
        runs["adapters"].append(_run(on, ji, args, spread, 1000 * r))
    best = {k: max(v) for k, v in runs.items()}
    result = {
        "rows": args.rows, "output_len": args.output_len, "rank": args.rank,
        "adapters": args.adapters, "tok_per_s": best,
        "adapters_vs_off": best["adapters"] / best["off"],
        "base_vs_off": best["base"] / best["off"],
        "per_round": {
            "adapters_vs_off": sorted(a / o for a, o in zip(runs["adapters"], runs["off"])),
            "base_vs_off": sorted(b / o for b, o in zip(runs["base"], runs["off"]))},
        "load_lora_s": min(load_s), "slot_write_s": min(swap_s),
        "adapter_mb": on._engine.loras.adapters[names[0]].nbytes / 2**20,
        "runs": runs, "jax": __import__("jax").__version__,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    main()
