"""Compiled-shape buckets: every program the engine runs is keyed by one of these sizes, so a
bounded set of programs serves any mix of requests (see Runner.num_programs)."""

from __future__ import annotations


def geometric(limit: int, base: int, factor: int = 2) -> tuple[int, ...]:
    """base, factor * base, factor^2 * base, ... below limit, then limit."""
    out, b = [], base
    while b < limit:
        out.append(b)
        b *= factor
    return tuple(out) + (limit,)


def pick(buckets: tuple[int, ...], n: int) -> int:
    """The smallest bucket holding n (the largest when none does)."""
    for b in buckets:
        if b >= n:
            return b
    return buckets[-1]


def fill(buckets: tuple[int, ...], fixed: int, total: int) -> int:
    """How many of a step's `total` tokens (`fixed` decode tokens, the rest prefill) it should
    carry where a padding token costs what a real one does: a bucket's worth, trimmed down to
    the largest bucket of at most `total` tokens that leaves room for at least one beyond the
    `fixed` ones, or all `total`, padded up to the smallest bucket holding them, whichever is
    nearer to `total` (padding up on a tie). Trimming to a bucket far below left a prefill to
    trickle in a token or a few per step (15 decode rows and a new 25-token prompt: 25 steps
    of 15 + 1 tokens, where padding 40 tokens up to 64 takes one); padding up to a bucket far
    above multiplies padding (15 + 53 tokens: 188 padding tokens up to 256, where trimming to
    64 leaves 4 for the next steps). `total` when no bucket is below it, or none above."""
    below = [b for b in buckets if fixed < b <= total]
    above = [b for b in buckets if b >= total]
    if not below:
        return total
    if not above:
        return max(below)
    down, up = max(below), min(above)
    return total if up - total <= total - down else down
