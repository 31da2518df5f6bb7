"""Batch jobs against LLM.generate, and the cost of resuming a killed job.

    python benchmarks/batch.py [--num-requests 256] [--max-tokens 32] [--max-num-seqs 16]
        [--max-seq-len 512] [--runs 2] [--resume-runs 1] [--skip-overhead] [--skip-resume]
        [--json PATH]

1. Overhead (one process, one LLM, warmed up on the same workload first): the same
   --num-requests greedy requests (prompts of 20-60 tokens, exactly --max-tokens output tokens
   each, EOS ignored) through LLM.generate (all submitted at once) and through the job
   (jaxinfer.batch.run_local over the same requests as an OpenAI batch file, committing every
   64 lines: reading, checking, add_request/step, response bodies, fsynced commits, merge).
   The two alternate --runs times; the best run of each is reported. Target: the job's output
   tokens/s within 5% of generate's.
2. Resume (subprocesses of python -m jaxinfer.launch.batch, each loading the model and
   compiling from the persistent cache): the job run uninterrupted, then the same job killed
   (SIGKILL) once half of its requests are committed and rerun to the end, --resume-runs
   times, interleaved; wall time and CPU time (the job's own, less disturbed by other work on
   a shared machine) of each launch. Target: killed run + resumed run <= 1.1 x the
   uninterrupted run, start-ups included.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time

WORDS = ("river mountain quiet engine garden signal winter market letter orbit candle "
         "harbor meadow silver thunder library compass lantern valley").split()


def requests(n: int, max_tokens: int, seed: int = 0) -> list[str]:
    """n greedy completion lines of 20-60 words, exactly max_tokens output tokens each."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
        lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST",
                                 "url": "/v1/completions",
                                 "body": {"prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0, "ignore_eos": True}}))
    return lines


def overhead(args, path: str, work: str) -> dict:
    import jaxinfer as ji
    from jaxinfer.batch import JobSpec, run_local

    kwargs = {"model": "smollm2-135m", "max_seq_len": args.max_seq_len,
              "max_num_seqs": args.max_num_seqs}
    llm = ji.LLM(**kwargs)
    bodies = [json.loads(x)["body"] for x in open(path)]
    prompts = [b["prompt"] for b in bodies]
    params = ji.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts, params)  # compiles every shape this workload uses
    gen, job, texts = [], [], None
    for run in range(args.runs):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        gen.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
        spec = JobSpec(path, os.path.join(work, f"overhead-{run}"), kwargs, commit_every=64,
                       progress=False)
        t0 = time.perf_counter()
        summary = run_local(llm, spec)
        job.append(summary["completion_tokens"] / (time.perf_counter() - t0))
        with open(summary["output"]) as f:
            texts = [json.loads(x)["response"]["body"]["choices"][0]["text"] for x in f]
        print(f"run {run}: generate {gen[-1]:.1f} tok/s, job {job[-1]:.1f} tok/s",
              file=sys.stderr)
    same = sum(t == o.text for t, o in zip(texts, outs))
    return {"generate_tok_s": max(gen), "job_tok_s": max(job),
            "overhead": 1 - max(job) / max(gen), "generate_runs": gen, "job_runs": job,
            "outputs_equal": same, "requests": len(prompts)}


def _committed(out: str) -> int:
    path = os.path.join(out, "shard-00000-of-00001", "manifest.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(json.loads(x)["records"] for x in f if x.endswith("\n"))


def resume(args, path: str, work: str) -> dict:
    def command(out):
        return [sys.executable, "-m", "jaxinfer.launch.batch", "--input", path, "--output", out,
                "--max_seq_len", str(args.max_seq_len), "--max_num_seqs",
                str(args.max_num_seqs), "--commit_every", "16", "--commit_interval", "5",
                "--progress=false"]

    def timed(out, kill_at=None):
        """(wall seconds, CPU seconds) of one launch: CPU time is what the job itself used,
        less disturbed than wall time by other work on a shared machine."""
        cpu0, t0 = _children_cpu(), time.perf_counter()
        proc = subprocess.Popen(command(out), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        while kill_at is not None and proc.poll() is None and _committed(out) < kill_at:
            time.sleep(0.05)
        if kill_at is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        if kill_at is None and proc.returncode != 0:
            sys.exit(f"the batch job failed:\n{err.decode()[-3000:]}")
        return time.perf_counter() - t0, _children_cpu() - cpu0

    runs = []
    for rep in range(args.resume_runs):  # interleaved, so that load changes hit both
        whole = timed(os.path.join(work, f"whole-{rep}"))
        out = os.path.join(work, f"killed-{rep}")
        killed = timed(out, kill_at=args.num_requests // 2)
        at_kill = _committed(out)
        resumed = timed(out)
        runs.append({"uninterrupted_s": whole[0], "killed_run_s": killed[0],
                     "resumed_run_s": resumed[0], "committed_at_kill": at_kill,
                     "ratio": (killed[0] + resumed[0]) / whole[0],
                     "uninterrupted_cpu_s": whole[1], "killed_cpu_s": killed[1],
                     "resumed_cpu_s": resumed[1],
                     "cpu_ratio": (killed[1] + resumed[1]) / whole[1]})
        print(f"resume {rep}: {runs[-1]}", file=sys.stderr)
    return {"runs": runs, "ratio": min(r["ratio"] for r in runs),
            "cpu_ratio": min(r["cpu_ratio"] for r in runs)}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--resume-runs", type=int, default=1)
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-resume", action="store_true")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "requests.jsonl")
        with open(path, "w") as f:
            f.write("".join(x + "\n" for x in requests(args.num_requests, args.max_tokens)))
        result = {"config": vars(args)}
        if not args.skip_overhead:
            result["overhead"] = overhead(args, path, work)
        if not args.skip_resume:
            result["resume"] = resume(args, path, work)
    if "overhead" in result:
        o = result["overhead"]
        print(f"{o['requests']} requests x {args.max_tokens} tokens, max_num_seqs "
              f"{args.max_num_seqs}: generate {o['generate_tok_s']:.1f} tok/s, job "
              f"{o['job_tok_s']:.1f} tok/s, overhead {o['overhead']:+.1%} (target <= 5%); "
              f"{o['outputs_equal']}/{o['requests']} texts equal")
    for r in result.get("resume", {}).get("runs", []):
        print(f"uninterrupted {r['uninterrupted_s']:.1f} s ({r['uninterrupted_cpu_s']:.0f} CPU "
              f"s); killed at {r['committed_at_kill']} committed after {r['killed_run_s']:.1f} s "
              f"+ resumed {r['resumed_run_s']:.1f} s = {r['ratio']:.2f}x wall, "
              f"{r['cpu_ratio']:.2f}x CPU (target <= 1.1x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
