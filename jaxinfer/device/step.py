"""The flat step: one jitted forward over a TokenBatch (decode tokens and prefill chunks side by
side), then a sampled token for each row that completed what it had to feed.

Shape legend: B cache rows (slots), T tokens of a step, S rows sampled in a step, V vocab.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxinfer import backends
from jaxinfer.backends import Backend
from jaxinfer.backends.tuning import program_jit
from jaxinfer.config import ModelConfig
from jaxinfer.device.sampling import (maybe_sampled_logprob, maybe_top_logprobs, no_logprobs,
                                     sample)
from jaxinfer.device.state import DecodeState, _take, advance_rows
from jaxinfer.device.token_batch import TokenBatch
from jaxinfer.lora.weights import LoraSlots, LoraStep
from jaxinfer.models import get_model


def sample_rows(logits, state: DecodeState, rows: jax.Array, index: jax.Array,
                backend: Backend, allowed: jax.Array | None = None):
    """A token for each listed row [R] from logits [R, V] at token index [R], within the
    allowed tokens [R, ceil(V/32)] (sampling.apply_token_mask) when given; the rows' seen
    masks are gathered only where a repetition penalty applies."""
    sp = jax.tree.map(lambda x: _take(x, rows), state.rows.sampling)
    return sample(logits, sp, lambda: _take(state.seen, rows), index, backend, allowed)


def lora_step(lora: LoraSlots | None, state: DecodeState) -> LoraStep | None:
    """The forward's LoRA input: the slots and the rows' slots (None without adapters)."""
    return None if lora is None else LoraStep(slots=lora, row_slot=state.lora_slot)


@flax.struct.dataclass
class StepOutput:
    """What one step returns for the host."""

    sampled_rows: jax.Array  # [S] int32 rows that sampled a token (B: none), in row order
    tokens: jax.Array        # [S] int32 their tokens
    done: jax.Array          # [S] bool: the row ended (a stop id, or max_new)
    logprobs: tuple          # (ids [S, k], values [S, k], chosen [S], sampled [S]), filled
    #                          where wanted: the raw model's top k and chosen token's
    #                          log-probabilities, and the chosen token's under the sampling law
    prompt_logprobs: tuple   # (ids [T, k], values [T, k], chosen [T]) of batch.next_tokens


def step(params, state: DecodeState, batch: TokenBatch, sampled: jax.Array,
         next_tokens: jax.Array | None = None, allowed: jax.Array | None = None,
         lora: LoraSlots | None = None, *,
         cfg: ModelConfig, backend: Backend | None = None, query_tile: int = 16,
         draft_params=None, draft_cfg: ModelConfig | None = None
         ) -> tuple[StepOutput, DecodeState]:
    """One engine step, pure: every batch token through the model, then a token for each row in
    sampled [S] (B: empty) from its last token's logits. next_tokens [T] int32 (-1: none): the
    prompt token after each batch token, for prompt_logprobs. allowed [S, ceil(V/32)] int32:
    the sampled rows' packed token masks (structured outputs; -1 words: unconstrained); log
    probabilities stay the model's own. lora: adapter slots (jaxinfer.lora), each row's slot
    in state.lora_slot. backend default:
    backends.default(). Usable inside a caller's jax.jit (the engine's: step_jit). Returns
    (StepOutput, state)."""
    backend = backend if backend is not None else backends.default()
    B = state.last_token.shape[0]
    model = get_model(cfg.architecture)
    h, cache = model.forward_tokens(params, cfg, batch, state.cache, backend=backend,
                                    query_tile=query_tile, lora=lora_step(lora, state))
    draft_cache = state.draft_cache
    if draft_cfg is not None:
        _, draft_cache = get_model(draft_cfg.architecture).forward_tokens(
            draft_params, draft_cfg, batch, draft_cache, backend=backend,
            query_tile=query_tile)
    valid = batch.rows < B
    seen = state.seen.at[jnp.where(valid, batch.rows, B), batch.tokens].set(True, mode="drop")
    state = state.replace(seen=seen, cache=cache, draft_cache=draft_cache)
    last = _take(batch.query_start + batch.num_queries - 1, sampled)      # [S]
    logits = model.head(params, h[jnp.maximum(last, 0)], backend)         # [S, V]
    token = sample_rows(logits, state, sampled, _take(state.num_generated, sampled), backend,
                        allowed)
    real = sampled < B
    lp = maybe_top_logprobs(_take(state.rows.logprobs, sampled) & real, lambda x: x, logits,
                            token, backend)
    sp = jax.tree.map(lambda x: _take(x, sampled), state.rows.sampling)
    lp += (maybe_sampled_logprob(_take(state.rows.sampled_logprobs, sampled) & real, logits, sp,
                                 lambda: _take(state.seen, sampled), token, backend, allowed),)
    if next_tokens is None:
        prompt_lp = no_logprobs((batch.num_tokens,))
    else:
        want_p = _take(state.rows.prompt_logprobs, batch.rows) & valid & (next_tokens >= 0)
        prompt_lp = maybe_top_logprobs(want_p, lambda x: model.head(params, x, backend), h,
                                       next_tokens, backend)
    # The new token's position is the row's cache length (its fed tokens are in the cache).
    state, _, done = advance_rows(state, sampled, token[:, None], real.astype(jnp.int32), real,
                                  _take(cache.lengths, sampled) - 1)
    out = StepOutput(sampled_rows=sampled, tokens=token, done=done, logprobs=lp,
                     prompt_logprobs=prompt_lp)
    return out, state.constrained()


step_jit = program_jit(step, donate_argnums=(1,),
                       static_argnames=("cfg", "backend", "query_tile", "draft_cfg"))
