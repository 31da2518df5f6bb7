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
    """How many of a step's `total` tokens (`fixed` decode tokens, the rest prefill) to carry
    where padding costs what a real token does: trimmed to the largest bucket below `total`
    with room beyond `fixed`, or all `total` padded to the next bucket, whichever is nearer
    (a tie pads). Always trimming lets a prompt trickle in a few tokens a step; always padding
    multiplies padding (docs/architecture.md)."""
    below = [b for b in buckets if fixed < b <= total]
    above = [b for b in buckets if b >= total]
    if not below:
        return total
    if not above:
        return max(below)
    down, up = max(below), min(above)
    return total if up - total <= total - down else down
