"""Beam search over the engine's paged cache: beams fork and die by moving block-table
references (PageAllocator.fork), never by copying a cache. Each step feeds every live beam's
newest token through one flat step; the host ranks the top-k candidates by cumulative
log-probability, keeps the best 2W, finishes those among the first W that end the sequence,
and stops at max_tokens or once no live beam can beat the W finished ones. Score: cumulative
log-probability / generated_tokens ** length_penalty, counting an ending EOS that the text
excludes. The contract is in docs/api.md ("Generating").
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import numpy as np

from jaxinfer.engine.request import RequestMetrics, SamplingParams
from jaxinfer.engine.textstream import TextStream
from jaxinfer.device.sampling import MAX_LOGPROBS

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # 2W candidates per beam come from the device's top-k


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int = 4
    max_tokens: int = 64
    length_penalty: float = 1.0
    ignore_eos: bool = False
    stop: Optional[Union[str, Sequence[str]]] = None

    def __post_init__(self):
        for name, lo, hi in (("beam_width", 1, MAX_BEAM_WIDTH), ("max_tokens", 1, None)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi and v > hi):
                raise ValueError(f"{name} must be an int in [{lo}, {hi or 'inf'}], got {v!r}")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not np.isfinite(lp):
            raise ValueError(f"length_penalty must be a finite number, got {lp!r}")
        SamplingParams(stop=self.stop)  # the same check of stop strings

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return SamplingParams(stop=self.stop).stop_strings


@dataclasses.dataclass
class BeamSequence:
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    score: float               # cumulative_logprob / generated_tokens ** length_penalty
    finish_reason: str         # "stop" (EOS or a stop string) | "length"


@dataclasses.dataclass
class BeamSearchOutput:
    prompt: Optional[str]
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]  # best first


@dataclasses.dataclass
class _Beam:
    req: object                # the engine SequenceState holding its row and pages
    cum: float                 # cumulative log-probability
    candidates: tuple = ()     # (ids [k], logprobs [k]) of its next token


def _score(cum: float, length: int, penalty: float) -> float:
    return cum / max(length, 1) ** penalty


class BeamSearch:
    """One beam search over an idle engine (LLM.beam_search builds it)."""

    def __init__(self, llm, params: BeamSearchParams):
        self.llm, self.p = llm, params
        self.engine = llm._engine
        self.runner, self.scheduler = self.engine.runner, self.engine.scheduler
        self.paged = self.engine.paged
        self.eos = set() if params.ignore_eos else set(self.engine.eos_ids)
        self.W = params.beam_width
        self._ids = 0
        self._admit = []     # [(request, start)] to write on the device before the next step
        self._forks = []     # [(source slot, slot)]
        self._copies = []    # [(src page, dst page)]

    # ---- rows ------------------------------------------------------------------------------

    def _new_request(self, prompt_ids, token_ids):
        from jaxinfer.engine.engine import SequenceState

        self._ids += 1
        sp = SamplingParams(max_tokens=self.p.max_tokens, logprobs=MAX_LOGPROBS,
                            ignore_eos=True)
        return SequenceState(request_id=("beam", self._ids), prompt=None, prompt_ids=prompt_ids,
                       params=sp, seed=0, max_new=self.p.max_tokens,
                       stream=TextStream(None), metrics=RequestMetrics(),
                       token_ids=list(token_ids))

    def _replica(self, slot: int) -> int:
        return slot * self.scheduler.data // len(self.scheduler.slots)

    def _slot(self, replica: int) -> int:
        """A free slot of a data replica (a beam's row must sit with its pages)."""
        per = len(self.scheduler.slots) // self.scheduler.data
        for b in range(replica * per, (replica + 1) * per):
            if self.scheduler.slots[b] is None:
                return b
        raise RuntimeError("beam search needs a free slot per beam")

    def _release(self, req) -> None:
        self.scheduler.free(req)

    def _fork(self, source, token: int):
        """A new beam continuing `source` with `token`: shares its pages (one copied)."""
        child = self._new_request(source.prompt_ids, source.token_ids + [token])
        child.slot = self._slot(self._replica(source.slot))
        self.scheduler.slots[child.slot] = child
        length = len(source.prompt_ids) + len(source.token_ids)
        if self.paged is not None:
            copies = self.paged.fork(source, child, length)
            if copies is None:
                raise RuntimeError("beam search ran out of KV pages")
            self._copies += copies
        self._admit.append((child, length))
        self._forks.append((source.slot, child.slot))
        return child

    def _sync_device(self) -> None:
        self.runner.apply(self._admit, self.scheduler.take_tables(always=True), self._forks,
                          self._copies)
        self._admit, self._forks, self._copies = [], [], []

    def _run(self, segments: list, sample: list) -> dict:
        """One flat step; returns {slot: (top ids, top logprobs)} of the rows in `sample`."""
        self._sync_device()
        res = self.runner.step(segments, [r.slot for r in sample], None, want_logprobs=True)
        out = {}
        for req in sample:
            ids, vals = res.logprobs[req.slot][:2]
            out[req.slot] = (np.asarray(ids), np.asarray(vals, np.float64))
        return out

    # ---- the search --------------------------------------------------------------------------

    def prefill(self, prompts: list[list[int]]) -> list[_Beam]:
        """Every prompt's root beam, its prompt prefilled in chunks as the scheduler cuts them
        (a ring holds a window plus one chunk)."""
        roots = []
        for k, ids in enumerate(prompts):
            req = self._new_request(ids, [])
            req.prefill_ids = list(ids)
            replica = k % self.scheduler.data
            slot = self._slot(replica)
            cached = 0
            if self.paged is not None:
                cached = self.paged.admit(req, slot, replica)
                if cached is None:
                    raise RuntimeError("beam search ran out of KV pages")
            req.slot, req.prefilled = slot, cached
            self.scheduler.slots[slot] = req
            self._admit.append((req, cached))
            roots.append(_Beam(req, 0.0))
        ecfg = self.engine.engine_cfg
        budget, chunk = ecfg.max_num_batched_tokens, ecfg.prefill_chunk
        while any(b.req.prefilled < len(b.req.prefill_ids) for b in roots):
            segments, done, left = [], [], budget
            for b in roots:
                r = b.req
                n = min(len(r.prefill_ids) - r.prefilled, left, chunk)
                if n <= 0:
                    continue
                segments.append((r.slot, r.prefill_ids[r.prefilled:r.prefilled + n]))
                r.prefilled += n
                left -= n
                if r.prefilled == len(r.prefill_ids):
                    done.append(b)
            got = self._run(segments, [b.req for b in done])
            for b in done:
                b.candidates = got[b.req.slot]
                if self.paged is not None:
                    self.paged.computed(b.req, len(b.req.prefill_ids))
        return roots

    def _stops(self, req, token: int) -> Optional[str]:
        """Why appending token ends the beam: "stop" (EOS or a stop string) or None."""
        if token in self.eos:
            return "stop"
        stops = self.p.stop_strings
        if stops and self.llm.tokenizer is not None:
            text = self.llm.tokenizer.decode(req.token_ids + [token])
            if any(s in text for s in stops):
                return "stop"
        return None

    def advance(self, beams: list[_Beam], finished: list) -> list[_Beam]:
        """One step of one prompt's search: the next beams (rows rearranged on the host)."""
        W, lp = self.W, self.p.length_penalty
        cands = []
        for i, b in enumerate(beams):
            ids, vals = b.candidates
            for rank in range(min(2 * W, len(ids))):
                cands.append((b.cum + vals[rank], i, rank, int(ids[rank])))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        children: dict[int, list] = {i: [] for i in range(len(beams))}
        taken = 0
        for rank, (cum, i, _, token) in enumerate(cands[:2 * W]):
            if taken == W:
                break
            parent = beams[i].req
            reason = self._stops(parent, token)
            if reason is not None:
                if rank < W:
                    finished.append((_score(cum, len(parent.token_ids) + 1, lp), cum,
                                     list(parent.token_ids) + ([] if token in self.eos
                                                               else [token]), reason))
                continue
            children[i].append((cum, token))
            taken += 1
        for i, b in enumerate(beams):         # dead beams first: their slots serve the forks
            if not children[i]:
                self._release(b.req)
        new = []
        for i, b in enumerate(beams):
            kids = children[i]
            for cum, token in kids[1:]:       # forks before the parent's own next token
                new.append(_Beam(self._fork(b.req, token), cum))
            if kids:                          # the first child continues the parent's row
                cum, token = kids[0]
                b.req.token_ids.append(token)
                new.append(_Beam(b.req, cum))
        return new

    def feed(self, beams: list[_Beam]) -> None:
        """Every live beam's newest token through one step: their next candidates."""
        for b in beams:
            r = b.req
            length = len(r.prompt_ids) + len(r.token_ids)
            if self.paged is not None and not self.paged.grow(r, length):
                raise RuntimeError("beam search ran out of KV pages")
        got = self._run([(b.req.slot, [b.req.token_ids[-1]]) for b in beams],
                        [b.req for b in beams])
        for b in beams:
            b.candidates = got[b.req.slot]
            if self.paged is not None:
                self.paged.computed(b.req, len(b.req.prompt_ids) + len(b.req.token_ids))

    def result(self, finished: list) -> list[BeamSequence]:
        finished.sort(key=lambda f: -f[0])
        tok = self.llm.tokenizer
        out = []
        for score, cum, ids, reason in finished[:self.W]:
            text = tok.decode(ids) if tok is not None else ""
            for s in self.p.stop_strings:  # the text ends before a stop string
                cut = text.find(s)
                text = text[:cut] if cut >= 0 else text
            out.append(BeamSequence(text=text, token_ids=ids, cumulative_logprob=float(cum),
                                    score=float(score), finish_reason=reason))
        return out

    def search(self, prompts: list[list[int]]) -> list[list[BeamSequence]]:
        """The W best hypotheses of each prompt, best first."""
        W, lp = self.W, self.p.length_penalty
        max_seq_len = self.engine.engine_cfg.max_seq_len
        limits = [min(self.p.max_tokens, max_seq_len - len(ids)) for ids in prompts]
        roots = self.prefill(prompts)
        live = [[r] for r in roots]
        finished = [[] for _ in prompts]
        step = 0
        while any(live):
            for k in range(len(prompts)):
                if not live[k]:
                    continue
                live[k] = self.advance(live[k], finished[k])
                best = max((_score(b.cum, len(b.req.token_ids), lp) for b in live[k]),
                           default=-np.inf)
                top = sorted((f[0] for f in finished[k]), reverse=True)[:W]
                if step + 1 >= limits[k]:
                    finished[k] += self._close(live[k])
                    live[k] = []
                elif len(top) == W and best <= top[-1]:  # no live beam can enter the top W
                    for b in live[k]:
                        self._release(b.req)
                    live[k] = []
            step += 1
            if any(live):
                self.feed([b for beams in live for b in beams])
        return [self.result(finished[k]) for k in range(len(prompts))]

    def _close(self, beams: list[_Beam]) -> list:
        """Live beams as finished hypotheses ("length"), their rows released."""
        out = []
        for b in beams:
            out.append((_score(b.cum, len(b.req.token_ids), self.p.length_penalty), b.cum,
                        list(b.req.token_ids), "length"))
            self._release(b.req)
        return out
