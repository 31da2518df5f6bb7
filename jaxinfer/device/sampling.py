"""Token sampling over per-row parameter arrays ([B] each: a new temperature compiles nothing).

Token i of a request is drawn with fold_in(key(seed), i) alone, so a seeded request gives the
same tokens whatever shares the batch. Order (as HF and vLLM): repetition penalty, temperature,
top-k, top-p over the renormalised top-k survivors, min-p, then an inverse-CDF draw (`draw`:
one uniform per token, cheaper on XLA:CPU than Gumbel-max's one per vocabulary entry).
temperature == 0 is greedy (argmax after the repetition penalty).
"""

from __future__ import annotations

import functools
from typing import Callable, Union

import flax.struct
import jax
import jax.numpy as jnp

from jaxinfer import backends


@flax.struct.dataclass
class SamplingArrays:
    temperature: jax.Array         # [B] float32; 0 = greedy
    top_k: jax.Array               # [B] int32; 0 = off
    top_p: jax.Array               # [B] float32 in (0, 1]
    min_p: jax.Array               # [B] float32 in [0, 1)
    repetition_penalty: jax.Array  # [B] float32 > 0; 1 = off
    seed: jax.Array                # [B] uint32


Seen = Union[jax.Array, Callable[[], jax.Array]]


def logsumexp(x: jax.Array, backend, keepdims: bool = False) -> jax.Array:
    """log(sum(exp(x))) over the last axis, the sum by backend.row_sum (one order per row,
    whatever the batch); -inf for a row of -inf."""
    top = jnp.max(x, axis=-1, keepdims=True)
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    out = jnp.log(backend.row_sum(jnp.exp(x - shift)))[..., None] + shift
    return out if keepdims else out[..., 0]


def apply_repetition_penalty(logits: jax.Array, seen: Seen, penalty: jax.Array) -> jax.Array:
    """logits [B, V] float32; seen [B, V] bool (or a function giving it, called only where a
    penalty applies); penalty [B]. Skipped when every penalty is 1 (five passes over [B, V])."""
    def penalize(logits):
        pen = penalty[:, None]
        penalized = jnp.where(logits > 0, logits / pen, logits * pen)
        return jnp.where(seen() if callable(seen) else seen, penalized, logits)
    return jax.lax.cond(jnp.any(penalty != 1.0), penalize, lambda logits: logits, logits)


# Candidate counts tried before top-k / top-p sort a whole vocabulary (docs/sampling.md); with
# the native sort, a full sort is cheaper than XLA's top 4,096.
SORT_CANDIDATES = (256, 4096)
NATIVE_SORT_CANDIDATES = (256,)


def filtered_logits(logits: jax.Array, sp: SamplingArrays, backend=None,
                    candidates: tuple[int, ...] | None = None) -> jax.Array:
    """Temperature-scaled logits [B, V] with tokens outside top-k / top-p / min-p at -inf.

    Top-k / top-p rows are filtered over their candidates[0] most likely tokens when every
    row's survivors surely lie among them, else the next count is tried, last a full sort; each
    keeps what the full sort keeps. candidates=None: NATIVE_SORT_CANDIDATES with the native
    sort, else SORT_CANDIDATES."""
    backend = backend if backend is not None else backends.default()
    if candidates is None:
        candidates = NATIVE_SORT_CANDIDATES if backend.native_sort(logits) else SORT_CANDIDATES
    temp = jnp.where(sp.temperature > 0, sp.temperature, 1.0)
    scaled = logits / temp[:, None]
    # Only top-k and top-p need the vocabulary ordered; min-p is relative to the maximum.
    needs_sort = jnp.any((sp.top_k > 0) | (sp.top_p < 1.0))
    return jax.lax.cond(needs_sort, functools.partial(_candidate_filter, candidates=candidates,
                                                      backend=backend),
                        _min_p_filter, scaled, sp)


def filtered_weights(logits: jax.Array, sp: SamplingArrays, backend=None) -> jax.Array:
    """Each row's sampling distribution up to a factor, [B, V] float32: exp(filtered - max)."""
    masked = filtered_logits(logits, sp, backend)
    return jnp.exp(masked - jnp.max(masked, axis=-1, keepdims=True))


def _min_p_filter(scaled: jax.Array, sp: SamplingArrays) -> jax.Array:
    """filtered_logits for rows without top-k and top-p: p_i >= min_p * p_max."""
    rel = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))
    return jnp.where(rel >= sp.min_p[:, None], scaled, -jnp.inf)


def _top_k_size(sp: SamplingArrays, V: int) -> jax.Array:
    """[B] int32: how many tokens each row's top-k keeps (V where top-k is off)."""
    return jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, V), V)


def _keep_sorted(sorted_logits: jax.Array, sp: SamplingArrays, V: int, backend,
                 log_total: jax.Array):
    """(keep, probs) [B, C] of the first C of V tokens in descending order: which survive
    top-k, top-p and min-p, and their probabilities over the top-k set (log_total [B, 1]: the
    whole vocabulary's log weight, that set's where top-k is off)."""
    B, C = sorted_logits.shape
    rank = jnp.arange(C, dtype=jnp.int32)[None, :]
    k = _top_k_size(sp, V)[:, None]
    keep = rank < k
    in_k = logsumexp(jnp.where(keep, sorted_logits, -jnp.inf), backend, keepdims=True)
    # Top-k off: the whole vocabulary's log weight, summed in vocabulary order by every path
    # (the candidates' and the full sort's), so the kept set is the same whichever serves.
    lse = jnp.where(k < V, in_k, log_total)
    probs = jnp.where(keep, jnp.exp(sorted_logits - lse), 0.0)
    # The smallest prefix whose mass reaches top_p (the most likely token always stays). A
    # log-depth scan: XLA:CPU's jnp.cumsum (a reduce_window) was several times slower.
    mass_before = jax.lax.associative_scan(jnp.add, probs, axis=-1) - probs
    # top_p == 1 is "off": the float32 running sum reaches 1.0 before the tail.
    keep &= (mass_before < sp.top_p[:, None]) | (sp.top_p[:, None] >= 1.0)
    keep &= probs >= sp.min_p[:, None] * probs[:, :1]
    return keep, probs


def _candidate_filter(scaled: jax.Array, sp: SamplingArrays, candidates: tuple[int, ...],
                      backend):
    """filtered_logits over the first candidate count that holds every row's survivors, else
    the next, else the full sort."""
    V = scaled.shape[-1]
    caps = tuple(c for c in candidates if c < V)
    if not caps:
        return _sorted_filter(scaled, sp, backend)
    C = caps[0]
    vals, idx = backend.top(scaled, C)  # descending; equal values: lower index first
    keep, probs = _keep_sorted(vals, sp, V, backend, logsumexp(scaled, backend, keepdims=True))
    k = _top_k_size(sp, V)
    # Covered: top-k stops within the candidates, or their mass already reaches top_p.
    uses_sort = (sp.top_k > 0) | (sp.top_p < 1.0)
    covered = ~uses_sort | (k <= C) | ((k >= V) & (jnp.sum(probs, axis=-1) >= sp.top_p))
    sorted_rows = _in_vocab_order(scaled, vals, idx, keep, backend)
    filtered = jnp.where(uses_sort[:, None], sorted_rows, _min_p_filter(scaled, sp))
    return jax.lax.cond(jnp.all(covered), lambda s, p: filtered,
                        functools.partial(_candidate_filter, candidates=caps[1:],
                                          backend=backend), scaled, sp)


def _sorted_filter(scaled: jax.Array, sp: SamplingArrays, backend) -> jax.Array:
    """filtered_logits by sorting each row's whole vocabulary (backend.sort)."""
    sorted_logits, order = backend.sort(scaled)
    keep, _ = _keep_sorted(sorted_logits, sp, scaled.shape[-1], backend,
                           logsumexp(scaled, backend, keepdims=True))
    return _in_vocab_order(scaled, sorted_logits, order, keep, backend)


def _in_vocab_order(scaled: jax.Array, sorted_logits: jax.Array, order: jax.Array,
                    keep: jax.Array, backend) -> jax.Array:
    """scaled [B, V] with all but the survivors (keep [B, C] of the first C of each row's
    descending order) at -inf: _kept_prefix with the native sort's order, else a scatter."""
    if backend.native_sort(scaled):
        return _kept_prefix(scaled, sorted_logits, order, keep)
    B, V = scaled.shape
    return jnp.full((B, V), -jnp.inf, scaled.dtype).at[jnp.arange(B)[:, None], order].set(
        jnp.where(keep, sorted_logits, -jnp.inf))


def _kept_prefix(scaled: jax.Array, sorted_logits: jax.Array, order: jax.Array,
                 keep: jax.Array) -> jax.Array:
    """scaled [B, V] outside the first n of the native sort's order at -inf, n the survivors in
    keep [B, C]. The filters keep a prefix of that order, so the survivors are the tokens above
    the n-th value and those equal to it up to its index: one comparison, no scatter."""
    V = scaled.shape[-1]
    n = jnp.sum(keep, axis=-1, dtype=jnp.int32, keepdims=True)
    last = jnp.maximum(n - 1, 0)
    value = jnp.take_along_axis(sorted_logits, last, axis=-1)
    index = jnp.take_along_axis(order, last, axis=-1)
    vocab = jnp.arange(V, dtype=index.dtype)[None, :]
    kept = (n > 0) & ((scaled > value) | ((scaled == value) & (vocab <= index)))
    return jnp.where(kept, scaled, -jnp.inf)


DRAW_BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF


def draw(weights: jax.Array, u: jax.Array, backend=None, block: int = DRAW_BLOCK) -> jax.Array:
    """Inverse-CDF draw: for weights [B, V] (>= 0, unnormalised) and u [B] in [0, 1), the first
    token whose cumulative weight exceeds u * total -> [B] int32; weight 0 is never drawn.
    Two levels (block sums, then within the picked block), so no scan spans the vocabulary."""
    B, V = weights.shape
    C = -(-V // block)
    w = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, C * block - V))).reshape(B, C, block)
    backend = backend if backend is not None else backends.default()
    sums = backend.row_sum(w)                                              # [B, C]
    csum = jnp.cumsum(sums, axis=-1)
    target = u.astype(jnp.float32) * csum[:, -1]
    c = _first_or_last(csum > target[:, None], sums > 0)                   # [B]
    ws = jnp.take_along_axis(w, c[:, None, None], axis=1)[:, 0]            # [B, block]
    before = jnp.take_along_axis(csum - sums, c[:, None], axis=1)[:, 0]
    rest = jnp.maximum(target - before, 0.0)
    i = _first_or_last(jnp.cumsum(ws, axis=-1) > rest[:, None], ws > 0)
    return (c * block + i).astype(jnp.int32)


def _first_or_last(hit: jax.Array, positive: jax.Array) -> jax.Array:
    """Per row: the first index where hit & positive, else the last where positive."""
    n = hit.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    first = jnp.min(jnp.where(hit & positive, idx, n), axis=-1)
    last = jnp.max(jnp.where(positive, idx, -1), axis=-1)
    return jnp.where(first < n, first, jnp.maximum(last, 0))


def uniforms(seed: jax.Array, token_index: jax.Array, stream: int | None = None) -> jax.Array:
    """u [B] in [0, 1): uniform(fold_in(key(seed), token_index)), or of fold_in(that key,
    stream), a separate stream (speculative decoding's proposal and acceptance draws)."""
    def one(s, i):
        key = jax.random.fold_in(jax.random.key(s), i)
        if stream is not None:
            key = jax.random.fold_in(key, stream)
        return jax.random.uniform(key, (), jnp.float32)
    return jax.vmap(one)(seed, token_index)


ALL_TOKENS = -1  # a mask word with every bit set: the row is not constrained


def apply_token_mask(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """logits [B, V] with the tokens not allowed at -inf. allowed [B, ceil(V/32)] int32: bit j
    of word w allows token 32 w + j (llguidance's packed layout); a row of ALL_TOKENS words is
    unconstrained. Batches without a constrained row skip the unpacking."""
    V = logits.shape[-1]

    def masked(logits):
        bits = jnp.right_shift(allowed.astype(jnp.uint32)[:, :, None],
                               jnp.arange(32, dtype=jnp.uint32))
        keep = (bits & 1).astype(bool).reshape(allowed.shape[0], -1)[:, :V]
        return jnp.where(keep, logits, -jnp.inf)

    return jax.lax.cond(jnp.any(allowed != ALL_TOKENS), masked, lambda x: x, logits)


def sample(logits: jax.Array, sp: SamplingArrays, seen: Seen, token_index: jax.Array,
           backend=None, allowed: jax.Array | None = None) -> jax.Array:
    """One token per row: logits [B, V]; seen [B, V] bool (or a function giving it);
    token_index [B] int32 (the token's index in its request's output); allowed: packed token
    masks (apply_token_mask), applied before every other step -> [B] int32."""
    backend = backend if backend is not None else backends.default()
    if allowed is not None:
        logits = apply_token_mask(logits.astype(jnp.float32), allowed)
    def full(logits):
        logits = apply_repetition_penalty(logits, seen, sp.repetition_penalty)
        greedy = backend.argmax(logits)

        def stochastic(logits):
            drawn = draw(filtered_weights(logits, sp, backend), uniforms(sp.seed, token_index),
                         backend)
            return jnp.where(sp.temperature > 0, drawn, greedy)

        # All-greedy batches skip the filters' sort.
        return jax.lax.cond(jnp.any(sp.temperature > 0), stochastic, lambda _: greedy, logits)

    # All greedy without a penalty: the argmax alone (a skipped cond still copies the logits).
    plain = jnp.all(sp.temperature <= 0) & jnp.all(sp.repetition_penalty == 1.0)
    return jax.lax.cond(plain, backend.argmax, full, logits.astype(jnp.float32))


def sampling_probs(logits: jax.Array, sp: SamplingArrays, seen: jax.Array,
                   backend=None) -> jax.Array:
    """The distribution `sample` draws from, [B, V] float32 (one-hot for greedy rows)."""
    backend = backend if backend is not None else backends.default()
    logits = apply_repetition_penalty(logits.astype(jnp.float32), seen, sp.repetition_penalty)
    V = logits.shape[-1]
    greedy = jax.nn.one_hot(backend.argmax(logits), V, dtype=jnp.float32)

    def stochastic(logits):
        w = filtered_weights(logits, sp, backend)
        probs = w / backend.row_sum(w)[:, None]
        return jnp.where((sp.temperature > 0)[:, None], probs, greedy)

    return jax.lax.cond(jnp.any(sp.temperature > 0), stochastic, lambda _: greedy, logits)


def mark_seen(seen: jax.Array, tokens: jax.Array, valid: jax.Array) -> jax.Array:
    """seen [B, V]; tokens [B, T]; valid [B, T] bool -> seen with those tokens set."""
    B, T = tokens.shape
    V = seen.shape[-1]
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    cols = jnp.where(valid, tokens, V)                                   # V: out of range, dropped
    return seen.at[rows, cols].set(True, mode="drop")


MAX_LOGPROBS = 20  # top-k log-probabilities returned per token (a static output width)


def top_logprobs(logits: jax.Array, chosen: jax.Array, backend=None):
    """Log-probabilities of the raw logits [..., V]; chosen [...] int32 (-1: none) ->
    (ids [..., k] int32, values [..., k] float32, chosen_logprob [...]), k = MAX_LOGPROBS."""
    backend = backend if backend is not None else backends.default()
    logits = logits.astype(jnp.float32)
    lp = logits - logsumexp(logits, backend, keepdims=True)
    V = lp.shape[-1]
    vals, ids = jax.lax.top_k(lp, min(MAX_LOGPROBS, V))
    if V < MAX_LOGPROBS:  # a vocabulary smaller than the output width: pad with impossible ids
        pad = [(0, 0)] * (lp.ndim - 1) + [(0, MAX_LOGPROBS - V)]
        vals = jnp.pad(vals, pad, constant_values=-jnp.inf)
        ids = jnp.pad(ids, pad)
    pick = jnp.take_along_axis(lp, jnp.maximum(chosen, 0)[..., None], axis=-1)[..., 0]
    return ids.astype(jnp.int32), vals, pick


def no_logprobs(shape: tuple[int, ...]):
    """top_logprobs's output, zero-filled."""
    return (jnp.zeros(shape + (MAX_LOGPROBS,), jnp.int32),
            jnp.zeros(shape + (MAX_LOGPROBS,), jnp.float32), jnp.zeros(shape, jnp.float32))


def sampled_logprob(logits: jax.Array, sp: SamplingArrays, seen: Seen, chosen: jax.Array,
                    backend=None, allowed: jax.Array | None = None) -> jax.Array:
    """log p(chosen) [N] under the distribution `sample` draws from for logits [N, V]: after
    the token mask, the repetition penalty, temperature and the top-k / top-p / min-p filters.
    Greedy rows draw from a one-hot distribution: 0 (or -inf for a token it excludes)."""
    backend = backend if backend is not None else backends.default()
    logits = logits.astype(jnp.float32)
    if allowed is not None:
        logits = apply_token_mask(logits, allowed)
    logits = apply_repetition_penalty(logits, seen, sp.repetition_penalty)
    pick = jnp.maximum(chosen, 0)[:, None]
    greedy = jnp.where(backend.argmax(logits) == chosen, 0.0, -jnp.inf)

    def stochastic(logits):
        masked = filtered_logits(logits, sp, backend)
        lp = jnp.take_along_axis(masked, pick, axis=-1)[:, 0] - logsumexp(masked, backend)
        return jnp.where(sp.temperature > 0, lp, greedy)

    return jax.lax.cond(jnp.any(sp.temperature > 0), stochastic, lambda _: greedy, logits)


def maybe_sampled_logprob(want: jax.Array, logits: jax.Array, sp: SamplingArrays, seen: Seen,
                          chosen: jax.Array, backend=None,
                          allowed: jax.Array | None = None) -> jax.Array:
    """sampled_logprob if any of want [N] is set, else zeros [N]."""
    return jax.lax.cond(jnp.any(want), lambda x: sampled_logprob(x, sp, seen, chosen, backend,
                                                                 allowed),
                        lambda x: jnp.zeros(chosen.shape, jnp.float32), logits)


def maybe_top_logprobs(want: jax.Array, logits_fn, operand, chosen: jax.Array, backend=None):
    """top_logprobs(logits_fn(operand), chosen) if any of want [B] is set, else zeros."""
    return jax.lax.cond(jnp.any(want), lambda x: top_logprobs(logits_fn(x), chosen, backend),
                        lambda x: no_logprobs(chosen.shape), operand)
