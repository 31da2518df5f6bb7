"""Speculative decoding's device math: drafters and exact verification (the loop: loop.py).

Shape legend: B batch rows, k draft tokens per step, V vocab, L history length.

The target scores a row's last token and its drafts in one forward, and `verify` accepts a
prefix by exact rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft i with
probability min(1, p_i(d_i) / q_i(d_i)), a redraw from normalize(max(p_i - q_i, 0)) at the
first rejection, a bonus token from p_k when all pass. p is what `sampling.sample` draws from,
so at temperature 0 verification is prefix matching.

Token i's randomness comes from fold_in(key(seed), i) alone. For n-gram drafts the test uses
the sampler's own uniform, so speculation emits exactly plain sampling's tokens for every seed;
a draft model's acceptance and noise use streams 1 and 2, so outputs follow the target's
distribution and repeat for a seed, but are other draws.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxinfer import backends
from jaxinfer.device.sampling import (SamplingArrays, apply_repetition_penalty, draw, mark_seen,
                                      sample, sampling_probs, uniforms)


def ngram_propose(history: jax.Array, length: jax.Array, k: int, n_max: int, n_min: int = 1):
    """Prompt lookup: history [B, L] int32 (the first length[b] real). The longest n in
    n_max .. n_min whose last n tokens occur earlier wins, at its latest occurrence with k known
    tokens after it (else the latest). Returns (drafts [B, k] int32, num_drafts [B] int32)."""
    B, L = history.shape
    j = jnp.arange(L, dtype=jnp.int32)[None, :]                           # occurrence start
    start = jnp.full((B,), -1, jnp.int32)
    for n in range(n_max, n_min - 1, -1):
        match = (j + n < length[:, None]) & (length[:, None] > n)         # a known continuation
        for i in range(n):
            want = jnp.take_along_axis(history, jnp.maximum(length - n + i, 0)[:, None], axis=1)
            shifted = jnp.pad(history[:, i:], ((0, 0), (0, i)), constant_values=-1)
            match &= shifted == want
        full = match & (j + n + k <= length[:, None])
        latest = lambda m: jnp.max(jnp.where(m, j, -1), axis=1)           # noqa: E731
        found = jnp.where(jnp.any(full, axis=1), latest(full), latest(match))
        start = jnp.where((start < 0) & (found >= 0), found + n, start)
    num = jnp.where(start >= 0, jnp.minimum(k, length - start), 0).astype(jnp.int32)
    idx = jnp.clip(start[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :], 0, L - 1)
    return jnp.take_along_axis(history, idx, axis=1), num


def draw_draft(logits: jax.Array, sp: SamplingArrays, seen: jax.Array, token_index: jax.Array,
               backend=None):
    """A draft model's proposal for output index token_index [B]: (token [B] int32, q [B, V]
    the distribution it is drawn from, transformed as the target's p), from noise stream 2."""
    backend = backend if backend is not None else backends.default()
    q = sampling_probs(logits, sp, seen, backend)
    greedy = backend.argmax(q)

    def stochastic(q):
        drawn = draw(q, uniforms(sp.seed, token_index, stream=2), backend)
        return jnp.where(sp.temperature > 0, drawn, greedy)

    token = jax.lax.cond(jnp.any(sp.temperature > 0), stochastic, lambda _: greedy, q)
    return token, q


def per_position(sp: SamplingArrays, seen: jax.Array, drafts: jax.Array):
    """Each of a row's k + 1 verified positions as a row of its own: (sampling parameters
    [B * (k+1)], seen [B * (k+1), V], position s marking the drafts before it)."""
    B, k = drafts.shape
    S = k + 1
    sp_rep = jax.tree.map(lambda x: jnp.repeat(x, S, axis=0), sp)
    t = jnp.arange(k, dtype=jnp.int32)[None, None, :]
    s = jnp.arange(S, dtype=jnp.int32)[None, :, None]
    seen_s = mark_seen(jnp.repeat(seen, S, axis=0), jnp.repeat(drafts, S, axis=0),
                       jnp.broadcast_to(t < s, (B, S, k)).reshape(B * S, k))
    return sp_rep, seen_s


def verify(logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array, sp: SamplingArrays,
           seen: jax.Array, token_index: jax.Array, backend=None,
           draft_probs: Optional[jax.Array] = None):
    """Accepts a prefix of each row's drafts by exact rejection sampling.

    logits [B, k+1, V]: the target's after the last token and each draft; drafts [B, k] int32
    (the first num_drafts[b] real); seen [B, V] before this step; token_index [B]: the output
    index of the step's first token; draft_probs [B, k, V] the drafts' distributions (None:
    n-gram, q one-hot). Returns (accepted [B] int32, token [B] int32): the row emits
    drafts[:accepted], then token (the redraw or the bonus token).
    """
    backend = backend if backend is not None else backends.default()
    B, S, V = logits.shape
    k = S - 1
    sp_rep, seen_s = per_position(sp, seen, drafts)
    flat = logits.reshape(B * S, V).astype(jnp.float32)
    valid = jnp.arange(k, dtype=jnp.int32)[None, :] < num_drafts[:, None]   # [B, k]

    def leading(ok):  # number of leading True entries of ok [B, k] among the valid drafts
        return jnp.sum(jnp.cumprod(ok & valid, axis=1), axis=1).astype(jnp.int32)

    index = token_index[:, None] + jnp.arange(S, dtype=jnp.int32)[None, :]     # [B, S]
    if draft_probs is None:
        # q one-hot: accept with probability p(d), else draw from p without d. "The sampler's
        # own draw at this index is d" has that law, and on a mismatch it is the redraw.
        target = sample(flat, sp_rep, seen_s, index.reshape(-1), backend).reshape(B, S)
        a = leading(drafts == target[:, :k])
        return a, jnp.take_along_axis(target, a[:, None], axis=1)[:, 0]

    def greedy(_):
        target = backend.argmax(apply_repetition_penalty(
            flat, seen_s, sp_rep.repetition_penalty)).reshape(B, S)
        a = leading(drafts == target[:, :k])
        return a, jnp.take_along_axis(target, a[:, None], axis=1)[:, 0]

    def stochastic(_):
        p = sampling_probs(flat, sp_rep, seen_s, backend).reshape(B, S, V)
        u = uniforms(sp_rep.seed, index.reshape(-1), stream=1).reshape(B, S)
        p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
        q = draft_probs.astype(jnp.float32)
        q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
        a = leading(u[:, :k] * q_d < p_d)
        p_a = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]        # [B, V]
        q_pad = jnp.concatenate([q, jnp.zeros((B, 1, V), jnp.float32)], axis=1)
        q_a = jnp.take_along_axis(q_pad, a[:, None, None], axis=1)[:, 0]
        rejected = a < num_drafts
        residual = jnp.where(rejected[:, None], jnp.maximum(p_a - q_a, 0.0), p_a)
        # p == q makes rejection impossible, but rounding can leave an all-zero residual.
        residual = jnp.where(jnp.any(residual > 0, axis=-1, keepdims=True), residual, p_a)
        return a, draw(residual, uniforms(sp.seed, token_index + a), backend)

    a_g, tok_g = greedy(None)
    a_s, tok_s = jax.lax.cond(jnp.any(sp.temperature > 0), stochastic, lambda _: (a_g, tok_g),
                              None)
    hot = sp.temperature > 0
    return jnp.where(hot, a_s, a_g), jnp.where(hot, tok_s, tok_g)
