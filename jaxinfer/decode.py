"""Jitted device steps: prefill_chunk and decode_loop.

Shape legend: B batch rows (slots), T prefill chunk length, V vocab, E stop ids per row,
S decode steps per dispatch.

The device owns DecodeState (the cache, each row's last token, output count and seen-token mask)
and it is donated through every call. The host owns everything that describes requests and
passes it as arrays each call (RowParams), so no request property is ever a compile-time
constant. Static arguments are only shapes: the chunk length, steps per dispatch and kv_view.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from jaxinfer import sharding
from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import PagedKVCache, RingKVCache
from jaxinfer.models import llama
from jaxinfer.sampling import SamplingArrays, mark_seen, maybe_top_logprobs, no_logprobs, sample
from jaxinfer.speculative import draw_draft, ngram_propose, verify

# The device loops are compiled without XLA's while-loop invariant code motion. Our loop bodies
# hold nothing worth hoisting (weights are read as they are), and on XLA:CPU the pass hoists
# the float32 copy of a bf16 embedding table that the backend makes to gather from it: the whole
# table converted once per dispatch (36 ms for SmolLM2's, 5 ms a step), where inside the body
# the convert fuses into the gather of the B rows it needs.
LOOP_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


@flax.struct.dataclass
class DecodeState:
    cache: RingKVCache
    last_token: jax.Array     # [B] int32: the newest token of each row, not yet in the cache
    num_generated: jax.Array  # [B] int32: tokens generated so far by the row's request
    seen: jax.Array           # [B, V] bool: tokens of prompt and output (repetition penalty)
    draft_cache: RingKVCache | None = None  # a draft model's cache (speculative decoding)

    @classmethod
    def create(cls, cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.float32,
               cache=None, draft_cfg: ModelConfig | None = None, draft_capacity: int = 0):
        """A ring cache of `capacity` slots per row, or the given cache (e.g. a paged one);
        with draft_cfg, a ring of draft_capacity slots per row for the draft model too."""
        if cache is None:
            cache = RingKVCache.create(cfg.num_layers, batch, capacity, cfg.num_kv_heads,
                                       cfg.head_dim, dtype)
        draft = None if draft_cfg is None else RingKVCache.create(
            draft_cfg.num_layers, batch, draft_capacity, draft_cfg.num_kv_heads,
            draft_cfg.head_dim, dtype)
        return cls(cache=cache,
                   last_token=jnp.zeros((batch,), jnp.int32),
                   num_generated=jnp.zeros((batch,), jnp.int32),
                   seen=jnp.zeros((batch, cfg.vocab_size), bool), draft_cache=draft)

    def logical_axes(self) -> "DecodeState":
        """Each array's logical axes (jaxinfer.sharding), in the state's own structure."""
        return DecodeState(cache=self.cache.logical_axes(), last_token=("batch",),
                           num_generated=("batch",), seen=("batch", "vocab"),
                           draft_cache=None if self.draft_cache is None
                           else self.draft_cache.logical_axes())

    def constrained(self) -> "DecodeState":
        """The state pinned to its sharding on the context mesh (identity without one): every
        jitted step returns this, so its output sharding equals its input's."""
        return sharding.constrain_tree(self, self.logical_axes())


@flax.struct.dataclass
class RowParams:
    """Per-row request parameters, rebuilt by the host for every call."""

    sampling: SamplingArrays
    max_new: jax.Array    # [B] int32: tokens the row may generate (max_tokens, and max_seq_len)
    stop_ids: jax.Array   # [B, E] int32: ids that end the row (EOS unless ignore_eos); -1 pads
    active: jax.Array     # [B] bool: the row is decoding (False: free or still in prefill)
    start_index: jax.Array  # [B] int32: tokens the request generated before this prefill
    #                         (re-prefilled after a preemption; its next token has this index)
    logprobs: jax.Array   # [B] bool: return top log-probabilities of generated tokens
    prompt_logprobs: jax.Array  # [B] bool: return them for prompt tokens


@functools.partial(jax.jit, donate_argnums=(0,))
def reset_rows(state: DecodeState, mask: jax.Array, start: jax.Array,
               block_tables: jax.Array | None = None) -> DecodeState:
    """Empties the rows where mask [B] is set, for new requests starting at position start [B]
    (non-zero only for prefix-cache hits in a paged cache). K/V data is left in place: slots
    past a row's length are never attended. block_tables [B, M]: a paged cache's new tables."""
    cache = state.cache.reset_rows(mask, start)
    if block_tables is not None:
        cache = cache.replace(block_tables=block_tables)
    if state.draft_cache is not None:
        state = state.replace(draft_cache=state.draft_cache.reset_rows(mask, start))
    return state.replace(cache=cache,
                         last_token=jnp.where(mask, 0, state.last_token),
                         num_generated=jnp.where(mask, 0, state.num_generated),
                         seen=state.seen & ~mask[:, None]).constrained()


def grow_rows(state: DecodeState, batch: int) -> DecodeState:
    """The state with empty rows appended up to `batch` rows; the existing rows (running
    requests) keep their place and contents. A page pool passes through untouched."""
    if isinstance(state.cache, PagedKVCache):
        k, v = state.cache.k, state.cache.v
        state = _grow_rows(state.replace(cache=state.cache.replace(k=None, v=None)), batch)
        return state.replace(cache=state.cache.replace(k=k, v=v))
    return _grow_rows(state, batch)


@functools.partial(jax.jit, static_argnums=(1,))
def _grow_rows(state: DecodeState, batch: int) -> DecodeState:
    pad = lambda x, fill: jnp.pad(x, [(0, batch - x.shape[0])] + [(0, 0)] * (x.ndim - 1),  # noqa: E731
                                  constant_values=fill)
    return DecodeState(cache=state.cache.pad_rows(batch), last_token=pad(state.last_token, 0),
                       num_generated=pad(state.num_generated, 0), seen=pad(state.seen, False),
                       draft_cache=None if state.draft_cache is None
                       else state.draft_cache.pad_rows(batch)).constrained()


@functools.partial(jax.jit, donate_argnums=(0,))
def set_block_tables(state: DecodeState, block_tables: jax.Array) -> DecodeState:
    """A paged cache's block tables [B, M] after the host grew or freed rows' pages."""
    return state.replace(cache=state.cache.replace(block_tables=block_tables)).constrained()


@flax.struct.dataclass
class Chunk:
    """Prefill tokens for some rows: the prefill group of a step.

    tokens [G, T] int32, of which the first num_new[g] are real; rows [G] int32: the slot each
    query row belongs to (B marks a padding row, num_new 0), or None for all B slots in order;
    completes [G] bool: this chunk ends the row's prompt, so its first output token is sampled
    from the logits at the row's last real position; next_tokens [G, T] int32: the prompt token
    after each position (-1 past the prompt), scored when a row wants prompt_logprobs.
    """

    tokens: jax.Array
    num_new: jax.Array
    completes: jax.Array
    next_tokens: jax.Array
    rows: jax.Array | None = None


def _take(x: jax.Array, rows: jax.Array | None) -> jax.Array:
    """x's entries for the chunk's rows (padding rows read the last slot; discarded)."""
    return x if rows is None else x[jnp.minimum(rows, x.shape[0] - 1)]


def _put(x: jax.Array, rows: jax.Array | None, values: jax.Array) -> jax.Array:
    """x with the chunk's rows set to values (padding rows dropped)."""
    return values if rows is None else x.at[rows].set(values, mode="drop")


def _step(params, state: DecodeState, chunk: Chunk, rows: RowParams, *, cfg: ModelConfig,
          kv_view: int | None, attn_impl: str, decode: bool, draft_params=None,
          draft_cfg: ModelConfig | None = None):
    """A prefill chunk, plus (decode=True) one decode token for every active row, in one
    forward pass (and through the draft model, whose cache takes the same tokens). Returns
    (state, decode outputs (tokens [B], logprobs) or None, first tokens [G], first-token
    logprobs, prompt logprobs [G, T, ...])."""
    G, T = chunk.tokens.shape
    queries = [llama.Query(chunk.tokens, chunk.num_new, chunk.rows)]
    if decode:
        queries.append(llama.Query(state.last_token[:, None], rows.active.astype(jnp.int32)))
    hs, cache = llama.forward_groups(params, cfg, queries, state.cache, kv_view=kv_view,
                                     attn_impl=attn_impl)
    draft_cache = state.draft_cache
    if draft_cfg is not None:
        _, draft_cache = llama.forward_groups(draft_params, draft_cfg, queries, draft_cache,
                                              kv_view=kv_view, attn_impl="reference")
    seen, last_token, num_generated = state.seen, state.last_token, state.num_generated

    decoded = None
    if decode:
        running = rows.active
        logits = llama.lm_head(params, hs[1][:, 0])
        token = sample(logits, rows.sampling, seen, num_generated)
        token = jnp.where(running, token, last_token)
        decoded = (token, maybe_top_logprobs(rows.logprobs & running, lambda x: x, logits, token))
        seen = mark_seen(seen, token[:, None], running[:, None])
        last_token = token
        num_generated = num_generated + running

    # The prefill group: its rows' parameters and state, gathered.
    prow = jax.tree.map(lambda x: _take(x, chunk.rows), rows)
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    seen_p = mark_seen(_take(seen, chunk.rows), chunk.tokens, t < chunk.num_new[:, None])
    h = hs[0]
    last = jnp.clip(chunk.num_new - 1, 0, T - 1)
    h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]   # [G, D]
    logits = llama.lm_head(params, h_last)                               # [G, V]
    first = sample(logits, prow.sampling, seen_p, prow.start_index)
    first_lp = maybe_top_logprobs(prow.logprobs & chunk.completes, lambda x: x, logits, first)
    # Scoring every prompt position needs the head over all T tokens: only when asked.
    prompt_lp = maybe_top_logprobs(prow.prompt_logprobs & (chunk.num_new > 0),
                                   lambda x: llama.lm_head(params, x), h, chunk.next_tokens)
    seen_p = mark_seen(seen_p, first[:, None], chunk.completes[:, None])
    done = chunk.completes
    state = DecodeState(
        cache=cache,
        last_token=_put(last_token, chunk.rows,
                        jnp.where(done, first, _take(last_token, chunk.rows))),
        num_generated=_put(num_generated, chunk.rows,
                           jnp.where(done, prow.start_index + 1,
                                     _take(num_generated, chunk.rows))),
        seen=_put(seen, chunk.rows, seen_p), draft_cache=draft_cache)
    return state.constrained(), decoded, first, first_lp, prompt_lp


@functools.partial(jax.jit, static_argnames=("cfg", "kv_view", "attn_impl", "draft_cfg"),
                   donate_argnums=(1,))
def prefill_chunk(params, state: DecodeState, tokens: jax.Array, num_new: jax.Array,
                  completes: jax.Array, next_tokens: jax.Array, rows: RowParams, *,
                  cfg: ModelConfig, kv_view: int | None = None, attn_impl: str = "reference",
                  draft_params=None, draft_cfg: ModelConfig | None = None):
    """Feeds up to T prompt tokens per row into the cache (every row; see Chunk for tokens,
    num_new [B], completes and next_tokens).

    Returns (state, first_tokens [B] int32, first_logprobs, prompt_logprobs): first_tokens
    meaningful where completes; the logprobs as (ids, values, chosen) of top_logprobs, for the
    first token ([B, ...]) and for every next prompt token ([B, T, ...]).
    """
    chunk = Chunk(tokens=tokens, num_new=num_new, completes=completes, next_tokens=next_tokens)
    state, _, first, first_lp, prompt_lp = _step(params, state, chunk, rows, cfg=cfg,
                                                 kv_view=kv_view, attn_impl=attn_impl,
                                                 decode=False, draft_params=draft_params,
                                                 draft_cfg=draft_cfg)
    return state, first, first_lp, prompt_lp


@functools.partial(jax.jit, static_argnames=("cfg", "kv_view", "attn_impl", "draft_cfg"),
                   donate_argnums=(1,))
def mixed_step(params, state: DecodeState, chunk: Chunk, rows: RowParams, *, cfg: ModelConfig,
               kv_view: int | None = None, attn_impl: str = "reference", draft_params=None,
               draft_cfg: ModelConfig | None = None):
    """One engine step of decode-maximal batching: one new token for every decoding row
    (rows.active) and a prefill chunk for chunk.rows, through the weights once.

    Returns (state, tokens [B] int32 (meaningful where rows.active), logprobs of those
    ([B, ...], filled where rows.logprobs), first_tokens [G], first_logprobs, prompt_logprobs)
    with the prefill outputs as prefill_chunk's, per chunk row.
    """
    state, (tokens, lp), first, first_lp, prompt_lp = _step(
        params, state, chunk, rows, cfg=cfg, kv_view=kv_view, attn_impl=attn_impl, decode=True,
        draft_params=draft_params, draft_cfg=draft_cfg)
    return state, tokens, lp, first, first_lp, prompt_lp


@functools.partial(jax.jit,
                   static_argnames=("cfg", "num_steps", "kv_view", "attn_impl", "decode_pages"),
                   donate_argnums=(1,), compiler_options=LOOP_COMPILER_OPTIONS)
def decode_loop(params, state: DecodeState, rows: RowParams, *, cfg: ModelConfig,
                num_steps: int, kv_view: int | None = None, attn_impl: str = "reference",
                exit_on_stop: jax.Array | bool = False, decode_pages: int | None = None):
    """Runs up to num_steps decode steps in one dispatch (a lax.while_loop).

    Each step feeds every active row's last token, samples the next and records it. A row stops
    on a stop id or when it has max_new tokens; the loop ends when all rows have stopped or after
    num_steps, or (exit_on_stop, a traced bool: a request is waiting for a slot) as soon as any
    row stops. Returns (state, out_tokens [B, S] int32, num_out [B] int32, done [B] bool,
    logprobs): row b produced out_tokens[b, :num_out[b]]; done[b] says it stopped (its last token
    tells why); logprobs = (ids [B, S, k], values [B, S, k], chosen [B, S]) of top_logprobs,
    filled for rows with rows.logprobs. decode_pages (a paged cache, reference attention):
    attend through a flat page list of this size (llama.forward_groups); it must hold every
    running row's pages after num_steps more tokens.
    """
    B = state.last_token.shape[0]
    stopped = ~rows.active | (state.num_generated >= rows.max_new)
    stopped |= jnp.any(state.last_token[:, None] == rows.stop_ids, axis=-1) & rows.active
    stopped_before = stopped
    out = jnp.zeros((B, num_steps), jnp.int32)
    lp_out = no_logprobs((B, num_steps))

    def cond(carry):
        step, _, stopped, _, _, _ = carry
        freed = exit_on_stop & jnp.any(stopped & ~stopped_before)
        return (step < num_steps) & ~jnp.all(stopped) & ~freed

    def body(carry):
        step, state, stopped, out, num_out, lp_out = carry
        running = ~stopped
        h, cache = llama.forward(params, cfg, state.last_token[:, None], state.cache,
                                 running.astype(jnp.int32), kv_view=kv_view, attn_impl=attn_impl,
                                 decode_pages=decode_pages)
        logits = llama.lm_head(params, h[:, 0])
        token = sample(logits, rows.sampling, state.seen, state.num_generated)
        token = jnp.where(running, token, state.last_token)
        out = out.at[:, step].set(jnp.where(running, token, -1))
        lp = maybe_top_logprobs(rows.logprobs & running, lambda x: x, logits, token)
        lp_out = jax.tree.map(lambda buf, x: buf.at[:, step].set(x), lp_out, lp)
        num_generated = state.num_generated + running
        seen = mark_seen(state.seen, token[:, None], running[:, None])
        hit_stop = jnp.any(token[:, None] == rows.stop_ids, axis=-1)
        stopped = stopped | (running & (hit_stop | (num_generated >= rows.max_new)))
        state = state.replace(cache=cache, last_token=token, num_generated=num_generated,
                              seen=seen)
        return step + 1, state.constrained(), stopped, out, num_out + running, lp_out

    carry = (jnp.int32(0), state, stopped, out, jnp.zeros((B,), jnp.int32), lp_out)
    _, state, stopped, out, num_out, lp_out = jax.lax.while_loop(cond, body, carry)
    return state.constrained(), out, num_out, stopped, lp_out


def _run_if(pred: jax.Array, fn, operand, default):
    """fn(operand) -> (operand', out) when pred, else (operand, default): a while loop that
    runs at most once. XLA updates a while loop's buffers in place, but copies a cache passed
    into lax.cond's branches at every write (two full copies per layer)."""
    def body(carry):
        _, x, _ = carry
        return (jnp.bool_(False),) + fn(x)

    _, operand, out = jax.lax.while_loop(lambda c: c[0], body, (pred, operand, default))
    return operand, out


def _draft_model_steps(draft_params, draft_cfg: ModelConfig, state: DecodeState,
                       sampling: SamplingArrays, running: jax.Array, k: int, *,
                       kv_view: int | None):
    """k single-token steps of the draft model on state.draft_cache, the first feeding each
    running row's last token and each later one the token drawn before, then one more feeding
    the last draft (its K/V only: no head). Returns (drafts [B, k], their distributions
    q [B, k, V], draft cache)."""
    fed = running.astype(jnp.int32)

    def body(carry, i):
        cache, token, seen = carry
        h, cache = llama.forward(draft_params, draft_cfg, token[:, None], cache, fed,
                                 kv_view=kv_view)
        logits = llama.lm_head(draft_params, h[:, 0])
        drawn, q = draw_draft(logits, sampling, seen, state.num_generated + i)
        seen = mark_seen(seen, drawn[:, None], running[:, None])
        return (cache, drawn, seen), (drawn, q)

    (cache, last, _), (drafts, q) = jax.lax.scan(
        body, (state.draft_cache, state.last_token, state.seen), jnp.arange(k, dtype=jnp.int32))
    _, cache = llama.forward(draft_params, draft_cfg, last[:, None], cache, fed, kv_view=kv_view)
    return drafts.T, jnp.swapaxes(q, 0, 1), cache


def _emitted(drafts: jax.Array, accepted: jax.Array, token: jax.Array) -> jax.Array:
    """[B, k+1]: a verification step's tokens, the accepted drafts then the redrawn or bonus
    token (entries past it are filler)."""
    j = jnp.arange(drafts.shape[1] + 1, dtype=jnp.int32)[None, :]
    return jnp.where(j < accepted[:, None], jnp.concatenate([drafts, drafts[:, :1]], axis=1),
                     token[:, None])


@flax.struct.dataclass
class SpecCounts:
    """Per-row speculation counts of one dispatch, [B] int32 each."""

    steps: jax.Array     # verification steps in which the row had drafts
    drafted: jax.Array   # tokens proposed
    accepted: jax.Array  # proposals accepted


@functools.partial(jax.jit,
                   static_argnames=("cfg", "num_steps", "num_draft", "ngram_max", "ngram_min",
                                    "kv_view", "attn_impl", "draft_cfg"),
                   donate_argnums=(1,), compiler_options=LOOP_COMPILER_OPTIONS)
def speculative_loop(params, state: DecodeState, rows: RowParams, history: jax.Array,
                     draft_on: jax.Array, *, cfg: ModelConfig, num_steps: int, num_draft: int,
                     ngram_max: int = 3, ngram_min: int = 1, kv_view: int | None = None,
                     attn_impl: str = "reference", exit_on_stop: jax.Array | bool = False,
                     draft_params=None, draft_cfg: ModelConfig | None = None):
    """decode_loop with speculation: up to num_steps verification steps, each emitting 1 to
    num_draft + 1 tokens per row.

    Each step proposes up to k = num_draft tokens per row (rows where draft_on [B] is False
    propose none): by prompt lookup in history (speculative.ngram_propose), or with draft_cfg
    by k single-token steps of the draft model on state.draft_cache (drawn from its q with the
    row's sampling parameters; a (k+1)-th step feeds the last draft, so the draft cache holds
    whatever the target keeps). It then runs the row's
    last token and its drafts through the target in one forward, accepts a prefix of them by
    exact rejection sampling (speculative.verify) and rolls the cache back past the first
    rejected position (lengths only: nothing is copied). A step in which no row has a draft
    runs decode_loop's single-token step instead. Stop ids and max_new cut a step's tokens
    where they occur.

    history [B, L] int32: row b's prompt and generated tokens, the first cache.lengths[b] + 1
    entries (the last is last_token); L >= the cache capacity. Returns (state, out_tokens
    [B, W] int32 with W = num_steps * (k + 1), num_out [B], done [B], logprobs ([B, W, ...] as
    decode_loop's), counts (SpecCounts)). The caller guarantees kv_view covers every row's
    length plus W.
    """
    B, k = state.last_token.shape[0], num_draft
    W = num_steps * (k + 1)
    stopped = ~rows.active | (state.num_generated >= rows.max_new)
    stopped |= jnp.any(state.last_token[:, None] == rows.stop_ids, axis=-1) & rows.active
    stopped_before = stopped
    j = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    zeros = jnp.zeros((B,), jnp.int32)

    def cond(carry):
        step, _, stopped, *_ = carry
        freed = exit_on_stop & jnp.any(stopped & ~stopped_before)
        return (step < num_steps) & ~jnp.all(stopped) & ~freed

    def body(carry):
        step, state, stopped, history, out, num_out, lp_out, counts = carry
        running = ~stopped
        length = state.cache.lengths
        room = jnp.maximum(rows.max_new - state.num_generated - 1, 0)  # the last token is free
        want_lp = rows.logprobs & running
        can_draft = running & draft_on & (room > 0)
        if draft_cfg is None:
            ngram_drafts, num = ngram_propose(history, length + 1, k, ngram_max, ngram_min)
            num = jnp.where(can_draft, jnp.minimum(num, room), 0)
        else:
            num = jnp.where(can_draft, jnp.minimum(k, room), 0)

        def verify_drafts(caches):
            """Drafts (the draft model's k + 1 steps, or the n-gram ones), then the last token
            and the drafts through the target; exact acceptance."""
            cache, draft_cache = caches
            if draft_cfg is None:
                drafts, draft_probs = ngram_drafts, None
            else:
                drafts, draft_probs, draft_cache = _draft_model_steps(
                    draft_params, draft_cfg, state.replace(draft_cache=draft_cache),
                    rows.sampling, running, k, kv_view=kv_view)
            tokens = jnp.concatenate([state.last_token[:, None], drafts], axis=1)  # [B, k+1]
            h, cache = llama.forward(params, cfg, tokens, cache, jnp.where(running, 1 + num, 0),
                                     kv_view=kv_view, attn_impl=attn_impl)
            logits = llama.lm_head(params, h)                                   # [B, k+1, V]
            accepted, token = verify(logits, drafts, num, rows.sampling, state.seen,
                                     state.num_generated, draft_probs)
            emitted = _emitted(drafts, accepted, token)
            lp = maybe_top_logprobs(want_lp, lambda x: x, logits, emitted)
            return (cache, draft_cache), (drafts, accepted, token, lp)

        def plain_step(caches):
            """No row drafts: one token per row, as decode_loop (a (k+1)-token forward would
            cost more for nothing); a draft model's cache only takes the last token's K/V."""
            cache, draft_cache = caches
            fed = running.astype(jnp.int32)
            h, cache = llama.forward(params, cfg, state.last_token[:, None], cache, fed,
                                     kv_view=kv_view, attn_impl=attn_impl)
            if draft_cfg is not None:
                _, draft_cache = llama.forward(draft_params, draft_cfg,
                                               state.last_token[:, None], draft_cache, fed,
                                               kv_view=kv_view)
            logits = llama.lm_head(params, h[:, 0])
            token = sample(logits, rows.sampling, state.seen, state.num_generated)
            lp = maybe_top_logprobs(want_lp, lambda x: x, logits, token)
            lp = jax.tree.map(lambda x: jnp.pad(x[:, None], [(0, 0), (0, k)] +
                                                [(0, 0)] * (x.ndim - 1)), lp)
            return (cache, draft_cache), (jnp.zeros((B, k), jnp.int32), zeros, token, lp)

        any_draft = jnp.any(num > 0)
        none = (jnp.zeros((B, k), jnp.int32), zeros, zeros, no_logprobs((B, k + 1)))
        caches, drafted_out = _run_if(any_draft, verify_drafts,
                                      (state.cache, state.draft_cache), none)
        (cache, draft_cache), plain_out = _run_if(~any_draft, plain_step, caches, none)
        drafts, accepted, token, lp = jax.tree.map(lambda a, b: jnp.where(any_draft, a, b),
                                                   drafted_out, plain_out)
        emitted = _emitted(drafts, accepted, token)
        n = jnp.minimum(accepted + 1, rows.max_new - state.num_generated)
        is_stop = jnp.any(emitted[..., None] == rows.stop_ids[:, None, :], axis=-1) & (
            j < n[:, None])
        hit_stop = jnp.any(is_stop, axis=1)
        n = jnp.where(hit_stop, jnp.argmax(is_stop, axis=1) + 1, n)
        n = jnp.where(running, n, 0)
        keep = j < n[:, None]
        # The cache keeps the last token and the emitted tokens but the newest (fed next step).
        cache = cache.rollback(length + n)
        if draft_cache is not None:
            draft_cache = draft_cache.rollback(length + n)
        new_last = jnp.take_along_axis(emitted, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0]
        rows_ix = jnp.broadcast_to(jnp.arange(B)[:, None], emitted.shape)
        out = out.at[rows_ix, jnp.where(keep, num_out[:, None] + j, W)].set(emitted, mode="drop")
        history = history.at[rows_ix, jnp.where(keep, length[:, None] + 1 + j, history.shape[1])
                             ].set(emitted, mode="drop")
        lp_out = jax.tree.map(
            lambda buf, x: buf.at[rows_ix, jnp.where(keep, num_out[:, None] + j, W)].set(
                x, mode="drop"), lp_out, lp)
        num_generated = state.num_generated + n
        state = DecodeState(cache=cache, last_token=jnp.where(running, new_last, state.last_token),
                            num_generated=num_generated,
                            seen=mark_seen(state.seen, emitted, keep), draft_cache=draft_cache)
        stopped = stopped | (running & (hit_stop | (num_generated >= rows.max_new)))
        counts = SpecCounts(steps=counts.steps + (num > 0), drafted=counts.drafted + num,
                            accepted=counts.accepted + accepted)
        return step + 1, state.constrained(), stopped, history, out, num_out + n, lp_out, counts

    carry = (jnp.int32(0), state, stopped, history, jnp.zeros((B, W), jnp.int32), zeros,
             no_logprobs((B, W)), SpecCounts(steps=zeros, drafted=zeros, accepted=zeros))
    _, state, stopped, _, out, num_out, lp_out, counts = jax.lax.while_loop(cond, body, carry)
    return state.constrained(), out, num_out, stopped, lp_out, counts
