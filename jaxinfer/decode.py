"""Jitted device steps over one flat token batch: step, prefill and decode_loop (the
speculative loop over the same state is in jaxinfer.speculative_loop).

Shape legend: B cache rows (slots), T tokens of a step, R rows of a decode dispatch, S rows
sampled in a step, V vocab, E stop ids per row, W tokens a dispatch can emit per row.

The device owns DecodeState: the cache, each row's last token, output count, seen-token mask,
request parameters (RowParams, written when a request is admitted) and, for n-gram speculation,
each row's token history. It is donated through every call. A step's input is a TokenBatch
(jaxinfer.token_batch): decode tokens and prefill chunks side by side, one forward over
[T, D]. No request property is ever a compile-time constant: the static arguments are shapes
(T, R, steps per dispatch), the attention's query tile and the Backend (jaxinfer.backends),
whose ops every program takes.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from jaxinfer import backends, sharding
from jaxinfer.backends import Backend
from jaxinfer.backends.tuning import loop_jit, program_jit
from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import PagedKVCache
from jaxinfer.models import get_model
from jaxinfer.sampling import SamplingArrays, mark_seen, maybe_top_logprobs, no_logprobs, sample
from jaxinfer.token_batch import TokenBatch



@flax.struct.dataclass
class RowParams:
    """Per-row request parameters, written into the state when a request is admitted."""

    sampling: SamplingArrays
    max_new: jax.Array    # [B] int32: tokens the row may generate (max_tokens, and max_seq_len)
    stop_ids: jax.Array   # [B, E] int32: ids that end the row (EOS unless ignore_eos); -1 pads
    logprobs: jax.Array   # [B] bool: return top log-probabilities of generated tokens
    prompt_logprobs: jax.Array  # [B] bool: return them for prompt tokens

    @classmethod
    def empty(cls, batch: int, num_stop_ids: int) -> "RowParams":
        import numpy as np

        z = lambda dt: np.zeros(batch, dt)  # noqa: E731
        return cls(sampling=SamplingArrays(temperature=z(np.float32), top_k=z(np.int32),
                                           top_p=np.ones(batch, np.float32),
                                           min_p=z(np.float32),
                                           repetition_penalty=np.ones(batch, np.float32),
                                           seed=z(np.uint32)),
                   max_new=z(np.int32), stop_ids=np.full((batch, num_stop_ids), -1, np.int32),
                   logprobs=z(bool), prompt_logprobs=z(bool))


@flax.struct.dataclass
class DecodeState:
    cache: PagedKVCache
    last_token: jax.Array     # [B] int32: the newest token of each row, not yet in the cache
    num_generated: jax.Array  # [B] int32: tokens generated so far by the row's request
    seen: jax.Array           # [B, V] bool: tokens of prompt and output (repetition penalty)
    rows: RowParams           # [B] request parameters
    history: jax.Array | None = None       # [B, L] int32 prompt + output (n-gram drafting)
    draft_cache: PagedKVCache | None = None  # a draft model's ring (speculative decoding)

    @classmethod
    def create(cls, cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.float32,
               cache=None, draft_cfg: ModelConfig | None = None, draft_capacity: int = 0,
               history: int = 0, num_stop_ids: int = 8, xp=jnp):
        """A ring cache of `capacity` slots per row, or the given cache (e.g. a paged one);
        with draft_cfg, a ring of draft_capacity slots per row for the draft model too;
        history > 0: a token history of that many positions per row (n-gram drafting).
        xp=numpy builds the state on the host, for one device_put that compiles nothing (the
        engine's way: each jnp.zeros of a new shape would be a small program of its own)."""
        if cache is None:
            cache = PagedKVCache.ring(cfg.num_layers, batch, capacity, cfg.num_kv_heads,
                                      cfg.head_dim, dtype, xp=xp)
        draft = None if draft_cfg is None else PagedKVCache.ring(
            draft_cfg.num_layers, batch, draft_capacity, draft_cfg.num_kv_heads,
            draft_cfg.head_dim, dtype, xp=xp)
        return cls(cache=cache,
                   last_token=xp.zeros((batch,), xp.int32),
                   num_generated=xp.zeros((batch,), xp.int32),
                   seen=xp.zeros((batch, cfg.vocab_size), bool),
                   rows=jax.tree.map(xp.asarray, RowParams.empty(batch, num_stop_ids)),
                   history=xp.zeros((batch, history), xp.int32) if history else None,
                   draft_cache=draft)

    def logical_axes(self) -> "DecodeState":
        """Each array's logical axes (jaxinfer.sharding), in the state's own structure."""
        row_axes = jax.tree.map(lambda x: ("batch",) + (None,) * (x.ndim - 1), self.rows)
        return DecodeState(cache=self.cache.logical_axes(), last_token=("batch",),
                           num_generated=("batch",), seen=("batch", "vocab"), rows=row_axes,
                           history=None if self.history is None else ("batch", None),
                           draft_cache=None if self.draft_cache is None
                           else self.draft_cache.logical_axes())

    def constrained(self) -> "DecodeState":
        """The state pinned to its sharding on the context mesh (identity without one): every
        jitted step returns this, so its output sharding equals its input's."""
        return sharding.constrain_tree(self, self.logical_axes())


@functools.partial(program_jit, donate_argnums=(0,))
def admit_rows(state: DecodeState, mask: jax.Array, start: jax.Array, generated: jax.Array,
               rows: RowParams, history: jax.Array | None = None,
               block_tables: jax.Array | None = None) -> DecodeState:
    """Starts new requests in the rows where mask [B] is set: their cache rows restart at
    position start [B] (non-zero for prefix-cache hits), num_generated at generated [B] (the
    tokens a preempted request already produced, which its prefill recomputes), their
    parameters become rows' (others keep theirs) and, with n-gram drafting, their history
    history's [B, L]. K/V data is left in place: positions past a row's length are never
    attended. block_tables [B, M]: a paged cache's new tables."""
    cache = state.cache.reset_rows(mask, start)
    if block_tables is not None:
        cache = cache.replace(block_tables=block_tables)
    pick = lambda new, old: jnp.where(  # noqa: E731
        mask.reshape(mask.shape + (1,) * (old.ndim - 1)), new, old)
    if state.draft_cache is not None:
        state = state.replace(draft_cache=state.draft_cache.reset_rows(mask, start))
    if state.history is not None and history is not None:
        state = state.replace(history=pick(history, state.history))
    return state.replace(cache=cache,
                         last_token=jnp.where(mask, 0, state.last_token),
                         num_generated=jnp.where(mask, generated, state.num_generated),
                         seen=state.seen & ~mask[:, None],
                         rows=jax.tree.map(pick, rows, state.rows)).constrained()


@functools.partial(program_jit, donate_argnums=(0,))
def fork_rows(state: DecodeState, src_rows: jax.Array, dst_rows: jax.Array,
              src_pages: jax.Array, dst_pages: jax.Array) -> DecodeState:
    """Rows dst_rows [C] forked from src_rows [C] (B: padding), after admit_rows started them:
    each takes its source's seen-token mask (the prompt so far, for the repetition penalty).
    A paged cache copies pages src_pages [C'] into dst_pages [C'] (-1: none), the partly
    filled page each fork may not share; a ring cache (a hybrid cache's ring of local layers,
    and a draft model's ring) copies the source rows' whole rings."""
    seen = state.seen.at[dst_rows].set(_take(state.seen, src_rows), mode="drop")
    cache = state.cache.fork(src_rows, dst_rows, src_pages, dst_pages)
    draft = state.draft_cache
    if draft is not None:
        draft = draft.copy_rows(src_rows, dst_rows)
    return state.replace(seen=seen, cache=cache, draft_cache=draft).constrained()


@functools.partial(program_jit, donate_argnums=(0,))
def set_block_tables(state: DecodeState, block_tables: jax.Array) -> DecodeState:
    """A paged cache's block tables [B, M] after the host grew or freed rows' pages."""
    return state.replace(cache=state.cache.replace(block_tables=block_tables)).constrained()


def _take(x: jax.Array, rows: jax.Array) -> jax.Array:
    """x's entries for the listed rows (a padding entry, index B, reads the last row)."""
    return x[jnp.minimum(rows, x.shape[0] - 1)]


def _put(x: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    """x with the listed rows set to values (padding entries dropped)."""
    return x.at[rows].set(values, mode="drop")


def _sample_rows(logits, state: DecodeState, rows: jax.Array, index: jax.Array,
                 backend: Backend):
    """Samples a token for each listed row from its logits [R, V] with the row's parameters,
    seen mask and token index [R]. The rows' seen masks ([R, V]) are gathered only where a
    repetition penalty applies: gathered every step, they cost a copy of R x V bools."""
    sp = jax.tree.map(lambda x: _take(x, rows), state.rows.sampling)
    return sample(logits, sp, lambda: _take(state.seen, rows), index, backend)


@flax.struct.dataclass
class StepOutput:
    """What one step returns for the host: the rows that sampled and their tokens."""

    sampled_rows: jax.Array  # [S] int32 rows that sampled a token (B: none), in row order
    tokens: jax.Array        # [S] int32 their tokens
    logprobs: tuple          # (ids [S, k], values [S, k], chosen [S]), filled where wanted
    prompt_logprobs: tuple   # (ids [T, k], values [T, k], chosen [T]) of batch.next_tokens


def step(params, state: DecodeState, batch: TokenBatch, sample_rows: jax.Array,
         next_tokens: jax.Array | None = None, *, cfg: ModelConfig,
         backend: Backend | None = None, query_tile: int = 16, draft_params=None,
         draft_cfg: ModelConfig | None = None) -> tuple[StepOutput, DecodeState]:
    """One engine step, pure: every token of the flat batch through the model once (prefill
    chunks and one token per decoding row side by side), then a sampled token for each row
    listed in sample_rows [S] (B: an empty entry), from the logits of the row's last token
    in the batch. A row samples when the step completes what it had to feed (a decode token,
    or a prompt's last chunk); rows mid-prompt only fill their cache. next_tokens [T] int32
    (-1: none): the prompt token after each batch token, scored when the row wants
    prompt_logprobs. backend: the ops' implementations (default: backends.default(), as
    resolved when this is traced). Usable inside a caller's own jax.jit; jitted for the engine
    as step_jit. Returns (StepOutput, state)."""
    backend = backend if backend is not None else backends.default()
    B = state.last_token.shape[0]
    model = get_model(cfg.architecture)
    h, cache = model.forward_tokens(params, cfg, batch, state.cache, backend=backend,
                                    query_tile=query_tile)
    draft_cache = state.draft_cache
    if draft_cfg is not None:
        _, draft_cache = get_model(draft_cfg.architecture).forward_tokens(
            draft_params, draft_cfg, batch, draft_cache, backend=backend,
            query_tile=query_tile)
    valid = batch.rows < B
    seen = state.seen.at[jnp.where(valid, batch.rows, B), batch.tokens].set(True, mode="drop")
    state = state.replace(seen=seen)
    last = _take(batch.query_start + batch.num_queries - 1, sample_rows)  # [S]
    logits = model.head(params, h[jnp.maximum(last, 0)], backend)         # [S, V]
    index = _take(state.num_generated, sample_rows)
    token = _sample_rows(logits, state, sample_rows, index, backend)
    real = sample_rows < B
    want = _take(state.rows.logprobs, sample_rows) & real
    lp = maybe_top_logprobs(want, lambda x: x, logits, token)
    if next_tokens is None:
        prompt_lp = no_logprobs((batch.num_tokens,))
    else:
        want_p = _take(state.rows.prompt_logprobs, batch.rows) & valid & (next_tokens >= 0)
        prompt_lp = maybe_top_logprobs(want_p, lambda x: model.head(params, x, backend), h,
                                       next_tokens)
    length = _take(cache.lengths, sample_rows)
    history = state.history
    if history is not None:
        history = history.at[jnp.where(real, sample_rows, B), length].set(token, mode="drop")
    state = state.replace(
        cache=cache, draft_cache=draft_cache, history=history,
        last_token=_put(state.last_token, sample_rows, token),
        num_generated=_put(state.num_generated, sample_rows, index + 1),
        seen=mark_seen(state.seen, _put(jnp.full((B,), -1, jnp.int32), sample_rows, token)[:, None],
                       _put(jnp.zeros((B,), bool), sample_rows, real)[:, None]))
    out = StepOutput(sampled_rows=sample_rows, tokens=token, logprobs=lp,
                     prompt_logprobs=prompt_lp)
    return out, state.constrained()


# Compiled with the platform's compiler options (backends.tuning), as every program here.
step_jit = program_jit(step, donate_argnums=(1,),
                       static_argnames=("cfg", "backend", "query_tile", "draft_cfg"))


def _forward_rows(params, cfg, state_cache, tokens, num_new, rows, backend):
    """The target forward of a decode dispatch: [R, T] tokens of the listed rows."""
    return get_model(cfg.architecture).forward(params, cfg, tokens, state_cache, num_new,
                                               rows=rows, backend=backend)


# Compiled with the platform's loop options (backends.tuning).
@functools.partial(loop_jit, static_argnames=("cfg", "num_steps", "backend", "draft_cfg"),
                   donate_argnums=(1,))
def decode_loop(params, state: DecodeState, rows: jax.Array, *, cfg: ModelConfig,
                num_steps: int, backend: Backend | None = None,
                exit_on_stop: jax.Array | bool = False, draft_params=None,
                draft_cfg: ModelConfig | None = None):
    """Runs up to num_steps decode steps for the listed rows [R] (B: an empty entry) in one
    dispatch (a lax.while_loop); each step is a flat batch of one token per running row.

    Each step feeds every running row's last token, samples the next and records it. A row stops
    on a stop id or when it has max_new tokens; the loop ends when all rows have stopped or after
    num_steps, or (exit_on_stop, a traced bool: a request is waiting for a slot) as soon as any
    row stops. Returns (state, out_tokens [B, S] int32, num_out [B] int32, done [B] bool,
    logprobs): row b produced out_tokens[b, :num_out[b]]; done[b] says it stopped (its last token
    tells why); logprobs = (ids [B, S, k], values [B, S, k], chosen [B, S]) of top_logprobs,
    filled for rows with logprobs. A draft model's cache (draft_cfg) takes every fed token.
    backend: as step's.
    """
    backend = backend if backend is not None else backends.default()
    B = state.last_token.shape[0]
    R = rows.shape[0]
    listed = jnp.zeros((B,), bool).at[rows].set(True, mode="drop")
    stopped = ~listed | (state.num_generated >= state.rows.max_new)
    stopped |= jnp.any(state.last_token[:, None] == state.rows.stop_ids, axis=-1) & listed
    stopped_before = stopped
    out = jnp.zeros((B, num_steps), jnp.int32)
    lp_out = no_logprobs((B, num_steps))

    def cond(carry):
        step, _, stopped, _, _, _ = carry
        freed = exit_on_stop & jnp.any(stopped & ~stopped_before)
        return (step < num_steps) & ~jnp.all(stopped) & ~freed

    def body(carry):
        i, state, stopped, out, num_out, lp_out = carry
        running = ~stopped
        fed = _take(running, rows) & (rows < B)                           # [R]
        tokens = _take(state.last_token, rows)[:, None]
        h, cache = _forward_rows(params, cfg, state.cache, tokens, fed.astype(jnp.int32),
                                 rows, backend)
        draft_cache = state.draft_cache
        if draft_cfg is not None:
            _, draft_cache = get_model(draft_cfg.architecture).forward(
                draft_params, draft_cfg, tokens, draft_cache, fed.astype(jnp.int32), rows=rows,
                backend=backend)
        logits = get_model(cfg.architecture).head(params, h[:, 0], backend)  # [R, V]
        drawn = _sample_rows(logits, state, rows, _take(state.num_generated, rows), backend)
        token = jnp.where(running, _put(state.last_token, rows, drawn), state.last_token)
        out = out.at[:, i].set(jnp.where(running, token, -1))
        want = _take(state.rows.logprobs & running, rows)
        lp = maybe_top_logprobs(want, lambda x: x, logits, drawn)
        lp = jax.tree.map(lambda x: _put(jnp.zeros((B,) + x.shape[1:], x.dtype), rows, x), lp)
        lp_out = jax.tree.map(lambda buf, x: buf.at[:, i].set(x), lp_out, lp)
        num_generated = state.num_generated + running
        seen = mark_seen(state.seen, token[:, None], running[:, None])
        history = state.history
        if history is not None:
            history = history.at[jnp.where(running, jnp.arange(B), B),
                                 cache.lengths].set(token, mode="drop")
        hit_stop = jnp.any(token[:, None] == state.rows.stop_ids, axis=-1)
        stopped = stopped | (running & (hit_stop | (num_generated >= state.rows.max_new)))
        state = state.replace(cache=cache, last_token=token, num_generated=num_generated,
                              seen=seen, history=history, draft_cache=draft_cache)
        return i + 1, state.constrained(), stopped, out, num_out + running, lp_out

    del R
    carry = (jnp.int32(0), state, stopped, out, jnp.zeros((B,), jnp.int32), lp_out)
    _, state, stopped, out, num_out, lp_out = jax.lax.while_loop(cond, body, carry)
    return state.constrained(), out, num_out, stopped, lp_out


@functools.partial(program_jit, static_argnames=("cfg", "backend", "draft_cfg"),
                   donate_argnums=(1,))
def prefill(params, state: DecodeState, tokens: jax.Array, num_new: jax.Array, *,
            cfg: ModelConfig, backend: Backend | None = None, draft_params=None,
            draft_cfg: ModelConfig | None = None):
    """Feeds row b its first num_new[b] tokens of tokens [B, T] (one step over a dense block)
    and samples the next token of every fed row with the row's parameters (state.rows, set by
    admit_rows). Returns (first tokens [B] int32, meaningful where num_new > 0; state): the
    embeddable way to start rows before decode_loop."""
    B, T = tokens.shape
    batch = TokenBatch.dense(tokens, num_new, None, B)
    sample_rows = jnp.where(num_new > 0, jnp.arange(B, dtype=jnp.int32), B)
    out, state = step(params, state, batch, sample_rows, cfg=cfg, backend=backend,
                      query_tile=T, draft_params=draft_params, draft_cfg=draft_cfg)
    return jnp.zeros((B,), jnp.int32).at[sample_rows].set(out.tokens, mode="drop"), state
