"""Compiled-shape buckets: every program the engine runs is keyed by one of these sizes, so a
bounded set of programs serves any mix of requests (see Runner.num_programs)."""

from __future__ import annotations


def doubling(limit: int, base: int) -> tuple[int, ...]:
    """base, 2 * base, 4 * base, ... below limit, then limit."""
    out, b = [], base
    while b < limit:
        out.append(b)
        b *= 2
    return tuple(out) + (limit,)


def pick(buckets: tuple[int, ...], n: int) -> int:
    """The smallest bucket holding n (the largest when none does)."""
    for b in buckets:
        if b >= n:
            return b
    return buckets[-1]

