"""decode_loop: several decode steps of the listed rows in one dispatch, with or without
speculation (num_draft = 0 is plain decoding; the same loop, step and bookkeeping).

Shape legend: B cache rows, R listed rows of a dispatch, k draft tokens per step, V vocab,
W tokens a dispatch can emit per row.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from jaxinfer import backends
from jaxinfer.backends import Backend
from jaxinfer.backends.tuning import loop_jit
from jaxinfer.config import ModelConfig
from jaxinfer.device.drafting import draw_draft, ngram_propose, per_position, verify
from jaxinfer.device.kv_cache import PagedKVCache
from jaxinfer.device.sampling import (ALL_TOKENS, SamplingArrays, mark_seen,
                                     maybe_sampled_logprob, maybe_top_logprobs, no_logprobs)
from jaxinfer.device.state import DecodeState, _put, _take, advance_rows
from jaxinfer.device.step import lora_step, sample_rows
from jaxinfer.models import get_model


def _run_if(pred: jax.Array, fn, operand, default):
    """fn(operand) -> (operand', out) when pred, else (operand, default), as a while loop run at
    most once: XLA updates its buffers in place, where lax.cond's branches copied the cache."""
    def body(carry):
        _, x, _ = carry
        return (jnp.bool_(False),) + fn(x)

    _, operand, out = jax.lax.while_loop(lambda c: c[0], body, (pred, operand, default))
    return operand, out


def _draft_model_steps(draft_params, draft_cfg: ModelConfig, draft_cache: PagedKVCache,
                       last_token: jax.Array, seen: jax.Array, num_generated: jax.Array,
                       sampling: SamplingArrays, rows: jax.Array, fed: jax.Array, k: int,
                       backend: Backend):
    """k single-token steps of the draft model on rows [R], fed each row's last token then its
    drafts, and one more for the last draft's K/V. Returns (drafts [R, k], q [R, k, V], cache)."""
    fed = fed.astype(jnp.int32)
    draft = get_model(draft_cfg.architecture)

    def body(carry, i):
        cache, token, seen = carry
        h, cache = draft.forward(draft_params, draft_cfg, token[:, None], cache, fed, rows=rows,
                                 backend=backend)
        logits = draft.head(draft_params, h[:, 0], backend)
        drawn, q = draw_draft(logits, sampling, seen, num_generated + i, backend)
        seen = mark_seen(seen, drawn[:, None], fed[:, None] > 0)
        return (cache, drawn, seen), (drawn, q)

    (cache, last, _), (drafts, q) = jax.lax.scan(
        body, (draft_cache, last_token, seen), jnp.arange(k, dtype=jnp.int32))
    _, cache = draft.forward(draft_params, draft_cfg, last[:, None], cache, fed, rows=rows,
                             backend=backend)
    return drafts.T, jnp.swapaxes(q, 0, 1), cache


def _emitted(drafts: jax.Array, accepted: jax.Array, token: jax.Array) -> jax.Array:
    """[R, k+1]: a step's accepted drafts then its redrawn, bonus or sampled token (filler past
    it)."""
    if drafts.shape[1] == 0:
        return token[:, None]
    j = jnp.arange(drafts.shape[1] + 1, dtype=jnp.int32)[None, :]
    return jnp.where(j < accepted[:, None], jnp.concatenate([drafts, drafts[:, :1]], axis=1),
                     token[:, None])


@flax.struct.dataclass
class SpecCounts:
    """Per-row speculation counts of one dispatch, [B] int32 each (zeros without drafting)."""

    steps: jax.Array     # verification steps in which the row had drafts
    drafted: jax.Array   # tokens proposed
    accepted: jax.Array  # proposals accepted


# Compiled with the platform's loop options (backends.tuning).
@functools.partial(loop_jit,
                   static_argnames=("cfg", "num_steps", "num_draft", "ngram_max", "ngram_min",
                                    "backend", "draft_cfg"),
                   donate_argnums=(1,))
def decode_loop(params, state: DecodeState, rows: jax.Array, draft_on: jax.Array | None = None,
                allowed: jax.Array | None = None, lora=None, *, cfg: ModelConfig,
                num_steps: int,
                num_draft: int = 0, ngram_max: int = 3, ngram_min: int = 1,
                backend: Backend | None = None, exit_on_stop: jax.Array | bool = False,
                draft_params=None, draft_cfg: ModelConfig | None = None):
    """Up to num_steps decode steps of the listed rows [R] (B: empty) in one lax.while_loop,
    each emitting 1 to num_draft + 1 tokens per row.

    A plain step feeds each running row's last token and samples the next. With num_draft k > 0
    rows with draft_on [B] propose up to k tokens (prompt lookup in state.history, or the draft
    model on state.draft_cache); the target takes last token and drafts as one batch, accepts a
    prefix (drafting.verify), and the cache's lengths roll back past the first rejection. A step
    with no drafts is a plain step. advance_rows books every step and decides the stops. The
    loop ends when every row is done, after num_steps, or (exit_on_stop: a request waits for a
    slot) when any row is done.

    allowed [R, ceil(V/32)] int32: packed token masks of the listed rows' first step
    (structured outputs, sampling.apply_token_mask; -1 words: unconstrained). A row's later
    tokens depend on its first, so a dispatch with a constrained row runs that one step (rows
    that may draft must not be constrained: verification does not apply masks). lora: adapter
    slots (jaxinfer.lora) for the target's forwards, each row's slot in state.lora_slot.

    Returns (state, out_tokens [B, W] int32 (row b's: the first num_out[b]; W = num_steps *
    (k + 1)), num_out [B] int32, done [B] bool, logprobs (ids [B, W, K], values [B, W, K],
    chosen [B, W], sampled [B, W]: the chosen token's under the sampling law), SpecCounts).
    """
    backend = backend if backend is not None else backends.default()
    B, k, R = state.last_token.shape[0], num_draft, rows.shape[0]
    W = num_steps * (k + 1)
    listed = jnp.zeros((B,), bool).at[rows].set(True, mode="drop")
    stopped = ~listed | (state.num_generated >= state.rows.max_new)
    stopped |= jnp.any(state.last_token[:, None] == state.rows.stop_ids, axis=-1) & listed
    stopped_before = stopped
    j = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    zeros = jnp.zeros((B,), jnp.int32)
    sp = jax.tree.map(lambda x: _take(x, rows), state.rows.sampling)      # [R] parameters
    max_new = _take(state.rows.max_new, rows)
    want_lp_rows = _take(state.rows.logprobs, rows)
    want_sampled_rows = _take(state.rows.sampled_logprobs, rows)
    real = rows < B
    model = get_model(cfg.architecture)
    zeros_r = jnp.zeros((R,), jnp.int32)
    none = (jnp.zeros((R, k), jnp.int32), zeros_r, zeros_r,
            no_logprobs((R, k + 1)) + (jnp.zeros((R, k + 1), jnp.float32),))

    constrained = jnp.bool_(False) if allowed is None else jnp.any(allowed != ALL_TOKENS)
    last_step = jnp.where(constrained, 1, num_steps)

    def cond(carry):
        i, _, stopped, *_ = carry
        freed = exit_on_stop & jnp.any(stopped & ~stopped_before)
        return (i < last_step) & ~jnp.all(stopped) & ~freed

    def body(carry):
        i, state, stopped, out, num_out, lp_out, counts = carry
        running = _take(~stopped, rows) & real                             # [R]
        length = _take(state.cache.lengths, rows)
        generated = _take(state.num_generated, rows)
        last_token = _take(state.last_token, rows)
        want_lp = want_lp_rows & running
        want_sampled = want_sampled_rows & running

        def plain_step(caches):
            """One token per row; a draft model's cache takes the last token's K/V."""
            cache, draft_cache = caches
            fed = running.astype(jnp.int32)
            h, cache = model.forward(params, cfg, last_token[:, None], cache, fed, rows=rows,
                                     backend=backend, lora=lora_step(lora, state))
            if draft_cfg is not None:
                _, draft_cache = get_model(draft_cfg.architecture).forward(
                    draft_params, draft_cfg, last_token[:, None], draft_cache, fed, rows=rows,
                    backend=backend)
            logits = model.head(params, h[:, 0], backend)                 # [R, V]
            token = sample_rows(logits, state, rows, generated, backend, allowed)
            lp = maybe_top_logprobs(want_lp, lambda x: x, logits, token, backend)
            lp += (maybe_sampled_logprob(want_sampled, logits, sp,
                                         lambda: _take(state.seen, rows), token, backend,
                                         allowed),)
            lp = jax.tree.map(lambda x: jnp.pad(x[:, None], [(0, 0), (0, k)] +
                                                [(0, 0)] * (x.ndim - 1)), lp)
            return (cache, draft_cache), (none[0], zeros_r, token, lp)

        caches = (state.cache, state.draft_cache)
        num = zeros_r
        if k:
            seen = _take(state.seen, rows)
            room = jnp.maximum(max_new - generated - 1, 0)  # the last token is free
            can_draft = running & _take(draft_on, rows) & (room > 0)
            if draft_cfg is None:
                ngram_drafts, num = ngram_propose(_take(state.history, rows), length + 1, k,
                                                  ngram_max, ngram_min)
                num = jnp.where(can_draft, jnp.minimum(num, room), 0)
            else:
                num = jnp.where(can_draft, jnp.minimum(k, room), 0)

            def verify_drafts(caches):
                """Drafts, then the last token and the drafts through the target."""
                cache, draft_cache = caches
                if draft_cfg is None:
                    drafts, draft_probs = ngram_drafts, None
                else:
                    drafts, draft_probs, draft_cache = _draft_model_steps(
                        draft_params, draft_cfg, draft_cache, last_token, seen, generated, sp,
                        rows, running, k, backend)
                tokens = jnp.concatenate([last_token[:, None], drafts], axis=1)  # [R, k+1]
                h, cache = model.forward(params, cfg, tokens, cache,
                                         jnp.where(running, 1 + num, 0), rows=rows,
                                         backend=backend, lora=lora_step(lora, state))
                logits = model.head(params, h, backend)                   # [R, k+1, V]
                accepted, token = verify(logits, drafts, num, sp, seen, generated, backend,
                                         draft_probs)
                emitted = _emitted(drafts, accepted, token)
                lp = maybe_top_logprobs(want_lp, lambda x: x, logits, emitted, backend)
                sp_s, seen_s = per_position(sp, seen, drafts)
                lp += (maybe_sampled_logprob(
                    jnp.repeat(want_sampled, k + 1), logits.reshape(R * (k + 1), -1), sp_s,
                    seen_s, emitted.reshape(-1), backend).reshape(R, k + 1),)
                return (cache, draft_cache), (drafts, accepted, token, lp)

            any_draft = jnp.any(num > 0)
            caches, drafted_out = _run_if(any_draft, verify_drafts, caches, none)
            caches, plain_out = _run_if(~any_draft, plain_step, caches, none)
            drafts, accepted, token, lp = jax.tree.map(
                lambda a, b: jnp.where(any_draft, a, b), drafted_out, plain_out)
        else:
            caches, (drafts, accepted, token, lp) = plain_step(caches)
        cache, draft_cache = caches
        emitted = _emitted(drafts, accepted, token)                          # [R, k+1]
        state, n, done = advance_rows(state.replace(cache=cache, draft_cache=draft_cache),
                                      rows, emitted, accepted + 1, running, length)
        # The cache keeps the last token and the emitted tokens but the newest (fed next step).
        new_len = _put(cache.lengths, rows, length + n)
        state = state.replace(cache=cache.rollback(new_len), draft_cache=None if
                              draft_cache is None else draft_cache.rollback(new_len))
        keep = j < n[:, None]
        slot = jnp.where(keep, _take(num_out, rows)[:, None] + j, W)
        row_ix = jnp.broadcast_to(jnp.where(real, rows, B)[:, None], emitted.shape)
        out = out.at[row_ix, slot].set(emitted, mode="drop")
        lp_out = jax.tree.map(lambda buf, x: buf.at[row_ix, slot].set(x, mode="drop"),
                              lp_out, lp)
        stopped = stopped | _put(jnp.zeros((B,), bool), rows, done)
        counts = SpecCounts(steps=counts.steps + _put(zeros, rows, (num > 0).astype(jnp.int32)),
                            drafted=counts.drafted + _put(zeros, rows, num),
                            accepted=counts.accepted + _put(zeros, rows, accepted))
        return (i + 1, state.constrained(), stopped, out, num_out + _put(zeros, rows, n),
                lp_out, counts)

    carry = (jnp.int32(0), state, stopped, jnp.zeros((B, W), jnp.int32), zeros,
             no_logprobs((B, W)) + (jnp.zeros((B, W), jnp.float32),),
             SpecCounts(steps=zeros, drafted=zeros, accepted=zeros))
    _, state, stopped, out, num_out, lp_out, counts = jax.lax.while_loop(cond, body, carry)
    return state.constrained(), out, num_out, stopped, lp_out, counts
