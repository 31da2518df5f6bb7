"""Online serving: jaxinfer's OpenAI server against llama.cpp's servers (llama-cpp-python's
llama_cpp.server, llama.cpp's own llama-server), with the same client and prompts, one server
after the other, on loopback: Poisson arrivals rate by rate, or --burst (all at once).

    pip install -e ".[bench,serve]"   # llama-cpp-python compiles llama.cpp on install
    python benchmarks/serving.py [--rates 0.5,1,2,4,8] [--num-requests 32] [--max-tokens 32]
        [--prompt-words 60] [--servers jaxinfer,llamacpp] [--rate-time-limit 240]
        [--jaxinfer-args "--dtype bfloat16 --max_num_seqs 16 --max_seq_len 512"]
        [--threads 2] [--out benchmarks/results/serving]

    bash benchmarks/build_llama_server.sh   # llama-server and an F16 GGUF, ~/.cache/jaxinfer-bench
    python benchmarks/serving.py --burst --num-requests 64 --max-tokens 128 --rounds 2 \
        --servers jaxinfer,llamaserver-f16,llamaserver-q4_1 [--slots 16] [--slot-context 512]

Servers (--servers):
  jaxinfer          python -m jaxinfer.launch.serve on the default model (--jaxinfer-args)
  llamacpp          python -m llama_cpp.server on the same GGUF: one stream at a time
  llamaserver-q4_1  llama.cpp's llama-server on the same GGUF (Q4_1), --slots parallel slots
                    with continuous batching (-np --slots -cb), -c --slots x --slot-context,
                    -t/-tb --threads; binary and files under --llama-cpp-dir
  llamaserver-f16   the same on an F16 copy of that file (the build script writes it)

--burst: --num-requests requests sent at t=0 (not streamed), each a prompt of 20-30 random
token ids from the vocabulary's normal tokens (chat-sized, as benchmarks/throughput.py's chat
workload; sent as token ids so every server gets the same tokens), greedy, EOS ignored, every
request exactly --max-tokens tokens (checked). Each of --rounds rounds draws new prompts (so no
prefix cache helps) and serves them with every server in turn. Reports output tokens per
second (tokens / time from the first send to the last answer) per server and round, and each
server's tok/s over the first server's in the same round.

Each server starts as a subprocess on a free 127.0.0.1 port (jaxinfer: python -m
jaxinfer.launch.serve, compiled before it reports healthy; llama.cpp: python -m
llama_cpp.server on the same GGUF, --interrupt_requests False so that a new request does not cut
a running stream off) and gets two untimed requests. Then, rate by rate, each server in turn
(never two at once; alternating keeps a shared machine's background load alike for both) gets
--num-requests streamed /v1/completions requests whose send times follow a Poisson process
of that rate (exponential gaps, drawn once from --seed, so both servers see the same schedule
and prompts). Prompts are
--prompt-words random common words each, a different prompt per request; every request asks
for --max-tokens tokens, greedy, with EOS suppressed (jaxinfer: ignore_eos; llama.cpp:
logit_bias -100 on the EOS ids), so both generate the same number of tokens. A rate's requests
still running --rate-time-limit seconds after its first send are cancelled and count as misses.

Poisson mode, per rate and server (the openai client's stream, times taken as chunks arrive):
  TTFT        send to the first chunk with text, p50 / p99 over requests
  ITL         a request's mean gap between tokens, (last chunk - first chunk) / (tokens - 1),
              p50 / p99 over requests (jaxinfer streams several tokens per chunk)
  goodput     requests meeting the SLO (TTFT <= 2 s and ITL <= 200 ms) per second of the
              rate's run (first send to last finish), and the fraction that met it
  tok/s       generated tokens per second of the rate's run
A rate is sustained when at least 90% of its requests meet the SLO. Writes RESULTS.json and a
plot (latency and goodput against the request rate) to --out.

--threads is llama.cpp's thread count. On a machine that other work shares, 1 is its best
setting: its OpenMP threads spin at barriers, and with the two cores contended a 32-token request
took 5.9-40 s at 2 threads against 1.3 s at 1 (measured on this machine under a load average
of 5). llama-server alike: 16 requests of 64 tokens ran at 7-10 tok/s at 2 threads, 94-109 with
OMP_WAIT_POLICY=passive in the environment (threads sleep at barriers; the servers inherit it,
jaxinfer uses no OpenMP) and 124-129 at 1 thread (load average 6-7). jaxinfer's XLA thread pool
has no such setting (see benchmarks/throughput.py). --burst records the load average and the
OMP_ variables in RESULTS.json.

llama-cpp-python builds llama.cpp for the build machine's CPU. Where the CPU reports AMX but the
virtual machine does not let processes use it (llama.cpp then dies on `ldtilecfg`, a general
protection fault), build it without AMX:
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
      -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
      -DGGML_AMX_BF16=OFF" pip install --force-reinstall --no-deps llama-cpp-python==0.3.36
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np

SLO_TTFT_S, SLO_ITL_S, SUSTAINED = 2.0, 0.2, 0.9
MODEL = "smollm2-135m"
WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money "
         "story fact month lot right study book eye job word business issue side kind head "
         "house service friend father power hour game line end member law car city community "
         "name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason "
         "research girl guy moment air teacher force education river garden music market").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


class ServerProcess:
    """A server subprocess on loopback: started, waited for, stopped with SIGTERM."""

    def __init__(self, name: str, cmd: list[str], ready_path: str, port: int, log_path: str):
        self.name, self.cmd, self.port = name, cmd, port
        self.url = f"http://127.0.0.1:{port}"
        self.ready_url = self.url + ready_path
        self.log = open(log_path, "w")
        self.proc = None

    def start(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        print(f"[{self.name}] {shlex.join(self.cmd)}", flush=True)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        while not http_ok(self.ready_url):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see "
                                   f"{self.log.name}")
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s")
            time.sleep(1.0)
        return time.monotonic() - t0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def llama_server_gguf(args, kind: str, q4_1: str) -> str:
    if kind == "q4_1":
        return q4_1
    stem = os.path.basename(q4_1).removesuffix(".gguf").removesuffix(".Q4_1")
    path = os.path.join(args.llama_cpp_dir, "models", f"{stem}.F16.gguf")
    if not os.path.exists(path):
        raise SystemExit(f"{path} not found: run bash benchmarks/build_llama_server.sh")
    return path


def make_servers(args, gguf: str, eos_ids: list[int], out: str) -> dict:
    servers = {}
    py = [sys.executable]
    for kind in ("f16", "q4_1"):
        name = f"llamaserver-{kind}"
        if name not in args.servers:
            continue
        binary = os.path.join(args.llama_cpp_dir, "build", "bin", "llama-server")
        if not os.path.exists(binary):
            raise SystemExit(f"{binary} not found: run bash benchmarks/build_llama_server.sh")
        port = free_port()
        cmd = [binary, "-m", llama_server_gguf(args, kind, gguf), "--alias", MODEL,
               "--host", "127.0.0.1", "--port", str(port), "-np", str(args.slots), "-cb",
               "-c", str(args.slots * args.slot_context), "-t", str(args.threads),
               "-tb", str(args.threads)]
        servers[name] = (ServerProcess(name, cmd, "/health", port,
                                       os.path.join(out, f"{name}.log")),
                         {"ignore_eos": True})
    if "jaxinfer" in args.servers:
        port = free_port()
        cmd = py + ["-m", "jaxinfer.launch.serve", "--model", MODEL, "--port", str(port),
                    "--max_waiting", "100000"] + shlex.split(args.jaxinfer_args)
        servers["jaxinfer"] = (ServerProcess("jaxinfer", cmd, "/health", port,
                                             os.path.join(out, "jaxinfer.log")),
                               {"ignore_eos": True})
    if "llamacpp" in args.servers:
        port = free_port()
        cmd = py + ["-m", "llama_cpp.server", "--model", gguf, "--model_alias", MODEL,
                    "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048",
                    "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
                    "--interrupt_requests", "False"]
        servers["llamacpp"] = (ServerProcess("llamacpp", cmd, "/v1/models", port,
                                             os.path.join(out, "llamacpp.log")),
                               {"logit_bias": {str(i): -100.0 for i in eos_ids}})
    return servers


async def one_request(client, prompt: str, max_tokens: int, extra: dict, tokenizer) -> dict:
    t_send = time.perf_counter()
    first = last = None
    text, usage = "", None
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, stream=True, extra_body=extra)
    async for chunk in stream:
        usage = getattr(chunk, "usage", None) or usage
        piece = "".join(c.text or "" for c in chunk.choices)
        if piece:
            now = time.perf_counter()
            first = first if first is not None else now
            last, text = now, text + piece
    n = usage.completion_tokens if usage else len(tokenizer.encode(text))
    return {"send": t_send, "first": first, "last": last, "tokens": n}


async def run_rate(url: str, rate: float, prompts: list[str], gaps: list[float], args,
                   extra: dict, tokenizer) -> list[dict]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0,
                                timeout=args.rate_time_limit)

    async def scheduled(delay: float, prompt: str) -> dict:
        await asyncio.sleep(delay)
        sent = time.perf_counter()
        try:
            return await one_request(client, prompt, args.max_tokens, extra, tokenizer)
        except Exception as e:  # noqa: BLE001 - a failed request is a miss, reported
            return {"send": sent, "error": f"{type(e).__name__}: {e}"[:200]}

    offsets = np.cumsum(gaps)
    tasks = [asyncio.ensure_future(scheduled(float(d), p)) for d, p in zip(offsets, prompts)]
    done, pending = await asyncio.wait(tasks, timeout=args.rate_time_limit)
    for t in pending:
        t.cancel()
    await client.close()
    return [t.result() if t in done else {"error": "timed out"} for t in tasks]


async def run_burst(url: str, prompts: list, args, extra: dict) -> dict:
    """All prompts sent at once, not streamed; output tok/s from the first send to the last
    answer."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0,
                                timeout=args.rate_time_limit)
    t0 = time.perf_counter()
    outs = await asyncio.gather(*[client.completions.create(
        model=MODEL, prompt=p, max_tokens=args.max_tokens, temperature=0, extra_body=extra)
        for p in prompts])
    span = time.perf_counter() - t0
    await client.close()
    tokens = [o.usage.completion_tokens for o in outs]
    if tokens != [args.max_tokens] * len(prompts):
        raise RuntimeError(f"{url} generated {sum(tokens)} tokens, not "
                           f"{args.max_tokens * len(prompts)}")
    return {"span_s": span, "tokens": sum(tokens), "tok_per_s": sum(tokens) / span}


def burst(args, servers: dict, vocab, rng: random.Random) -> dict:
    """--rounds rounds, each new prompts served by every server in turn."""
    draw = lambda n: [[int(rng.choice(vocab)) for _ in range(rng.randint(20, 30))]  # noqa: E731
                      for _ in range(n)]
    results = {name: [] for name in servers}
    for name, (server, extra) in servers.items():
        asyncio.run(run_burst(server.url, draw(2), args, extra))  # untimed
    for r in range(args.rounds):
        prompts = draw(args.num_requests)
        for name, (server, extra) in servers.items():
            res = asyncio.run(run_burst(server.url, prompts, args, extra))
            results[name].append(res)
            print(f"[{name}] round {r}: {res['tokens']} tokens in {res['span_s']:.1f} s, "
                  f"{res['tok_per_s']:.1f} tok/s", flush=True)
    first = next(iter(results))
    ratios = {name: [a["tok_per_s"] / b["tok_per_s"] for a, b in zip(runs, results[first])]
              for name, runs in results.items()}
    for name, runs in results.items():
        print(f"{name:<18} tok/s " + " ".join(f"{x['tok_per_s']:7.1f}" for x in runs)
              + f"   / {first}: " + " ".join(f"{x:.2f}" for x in ratios[name]))
    return {"rounds": results, "ratio_to_" + first: ratios}


def summarize(results: list[dict]) -> dict:
    ok = [r for r in results if "error" not in r and r["first"] is not None]
    ttft = np.array([r["first"] - r["send"] for r in ok])
    itl = np.array([(r["last"] - r["first"]) / max(r["tokens"] - 1, 1) for r in ok])
    if not ok:
        return {"completed": 0, "errors": len(results), "goodput_rps": 0.0, "slo_fraction": 0.0}
    span = max(r["last"] for r in ok) - min(r["send"] for r in results if "send" in r)
    good = int(np.sum((ttft <= SLO_TTFT_S) & (itl <= SLO_ITL_S)))
    pct = lambda a, q: float(np.percentile(a, q) * 1e3)  # noqa: E731
    return {"completed": len(ok), "errors": len(results) - len(ok),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
            "goodput_rps": good / span, "slo_fraction": good / len(results),
            "tok_per_s": sum(r["tokens"] for r in ok) / span, "span_s": span,
            "error_samples": sorted({r["error"] for r in results if "error" in r})[:3]}


def plot(summary: dict, rates: list[float], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = dict(zip(summary, ("tab:blue", "tab:orange", "tab:green")))
    panels = (("ttft", "TTFT (ms)", SLO_TTFT_S * 1e3),
              ("itl", "ITL, mean per request (ms)", SLO_ITL_S * 1e3))
    for ax, (key, label, slo) in zip(axes, panels):
        for name, per_rate in summary.items():
            for q, style in (("p50", "-o"), ("p99", "--x")):
                ys = [per_rate[str(r)].get(f"{key}_{q}_ms", np.nan) for r in rates]
                ax.plot(rates, ys, style, color=colors[name], label=f"{name} {q}")
        ax.axhline(slo, color="grey", lw=0.8, ls=":", label="SLO")
        ax.set(ylabel=label, yscale="log")
    for name, per_rate in summary.items():
        axes[2].plot(rates, [per_rate[str(r)]["goodput_rps"] for r in rates], "-o",
                     color=colors[name], label=name)
    axes[2].plot(rates, rates, ":", color="grey", label="offered")
    axes[2].set(ylabel="goodput (req/s meeting the SLO)")
    for ax in axes:
        ax.set(xlabel="request rate (req/s)", xscale="log")
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.legend(fontsize=8)
    fig.suptitle(f"{MODEL} on this machine's CPU: SLO TTFT <= {SLO_TTFT_S:.0f} s and "
                 f"ITL <= {SLO_ITL_S * 1e3:.0f} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="0.5,1,2,4,8")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=60)
    p.add_argument("--servers", default="jaxinfer,llamacpp")
    p.add_argument("--rate-time-limit", type=float, default=240.0)
    p.add_argument("--startup-timeout", type=float, default=1200.0)
    p.add_argument("--jaxinfer-args",
                   default="--dtype bfloat16 --max_num_seqs 16 --max_seq_len 512")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--burst", action="store_true")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--slot-context", type=int, default=512)
    p.add_argument("--llama-cpp-dir",
                   default=os.path.expanduser("~/.cache/jaxinfer-bench/llama.cpp"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="default benchmarks/results/serving, with --burst serving_burst")
    args = p.parse_args()
    args.servers = args.servers.split(",")
    args.out = args.out or os.path.join("benchmarks", "results",
                                        "serving_burst" if args.burst else "serving")
    rates = [float(r) for r in args.rates.split(",")]
    os.makedirs(args.out, exist_ok=True)

    from jaxinfer.loading.gguf_file import GGUFFile
    from jaxinfer.loading.hub import resolve_alias
    from jaxinfer.loading.tokenizer import Tokenizer

    gguf = resolve_alias(MODEL)
    f = GGUFFile(gguf)
    tokenizer = Tokenizer.from_gguf_metadata(f.metadata)
    f.close()
    rng = random.Random(args.seed)
    schedule = {r: ([" ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
                     for _ in range(args.num_requests)],
                    [rng.expovariate(r) for _ in range(args.num_requests)]) for r in rates}
    warm = [" ".join(rng.choice(WORDS) for _ in range(args.prompt_words)) for _ in range(2)]

    report = {"config": {k: v for k, v in vars(args).items()}, "slo": {
        "ttft_s": SLO_TTFT_S, "itl_s": SLO_ITL_S, "sustained_fraction": SUSTAINED},
        "results": {}, "startup_s": {}}
    servers = make_servers(args, gguf, list(tokenizer.eos_token_ids), args.out)
    servers = {name: servers[name] for name in args.servers}
    if args.burst:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from throughput import normal_token_ids

        report = {"config": vars(args), "startup_s": {}, "loadavg_start": os.getloadavg(),
                  "env": {k: v for k, v in os.environ.items() if k.startswith("OMP_")}}
        try:
            for name, (server, _) in servers.items():
                report["startup_s"][name] = server.start(args.startup_timeout)
            report.update(burst(args, servers, normal_token_ids(gguf)[0].tolist(), rng))
            report["loadavg_end"] = os.getloadavg()
        finally:
            for server, _ in servers.values():
                server.stop()
        with open(os.path.join(args.out, "RESULTS.json"), "w") as fh:
            json.dump(report, fh, indent=1)
        print(f"wrote {args.out}/RESULTS.json")
        return
    try:
        for name, (server, extra) in servers.items():
            report["startup_s"][name] = server.start(args.startup_timeout)
            asyncio.run(run_rate(server.url, 1.0, warm, [0.0, 0.0], args, extra, tokenizer))
            report["results"][name] = {}
        # Rate by rate, each server in turn (one at a time), so that both meet the same
        # background load on a shared machine.
        for r in rates:
            prompts, gaps = schedule[r]
            for name, (server, extra) in servers.items():
                res = asyncio.run(run_rate(server.url, r, prompts, gaps, args, extra,
                                           tokenizer))
                s_ = report["results"][name][str(r)] = summarize(res)
                print(f"[{name}] {r:g} req/s: " + (
                    f"TTFT p50/p99 {s_['ttft_p50_ms']:.0f}/{s_['ttft_p99_ms']:.0f} ms, ITL "
                    f"p50/p99 {s_['itl_p50_ms']:.0f}/{s_['itl_p99_ms']:.0f} ms, goodput "
                    f"{s_['goodput_rps']:.2f} req/s ({s_['slo_fraction']:.0%} in SLO), "
                    f"{s_['tok_per_s']:.0f} tok/s, {s_['errors']} errors"
                    if s_["completed"] else f"all {s_['errors']} failed"), flush=True)
    finally:
        for server, _ in servers.values():
            server.stop()
    sustained = {name: max([r for r in rates if per[str(r)]["slo_fraction"] >= SUSTAINED],
                           default=0.0) for name, per in report["results"].items()}
    report["sustained_rate"] = sustained
    with open(os.path.join(args.out, "RESULTS.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    if report["results"]:
        plot(report["results"], rates, os.path.join(args.out, "serving.png"))
    print(f"highest rate with >= {SUSTAINED:.0%} of requests in SLO: {sustained}")
    print(f"wrote {args.out}/RESULTS.json and serving.png")


if __name__ == "__main__":
    main()
