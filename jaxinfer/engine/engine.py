"""The host-side engine: requests in slots of a KV cache (paged, or a ring for sliding-window
models), driven step by step.

Host code only: it decides which rows prefill or decode, pads inputs in numpy to bucketed shapes,
and turns device outputs into RequestOutputs. All device math is in jaxinfer.decode.

A step: (1) admit waiting requests into free slots, (2) if any row is prefilling, run one
prefill chunk for all of them, (3) run one decode dispatch (several steps in a while_loop) for the
rows that are decoding. Finished rows free their slot for the next waiting request.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Optional

import jax
import numpy as np

from jaxinfer import decode
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.paged import PagedSlots
from jaxinfer.engine.request import RequestMetrics, RequestOutput, SamplingParams
from jaxinfer.engine.textstream import TextStream
from jaxinfer.kv_cache import PagedKVCache
from jaxinfer.sampling import SamplingArrays

MAX_STOP_IDS = 8


def _buckets(limit: int, base: int, factor: int) -> tuple[int, ...]:
    out, b = [], base
    while b < limit:
        out.append(b)
        b *= factor
    return tuple(out) + (limit,)


def _pick(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    return buckets[-1]


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: Optional[str]
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_new: int
    stream: TextStream
    metrics: RequestMetrics
    slot: Optional[int] = None
    prefill_ids: list[int] = dataclasses.field(default_factory=list)  # prompt (+ recomputed)
    prefilled: int = 0         # tokens of prefill_ids in the cache
    admitted_order: int = -1   # admission counter: the newest running request is preempted first
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    logprobs: Optional[list] = None         # per generated token {token_id: logprob}
    prompt_logprobs: Optional[list] = None  # per prompt token (the first is None)

    def __post_init__(self):
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    def output(self) -> RequestOutput:
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=list(self.prompt_ids), text=self.stream.text,
                             token_ids=list(self.token_ids), finish_reason=self.finish_reason,
                             metrics=self.metrics,
                             logprobs=None if self.logprobs is None else list(self.logprobs),
                             prompt_logprobs=None if self.prompt_logprobs is None
                             else list(self.prompt_logprobs))


def _logprob_dict(k: int, ids, values, token: int, chosen: float) -> dict[int, float]:
    """The top k entries plus the token itself, as vLLM reports them."""
    out = {int(i): float(v) for i, v in zip(ids[:k], values[:k])}
    out[int(token)] = float(chosen)
    return out


class Engine:
    """Continuous batching over max_num_seqs slots of a paged (or ring) KV cache."""

    def __init__(self, cfg: ModelConfig, params, tokenizer, engine_cfg: EngineConfig,
                 capacity: int, dtype, paged: Optional[PagedSlots] = None,
                 num_pages: int = 0):
        self.cfg = cfg
        self.params = params
        self.tokenizer = tokenizer
        self.ecfg = engine_cfg
        self.capacity = capacity
        self.dtype = dtype
        B = engine_cfg.max_num_seqs
        self.batch_buckets = _buckets(B, 1, 4)
        self.chunk_buckets = _buckets(engine_cfg.prefill_chunk, min(16, engine_cfg.prefill_chunk), 8)
        self.paged = paged
        self.num_pages = num_pages
        if paged is not None:
            capacity = paged.table_width * paged.page_size
            self.capacity = capacity
        # kv_view buckets; a paged view must be whole pages.
        unit = paged.page_size if paged is not None else 1
        self.kv_buckets = tuple(sorted({-(-b // unit) * unit for b in
                                        _buckets(capacity, min(256, capacity), 4)}))
        self.admissions = 0
        self.waiting: collections.deque[Request] = collections.deque()
        self.slots: list[Optional[Request]] = []
        self.state: Optional[decode.DecodeState] = None
        self.eos_ids = tuple(getattr(tokenizer, "eos_token_ids", None) or
                             ([cfg.eos_token_id] if cfg.eos_token_id is not None else []))
        self.stats_counters = collections.Counter()
        self.start_time = time.perf_counter()

    # ---- requests ----------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request_id: str) -> Optional[Request]:
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                return self._finish(req, "abort")
        for req in self.slots:
            if req is not None and req.request_id == request_id:
                return self._finish(req, "abort")
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.slots)

    def _finish(self, req: Request, reason: str) -> Request:
        if self.paged is not None:
            self.paged.release(req)
        req.finish_reason = reason
        req.stream.finish()
        req.metrics.finished_time = time.perf_counter()
        if req.slot is not None and req.slot < len(self.slots) and self.slots[req.slot] is req:
            self.slots[req.slot] = None
        self.stats_counters["finished"] += 1
        return req

    # ---- device state ------------------------------------------------------------------------

    def _ensure_batch(self) -> None:
        """Sizes the slot batch for what is running and waiting (bucketed), keeping the state
        while running rows exist. A paged cache keeps its page pool (and so its prefix cache)."""
        running = sum(r is not None for r in self.slots)
        want = _pick(self.batch_buckets, running + len(self.waiting))
        if self.state is not None and (want == len(self.slots) or running):
            return
        self.state = self._new_state(want)
        self.slots = [None] * want

    def _new_state(self, B: int) -> decode.DecodeState:
        """A state for B slots. A paged cache keeps the previous state's page pool (pages still
        hold prefix-cache entries); only the per-row parts are new."""
        if self.paged is None:
            return decode.DecodeState.create(self.cfg, B, self.capacity, self.dtype)
        if self.state is not None:
            k, v = self.state.cache.k, self.state.cache.v
        else:
            shape = (self.cfg.num_layers, self.num_pages * self.paged.page_size,
                     self.cfg.num_kv_heads, self.cfg.head_dim)
            k, v = jax.numpy.zeros(shape, self.dtype), jax.numpy.zeros(shape, self.dtype)
        self.paged.resize(B)
        cache = PagedKVCache(k=k, v=v,
                             block_tables=np.zeros((B, self.paged.table_width), np.int32),
                             lengths=np.zeros(B, np.int32), page_size=self.paged.page_size)
        return decode.DecodeState.create(self.cfg, B, self.capacity, self.dtype, cache=cache)

    def _row_params(self, decoding: np.ndarray) -> decode.RowParams:
        B = len(self.slots)
        temp = np.zeros(B, np.float32)
        top_k = np.zeros(B, np.int32)
        top_p = np.ones(B, np.float32)
        min_p = np.zeros(B, np.float32)
        rep = np.ones(B, np.float32)
        seed = np.zeros(B, np.uint32)
        max_new = np.zeros(B, np.int32)
        stop_ids = np.full((B, MAX_STOP_IDS), -1, np.int32)
        want_lp = np.zeros(B, bool)
        want_prompt_lp = np.zeros(B, bool)
        start = np.zeros(B, np.int32)
        for b, req in enumerate(self.slots):
            if req is None:
                continue
            p = req.params
            temp[b], top_k[b], top_p[b], min_p[b] = p.temperature, p.top_k, p.top_p, p.min_p
            rep[b], seed[b], max_new[b] = p.repetition_penalty, req.seed, req.max_new
            want_lp[b] = p.logprobs is not None
            want_prompt_lp[b] = p.prompt_logprobs is not None
            start[b] = len(req.prefill_ids) - len(req.prompt_ids)
            if not p.ignore_eos:
                ids = self.eos_ids[:MAX_STOP_IDS]
                stop_ids[b, :len(ids)] = ids
        sampling = SamplingArrays(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                                  repetition_penalty=rep, seed=seed)
        return decode.RowParams(sampling=sampling, max_new=max_new, stop_ids=stop_ids,
                                active=decoding, start_index=start, logprobs=want_lp,
                                prompt_logprobs=want_prompt_lp)

    # ---- one scheduling step -----------------------------------------------------------------

    def step(self) -> list[Request]:
        """Runs one scheduling step; returns the requests that progressed (finished included)."""
        self._ensure_batch()
        progressed: dict[str, Request] = {}
        now = time.perf_counter()
        admitted = np.zeros(len(self.slots), bool)
        start = np.zeros(len(self.slots), np.int32)
        for b in range(len(self.slots)):
            if self.slots[b] is None and self.waiting:
                req = self.waiting[0]
                # After a preemption the tokens already produced are re-prefilled, never
                # re-sampled.
                req.prefill_ids = req.prompt_ids + req.token_ids
                cached = 0
                if self.paged is not None:
                    cached = self.paged.admit(req, b)
                    if cached is None:
                        break  # first come, first served: wait for pages
                self.waiting.popleft()
                req.slot, req.prefilled, start[b] = b, cached, cached
                req.metrics.prefix_cache_hit_tokens += cached
                req.admitted_order = self.admissions
                self.admissions += 1
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = now
                self.slots[b] = req
                admitted[b] = True
        if admitted.any():
            tables = self.paged.take_tables() if self.paged is not None else None
            self.state = decode.reset_rows(self.state, admitted, start, tables)

        # Rows already decoding run this step; rows whose prompt completes now return their
        # first token from this step and decode from the next, so the first token is seen early.
        decoding = np.array([r is not None and r.prefilled == len(r.prefill_ids)
                             for r in self.slots])
        prefilling = [r for r in self.slots
                      if r is not None and r.prefilled < len(r.prefill_ids)]
        if prefilling:
            for req in self._prefill(prefilling):
                progressed[req.request_id] = req
        decoding &= np.array([r is not None for r in self.slots])
        if decoding.any():
            for req in self._decode(decoding):
                progressed[req.request_id] = req
        return list(progressed.values())

    def _prefill(self, prefilling: list[Request]) -> list[Request]:
        B = len(self.slots)
        remaining = max(len(r.prefill_ids) - r.prefilled for r in prefilling)
        T = _pick(self.chunk_buckets, remaining)
        tokens = np.zeros((B, T), np.int32)
        next_tokens = np.full((B, T), -1, np.int32)
        num_new = np.zeros(B, np.int32)
        completes = np.zeros(B, bool)
        longest = 0
        for req in prefilling:
            start, n = req.prefilled, min(T, len(req.prefill_ids) - req.prefilled)
            tokens[req.slot, :n] = req.prefill_ids[start:start + n]
            following = req.prompt_ids[start + 1:start + n + 1]  # prompt tokens only
            next_tokens[req.slot, :len(following)] = following
            num_new[req.slot] = n
            completes[req.slot] = start + n == len(req.prefill_ids)
            longest = max(longest, start)
        kv_view = _pick(self.kv_buckets, longest + T)
        rows = self._row_params(completes)
        self.state, first, first_lp, prompt_lp = decode.prefill_chunk(
            self.params, self.state, tokens, num_new, completes, next_tokens, rows,
            cfg=self.cfg, kv_view=kv_view, attn_impl=self.ecfg.attention)
        self.stats_counters["prompt_tokens"] += int(num_new.sum())
        if any(r.prompt_logprobs is not None for r in prefilling):
            ids, vals, chosen = jax.device_get(prompt_lp)
            for req in prefilling:
                if req.prompt_logprobs is None:
                    continue
                b, k = req.slot, req.params.prompt_logprobs
                for t in range(int(num_new[b])):
                    # Prompt token p + 1 is scored once: not again when a preempted request
                    # re-prefills, nor for positions a prefix-cache hit skipped (left out).
                    if (next_tokens[b, t] >= 0
                            and req.prefilled + t + 1 == len(req.prompt_logprobs)):
                        req.prompt_logprobs.append(
                            _logprob_dict(k, ids[b, t], vals[b, t], next_tokens[b, t],
                                          chosen[b, t]))
        for req in prefilling:
            req.prefilled += int(num_new[req.slot])
            if self.paged is not None:
                self.paged.computed(req, req.prefilled)
        if not completes.any():
            return []
        first = np.asarray(first)
        first_lp = jax.device_get(first_lp) if rows.logprobs.any() else None
        done = []
        for req in prefilling:
            if completes[req.slot]:
                b = req.slot
                lps = None if first_lp is None else [tuple(x[b] for x in first_lp)]
                self._append(req, [int(first[b])], stopped=False, lps=lps)
                done.append(req)
        return done

    def _grow_or_preempt(self, decoding: np.ndarray) -> np.ndarray:
        """Gives every decoding row pages for the next dispatch, preempting the newest running
        requests (pages freed, requeued first for recompute) while pages run short."""
        steps = self.ecfg.decode_steps
        order = sorted((r for r, d in zip(self.slots, decoding) if d),
                       key=lambda r: r.admitted_order)
        for req in order:
            if req.slot is None or self.slots[req.slot] is not req:
                continue  # preempted meanwhile
            while not self.paged.grow(req, len(req.prompt_ids) + len(req.token_ids) + steps):
                running = [r for r in self.slots if r is not None]
                victim = max(running, key=lambda r: r.admitted_order)
                self._preempt(victim)
                if victim is req:
                    break
        decoding = decoding & np.array([r is not None for r in self.slots])
        tables = self.paged.take_tables()
        if tables is not None:
            self.state = decode.set_block_tables(self.state, tables)
        return decoding

    def _preempt(self, req: Request) -> None:
        self.paged.release(req)
        self.slots[req.slot] = None
        req.slot, req.prefilled = None, 0
        req.metrics.preemptions += 1
        self.stats_counters["preemptions"] += 1
        self.waiting.appendleft(req)

    def _decode(self, decoding: np.ndarray) -> list[Request]:
        if self.paged is not None:
            decoding = self._grow_or_preempt(decoding)
            if not decoding.any():
                return []
        longest = max(len(r.prompt_ids) + len(r.token_ids)
                      for r, d in zip(self.slots, decoding) if d)
        kv_view = _pick(self.kv_buckets, longest + self.ecfg.decode_steps)
        rows = self._row_params(decoding)
        self.state, out, num_out, done, lp = decode.decode_loop(
            self.params, self.state, rows, cfg=self.cfg,
            num_steps=self.ecfg.decode_steps, kv_view=kv_view, attn_impl=self.ecfg.attention)
        out, num_out, done = jax.device_get((out, num_out, done))
        lp = jax.device_get(lp) if (rows.logprobs & decoding).any() else None
        progressed = []
        for b, req in enumerate(self.slots):
            if req is None or not decoding[b]:
                continue
            n = int(num_out[b])
            lps = None if lp is None else [tuple(x[b, i] for x in lp) for i in range(n)]
            self._append(req, out[b, :n].tolist(), stopped=bool(done[b]), lps=lps)
            if self.paged is not None and req.finish_reason is None:
                # Everything but the newest token (fed next step) has K/V in the pages.
                self.paged.computed(req, len(req.prompt_ids) + len(req.token_ids) - 1)
            progressed.append(req)
        return progressed

    def _append(self, req: Request, new_ids: list[int], stopped: bool, lps=None) -> None:
        """Adds tokens the device produced, applying EOS, stop strings and length limits.
        lps: per token (top ids, top values, chosen logprob) when the request wants logprobs."""
        now = time.perf_counter()
        if req.metrics.first_token_time is None and new_ids:
            req.metrics.first_token_time = now
        eos = set(self.eos_ids) if not req.params.ignore_eos else set()
        for i, tok in enumerate(new_ids):
            if tok in eos:
                self._finish(req, "stop")
                return
            req.token_ids.append(tok)
            if req.logprobs is not None and lps is not None:
                req.logprobs.append(_logprob_dict(req.params.logprobs, *lps[i][:2], tok,
                                                  lps[i][2]))
            req.metrics.generated_tokens += 1
            req.metrics.token_times.append(now)
            self.stats_counters["generated_tokens"] += 1
            if req.stream.add(tok):
                self._finish(req, "stop")
                return
            if len(req.token_ids) >= req.max_new:
                self._finish(req, "length")
                return
        if stopped:  # device stopped the row on a limit it knows (max_new)
            self._finish(req, "length")

    # ---- warmup and stats --------------------------------------------------------------------

    def warmup(self) -> float:
        """Compiles every (batch, chunk, kv_view) shape the engine can dispatch. Needs an idle
        engine (the rows it runs are all inactive, so the cache contents are kept)."""
        if self.has_unfinished():
            raise RuntimeError("warmup() needs an engine with no unfinished requests")
        t0 = time.perf_counter()
        for B in self.batch_buckets:
            self.slots = [None] * B
            self.state = self._new_state(B)
            idle = np.zeros(B, bool)
            rows = self._row_params(idle)
            tables = self.paged.take_tables() if self.paged is not None else None
            self.state = decode.reset_rows(self.state, idle, np.zeros(B, np.int32), tables)
            if tables is not None:
                self.state = decode.set_block_tables(self.state, tables)
            for kv_view in self.kv_buckets:
                for T in self.chunk_buckets:
                    self.state, *_ = decode.prefill_chunk(
                        self.params, self.state, np.zeros((B, T), np.int32),
                        np.zeros(B, np.int32), idle, np.full((B, T), -1, np.int32), rows,
                        cfg=self.cfg, kv_view=kv_view, attn_impl=self.ecfg.attention)
                self.state, *_ = decode.decode_loop(
                    self.params, self.state, rows, cfg=self.cfg,
                    num_steps=self.ecfg.decode_steps, kv_view=kv_view,
                    attn_impl=self.ecfg.attention)
            jax.block_until_ready(self.state)
        return time.perf_counter() - t0

    def stats(self) -> dict:
        elapsed = time.perf_counter() - self.start_time
        c = self.stats_counters
        return {
            "running": sum(r is not None for r in self.slots),
            "waiting": len(self.waiting),
            "num_slots": len(self.slots),
            "max_num_seqs": self.ecfg.max_num_seqs,
            "prompt_tokens": c["prompt_tokens"],
            "generated_tokens": c["generated_tokens"],
            "finished_requests": c["finished"],
            "elapsed_s": elapsed,
            "generation_tokens_per_s": c["generated_tokens"] / elapsed if elapsed > 0 else 0.0,
            "preemptions": c["preemptions"],
            **(self.paged.stats() if self.paged is not None else {}),
        }
