"""Batch-1 decode and 512-token prefill throughput against the weight-bandwidth roofline.

    python benchmarks/decode.py [--model smollm2-135m] [--dtype D] [--kv_cache_dtype int8]
                                [--runs 5] [--decode_tokens 128] [--page_size N]
                                [--rows 16] [--context_min 128] [--context_max 384]
                                [--generated 0] [--ablate_attention]

Prints, all measured in this one process, interleaved run by run so that machine noise hits
them alike:
  * read bandwidth: a jitted jnp.sum over a 1 GiB float32 array;
  * decode tokens/s at batch 1 (ignore_eos, tokens after the first);
  * prefill tokens/s for a 512-token prompt;
  * roofline = bandwidth / weight bytes read per decode token; fraction = decode / roofline,
    per run, and the median of those;
  * a --rows-row decode step against the bare matmul stack of the same model for as many rows:
    --rows requests with prompts of --context_min..--context_max tokens (seeded) are prefilled,
    and decode --generated tokens each untimed (their pages taken step by step, as a long
    output's are), then each run times one engine step (LLM.step(): a dispatch of
    decode_steps decode steps for every row, host booking included) and one call of a jitted
    loop of decode_steps iterations of the model's linears alone (q, k, v, o, gate, up, down
    per layer and the head, through the same quantization-aware `linear`, no norms, RoPE,
    attention or sampling). Both per step; the ratio step / stack per run, and its median;
  * the keys and values the --rows-row step reads (each row's context, averaged over a
    run's steps, times the bytes a key and value take in every layer's pool), that read
    timed at the read bandwidth sampled beside each run, and (stack + that time) / stack:
    the step / stack ratio of a step that did nothing but its matmuls and one read of its
    cache at the bandwidth jnp.sum reaches, a floor for the measured ratio;
  * with --ablate_attention, the same comparison again with the attention (the jnp path and
    the native decode kernel) replaced by zeros (the step's cost beyond its matmuls apart from
    attention).
On CPU the engine and the stack use the native CPU kernels where they are built
(docs/cpu_kernels.md: batch-1 bf16 products, decode attention); JAXINFER_CPU_KERNELS=0 measures
XLA's code alone.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


class Bandwidth:
    """Read bandwidth of a jitted jnp.sum over a `gib` GiB float32 array, one sample per call."""

    def __init__(self, gib: float = 1.0):
        self.n = int(gib * (1 << 30) // 4)
        self.x = jnp.ones((self.n,), jnp.float32)
        self.f = jax.jit(jnp.sum)
        self.f(self.x).block_until_ready()

    def sample(self) -> float:
        t = time.perf_counter()
        self.f(self.x).block_until_ready()
        return self.n * 4 / (time.perf_counter() - t)


def weight_bytes(params) -> int:
    # Every weight is read once per decode step; the tied head reads the whole embedding.
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(params))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default=None, help="LLM's dtype (default: its own default)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--decode_tokens", type=int, default=128)
    ap.add_argument("--prefill_tokens", type=int, default=512)
    ap.add_argument("--rows", type=int, default=16, help="rows of the batched decode step "
                    "compared with the matmul stack (0: skip)")
    ap.add_argument("--context_min", type=int, default=128)
    ap.add_argument("--context_max", type=int, default=384)
    ap.add_argument("--generated", type=int, default=0,
                    help="tokens each of the --rows rows decodes before the timed runs")
    ap.add_argument("--kv_cache_dtype", default=None,
                    help="the LLMs' KV cache dtype (default: the model's dtype)")
    ap.add_argument("--page_size", type=int, default=None,
                    help="the LLMs' KV page size (default: the LLM's default)")
    ap.add_argument("--ablate_attention", action="store_true",
                    help="also time the --rows-row step with attention replaced by zeros")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of text")
    args = ap.parse_args()
    if args.rows:
        check_generated(args)

    import jaxinfer as ji

    llm = ji.LLM(args.model, max_num_seqs=1, max_seq_len=1024, **llm_kwargs(args))
    wbytes = weight_bytes(llm.params)  # as placed
    rng = np.random.default_rng(0)
    prefill_prompt = rng.integers(100, llm.model_config.vocab_size, args.prefill_tokens).tolist()
    llm.generate([prefill_prompt], ji.SamplingParams(max_tokens=2))  # compile
    decode_params = ji.SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
    llm.generate("The history of", decode_params)  # compile

    bandwidth = Bandwidth()
    decode_tps, prefill_tps, bws = [], [], []
    for _ in range(args.runs):
        bws.append(bandwidth.sample())
        out = llm.generate("The history of", decode_params)[0]
        decode_tps.append(out.metrics.decode_tokens_per_s)
        # A new prompt each run: a repeated one would be served from the prefix cache.
        prompt = rng.integers(100, llm.model_config.vocab_size, args.prefill_tokens).tolist()
        out = llm.generate([prompt], ji.SamplingParams(max_tokens=1))[0]
        prefill_tps.append(args.prefill_tokens / out.metrics.ttft_s)
        bws.append(bandwidth.sample())
    # Each run's fraction uses the bandwidth sampled just before and after it.
    fractions = [d * wbytes / statistics.mean(bws[2 * i:2 * i + 2])
                 for i, d in enumerate(decode_tps)]
    bw = statistics.median(bws)
    decode = statistics.median(decode_tps)
    roofline = bw / wbytes
    result = {
        "backend": jax.default_backend(), "dtype": llm.dtype,
        "kv_cache_dtype": args.kv_cache_dtype or llm.dtype,
        "weight_bytes": wbytes, "read_bandwidth_GBps": bw / 1e9,
        "decode_tokens_per_s": decode, "decode_runs": decode_tps,
        "prefill_tokens_per_s": statistics.median(prefill_tps),
        "roofline_tokens_per_s": roofline,
        "fraction_of_roofline": statistics.median(fractions), "fraction_runs": fractions,
    }
    del llm
    if args.rows:
        result.update(batch_step_vs_matmuls(args))
    if args.rows and args.ablate_attention:
        ablated = step_without_attention(args)
        result.update(ablated_step_ms=ablated["batch_step_ms"],
                      ablated_stack_ms=ablated["matmul_stack_ms"],
                      ablated_step_over_stack=ablated["step_over_stack"])
    if args.json:
        print(json.dumps(result))
        return
    print(f"backend {result['backend']}, dtype {result['dtype']}, "
          f"KV cache {result['kv_cache_dtype']}, "
          f"weights {wbytes / 1e6:.1f} MB read per decode token")
    print(f"read bandwidth        {bw / 1e9:8.2f} GB/s (jnp.sum over 1 GiB, median of "
          f"{len(bws)})")
    print(f"decode (batch 1)      {decode:8.2f} tokens/s (median of {args.runs}: "
          f"{', '.join(f'{x:.1f}' for x in decode_tps)})")
    print(f"prefill (512 tokens)  {result['prefill_tokens_per_s']:8.1f} tokens/s")
    print(f"roofline              {roofline:8.2f} tokens/s (bandwidth / weight bytes)")
    print(f"fraction of roofline  {result['fraction_of_roofline']:8.2f} (median of per-run "
          f"fractions: {', '.join(f'{x:.2f}' for x in fractions)})")
    if args.rows:
        print(f"{args.rows}-row decode step  {result['batch_step_ms']:8.2f} ms (median; "
              f"contexts {args.context_min}-{args.context_max} tokens"
              f"{f' + {args.generated} generated' if args.generated else ''})")
        print(f"{args.rows}-row matmul stack {result['matmul_stack_ms']:8.2f} ms (median)")
        print(f"step / matmul stack   {result['step_over_stack']:8.2f} (median of per-run "
              f"ratios: {', '.join(f'{x:.2f}' for x in result['step_over_stack_runs'])})")
        print(f"KV read per step      {result['kv_read_MB_per_step']:8.1f} MB (median); "
              f"(stack + that read at the read bandwidth) / stack "
              f"{result['stack_plus_kv_read_over_stack']:.2f} (median)")
    if args.rows and args.ablate_attention:
        print(f"without attention     {result['ablated_step_over_stack']:8.2f} (step / matmul "
              f"stack, median; {result['ablated_step_ms']:.2f} against "
              f"{result['ablated_stack_ms']:.2f} ms)")


def matmul_stack(params, x, *, num_steps: int, architecture: str = "llama", backend=None):
    """num_steps iterations of the model's linears over x [R, D] (see the module docstring):
    each layer's q, k, v, o, gate, up and down (a llama-style layer's), then the family's
    head; chained so none is dead code. backend: the LLM's (its products)."""
    import functools

    from jaxinfer import layers
    from jaxinfer.models import get_model
    head = get_model(architecture).head
    linear = functools.partial(layers.linear, backend=backend)

    def body(_, x):
        for lp in params.layers:
            q = linear(x, lp.wq)
            kv = linear(x, lp.wk) + linear(x, lp.wv)
            o = q + jnp.tile(kv, q.shape[-1] // kv.shape[-1])
            x = x + linear(o, lp.wo)
            x = x + linear(jax.nn.silu(linear(x, lp.w_gate)) * linear(x, lp.w_up), lp.w_down)
        logits = head(params, x, backend)
        return x + 1e-6 * logits[:, :x.shape[-1]]
    return jax.lax.fori_loop(0, num_steps, body, x)


def llm_kwargs(args) -> dict:
    kw = dict(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
    if args.page_size is not None:
        kw["page_size"] = args.page_size
    return kw


def check_generated(args) -> None:
    """--generated must leave its rows room (2048 tokens each at the LLM's defaults) for the
    timed runs' dispatches."""
    from jaxinfer.config import EngineConfig

    steps = EngineConfig.decode_steps
    room = 2048 - args.context_max - 1 - (args.runs + 2) * steps
    if not 0 <= args.generated <= room:
        raise SystemExit(f"--generated {args.generated}: must be in [0, {room}] (2048-token rows "
                         f"holding prompts of up to --context_max {args.context_max} tokens and "
                         f"{args.runs + 2} more dispatches of {steps} steps)")


def batch_step_vs_matmuls(args) -> dict:
    import jaxinfer as ji
    from jaxinfer.backends import tuning

    R = args.rows
    check_generated(args)
    llm = ji.LLM(args.model, max_num_seqs=R, **llm_kwargs(args))
    steps = llm.engine_config.decode_steps
    rng = np.random.default_rng(1)
    V = llm.model_config.vocab_size
    waiting = {llm.add_request(rng.integers(100, V, int(n)).tolist(),
                               ji.SamplingParams(max_tokens=2048 - args.context_max - 1,
                                                 ignore_eos=True))
               for n in rng.integers(args.context_min, args.context_max + 1, R)}
    # Admission and prefill (and their compilation): a request whose prompt is prefilled has
    # sampled its first token.
    while waiting:
        waiting -= {out.request_id for out in llm.step() if out.token_ids}
    llm.step()      # compiles the R-row decode loop
    generated = 0
    while generated < args.generated:
        generated = min((len(out.token_ids) for out in llm.step()), default=generated)
    stack = tuning.loop_jit(functools.partial(matmul_stack,
                                              architecture=llm.model_config.architecture,
                                              backend=llm.backend),
                            static_argnames="num_steps")
    x = jnp.asarray(rng.standard_normal((R, llm.model_config.d_model)), jnp.float32) * 0.01
    params = llm.params  # the LLM's weights as placed
    stack(params, x, num_steps=steps).block_until_ready()
    per_key = kv_bytes_per_key(llm.model_config, llm._engine.kv_dtype)
    bandwidth = Bandwidth()
    lengths = {}  # request -> tokens in its cache after the last step (prompt + generated)

    def step_lengths():
        for out in llm.step():
            lengths[out.request_id] = len(out.prompt_token_ids) + len(out.token_ids)
        return sum(lengths.values())

    total = step_lengths()
    step_ms, stack_ms, kv_mb, floors = [], [], [], []
    for _ in range(args.runs):
        bw = bandwidth.sample()
        t = time.perf_counter()
        after = step_lengths()
        step_ms.append((time.perf_counter() - t) * 1e3 / steps)
        t = time.perf_counter()
        stack(params, x, num_steps=steps).block_until_ready()
        stack_ms.append((time.perf_counter() - t) * 1e3 / steps)
        # Step s of the run reads every row's keys up to its new token: on average the rows'
        # contexts midway between the run's start and end.
        kv = (total + after) / 2 * per_key
        total = after
        bw = (bw + bandwidth.sample()) / 2
        kv_mb.append(kv / 1e6)
        floors.append((stack_ms[-1] + kv / bw * 1e3) / stack_ms[-1])
    ratios = [a / b for a, b in zip(step_ms, stack_ms)]
    return {"rows": R, "batch_step_ms": statistics.median(step_ms),
            "matmul_stack_ms": statistics.median(stack_ms),
            "step_over_stack": statistics.median(ratios), "step_over_stack_runs": ratios,
            "kv_read_MB_per_step": statistics.median(kv_mb),
            "stack_plus_kv_read_over_stack": statistics.median(floors)}


def kv_bytes_per_key(cfg, kv_dtype) -> int:
    """Bytes one token's keys and values take over every layer's pool: K * H elements each
    (and a float32 scale per kv head for int8 / fp8 codes)."""
    from jaxinfer.device.kv_cache import KV_MAX

    dtype = jnp.dtype(kv_dtype)
    per_head = cfg.head_dim * dtype.itemsize + (4 if dtype in KV_MAX else 0)
    return 2 * cfg.num_layers * cfg.num_kv_heads * per_head


def step_without_attention(args) -> dict:
    """batch_step_vs_matmuls with the CPU's attention replaced by zeros: what the rest of the
    step (norms, RoPE, cache writes, sampling, host booking) costs beyond the matmuls. Both
    CPU paths are replaced: the jnp attention, and the native decode kernel that writes the
    step's keys and values and attends in one call (docs/cpu_kernels.md), whose writes then go
    through XLA's scatter. Compiled programs are dropped first, so the step is traced again with
    the replacement, and again after it is undone; the programs cache is off meanwhile (its key
    is the code as written, so it would hand back the step with attention)."""
    import os

    from jaxinfer import backends
    from jaxinfer.backends import attention

    if backends.default().attention != "reference":
        raise SystemExit("--ablate_attention replaces the jnp attention, which this platform "
                         "does not use by default")
    real, real_fused = attention.paged_loop_attention, attention._native_write_and_attend
    cache_setting = os.environ.get("JAXINFER_PROGRAM_CACHE")
    jax.clear_caches()
    attention.paged_loop_attention = lambda backend, q, *a, **kw: jnp.zeros_like(q)
    # The caller writes, then attends (zeros).
    attention._native_write_and_attend = lambda *a, **kw: None
    os.environ["JAXINFER_PROGRAM_CACHE"] = "0"
    try:
        return batch_step_vs_matmuls(args)
    finally:
        attention.paged_loop_attention, attention._native_write_and_attend = real, real_fused
        if cache_setting is None:
            del os.environ["JAXINFER_PROGRAM_CACHE"]
        else:
            os.environ["JAXINFER_PROGRAM_CACHE"] = cache_setting
        jax.clear_caches()


if __name__ == "__main__":
    main()
