"""Speculative decoding: drafters and exact verification (device math; the loop is in
device/loop.py).

Shape legend: B batch rows, k draft tokens per step, V vocab, L history length.

A step proposes up to k tokens per row, the target scores the row's last token and its drafts in
one forward (k + 1 query tokens), and `verify` accepts a prefix of the drafts by exact rejection
sampling (Leviathan et al. 2023, Chen et al. 2023): draft i is accepted with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is redrawn from
normalize(max(p_i - q_i, 0)), and when every draft is accepted a bonus token is drawn from
p_{k}. Every emitted token then follows the target's distribution exactly. p is the distribution
`sampling.sample` draws from (repetition penalty, temperature, top-k, top-p, min-p; one-hot at
the argmax for greedy rows), so at temperature 0 verification is prefix matching.

Randomness comes from fold_in(key(seed), i) for the request's token at index i alone, as in
plain sampling. For n-gram drafts (q one-hot) the acceptance test is coupled to the sampler's own
uniform (see verify), so speculation emits exactly the tokens plain sampling would, for
every seed: a seeded request gives the same tokens with or without speculation, alone or in a
crowd. With a draft model, acceptance takes a uniform from fold_in(key, 1) and the draft its
noise from fold_in(key, 2): outputs follow the target's distribution and repeat for a seed, but
are other draws than plain sampling's.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxinfer import backends
from jaxinfer.device.sampling import (SamplingArrays, apply_repetition_penalty, draw, mark_seen,
                                      sample, sampling_probs, uniforms)

def ngram_propose(history: jax.Array, length: jax.Array, k: int, n_max: int, n_min: int = 1):
    """Prompt lookup on device. history [B, L] int32 holds each row's tokens (prompt, then
    output), of which the first length[b] are real. For n from n_max down to n_min, the last n
    tokens are looked up earlier in the row; the longest n that occurs wins, and of its
    occurrences the latest one with k known tokens after it (else the latest one). Returns
    (drafts [B, k] int32, num_drafts [B] int32): the tokens after the occurrence, at most k and
    only known ones (num_drafts 0 where nothing matched)."""
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
    """A draft model's proposal for output index token_index [B]: (token [B] int32, q [B, V]),
    q the distribution it is drawn from (the same transforms as the target's p; one-hot at the
    argmax for greedy rows). Its noise comes from fold_in(key(seed, index), 2), apart from the
    verification's."""
    backend = backend if backend is not None else backends.default()
    q = sampling_probs(logits, sp, seen, backend)
    greedy = backend.argmax(q)

    def stochastic(q):
        drawn = draw(q, uniforms(sp.seed, token_index, stream=2))
        return jnp.where(sp.temperature > 0, drawn, greedy)

    token = jax.lax.cond(jnp.any(sp.temperature > 0), stochastic, lambda _: greedy, q)
    return token, q


def verify(logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array, sp: SamplingArrays,
           seen: jax.Array, token_index: jax.Array, backend=None,
           draft_probs: Optional[jax.Array] = None):
    """Accepts a prefix of each row's drafts by exact rejection sampling.

    logits [B, k+1, V]: the target's logits after the row's last token and after each draft;
    drafts [B, k] int32, of which the first num_drafts[b] are real; seen [B, V]: tokens of the
    prompt and output before this step (repetition penalty; drafts are added position by
    position); token_index [B]: index in the request's output of the first token this step
    produces. draft_probs [B, k, V]: the distributions the drafts were drawn from, or None for
    proposals that are not sampled (n-gram: q is one-hot at the draft).

    Returns (accepted [B] int32 <= num_drafts, token [B] int32): the row emits
    drafts[:accepted] and then token (the redrawn token after a rejection, or the bonus token).
    """
    backend = backend if backend is not None else backends.default()
    B, S, V = logits.shape
    k = S - 1
    sp_rep = jax.tree.map(lambda x: jnp.repeat(x, S, axis=0), sp)
    t = jnp.arange(k, dtype=jnp.int32)[None, None, :]
    s = jnp.arange(S, dtype=jnp.int32)[None, :, None]
    seen_s = mark_seen(jnp.repeat(seen, S, axis=0), jnp.repeat(drafts, S, axis=0),
                       jnp.broadcast_to(t < s, (B, S, k)).reshape(B * S, k))
    flat = logits.reshape(B * S, V).astype(jnp.float32)
    valid = jnp.arange(k, dtype=jnp.int32)[None, :] < num_drafts[:, None]   # [B, k]

    def leading(ok):  # number of leading True entries of ok [B, k] among the valid drafts
        return jnp.sum(jnp.cumprod(ok & valid, axis=1), axis=1).astype(jnp.int32)

    index = token_index[:, None] + jnp.arange(S, dtype=jnp.int32)[None, :]     # [B, S]
    if draft_probs is None:
        # q is one-hot at the draft, so the rule is: accept with probability p(d), else draw
        # from p without d. "The token the sampler draws at this index with its own noise is d"
        # has exactly that law, and on a mismatch that token is the redraw. Coupled so, the
        # emitted tokens are the ones plain sampling emits, whatever was drafted.
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
        residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_a)
        return a, draw(residual, uniforms(sp.seed, token_index + a))

    a_g, tok_g = greedy(None)
    a_s, tok_s = jax.lax.cond(jnp.any(sp.temperature > 0), stochastic, lambda _: (a_g, tok_g),
                              None)
    hot = sp.temperature > 0
    return jnp.where(hot, a_s, a_g), jnp.where(hot, tok_s, tok_g)
