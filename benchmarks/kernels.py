"""Pallas attention kernels against their baselines: prefill TFLOP/s and decode HBM bandwidth.

    python benchmarks/kernels.py                  # on the GPU machine (H100 / H200)
    python benchmarks/kernels.py --json           # one JSON object per measured row
    python benchmarks/kernels.py --smoke          # tiny shapes; automatic when the backend is CPU

1. Flash attention (prefill), bf16, causal, B=8, N=32 query heads, K=8 kv heads, H=128,
   T = S in {2048, 8192}: `flash_attention` against `jax.nn.dot_product_attention(...,
   is_causal=True)` with implementation="xla" and "cudnn", all three timed in this one process,
   interleaved run by run (the order rotates every run).
       causal FLOPs = 4 * B * N * T * S * H / 2     (QK^T and PV, 2 FLOPs per MAC, half masked)
   Prints TFLOP/s, flash/cudnn (target >= 0.9) and flash/xla, and the max |flash - xla| so a fast
   but wrong kernel shows. The xla path materialises a float32 [b, N, T, S] score matrix (64 GiB
   at B=8, S=8192), so it runs on the first b rows only, b the largest batch whose score matrix
   fits --xla_score_gib (default 8 GiB: b=8 at S=2048, b=1 at S=8192); TFLOP/s use that b.
   cuDNN may reject a shape or dtype (it needs bf16/f16): it is then reported as unavailable,
   with the reason.
2. Paged attention (decode), bf16, N=32, K=8, H=128, page_size 16, batch in {32, 64, 128},
   context in {1024, 4096, 8192}, lengths = context, each sequence's pages shuffled in the pool.
       bytes = 2 (K and V) * B * context * K * H * 2 (bf16)     achieved = bytes / time
   Prints GB/s and the fraction of the card's bandwidth (H100 3.35e12 B/s, H200 4.8e12, from
   jax.devices()[0].device_kind, or --peak_bw); target >= 0.6. Each config's first rows are checked
   against `paged_attention_reference` (max abs diff).

3. Ragged paged attention (one flat step), bf16, N=32, K=8, H=128, page_size 16, shuffled pages,
   three mixes: "mixed" (4 prefill chunks of 512 tokens ending at context 2048, beside 64 decode
   rows at context 2048: T = 2112), "decode-heavy" (128 decode rows at context 4096 beside one
   256-token chunk ending at 4096: T = 384) and "decode" (64 decode rows at context 4096 alone).
   On each mix, timed interleaved in one process:
     ragged      `ragged_paged_attention` over the flat batch (block sizes from its table);
     ragged:*    the same with a block_q / pages_per_block override (--ragged_variants);
     split       `paged_attention` over the decode rows plus `flash_attention` over the prefill
                 chunks in one jitted call (the two-kernel step this design replaced; flash gets
                 each chunk's keys as a contiguous [C, context, K, H] array gathered beforehand,
                 outside the timing, so the split baseline is favoured);
     reference   `ragged_paged_attention_reference` (jnp, materialises each token's keys).
       bytes = 2 (K and V) * sum_r context_r * K * H * 2 + 2 * T * N * H * 2 (q in, out)
       FLOPs = 4 * N * H * sum over query tokens of the keys it sees
   Prints ms, GB/s, the fraction of the card's bandwidth, TFLOP/s, and max |x - reference| on the
   whole batch (split: its outputs put back in flat order).

Timing: jax.block_until_ready around each sample, after compile and warm-up calls; one sample
dispatches enough back-to-back calls to last >= --min_sample_ms (so launch overhead does not
dominate short decode kernels) and reports time per call; the figure is the median of --runs
samples (default 20, at least 10 off smoke mode).

On CPU the kernels run in Pallas interpret mode on tiny shapes: the columns are the same, but
those timings are NOT performance figures, only proof that the script works end to end. --smoke on
a GPU runs the compiled kernels on the tiny shapes (add --interpret for interpret mode).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import (flash_attention, paged_attention, paged_attention_reference,  # noqa
                            ragged_paged_attention, ragged_paged_attention_reference)

CPU_NOTE = ("CPU / interpret mode: these timings are NOT performance figures; the run only shows "
            "that the benchmark works end to end.")


def peak_bandwidth(kind: str, override: float | None) -> float | None:
    """Card HBM bandwidth in bytes/s from the device kind, or None when unknown."""
    if override:
        return override
    if "H200" in kind:
        return 4.8e12
    if "H100" in kind:
        return 3.35e12
    return None


def time_interleaved(fns: dict, runs: int, min_sample_s: float) -> dict[str, float]:
    """Median seconds per call of each zero-argument callable, sampled interleaved."""
    inner = {}
    for name, f in fns.items():
        jax.block_until_ready(f())                      # compile (already warm for most)
        t = time.perf_counter()
        jax.block_until_ready(f())
        dt = time.perf_counter() - t
        inner[name] = max(1, min(200, math.ceil(min_sample_s / max(dt, 1e-7))))
    samples = {name: [] for name in fns}
    names = list(fns)
    for r in range(runs):
        for name in names[r % len(names):] + names[:r % len(names)]:
            f, n = fns[name], inner[name]
            t = time.perf_counter()
            jax.block_until_ready([f() for _ in range(n)])
            samples[name].append((time.perf_counter() - t) / n)
    return {name: statistics.median(s) for name, s in samples.items()}


def short(e: Exception) -> str:
    msg = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return msg[:140]


def max_diff(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def bench_flash(args, cfg, interpret: bool, emit):
    B, N, K, H = cfg["B"], cfg["N"], cfg["K"], cfg["H"]
    dtype = jnp.bfloat16
    blocks = {"block_q": args.block_q, "block_k": args.block_k}
    flash = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=interpret,
                                                    **blocks))

    def sdpa(impl):
        return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                    implementation=impl))

    for S in cfg["seqs"]:
        T = S
        kq, kk, kv = jax.random.split(jax.random.key(S), 3)
        q = jax.random.normal(kq, (B, T, N, H), dtype)
        k = jax.random.normal(kk, (B, S, K, H), dtype)
        v = jax.random.normal(kv, (B, S, K, H), dtype)
        score_bytes = N * T * S * 4                   # float32 scores per batch row (xla path)
        xb = min(B, int(args.xla_score_gib * 2**30 // score_bytes))
        batch = {"flash": B, "cudnn": B, "xla": xb}
        fns, notes, outs = {}, {}, {}
        for name, f in (("flash", flash), ("cudnn", sdpa("cudnn")), ("xla", sdpa("xla"))):
            b = batch[name]
            if b == 0:
                notes[name] = (f"skipped: batch-1 score matrix {score_bytes / 2**30:.1f} GiB > "
                               f"--xla_score_gib {args.xla_score_gib}")
                continue
            qb, kb, vb = (q, k, v) if b == B else (q[:b], k[:b], v[:b])
            try:
                outs[name] = jax.block_until_ready(f(qb, kb, vb))   # compile + first run
            except Exception as e:  # noqa: BLE001 -- any rejection means "unavailable"
                notes[name] = "unavailable: " + short(e)
                continue
            fns[name] = (lambda f=f, qb=qb, kb=kb, vb=vb: f(qb, kb, vb))
            if b < B:
                notes[name] = f"batch {b} (score matrix memory)"
        diffs = {}
        if "xla" in outs:
            for name in ("flash", "cudnn"):
                if name in outs:
                    diffs[name] = max_diff(outs[name][:xb], outs["xla"])
        outs.clear()
        times = time_interleaved(fns, args.runs, args.min_sample_ms / 1e3) if fns else {}
        tflops = {}
        for name in ("flash", "cudnn", "xla"):
            b = batch[name]
            flops = 4 * b * N * T * S * H / 2
            row = {"bench": "flash_attention", "impl": name, "B": b, "N": N, "K": K, "H": H,
                   "T": T, "S": S, "flops": flops}
            if name in times:
                tflops[name] = flops / times[name] / 1e12
                row.update(ms=times[name] * 1e3, tflops=tflops[name])
            if name in diffs:
                row["max_abs_diff_vs_xla"] = diffs[name]
            if name in notes:
                row["note"] = notes[name]
            emit(row)
        ratios = {"bench": "flash_ratio", "S": S, "target_flash_over_cudnn": 0.9}
        for other in ("cudnn", "xla"):
            if "flash" in tflops and other in tflops:
                ratios[f"flash_over_{other}"] = tflops["flash"] / tflops[other]
        emit(ratios)
        del q, k, v


def bench_paged(args, cfg, interpret: bool, peak: float | None, emit):
    N, K, H, page = cfg["N"], cfg["K"], cfg["H"], cfg["page_size"]
    dtype = jnp.bfloat16
    rng = np.random.default_rng(0)
    kernel = jax.jit(lambda *a: paged_attention(*a, interpret=interpret,
                                                pages_per_block=args.pages_per_block))
    for ctx in cfg["contexts"]:
        for B in cfg["batches"]:
            pages_per_seq = -(-ctx // page)
            P = B * pages_per_seq
            kq, kk, kv = jax.random.split(jax.random.key(B * 100003 + ctx), 3)
            q = jax.random.normal(kq, (B, N, H), dtype)
            k_pages = jax.random.normal(kk, (P, page, K, H), dtype)
            v_pages = jax.random.normal(kv, (P, page, K, H), dtype)
            tables = jnp.asarray(rng.permutation(P).astype(np.int32).reshape(B, pages_per_seq))
            lengths = jnp.full((B,), ctx, jnp.int32)
            row = {"bench": "paged_attention", "B": B, "context": ctx, "N": N, "K": K, "H": H,
                   "page_size": page}
            try:
                row.update(measure_paged(args, kernel, q, k_pages, v_pages, lengths, tables))
            except Exception as e:  # noqa: BLE001 -- report and go on with the other configs
                row["note"] = "failed: " + short(e)
            del q, k_pages, v_pages, tables                # free the pool before the next one
            if "ms" in row:
                nbytes = 2 * B * ctx * K * H * 2
                t = row["ms"] / 1e3
                row.update(bytes=nbytes, GBps=nbytes / t / 1e9)
                if peak:
                    row.update(peak_Bps=peak, fraction_of_peak=nbytes / t / peak, target=0.6)
                    if nbytes / t / peak < 0.6:
                        row["note"] = "below target"
            emit(row)


def measure_paged(args, kernel, q, k_pages, v_pages, lengths, tables) -> dict:
    nb = min(q.shape[0], 4)                                # correctness on the first rows
    sub = (q[:nb], k_pages, v_pages, lengths[:nb], tables[:nb])
    diff = max_diff(kernel(*sub), paged_attention_reference(*sub))
    full = (q, k_pages, v_pages, lengths, tables)
    t = time_interleaved({"paged": lambda: kernel(*full)}, args.runs, args.min_sample_ms / 1e3)
    return {"max_abs_diff_vs_ref": diff, "ms": t["paged"] * 1e3}


RAGGED_MIXES = {
    # name: (list of (query tokens, context) per prefill chunk, decode rows, decode context)
    "full": {"mixed": ([(512, 2048)] * 4, 64, 2048),
             "decode-heavy": ([(256, 4096)], 128, 4096),
             "decode": ([], 64, 4096)},
    "smoke": {"mixed": ([(16, 48), (16, 24)], 4, 40),
              "decode": ([], 4, 40)},
}


def ragged_batch(chunks, decode_rows, decode_ctx, page, rng):
    """Flat-batch metadata of one mix: prefill chunks first, then decode rows; every row's pages
    drawn at random from one shuffled pool."""
    rows = list(chunks) + [(1, decode_ctx)] * decode_rows
    num_queries = np.array([n for n, _ in rows], np.int32)
    kv_lengths = np.array([c for _, c in rows], np.int32)
    query_start = np.concatenate([[0], np.cumsum(num_queries)[:-1]]).astype(np.int32)
    pages = -(-kv_lengths // page)
    max_pages = int(pages.max())
    perm = rng.permutation(int(pages.sum())).astype(np.int32)
    tables = np.zeros((len(rows), max_pages), np.int32)
    at = 0
    for r, n in enumerate(pages):
        tables[r, :n] = perm[at:at + n]
        at += n
    return dict(num_queries=num_queries, kv_lengths=kv_lengths, query_start=query_start,
                tables=tables, num_pages=int(pages.sum()), T=int(num_queries.sum()))


def ragged_variants(spec: str) -> dict[str, dict]:
    """"bq64,ppb8" -> {"ragged:bq64": {"block_q": 64}, "ragged:ppb8": {"pages_per_block": 8}}."""
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        m = {"bq": "block_q", "ppb": "pages_per_block"}
        key = next((k for k in m if item.startswith(k) and item[len(k):].isdigit()), None)
        if key is None:
            raise SystemExit(f"--ragged_variants: {item!r} is not bq<N> or ppb<N>")
        out["ragged:" + item] = {m[key]: int(item[len(key):])}
    return out


def bench_ragged(args, cfg, interpret: bool, peak: float | None, emit):
    N, K, H, page = cfg["N"], cfg["K"], cfg["H"], cfg["page_size"]
    dtype = jnp.bfloat16
    rng = np.random.default_rng(1)
    variants = {"ragged": {}, **ragged_variants(args.ragged_variants)}
    for mix, (chunks, decode_rows, decode_ctx) in cfg["mixes"].items():
        b = ragged_batch(chunks, decode_rows, decode_ctx, page, rng)
        T, C = b["T"], len(chunks)
        kq, kk, kv = jax.random.split(jax.random.key(T), 3)
        q = jax.random.normal(kq, (T, N, H), dtype)
        k_pages = jax.random.normal(kk, (b["num_pages"], page, K, H), dtype)
        v_pages = jax.random.normal(kv, (b["num_pages"], page, K, H), dtype)
        meta = [jnp.asarray(b[n]) for n in ("kv_lengths", "tables", "query_start", "num_queries")]
        kv_len, tables, qstart, nq = meta
        fns = {}
        for name, over in variants.items():
            f = jax.jit(lambda *a, over=over: ragged_paged_attention(*a, interpret=interpret,
                                                                     **over))
            fns[name] = (lambda f=f: f(q, k_pages, v_pages, kv_len, tables, qstart, nq))
        ref = jax.jit(ragged_paged_attention_reference)
        fns["reference"] = lambda: ref(q, k_pages, v_pages, kv_len, tables, qstart, nq)

        # The split baseline: decode rows through paged_attention, chunks through flash.
        dq = q[T - decode_rows:]
        dtab, dlen = tables[C:], kv_len[C:]
        split_args = [dq, dtab, dlen]
        if C:
            width = max(c for _, c in chunks)
            if any(n != chunks[0][0] for n, _ in chunks):
                raise SystemExit("the split baseline needs chunks of equal query length")
            n0 = chunks[0][0]
            cq = q[:C * n0].reshape(C, n0, N, H)
            ctab = tables[:C, :-(-width // page)]
            ck = k_pages[ctab].reshape(C, -1, K, H)[:, :width]
            cv = v_pages[ctab].reshape(C, -1, K, H)[:, :width]
            coff = jnp.asarray([c - n for n, c in chunks], jnp.int32)
            clen = jnp.asarray([c for _, c in chunks], jnp.int32)
            split_args += [cq, ck, cv, coff, clen]

        @jax.jit
        def split(k_pages, v_pages, dq, dtab, dlen, *chunk):
            parts = []
            if chunk:
                cq, ck, cv, coff, clen = chunk
                parts.append(flash_attention(cq, ck, cv, causal=True, q_offset=coff,
                                             kv_lengths=clen,
                                             interpret=interpret).reshape(-1, N, H))
            if dq.shape[0]:
                parts.append(paged_attention(dq, k_pages, v_pages, dlen, dtab,
                                             interpret=interpret))
            return jnp.concatenate(parts)
        fns["split"] = lambda: split(k_pages, v_pages, *split_args)

        outs, notes = {}, {}
        for name in list(fns):
            try:
                outs[name] = jax.block_until_ready(fns[name]())
            except Exception as e:  # noqa: BLE001 -- report and time the others
                notes[name] = "failed: " + short(e)
                del fns[name]
        times = time_interleaved(fns, args.runs, args.min_sample_ms / 1e3) if fns else {}
        nbytes = 2 * int(b["kv_lengths"].sum()) * K * H * 2 + 2 * T * N * H * 2
        seen = sum(int(sum(c - n + 1 + i for i in range(n))) for n, c in
                   zip(b["num_queries"], b["kv_lengths"]))
        flops = 4 * N * H * seen
        for name in list(variants) + ["split", "reference"]:
            row = {"bench": "ragged_paged_attention", "mix": mix, "impl": name, "T": T,
                   "rows": len(b["num_queries"]), "chunks": C, "N": N, "K": K, "H": H,
                   "page_size": page, "bytes": nbytes, "flops": flops}
            if name in times:
                t = times[name]
                row.update(ms=t * 1e3, GBps=nbytes / t / 1e9, tflops=flops / t / 1e12)
                if peak:
                    row["fraction_of_peak"] = nbytes / t / peak
            if name in outs and "reference" in outs and name != "reference":
                row["max_abs_diff_vs_ref"] = max_diff(outs[name], outs["reference"])
            if name in notes:
                row["note"] = notes[name]
            emit(row)
        del q, k_pages, v_pages, outs, split_args, fns


def printer(as_json: bool, peak: float | None):
    def f(x, fmt, missing="-"):
        return missing if x is None else format(x, fmt)

    def emit(row):
        if as_json:
            print(json.dumps(row), flush=True)
            return
        b = row["bench"]
        if b == "flash_attention":
            print(f"{row['S']:>6} {row['impl']:>6} {row['B']:>3} {f(row.get('ms'), '10.3f'):>10} "
                  f"{f(row.get('tflops'), '8.4g'):>8} "
                  f"{f(row.get('max_abs_diff_vs_xla'), '11.2e'):>11}  {row.get('note', '')}",
                  flush=True)
        elif b == "flash_ratio":
            r = row.get("flash_over_cudnn")
            verdict = "" if r is None else (", meets target" if r >= 0.9 else ", BELOW target")
            print(f"{'':>6} flash/cudnn {f(r, '.2f', 'n/a')} (target >= 0.9{verdict}), "
                  f"flash/xla {f(row.get('flash_over_xla'), '.2f', 'n/a')}"
                  " (xla TFLOP/s at its own batch)", flush=True)
        elif b == "ragged_paged_attention":
            frac = row.get("fraction_of_peak")
            print(f"{row['mix']:>12} {row['impl']:>12} {row['T']:>5} {f(row.get('ms'), '9.4f'):>9} "
                  f"{f(row.get('GBps'), '8.4g'):>8} "
                  f"{f(frac, '6.2f', 'n/a' if not peak else '-'):>6} "
                  f"{f(row.get('tflops'), '7.3g'):>7} "
                  f"{f(row.get('max_abs_diff_vs_ref'), '11.2e'):>11}  {row.get('note', '')}",
                  flush=True)
        else:
            frac = row.get("fraction_of_peak")
            print(f"{row['B']:>5} {row['context']:>7} {f(row.get('ms'), '10.4f'):>10} "
                  f"{f(row.get('GBps'), '9.4g'):>9} "
                  f"{f(frac, '6.2f', 'n/a' if not peak else '-'):>6} "
                  f"{f(row.get('max_abs_diff_vs_ref'), '11.2e'):>11}  {row.get('note', '')}",
                  flush=True)
    return emit


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true",
                    help="one JSON object per line (config, each measured row) instead of tables")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (automatic on CPU)")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU: always)")
    ap.add_argument("--runs", type=int, default=None, help="samples per median (default 20; 3 "
                    "in smoke mode)")
    ap.add_argument("--min_sample_ms", type=float, default=20.0,
                    help="one sample repeats the call until it lasts about this long")
    ap.add_argument("--only", choices=("flash", "paged", "ragged"), default=None)
    ap.add_argument("--peak_bw", type=float, default=None, help="card bandwidth in bytes/s")
    ap.add_argument("--xla_score_gib", type=float, default=8.0,
                    help="cap on the xla path's float32 score matrix; sets its batch")
    ap.add_argument("--block_q", type=int, default=None, help="flash block_q override")
    ap.add_argument("--block_k", type=int, default=None, help="flash block_k override")
    ap.add_argument("--pages_per_block", type=int, default=None, help="paged override")
    ap.add_argument("--ragged_variants", default="bq32,bq64,ppb8",
                    help="extra ragged runs with overrides: bq<N> block_q, ppb<N> pages_per_block")
    args = ap.parse_args()

    backend = jax.default_backend()
    smoke = args.smoke or backend == "cpu"
    interpret = args.interpret or backend == "cpu"
    if args.runs is None:
        args.runs = 3 if smoke else 20
    if not smoke and args.runs < 10:
        ap.error("--runs must be >= 10 outside smoke mode")
    if smoke:
        args.min_sample_ms = min(args.min_sample_ms, 1.0)
        flash_cfg = dict(B=2, N=4, K=2, H=64, seqs=(64, 128))
        paged_cfg = dict(N=4, K=2, H=64, page_size=16, batches=(2, 4), contexts=(32, 80))
        ragged_cfg = dict(N=4, K=2, H=64, page_size=16, mixes=RAGGED_MIXES["smoke"])
    else:
        flash_cfg = dict(B=8, N=32, K=8, H=128, seqs=(2048, 8192))
        paged_cfg = dict(N=32, K=8, H=128, page_size=16, batches=(32, 64, 128),
                         contexts=(1024, 4096, 8192))
        ragged_cfg = dict(N=32, K=8, H=128, page_size=16, mixes=RAGGED_MIXES["full"])
    dev = jax.devices()[0]
    peak = peak_bandwidth(dev.device_kind, args.peak_bw)
    emit = printer(args.json, peak)
    header = {"bench": "config", "backend": backend, "device_kind": dev.device_kind,
              "jax": jax.__version__, "smoke": smoke, "interpret": interpret, "runs": args.runs,
              "peak_Bps": peak}
    if interpret:
        header["note"] = CPU_NOTE
    if args.json:
        print(json.dumps(header), flush=True)
    else:
        print(f"backend {backend} ({dev.device_kind}), jax {jax.__version__}, "
              f"{'SMOKE (tiny shapes)' if smoke else 'full shapes'}, interpret={interpret}, "
              f"median of {args.runs}")
        if interpret:
            print("NOTE: " + CPU_NOTE)
    t0 = time.perf_counter()
    if args.only in (None, "flash"):
        c = flash_cfg
        if not args.json:
            print(f"\nflash attention, bf16, causal, N={c['N']} K={c['K']} H={c['H']}, T = S; "
                  "TFLOP/s = 4*B*N*T*S*H/2 / time")
            print(f"{'S':>6} {'impl':>6} {'B':>3} {'ms':>10} {'TFLOP/s':>8} "
                  f"{'maxdiff/xla':>11}  note")
        bench_flash(args, c, interpret, emit)
    if args.only in (None, "paged"):
        c = paged_cfg
        if not args.json:
            bw = f"peak {peak / 1e9:.0f} GB/s" if peak else "peak unknown: GB/s only"
            print(f"\npaged decode attention, bf16, N={c['N']} K={c['K']} H={c['H']}, page_size "
                  f"{c['page_size']}, shuffled pages; GB/s = 2*B*ctx*K*H*2 bytes / time; {bw}; "
                  "target fraction >= 0.6")
            print(f"{'B':>5} {'context':>7} {'ms':>10} {'GB/s':>9} {'frac':>6} "
                  f"{'maxdiff/ref':>11}  note")
        bench_paged(args, c, interpret, peak, emit)
    if args.only in (None, "ragged"):
        c = ragged_cfg
        if not args.json:
            print(f"\nragged paged attention (one flat step), bf16, N={c['N']} K={c['K']} "
                  f"H={c['H']}, page_size {c['page_size']}, shuffled pages; GB/s = (2*sum ctx*K*H"
                  "*2 + 2*T*N*H*2) bytes / time; TFLOP/s = 4*N*H*(keys seen) / time")
            print(f"{'mix':>12} {'impl':>12} {'T':>5} {'ms':>9} {'GB/s':>8} {'frac':>6} "
                  f"{'TFLOP/s':>7} {'maxdiff/ref':>11}  note")
        bench_ragged(args, c, interpret, peak, emit)
    if not args.json:
        print(f"\ndone in {time.perf_counter() - t0:.1f} s" +
              (f". {CPU_NOTE}" if interpret else ""))


if __name__ == "__main__":
    main()
