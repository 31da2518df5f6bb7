"""Offline serving throughput: jaxinfer against HF transformers and llama.cpp on the same requests.

    pip install -e ".[bench]"   # torch, transformers, llama-cpp-python (compiles llama.cpp)
    python benchmarks/throughput.py [--workloads random,chat] [--num-requests 64]
        [--output-len 128] [--output-len-min N] [--seed 0] [--threads 2]
        [--peers hf,llamacpp] [--runs 2] [--max-num-seqs 16] [--page-size N] [--hf-batch 16]
        [--dtypes default] [--json PATH]

Workloads (--workloads, each served by every engine, one workload after the other):
  random  prompts of 32-256 tokens (--prompt-len-min / --prompt-len-max)
  chat    short chat-sized prompts of 20-30 tokens
Each: --num-requests requests that all arrive at t=0, output lengths uniform in
[--output-len-min, --output-len] (by default both --output-len: fixed), lengths drawn once
from --seed. Prompt token ids are
uniform over the model's normal (non-control) tokens and are drawn anew for every run, so no run
is served from a prefix cache an earlier one filled; every engine gets exactly the same token-id
lists. Decoding is greedy and every request generates exactly its output length (EOS ignored).

Engines run one after the other, each in its own subprocess (this file with --worker) pinned to
the first --threads CPUs. A worker loads the model, warms up untimed on two requests (jaxinfer
also compiles every shape with LLM.warmup()), then serves the whole workload --runs times; the
run with the highest throughput is reported. Load and warm-up times are reported separately.
  jaxinfer  LLM.generate on all requests at once: continuous batching of up to --max-num-seqs,
            weights dequantized from the GGUF into each of --dtypes ("default": LLM's own
            default, dtype=None: bfloat16; on CPU the weights' and the KV cache's dtype, while
            activations stay float32), one worker each. XLA's CPU thread pool follows the CPUs the
            process may use; XLA has no flag for its size (intra_op_parallelism_threads is a
            TensorFlow option, and --xla_cpu_multi_thread_eigen=true is already the default).
  hf        transformers generate, float32 weights from the same GGUF, sdpa attention,
            torch.set_num_threads(--threads); static batches of --hf-batch requests in arrival
            order, left-padded; a batch runs until its longest request is done.
  llamacpp  llama-cpp-python on the Q4_1 GGUF itself (quantized matmuls: it reads ~5x fewer
            weight bytes per token than the float32 engines), one request at a time in arrival
            order, n_threads = n_threads_batch = --threads.

Figures, from the time of each generated token, measured from submitting the workload (t=0):
  tok/s          output tokens / time from t=0 until the last request finishes
  TTFT           t=0 to a request's first token (queueing included), p50 / p99 over requests
  ITL/token      gaps between consecutive tokens of a request, p50 / p99 over all gaps.
                 jaxinfer returns several tokens per device dispatch, stamped alike, so most of
                 its gaps are 0 and the rest span a whole dispatch
  ITL/request    each request's mean gap, (last - first) / (n - 1), p50 / p99 over requests
Ratios are jaxinfer / peer: above 1 is better for tok/s, below 1 is better for the latencies.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version

import numpy as np

WARMUP_REQUESTS = 2
# The table's figures: summary key, header, decimals.
COLUMNS = (("tok_per_s", "tok/s", 1),
           ("ttft_p50_ms", "TTFT p50", 0), ("ttft_p99_ms", "TTFT p99", 0),
           ("itl_token_p50_ms", "ITL/tok p50", 1), ("itl_token_p99_ms", "ITL/tok p99", 1),
           ("itl_request_p50_ms", "ITL/req p50", 1), ("itl_request_p99_ms", "ITL/req p99", 1))


# ---- engines (run inside the worker subprocess) ---------------------------------------------
#
# Each engine loads in its constructor and serves a workload with serve(prompts, out_lens),
# which submits everything at t=0 and returns (wall seconds until the last request finished,
# per request the times of its generated tokens in seconds after t=0).

class Engine:
    def warmup(self, prompts, out_lens):
        self.serve(prompts, out_lens)


class JaxInfer(Engine):
    def __init__(self, spec):
        import jax
        import jaxinfer as ji

        self.ji = ji
        dtype = None if spec["dtype"] == "default" else spec["dtype"]
        kw = {} if spec.get("page_size") is None else {"page_size": spec["page_size"]}
        self.llm = ji.LLM(spec["model"], max_seq_len=spec["max_seq_len"],
                          max_num_seqs=spec["max_num_seqs"], dtype=dtype, **kw)
        self.versions = {"jaxinfer_dtype": self.llm.dtype}
        self.versions.update({"jaxinfer": version("jaxinfer"), "jax": jax.__version__,
                              "backend": jax.default_backend()})

    def warmup(self, prompts, out_lens):
        self.llm.warmup()  # compiles every (batch, chunk, kv length) shape the engine can use
        super().warmup(prompts, out_lens)

    def serve(self, prompts, out_lens):
        params = [self.ji.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                  for n in out_lens]
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        hits = sum(o.metrics.prefix_cache_hit_tokens for o in outs)
        if hits:
            raise RuntimeError(f"{hits} prompt tokens came from the prefix cache")
        return wall, [[t - t0 for t in o.metrics.token_times] for o in outs]


class HF(Engine):
    def __init__(self, spec):
        import torch
        import transformers
        from transformers.generation.streamers import BaseStreamer

        class StepTimes(BaseStreamer):
            """Stamps each decoding step; generate first puts the prompt, which is skipped."""

            def __init__(self):
                self.times, self.prompt_seen = [], False

            def put(self, value):
                if self.prompt_seen:
                    self.times.append(time.perf_counter())
                self.prompt_seen = True

            def end(self):
                pass

        torch.set_num_threads(spec["threads"])
        self.torch, self.StepTimes, self.batch = torch, StepTimes, spec["hf_batch"]
        self.pad = spec["pad_id"]
        folder, name = os.path.split(spec["model_path"])
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, attn_implementation="sdpa").eval()
        self.versions = {"torch": torch.__version__, "transformers": transformers.__version__}

    def serve(self, prompts, out_lens):
        torch, times = self.torch, []
        t0 = time.perf_counter()
        for i in range(0, len(prompts), self.batch):
            batch, lens = prompts[i:i + self.batch], out_lens[i:i + self.batch]
            width = max(map(len, batch))
            ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            steps, n = self.StepTimes(), max(lens)
            with torch.inference_mode():
                # min_new_tokens = max_new_tokens: EOS is masked out until the last step.
                self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                    max_new_tokens=n, min_new_tokens=n, pad_token_id=self.pad,
                                    streamer=steps)
            # A request is done at its own length; the rest of its batch's steps are waste.
            times += [[t - t0 for t in steps.times[:k]] for k in lens]
        return time.perf_counter() - t0, times


class LlamaCpp(Engine):
    def __init__(self, spec):
        import llama_cpp

        threads = spec["threads"]
        self.llm = llama_cpp.Llama(model_path=spec["model_path"], n_ctx=spec["max_seq_len"],
                                   n_threads=threads, n_threads_batch=threads, n_batch=512,
                                   verbose=False)
        self.versions = {"llama_cpp_python": llama_cpp.__version__}

    def serve(self, prompts, out_lens):
        times = []
        t0 = time.perf_counter()
        for prompt, n in zip(prompts, out_lens):
            stamps = []
            # Llama.generate samples forever (the EOS check lives in its completion API).
            for _ in self.llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True):
                stamps.append(time.perf_counter() - t0)
                if len(stamps) == n:
                    break
            times.append(stamps)
        return time.perf_counter() - t0, times


ENGINES = {"jaxinfer": JaxInfer, "hf": HF, "llamacpp": LlamaCpp}


def worker(name: str, spec_path: str, result_path: str, dtype: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    spec["dtype"] = dtype
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cpus[:spec["threads"]])  # before any engine sizes its thread pool
    t = time.perf_counter()
    engine = ENGINES[name](spec)
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    engine.warmup(spec["warmup_prompts"], spec["out_lens"][:WARMUP_REQUESTS])
    warmup_s = time.perf_counter() - t
    runs = []
    for prompts in spec["run_prompts"]:
        wall, times = engine.serve(prompts, spec["out_lens"])
        runs.append({"wall_s": wall, "token_times": times})
    with open(result_path, "w") as f:
        json.dump({"load_s": load_s, "warmup_s": warmup_s, "versions": engine.versions,
                   "cpus": len(os.sched_getaffinity(0)), "runs": runs}, f)


# ---- parent ---------------------------------------------------------------------------------

def normal_token_ids(model_path: str) -> tuple[np.ndarray, int]:
    """Ids of the GGUF vocabulary's normal tokens (not control, unused or byte tokens), and the
    padding id (EOS when the file names none)."""
    from gguf import GGUFReader

    fields = GGUFReader(model_path).fields
    types = fields["tokenizer.ggml.token_type"]
    kinds = np.array([int(types.parts[i][0]) for i in types.data])

    def scalar(key):
        return int(fields[key].parts[fields[key].data[0]][0]) if key in fields else None

    pad = scalar("tokenizer.ggml.padding_token_id")
    return np.flatnonzero(kinds == 1), scalar("tokenizer.ggml.eos_token_id") if pad is None else pad


def summarize(wall: float, times: list[list[float]]) -> dict:
    ms = lambda xs, q: 1e3 * float(np.percentile(xs, q))
    ttft = [t[0] for t in times]
    gaps = np.concatenate([np.diff(t) for t in times])
    per_request = [(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1]
    tokens = sum(map(len, times))
    return {"wall_s": wall, "output_tokens": tokens, "tok_per_s": tokens / wall,
            "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99),
            "itl_token_p50_ms": ms(gaps, 50), "itl_token_p99_ms": ms(gaps, 99),
            "itl_request_p50_ms": ms(per_request, 50), "itl_request_p99_ms": ms(per_request, 99)}


def run_worker(name: str, spec_path: str, timeout: float, dtype: str = "float32") -> dict:
    result_path = f"{spec_path}.{name}.{dtype}.json"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--spec", spec_path,
           "--result", result_path, "--dtype", dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-20:])
        raise RuntimeError(f"{name} worker failed (exit {proc.returncode}):\n{tail}")
    with open(result_path) as f:
        return json.load(f)


WORKLOADS = {"random": None, "chat": (20, 30)}  # random: --prompt-len-min/max


def run_workload(args, name: str, prompt_range: tuple[int, int], out_min: int, peers, dtypes,
                 model_path: str, vocab, pad_id) -> dict:
    """Serves one workload with every engine, one after the other; prints its table."""
    lo, hi = prompt_range
    rng = np.random.default_rng(args.seed)
    prompt_lens = rng.integers(lo, hi + 1, args.num_requests)
    out_lens = rng.integers(out_min, args.output_len + 1, args.num_requests).tolist()
    draw = lambda lens: [rng.choice(vocab, n).tolist() for n in lens]  # noqa: E731
    spec = {"model": args.model, "model_path": model_path, "threads": args.threads,
            "max_num_seqs": args.max_num_seqs, "page_size": args.page_size,
            "hf_batch": args.hf_batch, "pad_id": pad_id,
            # Room for the longest prompt and output, in whole 16-token pages.
            "max_seq_len": -(-(hi + args.output_len) // 16) * 16,
            "out_lens": out_lens, "warmup_prompts": draw(prompt_lens[:WARMUP_REQUESTS]),
            "run_prompts": [draw(prompt_lens) for _ in range(args.runs)]}

    engines = {}
    with tempfile.TemporaryDirectory(prefix="jaxinfer-throughput-") as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        for engine, dtype in [("jaxinfer", d) for d in dtypes] + [(p, "float32") for p in peers]:
            t = time.perf_counter()
            r = run_worker(engine, spec_path, args.timeout, dtype)
            engine = f"{engine}-{dtype}" if engine == "jaxinfer" else engine
            print(f"{name}: {engine} done in {time.perf_counter() - t:.0f} s", file=sys.stderr,
                  flush=True)
            for run in r["runs"]:
                produced = [len(t) for t in run["token_times"]]
                if produced != out_lens:
                    raise RuntimeError(f"{engine} generated {sum(produced)} tokens, "
                                       f"not the {sum(out_lens)} asked for")
            runs = [summarize(run["wall_s"], run["token_times"]) for run in r["runs"]]
            engines[engine] = {"load_s": r["load_s"], "warmup_s": r["warmup_s"],
                               "cpus": r["cpus"], "versions": r["versions"], "runs": runs,
                               "best": max(runs, key=lambda s: s["tok_per_s"])}
    ratios = {f"jaxinfer-{d}/{p}": {k: engines[f"jaxinfer-{d}"]["best"][k] / engines[p]["best"][k]
                                    for k, _, _ in COLUMNS if engines[p]["best"][k]}
              for d in dtypes for p in peers}

    print(f"[{name}] {args.num_requests} requests, prompts {lo}-{hi} tokens, outputs "
          f"{out_min}-{args.output_len} tokens ({sum(out_lens)} in all), {args.threads} threads, "
          f"best of {args.runs} runs; times in ms")
    print(f"{'engine':<18}{'load s':>8}{'warmup s':>10}"
          + "".join(f"{h:>12}" for _, h, _ in COLUMNS) + "   tok/s of each run")
    for engine, e in engines.items():
        print(f"{engine:<18}{e['load_s']:>8.1f}{e['warmup_s']:>10.1f}"
              + "".join(f"{e['best'][k]:>12.{d}f}" for k, _, d in COLUMNS)
              + "   " + " ".join(f"{r['tok_per_s']:.1f}" for r in e["runs"]))
    for pair, r in ratios.items():
        print(f"{pair}: " + ", ".join(f"{h} {r[k]:.2f}x" for k, h, _ in COLUMNS if k in r))
    print("versions: " + ", ".join(f"{k} {v}" for e in engines.values()
                                   for k, v in e["versions"].items()), flush=True)
    return {"prompt_lens": prompt_lens.tolist(), "output_lens": out_lens,
            "max_seq_len": spec["max_seq_len"], "engines": engines, "ratios": ratios}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="jaxinfer alias or a .gguf path")
    ap.add_argument("--workloads", default="random,chat",
                    help=f"comma-separated, from: {', '.join(WORKLOADS)}")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--output-len-min", type=int, default=None,
                    help="draw output lengths uniformly from [this, --output-len]")
    ap.add_argument("--prompt-len-min", type=int, default=32, help="the random workload's")
    ap.add_argument("--prompt-len-max", type=int, default=256, help="the random workload's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peers", default="hf,llamacpp", help="comma-separated, from: hf, llamacpp")
    ap.add_argument("--runs", type=int, default=2, help="timed runs per engine; the best counts")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="jaxinfer's batch size")
    ap.add_argument("--page-size", type=int, default=None,
                    help="jaxinfer's KV page size (default: the LLM's default)")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per engine")
    ap.add_argument("--dtypes", default="default",
                    help="jaxinfer's dtypes, comma-separated (default = LLM's dtype=None); "
                         "each runs as its own engine")
    ap.add_argument("--json", metavar="PATH", help="also write every figure to PATH")
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=sorted(ENGINES), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.spec, args.result, args.dtype)

    out_min = args.output_len if args.output_len_min is None else args.output_len_min
    peers = [p for p in args.peers.split(",") if p]
    dtypes = [d for d in args.dtypes.split(",") if d]
    workloads = [w for w in args.workloads.split(",") if w]
    if not dtypes or any(d not in ("default", "float32", "bfloat16", "float16") for d in dtypes):
        ap.error("--dtypes must name dtypes from default, float32, bfloat16, float16; "
                 f"got {args.dtypes!r}")
    if any(p not in ENGINES or p == "jaxinfer" for p in peers):
        ap.error(f"--peers must name engines from hf, llamacpp; got {args.peers!r}")
    if not workloads or any(w not in WORKLOADS for w in workloads):
        ap.error(f"--workloads must name workloads from {', '.join(WORKLOADS)}; "
                 f"got {args.workloads!r}")
    if not (1 <= args.prompt_len_min <= args.prompt_len_max and 1 <= out_min <= args.output_len
            and args.num_requests >= WARMUP_REQUESTS and args.runs >= 1 and args.threads >= 1):
        ap.error("need 1 <= min <= max lengths, --num-requests >= 2, --runs >= 1, --threads >= 1")

    from jaxinfer.loading.hub import resolve_alias

    model_path = args.model if os.path.isfile(args.model) else resolve_alias(args.model)
    vocab, pad_id = normal_token_ids(model_path)
    results = {}
    for w in workloads:
        prompt_range = WORKLOADS[w] or (args.prompt_len_min, args.prompt_len_max)
        results[w] = run_workload(args, w, prompt_range, out_min, peers, dtypes, model_path,
                                  vocab, pad_id)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "model_path": model_path, "workloads": results}, f,
                      indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
