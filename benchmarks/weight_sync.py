"""What a trainer pays to use the engine as its sampler: weight updates and sleep / wake.

    python benchmarks/weight_sync.py [--model smollm2-135m] [--rounds 5] [--rank 16]
        [--tokens 64] [--json PATH]

One engine at the defaults (bf16 weights on CPU), warmed up. Timed, each --rounds times (the
first of a kind apart: it compiles the conversion of that layout):

  full       update_weights(tree): the whole model from a float32 tree on the same device
             (cast to the engine's dtype and copied into its own buffers)
  subset     the last layer's seven matrices by name
  lora       update_weights(LoraParams, lora=...) of rank --rank on every projection
  sleep1     sleep(level=1) + wake_up(): the KV page pool freed and made again
  sleep2     sleep(level=2) + wake_up(): the weights to the host and back as well

and the live device bytes sleep frees at each level. Also the generation right after an
update against one before it (16 rows of --tokens tokens, tokens/s ratio; nothing
recompiles, so it should be ~1).
Times here are the CPU's; on an accelerator the transfers, not the casts, dominate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp


def live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def timed(fn, rounds: int) -> tuple[float, float]:
    """(first call's seconds, median of the next rounds') with the device work finished."""
    times = []
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[1:])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per row generated")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import jaxinfer as ji
    from jaxinfer.loading import load_model
    from jaxinfer.lora.trainable import LoraParams

    llm = ji.LLM(args.model, max_seq_len=512, max_num_seqs=16, max_loras=1,
                 max_lora_rank=args.rank)
    llm.warmup()
    tree = load_model(args.model, dtype=jnp.float32).params  # the trainer's float32 copy
    last = len(tree.layers) - 1
    layer = {f"layers.{last}.{f}": getattr(tree.layers[last], f)
             for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
    lora = LoraParams.init(jax.random.key(0), llm.model_config, args.rank,
                           ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"))
    sp = ji.SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.8, seed=0)
    prompts = [[1, 42, 7, 99, 13, 5]] * 16

    def rate():
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)

    rate()
    before = rate()
    rows = {}
    rows["full"] = timed(lambda: llm.update_weights(tree) or llm.params, args.rounds)
    after = rate()
    rows["subset"] = timed(lambda: llm.update_weights(layer) or llm.params, args.rounds)
    llm.update_weights(lora, lora="policy")
    llm.generate(prompts[:1], sp, lora="policy")  # in a slot now: each update rewrites it
    rows["lora"] = timed(lambda: llm.update_weights(lora, lora="policy")
                         or llm._engine.runner.lora, args.rounds)
    freed = {}

    def cycle(level):
        awake = live_bytes()
        llm.sleep(level=level)
        freed[level] = awake - live_bytes()
        llm.wake_up()
        return llm.params

    rows["sleep1"] = timed(lambda: cycle(1), args.rounds)
    rows["sleep2"] = timed(lambda: cycle(2), args.rounds)
    result = {"model": args.model, "dtype": llm.dtype, "rounds": args.rounds,
              "seconds": {k: {"first": a, "median": b} for k, (a, b) in rows.items()},
              "freed_bytes": {f"level{k}": v for k, v in freed.items()},
              "parameter_bytes": llm.stats()["parameter_bytes"],
              "tokens_per_s_after_update_over_before": after / before}
    print(f"{'what':8} {'first s':>9} {'median s':>9}")
    for k, (a, b) in rows.items():
        print(f"{k:8} {a:9.3f} {b:9.3f}")
    print(f"freed: level 1 {freed[1] / 2**20:.1f} MiB, level 2 {freed[2] / 2**20:.1f} MiB "
          f"(weights {result['parameter_bytes'] / 2**20:.1f} MiB)")
    print(f"generation after / before an update: {after / before:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
