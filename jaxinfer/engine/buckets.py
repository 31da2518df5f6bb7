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


# Per-backend settings of the step, measured on each (docs/architecture.md, "Buckets"):
#   min_tokens   smallest token bucket of a step with prefill;
#   query_tile   queries per attention tile of such a step (jaxinfer.attention.RaggedMeta).
BACKEND = {
    "cpu": {"min_tokens": 16, "query_tile": 16},
    "gpu": {"min_tokens": 16, "query_tile": 16},
}


def backend_settings(backend: str) -> dict:
    return BACKEND.get(backend, BACKEND["gpu"])
