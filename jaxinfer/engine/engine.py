"""The host-side engine: glue between the scheduler (which requests run, how many tokens), the
runner (device state, one dispatch per step) and the requests (tokens, stop conditions,
streaming, metrics). Host code only: the device math is in jaxinfer.device.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Optional

import jax
import numpy as np

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine import draft_policy
from jaxinfer.engine.slot_pages import PagedSlots
from jaxinfer.engine.sequence import SequenceState, logprob_dict
from jaxinfer.engine.runner import MAX_STOP_IDS, Runner
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.lora.manager import LoraManager
from jaxinfer.sharding import Partitioner, fetch

log = logging.getLogger(__name__)


def tree_bytes(tree) -> int:
    """The bytes of every array in a pytree, a sharded array at its global size."""
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


class Engine:
    """Continuous batching over max_num_seqs slots of a paged (or ring) KV cache."""

    def __init__(self, cfg: ModelConfig, params, tokenizer, engine_cfg: EngineConfig,
                 capacity: int, dtype, paged: Optional[PagedSlots] = None,
                 num_pages: int = 0, draft: Optional[tuple] = None,
                 partitioner: Optional[Partitioner] = None, kv_dtype=None,
                 ring_capacity: int = 0, program_index: Optional[str] = None,
                 backend=None, lora: Optional[dict] = None):
        self.engine_cfg = engine_cfg
        # The KV cache's storage dtype: the model's, or int8 / float8 codes (QuantizedKV).
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        self.partitioner = partitioner
        self.paged = paged
        self.eos_ids = tuple(getattr(tokenizer, "eos_token_ids", None) or
                             ([cfg.eos_token_id] if cfg.eos_token_id is not None else []))
        data = partitioner.mesh_config.data if partitioner is not None else 1
        B = engine_cfg.max_num_seqs
        if paged is not None:
            capacity = paged.table_width * paged.page_size
            paged.resize(B)
        self.runner = Runner(cfg, params, engine_cfg, num_slots=B, capacity=capacity,
                             dtype=dtype, kv_dtype=self.kv_dtype,
                             page_size=paged.page_size if paged is not None else 16,
                             num_pages=num_pages, paged=paged is not None, draft=draft,
                             partitioner=partitioner, eos_ids=self.eos_ids,
                             ring_capacity=ring_capacity, program_index=program_index,
                             backend=backend,
                             lora=(lora["max_loras"], lora["max_lora_rank"]) if lora else None)
        # LoRA: adapters in host memory and their device slots (jaxinfer.lora.manager).
        self.loras = None if not lora else LoraManager(
            lora["max_loras"], lora["max_lora_rank"], self.runner.write_lora,
            lora.get("max_cpu_loras"))
        self.scheduler = Scheduler(B, engine_cfg.max_num_batched_tokens,
                                   engine_cfg.prefill_chunk, paged, data,
                                   fill_buckets=self.runner.fill_buckets,
                                   decode_plan=self._plan_decode,
                                   admit_check=self._lora_admit if lora else None,
                                   release=self._lora_release if lora else None)
        self.spec = engine_cfg.speculative
        self.spec_rates = draft_policy.SpeculationRates()
        self.stats_counters = collections.Counter()
        self.start_time = time.perf_counter()
        # Counts weight updates (LLM.update_weights); outputs record it per token.
        self.weight_version = 0

    # Attributes tests, benchmarks and LLM read.
    params = property(lambda self: self.runner.params)
    state = property(lambda self: self.runner.state)
    draft_kw = property(lambda self: self.runner.draft_kw)
    num_pages = property(lambda self: self.runner.num_pages)
    slots = property(lambda self: self.scheduler.slots)
    waiting = property(lambda self: self.scheduler.waiting)

    # ---- requests ----------------------------------------------------------------------------

    def add(self, request: SequenceState) -> None:
        self.scheduler.waiting.append(request)

    def abort(self, request_id: str) -> Optional[SequenceState]:
        """Aborts every unfinished sequence of the request; returns its sequence 0."""
        found = [r for r in list(self.waiting) + self.slots
                 if r is not None and r.request_id == request_id]
        if not found:
            return None
        for req in found[0].group:
            if req in self.waiting:
                self.waiting.remove(req)
            if req.finish_reason is None:
                self._finish(req, "abort")
        return found[0].group[0]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _finish(self, req: SequenceState, reason: str) -> SequenceState:
        self.scheduler.free(req)
        for child in req.forks:  # sequences still waiting to fork from this one
            self.scheduler.free(child)
            child.finish_reason = reason
            child.stream.finish()
        req.forks = []
        req.finish_reason = reason
        req.stream.finish()
        req.metrics.finished_time = time.perf_counter()
        self.stats_counters["finished"] += 1
        return req

    def _fail(self, req: SequenceState) -> None:
        """Finishes with "error" a sequence whose host bookkeeping raised; the others go on."""
        log.exception("request %s: its bookkeeping failed; it finishes with finish_reason "
                      "'error'", req.request_id)
        req.stream.finished = True  # its text stays as it was; no flush of a broken stream
        if req.finish_reason is None:
            self._finish(req, "error")

    # ---- one scheduling step -----------------------------------------------------------------

    def step(self) -> list[SequenceState]:
        """Runs one scheduling step; returns the requests that progressed (finished included)."""
        with self.runner.on_mesh():
            self.runner.ensure_state()
            plan = self.scheduler.schedule()
            self.runner.apply(plan.admitted + [(c, c.fork_at) for c, _ in plan.forked],
                              plan.tables, [(p.slot, c.slot) for c, p in plan.forked],
                              plan.page_copies)
            if plan.multi_step:
                progressed = self._decode(plan) if plan.decode else []
            else:
                progressed = self._flat_step(plan)
        return list({id(req): req for req in progressed}.values())

    def _lora_admit(self, req: SequenceState) -> bool:
        """Gives an admitted request (and the sequences waiting to fork from it) its adapter's
        slot; False (it waits) while every slot is held by other adapters' running rows."""
        if req.lora is None:
            return True
        group = [req] + req.forks
        slot = self.loras.acquire(req.lora, [r.seq_id for r in group])
        if slot is None:
            return False
        for r in group:
            r.lora_slot = slot
        return True

    def _lora_release(self, req: SequenceState) -> None:
        self.loras.release(req.seq_id)

    def _plan_decode(self, decoding: list) -> tuple[int, Optional[np.ndarray]]:
        """A multi-step dispatch's tokens per row (pages are reserved for them) and, with
        speculation, which rows draft."""
        steps = self.engine_cfg.decode_steps
        if any(r.guide is not None for r in decoding):
            return 1, None if self.spec is None else np.zeros(len(self.slots), bool)
        if self.spec is None:
            return steps, None
        draft_on = np.zeros(len(self.slots), bool)
        for r in decoding:
            draft_on[r.slot] = draft_policy.may_draft(r)
        if draft_on.any() and not self.spec_rates.draft(len(decoding)):
            draft_on[:] = False
        return steps * (self.spec.num_draft_tokens + 1 if draft_on.any() else 1), draft_on

    def _flat_step(self, plan) -> list[SequenceState]:
        """One flat step: a token for every decoding row, then the prefill chunks."""
        segments = [(r.slot, [r.token_ids[-1]]) for r in plan.decode]
        completes = []
        want_prompt = any(r.prompt_logprobs is not None for r, _ in plan.prefill)
        nexts = [[-1] for _ in plan.decode] if want_prompt else None
        for req, n in plan.prefill:
            start = req.prefilled
            segments.append((req.slot, req.prefill_ids[start:start + n]))
            if start + n == len(req.prefill_ids):
                completes.append(req)
            if want_prompt:
                following = req.prompt_ids[start + 1:start + n + 1]  # prompt tokens only
                nexts.append(following + [-1] * (n - len(following)))
        sampling = plan.decode + completes
        want_lp = any(r.wants_logprobs for r in sampling)
        guides = {r.slot: r.guide for r in sampling if r.guide is not None}
        t0 = time.perf_counter()
        result = self.runner.step(segments, [r.slot for r in sampling], nexts, want_lp, guides)
        if guides:
            self._count_guided(guides, t0)
        self.stats_counters["prompt_tokens"] += sum(n for _, n in plan.prefill)
        if want_prompt:
            self._book_prompt_logprobs(plan, result.prompt_logprobs)
        for req, n in plan.prefill:
            req.prefilled += n
            if self.paged is not None:
                self.paged.computed(req, req.prefilled)
        progressed = []
        for req in sampling:
            try:
                lp = result.logprobs.get(req.slot) if req.wants_logprobs else None
                self._append(req, [result.tokens[req.slot]], done=result.done[req.slot],
                             lps=None if lp is None else [lp])
                self._computed(req)
            except Exception:  # noqa: BLE001 - this request's failure, not the others'
                self._fail(req)
            progressed.append(req)
        return progressed

    def _count_guided(self, guides: dict, t0: float) -> None:
        c = self.stats_counters
        c["guided_steps"] += 1
        c["guided_rows"] += len(guides)
        c["guided_step_ns"] += int((time.perf_counter() - t0) * 1e9)

    def _book_prompt_logprobs(self, plan, prompt_lp) -> None:
        ids, vals, chosen = prompt_lp
        t = len(plan.decode)
        for req, n in plan.prefill:
            if req.prompt_logprobs is not None:
                k = req.params.prompt_logprobs
                for i in range(n):
                    p = req.prefilled + i  # prompt position of this token
                    # Prompt token p + 1 is scored once: not again when a preempted request
                    # re-prefills, nor for positions a prefix-cache hit skipped (left out).
                    if p + 1 < len(req.prompt_ids) and p + 1 == len(req.prompt_logprobs):
                        req.prompt_logprobs.append(logprob_dict(
                            k, ids[t + i], vals[t + i], req.prompt_ids[p + 1], chosen[t + i]))
            t += n

    def _computed(self, req: SequenceState) -> None:
        """Everything but the newest token (fed next step) has K/V in the pages."""
        if self.paged is not None and req.finish_reason is None:
            self.paged.computed(req, len(req.prompt_ids) + len(req.token_ids) - 1)

    def _decode(self, plan) -> list[SequenceState]:
        """One decode dispatch of up to decode_steps steps per row, drafting per plan.draft_on."""
        decoding, draft_on = plan.decode, plan.draft_on
        # Each token of a constrained row needs the mask its previous token leads to: such a
        # dispatch is one step (docs/structured_outputs.md, "One step at a time").
        guides = {r.slot: r.guide for r in decoding if r.guide is not None}
        t0 = time.perf_counter()
        out, num_out, done, lp, counts = self.runner.decode(
            [r.slot for r in decoding], draft_on, exit_on_stop=bool(self.waiting),
            guides=guides)
        if guides:
            self._count_guided(guides, t0)
        if counts is not None:
            self.spec_rates.record(len(decoding), bool(draft_on.any()), int(num_out.sum()),
                                   time.perf_counter() - t0)
        lp = fetch(lp) if any(r.wants_logprobs for r in decoding) else None
        for req in decoding:
            b, n = req.slot, int(num_out[req.slot])
            try:
                lps = None if lp is None else [tuple(x[b, i] for x in lp) for i in range(n)]
                self._append(req, out[b, :n].tolist(), done=bool(done[b]), lps=lps)
                self._computed(req)
            except Exception:  # noqa: BLE001 - this request's failure, not the others'
                self._fail(req)
                continue
            if counts is not None and draft_on[b]:
                draft_policy.judge(req, int(counts.steps[b]), int(counts.drafted[b]),
                                  int(counts.accepted[b]), self.stats_counters)
        return decoding

    def _append(self, req: SequenceState, new_ids: list[int], done: bool, lps=None) -> None:
        """Books tokens the device produced and decided `done` for (a stop id, left out of the
        output, or max_new); the host adds stop strings. lps: per token (ids, values, chosen)."""
        now = time.perf_counter()
        if req.metrics.first_token_time is None and new_ids:
            req.metrics.first_token_time = now
        for i, tok in enumerate(new_ids):
            if not req.versions or req.versions[-1][1] != self.weight_version:
                req.versions.append((len(req.token_ids), self.weight_version))
            if req.sampling_lps is not None and lps is not None:
                # Every sampled token's, the stop id that ends the output included.
                req.model_lps.append(float(lps[i][2]))
                req.sampling_lps.append(float(lps[i][3]))
            if done and i == len(new_ids) - 1 and self._is_stop_id(req, tok):
                req.stop_token_id = tok
                self._finish(req, "stop")
                return
            req.token_ids.append(tok)
            if req.logprobs is not None and lps is not None:
                req.logprobs.append(logprob_dict(req.params.logprobs, *lps[i][:2], tok,
                                                  lps[i][2]))
            req.metrics.generated_tokens += 1
            req.metrics.token_times.append(now)
            self.stats_counters["generated_tokens"] += 1
            # A complete grammar ends the output: only EOS could follow.
            complete = req.guide is not None and req.guide.consume(tok)
            if req.stream.add(tok) or complete:
                self._finish(req, "stop")
                return
        if done:
            self._finish(req, "length")

    def _is_stop_id(self, req: SequenceState, token: int) -> bool:
        """Whether token is among the row's stop ids as runner.admit wrote them."""
        return not req.params.ignore_eos and token in self.eos_ids[:MAX_STOP_IDS]

    # ---- weight updates and memory (LLM.update_weights, sleep, wake_up) ----------------------

    def preempt_running(self, pick) -> int:
        """Preempts every running sequence for which pick(sequence): its tokens stay, its KV is
        recomputed when it is admitted again (under the weights then in place)."""
        chosen = [r for r in self.scheduler.running() if pick(r)]
        for req in sorted(chosen, key=lambda r: -r.admitted_order):
            self.scheduler._preempt(req)
        return len(chosen)

    def drop_prefix_cache(self) -> int:
        """Forgets the prefix cache's pages (computed under other weights)."""
        return self.paged.allocator.drop_cache() if self.paged is not None else 0

    def swap_params(self, params) -> None:
        """Weights of the same structure, shapes, dtypes and shardings (weight_sync.convert),
        for the next dispatch: the compiled programs take them as they are."""
        self.runner.params = params
        self.runner.drop_host_params()  # a copy sleep(level=2) kept is stale now
        self.weight_version += 1

    def sleep(self, level: int, keep_weights: bool) -> None:
        """Frees the KV page pool and the rows' state (level 1), and the weights too (level 2;
        copied to the host first when keep_weights). Needs an engine with no unfinished
        requests."""
        if self.has_unfinished():
            raise RuntimeError("sleep() needs an engine with no unfinished requests: let them "
                               "finish or abort them first")
        with self.runner.on_mesh():
            self.drop_prefix_cache()
            self.runner.release_state()
            if level == 2:
                self.runner.release_params(keep_weights)

    def wake_up(self) -> None:
        """Weights kept on the host back on the devices, and a new (empty) page pool."""
        with self.runner.on_mesh():
            self.runner.restore_params()
            self.runner.ensure_state()

    # ---- warmup, sizing and stats ------------------------------------------------------------

    def warmup(self) -> float:
        """Compiles every program the engine can dispatch. Needs an idle engine."""
        if self.has_unfinished():
            raise RuntimeError("warmup() needs an engine with no unfinished requests")
        t0 = time.perf_counter()
        with self.runner.on_mesh():
            self.runner.warmup(self.scheduler.take_tables(always=True))
        return time.perf_counter() - t0

    def num_programs(self) -> int:
        return self.runner.num_programs()

    def step_scratch_bytes(self) -> int:
        with self.runner.on_mesh():
            return self.runner.step_scratch_bytes()

    def set_num_pages(self, num_pages: int) -> None:
        """Resizes the (not yet allocated) page pool."""
        assert self.runner.state is None, "the pool is already allocated"
        self.runner.num_pages = num_pages
        old = self.paged
        self.paged = PagedSlots(num_pages, old.page_size, old.max_seq_len,
                                old.allocator.enable_prefix_caching, old.allocator.num_partitions)
        self.paged.resize(len(self.slots))
        self.scheduler.paged = self.paged

    def stats(self) -> dict:
        elapsed = time.perf_counter() - self.start_time
        c = self.stats_counters
        return {
            "running": sum(r is not None for r in self.slots),
            "waiting": len(self.waiting),
            "num_slots": len(self.slots),
            "max_num_seqs": self.engine_cfg.max_num_seqs,
            "prompt_tokens": c["prompt_tokens"],
            "generated_tokens": c["generated_tokens"],
            "finished_requests": c["finished"],
            "elapsed_s": elapsed,
            "generation_tokens_per_s": c["generated_tokens"] / elapsed if elapsed > 0 else 0.0,
            "preemptions": self.scheduler.preemptions,
            "parameter_bytes": tree_bytes(self.params),
            "state_bytes": tree_bytes(self.state) if self.state is not None else 0,
            "model_programs": self.num_programs(),
            "ring_slots": self.runner.ring_capacity,
            "guided_steps": c["guided_steps"],  # dispatches with constrained rows
            "guided_rows": c["guided_rows"],    # constrained rows sampled in them
            "guided_step_s": c["guided_step_ns"] / 1e9,  # those steps' time, masks included
            "guided_mask_s": self.runner.mask_s,  # host time writing their token masks
            **({"loras_loaded": len(self.loras.adapters),
                "loras_in_slots": len(self.loras.resident()),
                "lora_slot_writes": self.loras.writes} if self.loras is not None else {}),
            **({"spec_steps": c["spec_steps"], "draft_tokens": c["draft_tokens"],
                "accepted_tokens": c["accepted_tokens"],
                "acceptance_rate": c["accepted_tokens"] / max(c["draft_tokens"], 1),
                "mean_accepted_tokens": c["accepted_tokens"] / max(c["spec_steps"], 1)}
               if self.spec is not None else {}),
            **(self.paged.stats() if self.paged is not None else {}),
        }
