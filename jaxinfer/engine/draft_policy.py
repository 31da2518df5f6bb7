"""Speculation policy on the host: whether a decode dispatch drafts, and per request whether
drafting pays (acceptance), both judged from what the engine observes as it runs."""

from __future__ import annotations

import collections

# Every SPEC_JUDGE_STEPS verification steps, a request accepting under SPEC_MIN_ACCEPTED drafts
# a step pauses drafting for SPEC_PAUSE_TOKENS tokens, doubling to SPEC_MAX_PAUSE_TOKENS until a
# judgement passes.
SPEC_JUDGE_STEPS = 8
SPEC_MIN_ACCEPTED = 0.5
SPEC_PAUSE_TOKENS = 32
SPEC_MAX_PAUSE_TOKENS = 1024


class SpeculationRates:
    """Whether drafting pays at a batch size, from moving averages of recent dispatches' output
    tokens/s with and without it (verifying is cheap where a step reads weights, costly where it
    computes); the loser is retried every PROBE_EVERY dispatches as acceptance changes."""

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
        winner = spec >= plain
        self.since_probe[batch] += 1
        if self.since_probe[batch] >= self.PROBE_EVERY:  # re-measure the losing mode
            self.since_probe[batch] = 0
            return not winner
        return winner

    def record(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0 or tokens <= 0:
            return
        rate, key = tokens / seconds, (batch, drafted)
        old = self.rates.get(key)
        self.rates[key] = rate if old is None else (1 - self.ALPHA) * old + self.ALPHA * rate


def may_draft(req) -> bool:
    """Drafting is not paused for this request (low acceptance)."""
    return len(req.token_ids) >= req.spec_resume_at


def judge(req, steps: int, drafted: int, accepted: int, counters) -> None:
    """Books a dispatch's speculation counts; pauses drafting when acceptance stays low."""
    m = req.metrics
    m.spec_steps += steps
    m.draft_tokens += drafted
    m.accepted_tokens += accepted
    for name, v in (("spec_steps", steps), ("draft_tokens", drafted),
                    ("accepted_tokens", accepted)):
        counters[name] += v
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
