"""Speculative decoding: wall-clock speedup and acceptance, against the same engine without it.

    python benchmarks/speculative.py [--batch 1,16] [--max-tokens 128] [--num-draft 4]
        [--ngram-max 3] [--draft-model PATH] [--prompts-b1 4] [--runs 2] [--threads 2]
        [--model smollm2-135m] [--max-seq-len 1024] [--json PATH]

Workloads (chat-templated, greedy, EOS ends a request, at most --max-tokens new tokens):
  grounded  the answer is in the prompt: repeat a paragraph, summarise it, or return it with its
            spelling mistakes fixed (eight paragraphs written for this benchmark, the typos put
            in deterministically), where prompt lookup finds long matches;
  open      open-ended questions and story prompts, where it finds few.
Batch 1 serves the first --prompts-b1 prompts of a workload one after another through one slot
(max_num_seqs=1); batch 16 submits 16 at once (max_num_seqs=16).

Each batch size and method runs in its own subprocess (this file with --worker), pinned to the
first --threads CPUs, holding two engines: plain, and n-gram speculation
(SpeculativeConfig("ngram", num_draft_tokens, ngram_max)) or, with --draft-model (a checkpoint
from `python -m jaxinfer.launch.train_draft`), draft-model speculation. Both serve every workload twice untimed (compiling the shapes it
uses, also with its prompts in the prefix cache), then --runs times alternately, plain then speculative; each reports its fastest run, so
the speedup (plain seconds / speculative seconds) compares runs taken side by side. Greedy
speculation is exact, so both produce the same tokens (checked; a mismatch is reported).
Acceptance: accepted / proposed draft tokens, and accepted drafts per verification step, over
the timed runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PARAGRAPHS = [
    "The old lighthouse stood at the edge of the cliff for more than a century. Every night its "
    "keeper climbed the spiral stairs, trimmed the wick and wound the clockwork that turned the "
    "great lens. Ships passing the reef learned to trust its slow white flash, and the village "
    "below grew up around the harbour it protected.",
    "Photosynthesis is the process by which green plants turn light into chemical energy. In the "
    "leaves, chlorophyll absorbs sunlight, and the plant uses that energy to combine carbon "
    "dioxide from the air with water from the soil. The result is glucose, which feeds the "
    "plant, and oxygen, which is released into the atmosphere.",
    "To make a simple loaf of bread, mix flour, water, salt and yeast into a soft dough. Knead "
    "it for ten minutes until it is smooth and elastic, then leave it covered in a warm place "
    "for an hour. Shape the risen dough, let it rest again, and bake it in a hot oven until the "
    "crust is golden and the loaf sounds hollow when tapped.",
    "The committee met on Tuesday to review the budget for the new library. Members agreed to "
    "fund a larger children's section and longer opening hours on weekends. The proposal to "
    "replace the heating system was postponed until the spring, when updated cost estimates "
    "are expected from the contractors.",
    "Honeybees communicate the location of flowers through a movement known as the waggle "
    "dance. A returning forager runs in a straight line while shaking her body, then circles "
    "back and repeats the run. The angle of the run shows the direction of the food relative "
    "to the sun, and its length tells the other bees how far away it is.",
    "Our team released version two of the application last week. The update adds offline "
    "mode, a redesigned settings page and faster start-up on older phones. Several users "
    "reported that notifications arrived late, and a fix for that problem will be included in "
    "the next minor release at the end of the month.",
    "The river begins as a small spring high in the mountains. It gathers water from melting "
    "snow and dozens of streams as it flows down through forests and farmland. By the time it "
    "reaches the coast it is wide and slow, and it spreads into a delta of marshes where "
    "thousands of birds stop to rest during their migration.",
    "Regular exercise improves both physical and mental health. Walking, cycling or swimming "
    "for thirty minutes most days strengthens the heart and lungs, helps control weight and "
    "lowers the risk of many diseases. Studies also show that people who stay active sleep "
    "better and report less stress and anxiety.",
]

OPEN_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Why is the sky blue? Explain it simply.",
    "Give me three ideas for a birthday party for a ten-year-old.",
    "What are the main differences between cats and dogs as pets?",
    "Write a poem about the ocean at night.",
    "How does a computer store information?",
    "Describe your ideal weekend.",
    "What should I pack for a camping trip in the mountains?",
    "Explain what a black hole is.",
    "Write a letter to a friend who moved to another country.",
    "What are some good habits for studying?",
    "Tell me about the history of the bicycle.",
    "Invent a new sport and explain its rules.",
    "Why do leaves change colour in autumn?",
    "Write a dialogue between a chef and a customer.",
    "What makes a good leader?",
]


def _with_typos(text: str) -> str:
    """Every fifth word of five or more letters with two inner letters swapped."""
    words = text.split(" ")
    long_words = [i for i, w in enumerate(words) if len(w) >= 5 and w.isalpha()]
    for i in long_words[::5]:
        w = words[i]
        words[i] = w[:2] + w[3] + w[2] + w[4:]
    return " ".join(words)


def grounded_prompts() -> list[str]:
    tasks = [("Repeat the following text exactly, word for word:\n\n{}", False),
             ("Summarize the following text in a few sentences:\n\n{}", False),
             ("Fix the spelling mistakes in the following text and return the corrected "
              "text:\n\n{}", True)]
    out = []
    for i in range(16):
        template, typos = tasks[i % len(tasks)]
        text = PARAGRAPHS[i % len(PARAGRAPHS)]
        out.append(template.format(_with_typos(text) if typos else text))
    return out


def worker(args) -> dict:
    import jax

    import jaxinfer as ji

    def engine(spec):
        return ji.LLM(args.model, max_seq_len=args.max_seq_len, max_num_seqs=args.batch,
                      speculative=spec)

    spec = (ji.SpeculativeConfig("ngram", num_draft_tokens=args.num_draft,
                                 ngram_max=args.ngram_max) if args.method == "ngram" else
            ji.SpeculativeConfig("draft", num_draft_tokens=args.num_draft,
                                 draft_model=args.draft_model))
    engines = {"plain": engine(None), "spec": engine(spec)}
    tok = engines["plain"].tokenizer
    n = args.batch if args.batch > 1 else args.prompts_b1
    workloads = {"grounded": grounded_prompts()[:n], "open": OPEN_PROMPTS[:n]}
    params = ji.SamplingParams(max_tokens=args.max_tokens)
    texts = {name: [tok.apply_chat_template([{"role": "user", "content": p}],
                                            add_generation_prompt=True) for p in prompts]
             for name, prompts in workloads.items()}

    def serve(name, wl):
        t0 = time.perf_counter()
        outs = engines[name].generate(texts[wl], params)
        return time.perf_counter() - t0, outs

    # Untimed, twice: compiles the shapes each workload uses, also those of its repeats (the
    # prefix cache then holds the prompts, so prefill chunks are shorter).
    for _ in range(2):
        for wl in workloads:
            for name in engines:
                serve(name, wl)
    results = {}
    for wl in workloads:
        best = {name: None for name in engines}
        before = engines["spec"].stats()
        for _ in range(args.runs):
            for name in engines:
                secs, outs = serve(name, wl)
                if best[name] is None or secs < best[name][0]:
                    best[name] = (secs, outs)
        after = engines["spec"].stats()
        plain_outs, spec_outs = best["plain"][1], best["spec"][1]
        tokens = sum(len(o.token_ids) for o in spec_outs)
        drafted = after["draft_tokens"] - before["draft_tokens"]
        accepted = after["accepted_tokens"] - before["accepted_tokens"]
        steps = after["spec_steps"] - before["spec_steps"]
        results[wl] = {
            "requests": len(spec_outs), "output_tokens": tokens,
            "plain_s": round(best["plain"][0], 3), "spec_s": round(best["spec"][0], 3),
            "plain_tok_per_s": round(tokens / best["plain"][0], 1),
            "spec_tok_per_s": round(tokens / best["spec"][0], 1),
            "speedup": round(best["plain"][0] / best["spec"][0], 3),
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "accepted_per_step": round(accepted / steps, 3) if steps else None,
            "mismatched_requests": sum(a.token_ids != b.token_ids
                                       for a, b in zip(plain_outs, spec_outs)),
        }
    return {"batch": args.batch, "method": args.method, "device": str(jax.devices()[0]),
            "jax": jax.__version__, "workloads": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--ngram-max", type=int, default=3)
    ap.add_argument("--draft-model", help="a draft checkpoint: also measure draft speculation")
    ap.add_argument("--prompts-b1", type=int, default=4)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--method", default="ngram", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.batch = int(args.batch)
        with open(args.out, "w") as f:
            json.dump(worker(args), f)
        return

    report = {"args": {k: v for k, v in vars(args).items()
                       if k not in ("worker", "out", "method")}, "runs": []}
    methods = ["ngram"] + (["draft"] if args.draft_model else [])
    for batch, method in [(int(b), m) for b in args.batch.split(",") for m in methods]:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--out", out,
               "--batch", str(batch), "--method", method] + [
            a for k, v in vars(args).items()
            if k not in ("worker", "out", "batch", "json", "method") and v is not None
            for a in (f"--{k.replace('_', '-')}", str(v))]
        if hasattr(os, "sched_setaffinity"):
            cmd = ["taskset", "-c", f"0-{args.threads - 1}"] + cmd
        subprocess.run(cmd, check=True)
        with open(out) as f:
            result = json.load(f)
        os.unlink(out)
        report["runs"].append(result)
        print(f"\nbatch {batch}, {method} ({result['device']}):")
        print(f"{'workload':<10} {'tokens':>6} {'plain tok/s':>11} {'spec tok/s':>11} "
              f"{'speedup':>7} {'accept':>6} {'acc/step':>8} {'mismatch':>8}")
        for wl, r in result["workloads"].items():
            print(f"{wl:<10} {r['output_tokens']:>6} {r['plain_tok_per_s']:>11} "
                  f"{r['spec_tok_per_s']:>11} {r['speedup']:>7} "
                  f"{r['acceptance_rate'] if r['acceptance_rate'] is not None else '-':>6} "
                  f"{r['accepted_per_step'] if r['accepted_per_step'] is not None else '-':>8} "
                  f"{r['mismatched_requests']:>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
