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


def fill_down(buckets: tuple[int, ...], fixed: int, total: int) -> int:
    """How many tokens a step should carry to fill a bucket exactly: the largest bucket of at
    most `total` tokens that leaves room for at least one token beyond the `fixed` ones (the
    decode tokens); `total` itself when there is none (the step is then padded up)."""
    best = total
    for b in buckets:
        if fixed < b <= total:
            best = b
    return best
