"""The host-side engine: requests in slots of a KV cache (paged, or a ring for sliding-window
models), driven step by step.

Host code only: it decides which rows prefill or decode, pads inputs in numpy to bucketed shapes,
and turns device outputs into RequestOutputs. All device math is in jaxinfer.decode.

A step: (1) admit waiting requests into free slots (and pages); (2) if any row is prefilling,
one mixed_step runs prefill chunks for as many of them as the token budget
(max_num_batched_tokens) allows together with one token for every decoding row, decodes first
(SARATHI-style decode-maximal batching); (3) otherwise one decode_loop dispatch runs up to
decode_steps tokens per row. Finished rows free their slot for the next waiting request.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from typing import Optional

import jax
import numpy as np

from jaxinfer import decode, sharding
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine import memory
from jaxinfer.engine.paged import PagedSlots
from jaxinfer.engine.request import RequestMetrics, RequestOutput, SamplingParams
from jaxinfer.engine.textstream import TextStream
from jaxinfer.kv_cache import PagedKVCache, RingKVCache, kv_buffer
from jaxinfer.sampling import SamplingArrays
from jaxinfer.sharding import Partitioner, fetch

MAX_STOP_IDS = 8
RAGGED_MIN_BATCH = 8  # smallest batch decoded through page lists (Engine._ragged_decode)

# Adaptive speculation: every SPEC_JUDGE_STEPS verification steps a request's accepted drafts per
# step are judged; below SPEC_MIN_ACCEPTED its drafting pauses for SPEC_PAUSE_TOKENS generated
# tokens, doubling on each further pause up to SPEC_MAX_PAUSE_TOKENS (a pass resets it).
SPEC_JUDGE_STEPS = 8
SPEC_MIN_ACCEPTED = 0.5
SPEC_PAUSE_TOKENS = 32
SPEC_MAX_PAUSE_TOKENS = 1024


class SpeculationRates:
    """Whether drafting pays at a batch size, measured: the output tokens/s of recent decode
    dispatches with drafting and without (moving averages, per slot-batch size). Verifying k
    drafts per row costs about what a single-token step costs where a step is bound by reading
    the weights (a GPU at small batch, a CPU at batch 1), and several times that where it is
    bound by compute (a CPU at 16 rows); measuring covers both. The losing mode is tried again
    every PROBE_EVERY dispatches, as acceptance changes with the text."""

    PROBE_EVERY = 16
    ALPHA = 0.3

    def __init__(self):
        self.rates: dict[tuple[int, bool], float] = {}
        self.since_probe: collections.Counter = collections.Counter()

    def draft(self, batch: int) -> bool:
        """Should the next dispatch at this batch size draft (for rows that may)?"""
        spec, plain = self.rates.get((batch, True)), self.rates.get((batch, False))
        if spec is None or plain is None:
            return spec is None  # measure each mode once, drafting first
        if spec >= plain:
            return True
        self.since_probe[batch] += 1
        if self.since_probe[batch] >= self.PROBE_EVERY:
            self.since_probe[batch] = 0
            return True
        return False

    def record(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0 or tokens <= 0:
            return
        rate, key = tokens / seconds, (batch, drafted)
        old = self.rates.get(key)
        self.rates[key] = rate if old is None else (1 - self.ALPHA) * old + self.ALPHA * rate


def _buckets(limit: int, base: int, factor: int) -> tuple[int, ...]:
    out, b = [], base
    while b < limit:
        out.append(b)
        b *= factor
    return tuple(out) + (limit,)


def _page_buckets(limit: int, base: int) -> tuple[int, ...]:
    """base * 2**k and, below limit / 2, 1.5 * base * 2**k (so a short page list is padded by at
    most half), then limit."""
    out, b = [], base
    while b < limit:
        out += [b] + ([b * 3 // 2] if b * 3 < limit else [])
        b *= 2
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
    spec_resume_at: int = 0          # drafting is paused until this many tokens are generated
    spec_pause: int = SPEC_PAUSE_TOKENS
    spec_window: tuple[int, int] = (0, 0)  # (steps, accepted) since the last judgement

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
                 num_pages: int = 0, draft: Optional[tuple] = None,
                 partitioner: Optional[Partitioner] = None, kv_dtype=None):
        self.cfg = cfg
        # Weights and state are committed to the device (or to their shardings on the mesh):
        # jit keys its compiled programs on whether each argument is, and weights restored from
        # orbax arrive committed while weights from GGUF do not, so a state that went through a
        # step would otherwise stop matching a fresh one and recompile.
        self.device = jax.local_devices()[0]
        self.partitioner = partitioner
        self.params = self._place_params(params, cfg)
        self.tokenizer = tokenizer
        self.ecfg = engine_cfg
        self.capacity = capacity
        self.dtype = dtype
        # The KV cache's storage dtype: the model's, or int8 / float8 codes (QuantizedKV).
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        B = engine_cfg.max_num_seqs
        # With a data axis, the smallest batch already gives every replica a row. A paged
        # cache keeps one batch of max_num_seqs rows: slot b then always lives on replica
        # b // (B / data), whose partition of the page pool holds its pages (growing the batch
        # would move rows to other replicas, away from their pages).
        data = partitioner.mesh_config.data if partitioner is not None else 1
        self.data = data
        self.batch_buckets = [B] if paged is not None and data > 1 else _buckets(B, min(data, B), 4)
        self.chunk_buckets = _buckets(engine_cfg.prefill_chunk, min(16, engine_cfg.prefill_chunk), 8)
        self.paged = paged
        self.num_pages = num_pages
        if paged is not None:
            capacity = paged.table_width * paged.page_size
            self.capacity = capacity
        # kv_view buckets, doubling: attention reads the whole view and dominates a CPU decode
        # step at 16 rows (59 / 86 / 151 ms per step at 256 / 512 / 1024), so a row of 300
        # tokens should not pay for 1024. A paged view must be whole pages.
        unit = paged.page_size if paged is not None else 1
        self.kv_buckets = tuple(sorted({-(-b // unit) * unit for b in
                                        _buckets(capacity, min(256, capacity), 2)}))
        self.admissions = 0
        self.waiting: collections.deque[Request] = collections.deque()
        self.slots: list[Optional[Request]] = []
        self.state: Optional[decode.DecodeState] = None
        self.spec = engine_cfg.speculative
        self.spec_rates = SpeculationRates()
        # A draft model (params, config): its ring cache rides in DecodeState and every step
        # that feeds the target feeds it too. Passed to every step (None without one), so the
        # jitted functions always see the same keyword arguments.
        self.draft_kw = {"draft_params": self._place_params(*draft) if draft else None,
                         "draft_cfg": draft[1] if draft else None}
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
        """Sizes the slot batch for what is running and waiting (bucketed). With rows running,
        the batch only grows (running rows keep their slots); an idle engine takes a new state.
        A paged cache keeps its page pool (and so its prefix cache) either way."""
        running = sum(r is not None for r in self.slots)
        want = _pick(self.batch_buckets, running + len(self.waiting))
        if self.state is None or (not running and want != len(self.slots)):
            self.state = self._new_state(want)
            self.slots = [None] * want
        elif want > len(self.slots):
            self._grow(want)

    def _grow(self, B: int) -> None:
        self.state = decode.grow_rows(self.state, B)
        self.slots += [None] * (B - len(self.slots))
        if self.paged is not None:
            self.paged.resize(B, keep=True)

    def _new_state(self, B: int) -> decode.DecodeState:
        """A state for B slots. A paged cache keeps the previous state's page pool (pages still
        hold prefix-cache entries); only the per-row parts are new."""
        draft = dict(draft_cfg=self.draft_kw["draft_cfg"], draft_capacity=self.ecfg.max_seq_len)
        L, K, H = self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim
        if self.paged is None:
            shape = (L, B, self.capacity, K, H)
            cache = RingKVCache(k=self._zeros(shape, RingKVCache.KV_AXES),
                                v=self._zeros(shape, RingKVCache.KV_AXES),
                                positions=np.full((B, self.capacity), -1, np.int32),
                                lengths=np.zeros(B, np.int32))
            return self._place_state(decode.DecodeState.create(
                self.cfg, B, self.capacity, self.dtype, cache=cache, **draft))
        if self.state is not None:
            k, v = self.state.cache.k, self.state.cache.v
        else:
            shape = (L, self.num_pages * self.paged.page_size, K, H)
            k, v = (self._zeros(shape, PagedKVCache.KV_AXES),
                    self._zeros(shape, PagedKVCache.KV_AXES))
        self.paged.resize(B)
        cache = PagedKVCache(k=k, v=v,
                             block_tables=np.zeros((B, self.paged.table_width), np.int32),
                             lengths=np.zeros(B, np.int32), page_size=self.paged.page_size)
        return self._place_state(decode.DecodeState.create(self.cfg, B, self.capacity, self.dtype,
                                                           cache=cache, **draft))

    def _zeros(self, shape: tuple[int, ...], axes):
        """An empty K or V buffer (kv_cache.kv_buffer), made where it lives: on the device, or
        shard by shard (a quantized buffer's scales drop the head-dim axis)."""
        if self.partitioner is None:
            return kv_buffer(shape, self.kv_dtype)
        return kv_buffer(shape, self.kv_dtype, lambda sh, dt: self.partitioner.zeros(
            sh, dt, tuple(axes)[:len(sh)]))

    def _place_params(self, params, cfg: ModelConfig):
        if self.partitioner is None:
            return jax.device_put(params, self.device)
        from jaxinfer.models import get_model
        return self.partitioner.put_tree(
            params, sharding.param_axes(cfg, params, get_model(cfg.architecture).param_specs))

    def _place_state(self, state: decode.DecodeState) -> decode.DecodeState:
        if self.partitioner is None:
            return jax.device_put(state, self.device)
        return self.partitioner.put_tree(state, state.logical_axes())

    def _on_mesh(self):
        """The context of every dispatch: the mesh, whose rules the jitted steps' sharding
        constraints resolve against (nothing without one)."""
        return self.partitioner.active() if self.partitioner is not None \
            else contextlib.nullcontext()

    def step_scratch_bytes(self) -> int:
        """Scratch (temporary) bytes of the largest compiled programs the engine dispatches,
        from XLA's memory analysis: the biggest batch and kv_view, for the largest prefill
        group and for the decode loop. Compiles them with abstract inputs (nothing runs)."""
        with self._on_mesh():
            return self._step_scratch_bytes()

    def _step_scratch_bytes(self) -> int:
        B, kv_view = self.batch_buckets[-1], self.kv_buckets[-1]
        decode_pages = self._decode_page_buckets(B)[-1] if self._ragged_decode(B) else None
        self.slots = [None] * B
        state = jax.eval_shape(lambda: self._new_state(B))
        self.state = None
        rows = self._row_params(np.zeros(B, bool))
        G, T = max(self.chunk_shapes(B), key=lambda s: s[0] * s[1])
        chunk = decode.Chunk(tokens=np.zeros((G, T), np.int32), num_new=np.zeros(G, np.int32),
                             completes=np.zeros(G, bool),
                             next_tokens=np.zeros((G, T), np.int32), rows=np.zeros(G, np.int32))
        common = dict(cfg=self.cfg, kv_view=kv_view, attn_impl=self.ecfg.attention)
        programs = [decode.mixed_step.lower(self.params, state, chunk, rows, **common,
                                            **self.draft_kw)]
        if not self._speculative(B):
            programs.append(decode.decode_loop.lower(
                self.params, state, rows, num_steps=self.ecfg.decode_steps,
                exit_on_stop=np.bool_(False), decode_pages=decode_pages, **common))
        else:
            k = self.spec.num_draft_tokens
            programs.append(decode.speculative_loop.lower(
                self.params, state, rows, np.zeros((B, self.ecfg.max_seq_len), np.int32),
                np.zeros(B, bool), num_steps=self.ecfg.decode_steps, num_draft=k,
                ngram_max=self.spec.ngram_max, ngram_min=self.spec.ngram_min,
                exit_on_stop=np.bool_(False), **common, **self.draft_kw))
        return max(p.compile().memory_analysis().temp_size_in_bytes for p in programs)

    def set_num_pages(self, num_pages: int) -> None:
        """Resizes the (not yet allocated) page pool."""
        assert self.state is None, "the pool is already allocated"
        self.num_pages = num_pages
        self.paged = PagedSlots(num_pages, self.paged.page_size, self.paged.max_seq_len,
                                self.paged.allocator.enable_prefix_caching,
                                self.paged.allocator.num_partitions)

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
        """Runs one scheduling step; returns the requests that progressed (finished included).

        Rows still prefilling get chunks within the token budget, run together with one token
        for every decoding row (mixed_step). With nothing to prefill, one decode_loop dispatch
        runs up to decode_steps tokens, ending early when a row stops and a request waits."""
        with self._on_mesh():
            return self._step()

    def _step(self) -> list[Request]:
        self._ensure_batch()
        self._admit()
        decoding = np.array([r is not None and r.prefilled == len(r.prefill_ids)
                             for r in self.slots])
        if any(r is not None and r.prefilled < len(r.prefill_ids) for r in self.slots):
            progressed = self._mixed(decoding)
        elif decoding.any():
            progressed = self._decode(decoding)
        else:
            progressed = []
        return list({req.request_id: req for req in progressed}.values())

    def _admit(self) -> None:
        """Moves waiting requests into free slots, first come first served, while pages last."""
        now = time.perf_counter()
        admitted = np.zeros(len(self.slots), bool)
        start = np.zeros(len(self.slots), np.int32)
        for b in range(len(self.slots)):
            if self.slots[b] is not None or not self.waiting:
                continue
            req = self.waiting[0]
            # After a preemption the tokens already produced are re-prefilled, never re-sampled.
            req.prefill_ids = req.prompt_ids + req.token_ids
            cached = 0
            if self.paged is not None:
                cached = self.paged.admit(req, b, b * self.data // len(self.slots))
                if cached is None:
                    break  # wait for pages
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

    def chunk_shapes(self, B: int) -> list[tuple[int, int]]:
        """The (rows, tokens) shapes a prefill group may take with B slots: rows from the batch
        buckets, tokens from the chunk buckets, padded size within the token budget (one row
        of any chunk is always allowed, so a long prompt always progresses)."""
        budget = self.ecfg.max_num_batched_tokens
        return [(g, t) for g in self.batch_buckets if g <= B for t in self.chunk_buckets
                if g == 1 or g * t <= budget]

    def _schedule_prefill(self, num_decoding: int) -> list[tuple[Request, int]]:
        """Prefill chunks for this step, oldest request first: (request, tokens) pairs that fit
        the token budget left after one token per decoding row (at least the smallest chunk,
        so prefill never starves) and one of chunk_shapes()."""
        budget = max(self.ecfg.max_num_batched_tokens - num_decoding, self.chunk_buckets[0])
        shapes = self.chunk_shapes(len(self.slots))
        chosen: list[tuple[Request, int]] = []
        for req in sorted((r for r in self.slots
                           if r is not None and r.prefilled < len(r.prefill_ids)),
                          key=lambda r: r.admitted_order):
            take = min(len(req.prefill_ids) - req.prefilled, self.ecfg.prefill_chunk, budget)
            if take <= 0:
                break
            shape = (_pick(self.batch_buckets, len(chosen) + 1),
                     _pick(self.chunk_buckets, max([take] + [n for _, n in chosen])))
            if chosen and shape not in shapes:
                break
            chosen.append((req, take))
            budget -= take
        return chosen

    def _mixed(self, decoding: np.ndarray) -> list[Request]:
        """One mixed_step: prefill chunks within the token budget + one token per decoding row."""
        if self.paged is not None and decoding.any():
            decoding = self._grow_or_preempt(decoding, 1)
        chosen = self._schedule_prefill(int(decoding.sum()))
        if not chosen:  # preemption took every prefilling row
            return self._decode(decoding) if decoding.any() else []
        B = len(self.slots)
        G = _pick(self.batch_buckets, len(chosen))
        T = _pick(self.chunk_buckets, max(n for _, n in chosen))
        tokens = np.zeros((G, T), np.int32)
        next_tokens = np.full((G, T), -1, np.int32)
        num_new = np.zeros(G, np.int32)
        completes = np.zeros(G, bool)
        rows = np.full(G, B, np.int32)  # padding rows point past the slots
        for g, (req, n) in enumerate(chosen):
            start = req.prefilled
            tokens[g, :n] = req.prefill_ids[start:start + n]
            following = req.prompt_ids[start + 1:start + n + 1]  # prompt tokens only
            next_tokens[g, :len(following)] = following
            num_new[g], rows[g] = n, req.slot
            completes[g] = start + n == len(req.prefill_ids)
        longest = max([r.prefilled + T for r, _ in chosen] +
                      [len(r.prompt_ids) + len(r.token_ids) + 1
                       for r, d in zip(self.slots, decoding) if d])
        kv_view = _pick(self.kv_buckets, longest)
        params = self._row_params(decoding)
        chunk = decode.Chunk(tokens=tokens, num_new=num_new, completes=completes,
                             next_tokens=next_tokens, rows=rows)
        self.state, out, lp, first, first_lp, prompt_lp = decode.mixed_step(
            self.params, self.state, chunk, params, cfg=self.cfg, kv_view=kv_view,
            attn_impl=self.ecfg.attention, **self.draft_kw)
        self.stats_counters["prompt_tokens"] += int(num_new.sum())
        progressed = []
        if decoding.any():
            lp = (tuple(x[:, None] for x in fetch(lp))
                  if (params.logprobs & decoding).any() else None)
            progressed += self._take_decoded(decoding, fetch(out)[:, None],
                                             np.ones(B, np.int32), np.zeros(B, bool), lp)
        progressed += self._take_prefilled(chosen, chunk, params, first, first_lp, prompt_lp)
        return progressed

    def _take_prefilled(self, chosen, chunk: decode.Chunk, params: decode.RowParams, first,
                        first_lp, prompt_lp) -> list[Request]:
        """Books a prefill group's results: prompt logprobs, progress, first tokens."""
        if any(r.prompt_logprobs is not None for r, _ in chosen):
            ids, vals, chosen_lp = fetch(prompt_lp)
            for g, (req, n) in enumerate(chosen):
                if req.prompt_logprobs is None:
                    continue
                k = req.params.prompt_logprobs
                for t in range(n):
                    # Prompt token p + 1 is scored once: not again when a preempted request
                    # re-prefills, nor for positions a prefix-cache hit skipped (left out).
                    if (chunk.next_tokens[g, t] >= 0
                            and req.prefilled + t + 1 == len(req.prompt_logprobs)):
                        req.prompt_logprobs.append(_logprob_dict(
                            k, ids[g, t], vals[g, t], chunk.next_tokens[g, t], chosen_lp[g, t]))
        for req, n in chosen:
            req.prefilled += n
            if self.paged is not None:
                self.paged.computed(req, req.prefilled)
        if not chunk.completes.any():
            return []
        first = fetch(first)
        want_lp = any(params.logprobs[r.slot] for r, _ in chosen)
        first_lp = fetch(first_lp) if want_lp else None
        done = []
        for g, (req, _) in enumerate(chosen):
            if chunk.completes[g]:
                lps = None if first_lp is None else [tuple(x[g] for x in first_lp)]
                self._append(req, [int(first[g])], stopped=False, lps=lps)
                done.append(req)
        return done

    def _grow_or_preempt(self, decoding: np.ndarray, steps: int) -> np.ndarray:
        """Gives every decoding row pages for `steps` more tokens, preempting the newest running
        requests (pages freed, requeued first for recompute) while pages run short."""
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
        """One decode_loop dispatch of up to decode_steps tokens per decoding row (with
        speculation on, a speculative_loop of decode_steps steps)."""
        steps = self.ecfg.decode_steps
        speculative = self._speculative(len(self.slots))
        draft_on = self._drafting(decoding) & speculative
        if draft_on.any() and not self.spec_rates.draft(len(self.slots)):
            draft_on[:] = False
        per_step = self.spec.num_draft_tokens + 1 if draft_on.any() else 1
        if self.paged is not None:
            decoding = self._grow_or_preempt(decoding, steps * per_step)
            if not decoding.any():
                return []
            draft_on &= decoding
        lengths = [len(r.prompt_ids) + len(r.token_ids) + steps * per_step
                   for r, d in zip(self.slots, decoding) if d]
        if speculative:
            return self._speculate(decoding, draft_on, _pick(self.kv_buckets, max(lengths)))
        kv_view, decode_pages = _pick(self.kv_buckets, max(lengths)), None
        if self._ragged_decode(len(self.slots)):
            Z, M = self.paged.page_size, self.paged.table_width
            pages = sum(min(-(-n // Z), M) for n in lengths)
            kv_view, decode_pages = None, _pick(self._decode_page_buckets(len(self.slots)), pages)
        rows = self._row_params(decoding)
        self.state, out, num_out, done, lp = self._decode_loop(rows, kv_view, decode_pages)
        out, num_out, done = fetch((out, num_out, done))
        lp = fetch(lp) if (rows.logprobs & decoding).any() else None
        return self._take_decoded(decoding, out, num_out, done, lp)

    def _drafting(self, decoding: np.ndarray) -> np.ndarray:
        """[B] bool: decoding rows whose requests draft in the next dispatch (speculation on and
        not paused for low acceptance)."""
        if self.spec is None:
            return np.zeros(len(self.slots), bool)
        return np.array([bool(d) and len(r.token_ids) >= r.spec_resume_at
                         for r, d in zip(self.slots, decoding)])

    def _history(self) -> np.ndarray:
        """[B, max_seq_len] int32: each slot's prompt and generated tokens (n-gram lookup; a
        draft model does not read it)."""
        hist = np.zeros((len(self.slots), self.ecfg.max_seq_len), np.int32)
        if self.spec.method != "ngram":
            return hist
        for b, req in enumerate(self.slots):
            if req is not None:
                ids = req.prompt_ids + req.token_ids
                hist[b, :len(ids)] = ids
        return hist

    def _speculate(self, decoding: np.ndarray, draft_on: np.ndarray,
                   kv_view: int) -> list[Request]:
        """One speculative_loop dispatch: decode_steps steps per decoding row (single-token
        steps while no row drafts, so it also serves an engine whose rows all paused)."""
        rows = self._row_params(decoding)
        t0 = time.perf_counter()
        self.state, out, num_out, done, lp, counts = self._speculative_loop(rows, draft_on,
                                                                            kv_view)
        out, num_out, done, counts = fetch((out, num_out, done, counts))
        self.spec_rates.record(len(self.slots), bool(draft_on.any()), int(num_out.sum()),
                               time.perf_counter() - t0)
        lp = fetch(lp) if (rows.logprobs & decoding).any() else None
        drafting = [(b, r) for b, r in enumerate(self.slots) if draft_on[b]]
        progressed = self._take_decoded(decoding, out, num_out, done, lp)
        for b, req in drafting:
            self._judge_speculation(req, int(counts.steps[b]), int(counts.drafted[b]),
                                    int(counts.accepted[b]))
        return progressed

    def _decode_loop(self, rows: decode.RowParams, kv_view: Optional[int],
                     decode_pages: Optional[int]):
        """decode_loop on the engine's state; every call passes the same keywords (a missing
        one would compile a second program)."""
        return decode.decode_loop(
            self.params, self.state, rows, cfg=self.cfg, num_steps=self.ecfg.decode_steps,
            kv_view=kv_view, attn_impl=self.ecfg.attention,
            exit_on_stop=np.bool_(bool(self.waiting)), decode_pages=decode_pages)

    def _speculative_loop(self, rows: decode.RowParams, draft_on: np.ndarray, kv_view: int):
        return decode.speculative_loop(
            self.params, self.state, rows, self._history(), draft_on, cfg=self.cfg,
            num_steps=self.ecfg.decode_steps, num_draft=self.spec.num_draft_tokens,
            ngram_max=self.spec.ngram_max, ngram_min=self.spec.ngram_min, kv_view=kv_view,
            attn_impl=self.ecfg.attention, exit_on_stop=np.bool_(bool(self.waiting)),
            **self.draft_kw)

    def _judge_speculation(self, req: Request, steps: int, drafted: int, accepted: int) -> None:
        """Books a dispatch's speculation counts; pauses drafting when acceptance stays low."""
        m = req.metrics
        m.spec_steps += steps
        m.draft_tokens += drafted
        m.accepted_tokens += accepted
        for name, v in (("spec_steps", steps), ("draft_tokens", drafted),
                        ("accepted_tokens", accepted)):
            self.stats_counters[name] += v
        window = (req.spec_window[0] + steps, req.spec_window[1] + accepted)
        if window[0] < SPEC_JUDGE_STEPS:
            req.spec_window = window
            return
        req.spec_window = (0, 0)
        if window[1] < SPEC_MIN_ACCEPTED * window[0]:
            req.spec_resume_at = len(req.token_ids) + req.spec_pause
            req.spec_pause = min(2 * req.spec_pause, SPEC_MAX_PAUSE_TOKENS)
        else:
            req.spec_pause = SPEC_PAUSE_TOKENS

    def _ragged_decode(self, B: int) -> bool:
        """A full batch of paged decode under the pure-jnp attention attends through a flat
        list of the rows' own pages (llama.forward_groups decode_pages), not over the longest
        row's view: 64 instead of 96 ms a step for 16 rows of 144-400 tokens. Smaller batches
        keep kv_view: every compiled program maps three memory areas per kernel (about 940 for
        SmolLM2), and all of them must stay inside Linux's default 65530 maps a process
        (warmup at max_num_seqs=16, max_seq_len=2048: about 57,800). Below RAGGED_MIN_BATCH
        rows there is little raggedness to save. A speculative engine decodes this batch the
        same way and does not draft in it (see _speculative)."""
        return (self.paged is not None and self.ecfg.attention == "reference"
                and B == self.batch_buckets[-1] and B >= RAGGED_MIN_BATCH)

    def _speculative(self, B: int) -> bool:
        """Does a B-slot batch decode through speculative_loop? With speculation on, yes, except
        where it decodes through page lists (the CPU reference path at its largest batch):
        there a step is bound by compute, so verifying k drafts per row costs several single
        steps and drafting lost even at 84% acceptance (0.94x at 16 rows), while the page-list
        decode it would give up is 1.5x faster than the view speculative_loop attends over.
        Compiling both would not fit the process map limit."""
        return self.spec is not None and not self._ragged_decode(B)

    def _decode_page_buckets(self, B: int) -> tuple[int, ...]:
        """Page-list lengths of a B-row ragged decode (from 8 pages a row up to every row's
        full table)."""
        limit = B * self.paged.table_width
        return _page_buckets(limit, min(8 * B, limit))

    def _take_decoded(self, decoding, out, num_out, done, lp) -> list[Request]:
        """Books decoded tokens: row b produced out[b, :num_out[b]] (done[b]: the device
        stopped it); lp: (ids, values, chosen) [B, S, ...] when a row wants logprobs."""
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
        with self._on_mesh():
            return self._warmup()

    def _warmup(self) -> float:
        t0 = time.perf_counter()
        budget = memory.MapBudget()
        left = self.num_programs()

        def compiled():
            nonlocal left
            left -= 1
            budget.check(left)

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
                for G, T in self.chunk_shapes(B):
                    chunk = decode.Chunk(tokens=np.zeros((G, T), np.int32),
                                         num_new=np.zeros(G, np.int32),
                                         completes=np.zeros(G, bool),
                                         next_tokens=np.full((G, T), -1, np.int32),
                                         rows=np.full(G, B, np.int32))
                    self.state, *_ = decode.mixed_step(
                        self.params, self.state, chunk, rows, cfg=self.cfg, kv_view=kv_view,
                        attn_impl=self.ecfg.attention, **self.draft_kw)
                    compiled()
                if self._speculative(B):
                    self.state, *_ = self._speculative_loop(rows, np.zeros(B, bool), kv_view)
                    compiled()
                elif not self._ragged_decode(B):
                    self.state, *_ = self._decode_loop(rows, kv_view, None)
                    compiled()
            for decode_pages in (self._decode_page_buckets(B) if self._ragged_decode(B)
                                 else ()):
                self.state, *_ = self._decode_loop(rows, None, decode_pages)
                compiled()
            jax.block_until_ready(self.state)
        assert left == 0, f"num_programs() is off by {left}"
        for i, small in enumerate(self.batch_buckets):  # growing a running batch
            for B in self.batch_buckets[i + 1:]:
                self.slots = [None] * small
                self.state = self._new_state(small)
                self._grow(B)
        jax.block_until_ready(self.state)
        return time.perf_counter() - t0

    def num_programs(self) -> int:
        """The model programs warmup compiles: mixed steps, and decode (or speculative) loops."""
        n = 0
        for B in self.batch_buckets:
            loops = 0 if self._ragged_decode(B) else len(self.kv_buckets)
            pages = len(self._decode_page_buckets(B)) if self._ragged_decode(B) else 0
            n += len(self.kv_buckets) * len(self.chunk_shapes(B)) + loops + pages
        return n

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
            **({"spec_steps": c["spec_steps"], "draft_tokens": c["draft_tokens"],
                "accepted_tokens": c["accepted_tokens"],
                "acceptance_rate": c["accepted_tokens"] / max(c["draft_tokens"], 1),
                "mean_accepted_tokens": c["accepted_tokens"] / max(c["spec_steps"], 1)}
               if self.spec is not None else {}),
            **(self.paged.stats() if self.paged is not None else {}),
        }
