"""The scheduler (host only): each step it admits waiting requests while slots and pages last,
then plans one flat step (a token for every decoding row plus prefill chunks of the oldest
prefilling requests within the token budget) or, with nothing to prefill, one multi-step
decode dispatch. It reserves the plan's pages, preempting the newest requests while pages run
short, so the plan is final for its dispatch.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Optional

import numpy as np

from jaxinfer.engine import buckets
from jaxinfer.engine.slot_pages import PagedSlots


@dataclasses.dataclass
class SchedulerOutput:
    admitted: list            # [(request, cached tokens)] placed in slots this step
    prefill: list             # [(request, tokens)]: chunks from request.prefilled on
    decode: list              # requests feeding their newest token
    multi_step: bool          # nothing to prefill: one dispatch of several decode steps
    forked: list = dataclasses.field(default_factory=list)       # [(sequence, its source)]
    page_copies: list = dataclasses.field(default_factory=list)  # [(src page, dst page)]
    draft_on: Optional[np.ndarray] = None  # multi-step with speculation: [B] rows that draft
    tables: Optional[np.ndarray] = None    # the block tables where they changed, else None


class Scheduler:
    def __init__(self, num_slots: int, max_num_batched_tokens: int, prefill_chunk: int,
                 paged: Optional[PagedSlots] = None, data: int = 1,
                 fill_buckets: Optional[tuple[int, ...]] = None,
                 decode_plan: Optional[Callable] = None,
                 admit_check: Optional[Callable] = None, release: Optional[Callable] = None):
        self.slots: list = [None] * num_slots
        self.waiting: collections.deque = collections.deque()
        self.budget = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk
        self.paged = paged
        self.data = data
        self.fill_buckets = fill_buckets
        # decode_plan(decoding) -> (tokens per row, draft_on or None) of a multi-step dispatch.
        self.decode_plan = decode_plan or (lambda decoding: (1, None))
        # admit_check(request) -> whether it may start now (its LoRA adapter has a slot);
        # release(request) when it leaves its slot (finished or preempted).
        self.admit_check = admit_check or (lambda req: True)
        self.release = release or (lambda req: None)
        self.admissions = 0
        self.preemptions = 0

    def running(self) -> list:
        """Sequences in slots, those waiting to fork excluded (they hold no pages)."""
        return [r for r in self.slots if r is not None and not r.waiting_fork]

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.slots)

    def free(self, req) -> None:
        """Releases a finished (or aborted) request's slot and pages."""
        self.release(req)
        if self.paged is not None:
            self.paged.release(req)
        if req.slot is not None and self.slots[req.slot] is req:
            self.slots[req.slot] = None

    def schedule(self) -> SchedulerOutput:
        admitted = self._admit()
        forked, copies = self._fork()
        active = [r for r in self.slots if r is not None and not r.waiting_fork]
        decoding = [r for r in active if r.prefilled == len(r.prefill_ids)]
        prefilling = sorted((r for r in active if r.prefilled < len(r.prefill_ids)),
                            key=lambda r: r.admitted_order)
        tokens, draft_on = (1, None) if prefilling or not decoding \
            else self.decode_plan(decoding)
        preempted = self.reserve(decoding, tokens) if decoding else []
        chunks = []
        if prefilling:
            admitted, forked = self._still_placed(admitted, forked, preempted)
            budget = self.budget - sum(r.slot is not None for r in decoding)
            for req in prefilling:
                if req.slot is None:  # preempted just now
                    continue
                # A request whose sequences wait to fork stops before its last prompt token.
                end = req.fork_at if req.forks else len(req.prefill_ids)
                take = min(end - req.prefilled, self.prefill_chunk, budget)
                if take <= 0:
                    if req.forks:
                        continue  # waits for pages to fork
                    break
                chunks.append((req, take))
                budget -= take
            if chunks and self.fill_buckets:
                chunks = self._fill(chunks, sum(r.slot is not None for r in decoding))
            if not chunks and decoding:  # the prefilling rows wait (pages, forks): decode
                tokens, draft_on = self.decode_plan(decoding)
                preempted += self.reserve(decoding, tokens)
        admitted, forked = self._still_placed(admitted, forked, preempted)
        return SchedulerOutput(admitted, chunks, [r for r in decoding if r.slot is not None],
                               multi_step=not chunks, forked=forked,
                               page_copies=copies, draft_on=draft_on, tables=self.take_tables())

    def _still_placed(self, admitted: list, forked: list, preempted: list) -> tuple:
        """This round's admissions and forks that no preemption undid: a preempted one must not
        reach the device (it has no row), and a fork whose source went waits again too."""
        for child, source in forked:
            if source.slot is None and child.slot is not None:
                self._preempt(child)
                preempted.append(child)
        return ([(r, c) for r, c in admitted if r.slot is not None],
                [(c, p) for c, p in forked if c.slot is not None])

    def _fill(self, chunks: list, decodes: int) -> list:
        """chunks trimmed from the newest to the token count buckets.fill picks (unchanged
        when it pads the step up instead)."""
        total = decodes + sum(n for _, n in chunks)
        cut = total - buckets.fill(self.fill_buckets, decodes, total)
        while cut > 0:
            req, n = chunks.pop()
            if n > cut:
                chunks.append((req, n - cut))
            cut -= n
        return chunks

    def _free_slots(self, need: int) -> Optional[list[int]]:
        """`need` free slots of one data replica (a group's sequences share pages), or None."""
        per = len(self.slots) // self.data
        for d in range(self.data):
            free = [b for b in range(d * per, (d + 1) * per) if self.slots[b] is None]
            if len(free) >= need:
                return free[:need]
        return None

    def _admit(self) -> list:
        """Moves waiting requests into free slots, first come first served, while pages last.
        A request of n sequences not yet forked takes n slots of one replica at once."""
        now = time.perf_counter()
        admitted = []
        while self.waiting:
            req = self.waiting[0]
            slots = self._free_slots(1 + len(req.forks))
            if slots is None:
                break
            b = slots[0]
            if not self.admit_check(req):
                break  # waits for its adapter's slot
            # After a preemption the tokens already produced are re-prefilled, never re-sampled.
            req.prefill_ids = req.prompt_ids + req.token_ids
            cached = 0
            if self.paged is not None:
                cached = self.paged.admit(req, b, b * self.data // len(self.slots))
                if cached is None:
                    for r in [req] + req.forks:
                        self.release(r)
                    break  # wait for pages
            self.waiting.popleft()
            req.slot, req.prefilled = b, cached
            req.metrics.prefix_cache_hit_tokens += cached
            req.admitted_order = self.admissions
            self.admissions += 1
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            self.slots[b] = req
            for child, c in zip(req.forks, slots[1:]):
                child.slot, child.waiting_fork = c, True
                child.admitted_order = req.admitted_order
                self.slots[c] = child
            admitted.append((req, cached))
        return admitted

    def _fork(self) -> tuple[list, list]:
        """Forks the sequences waiting on a request whose prompt but its last token is in the
        cache. Returns ([(sequence, source)], [(src page, dst page)])."""
        forked, copies = [], []
        for req in self.slots:
            if req is None or not req.forks or req.prefilled < req.fork_at:
                continue
            for child in list(req.forks):
                if self.paged is not None:
                    got = self.paged.fork(req, child, req.fork_at)
                    if got is None:
                        break  # wait for a free page
                    copies += got
                child.prefill_ids, child.prefilled = list(child.prompt_ids), req.fork_at
                child.waiting_fork = False
                req.forks.remove(child)
                forked.append((child, req))
        return forked, copies

    def reserve(self, decoding: list, tokens: int) -> list:
        """Gives every decoding request pages for `tokens` more tokens, preempting the newest
        running requests while pages run short; returns the preempted."""
        if self.paged is None:
            return []
        preempted = []
        for req in sorted(decoding, key=lambda r: r.admitted_order):
            if req.slot is None:
                continue  # preempted meanwhile
            while not self.paged.grow(req, len(req.prompt_ids) + len(req.token_ids) + tokens):
                victim = max(self.running(), key=lambda r: r.admitted_order)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
        return preempted

    def _preempt(self, req) -> None:
        for r in [req] + req.forks:
            self.release(r)
        self.paged.release(req)
        self.slots[req.slot] = None
        for child in req.forks:  # not forked yet: they wait with it
            self.slots[child.slot] = None
            child.slot, child.waiting_fork = None, False
        req.slot, req.prefilled = None, 0
        req.metrics.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def take_tables(self, always: bool = False):
        """A paged cache's block tables if they changed since the last call (always: in any
        case), else None; None for a ring."""
        if self.paged is None:
            return None
        tables = self.paged.take_tables()
        return self.paged.tables.copy() if tables is None and always else tables
