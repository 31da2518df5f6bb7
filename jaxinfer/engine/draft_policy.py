"""Speculation policy on the host: whether a decode dispatch drafts, and per request whether
drafting pays (acceptance), measured as the engine runs."""

from __future__ import annotations

import collections

# Adaptive speculation: every SPEC_JUDGE_STEPS verification steps a request's accepted drafts per
# step are judged; below SPEC_MIN_ACCEPTED its drafting pauses for SPEC_PAUSE_TOKENS generated
# tokens, doubling on each further pause up to SPEC_MAX_PAUSE_TOKENS (a pass resets it).
SPEC_JUDGE_STEPS = 8
SPEC_MIN_ACCEPTED = 0.5
SPEC_PAUSE_TOKENS = 32
SPEC_MAX_PAUSE_TOKENS = 1024


class SpeculationRates:
    """Whether drafting pays at a batch size, measured: the output tokens/s of recent decode
    dispatches with drafting and without (moving averages, per row-bucket size). Verifying k
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
