"""DecodeState, the device state of a batch of rows (donated through every call; no request
property is a compile-time constant), the programs that change it outside a step (admission,
forks, block tables), and `advance_rows`, the bookkeeping of every step's new tokens.

Shape legend: B cache rows (slots), R listed rows, V vocab, E stop ids per row, W tokens a row
may emit at once.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from jaxinfer import sharding
from jaxinfer.backends.tuning import program_jit
from jaxinfer.config import ModelConfig
from jaxinfer.device.kv_cache import PagedKVCache
from jaxinfer.device.sampling import SamplingArrays


@flax.struct.dataclass
class RowParams:
    """Per-row request parameters, written into the state when a request is admitted."""

    sampling: SamplingArrays
    max_new: jax.Array    # [B] int32: tokens the row may generate (max_tokens, and max_seq_len)
    stop_ids: jax.Array   # [B, E] int32: ids that end the row (EOS unless ignore_eos); -1 pads
    logprobs: jax.Array   # [B] bool: return top log-probabilities of generated tokens
    prompt_logprobs: jax.Array  # [B] bool: return them for prompt tokens
    sampled_logprobs: jax.Array  # [B] bool: also the sampled token's under the sampling law

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
                   logprobs=z(bool), prompt_logprobs=z(bool), sampled_logprobs=z(bool))


@flax.struct.dataclass
class DecodeState:
    cache: PagedKVCache
    last_token: jax.Array     # [B] int32: the newest token of each row, not yet in the cache
    num_generated: jax.Array  # [B] int32: tokens generated so far by the row's request
    seen: jax.Array           # [B, V] bool: tokens of prompt and output (repetition penalty)
    rows: RowParams           # [B] request parameters
    history: jax.Array | None = None       # [B, L] int32 prompt + output (n-gram drafting)
    draft_cache: PagedKVCache | None = None  # a draft model's ring (speculative decoding)
    lora_slot: jax.Array | None = None     # [B] int32 each row's adapter slot, -1 none (LoRA)

    @classmethod
    def create(cls, cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.float32,
               cache=None, draft_cfg: ModelConfig | None = None, draft_capacity: int = 0,
               history: int = 0, num_stop_ids: int = 8, lora: bool = False, xp=jnp):
        """A ring cache of `capacity` slots per row, or the given cache; with draft_cfg a draft
        ring of draft_capacity slots; history > 0: that many positions of token history.
        xp=numpy builds it on the host, for one device_put that compiles nothing."""
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
                   draft_cache=draft,
                   lora_slot=xp.full((batch,), -1, xp.int32) if lora else None)

    def logical_axes(self) -> "DecodeState":
        """Each array's logical axes (jaxinfer.sharding), in the state's own structure."""
        row_axes = jax.tree.map(lambda x: ("batch",) + (None,) * (x.ndim - 1), self.rows)
        return DecodeState(cache=self.cache.logical_axes(), last_token=("batch",),
                           num_generated=("batch",), seen=("batch", "vocab"), rows=row_axes,
                           history=None if self.history is None else ("batch", None),
                           draft_cache=None if self.draft_cache is None
                           else self.draft_cache.logical_axes(),
                           lora_slot=None if self.lora_slot is None else ("batch",))

    def constrained(self) -> "DecodeState":
        """The state pinned to its sharding on the context mesh, so a step's output sharding
        equals its input's."""
        return sharding.constrain_tree(self, self.logical_axes())


@functools.partial(program_jit, donate_argnums=(0,))
def admit_rows(state: DecodeState, mask: jax.Array, start: jax.Array, generated: jax.Array,
               rows: RowParams, history: jax.Array | None = None,
               block_tables: jax.Array | None = None,
               lora_slot: jax.Array | None = None) -> DecodeState:
    """Starts requests in the rows where mask [B] is set: the cache row restarts at start [B]
    (prefix-cache hits), num_generated at generated [B] (a preempted request's), with rows'
    parameters and history [B, L]. K/V stay in place (past a row's length, never attended).
    block_tables [B, M]: a paged cache's new tables; lora_slot [B]: the rows' adapter slots."""
    cache = state.cache.reset_rows(mask, start)
    if block_tables is not None:
        cache = cache.replace(block_tables=block_tables)
    pick = lambda new, old: jnp.where(  # noqa: E731
        mask.reshape(mask.shape + (1,) * (old.ndim - 1)), new, old)
    if state.draft_cache is not None:
        state = state.replace(draft_cache=state.draft_cache.reset_rows(mask, start))
    if state.history is not None and history is not None:
        state = state.replace(history=pick(history, state.history))
    if state.lora_slot is not None and lora_slot is not None:
        state = state.replace(lora_slot=pick(lora_slot, state.lora_slot))
    return state.replace(cache=cache,
                         last_token=jnp.where(mask, 0, state.last_token),
                         num_generated=jnp.where(mask, generated, state.num_generated),
                         seen=state.seen & ~mask[:, None],
                         rows=jax.tree.map(pick, rows, state.rows)).constrained()


@functools.partial(program_jit, donate_argnums=(0,))
def fork_rows(state: DecodeState, src_rows: jax.Array, dst_rows: jax.Array,
              src_pages: jax.Array, dst_pages: jax.Array) -> DecodeState:
    """Rows dst_rows [C] forked from src_rows [C] (B: padding) after admit_rows: each takes its
    source's seen mask and, through PagedKVCache.fork, its pages (src_pages [C'] into dst_pages
    [C'], -1: none) or whole ring rows (a draft model's too)."""
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


def advance_rows(state: DecodeState, rows: jax.Array, emitted: jax.Array, count: jax.Array,
                 running: jax.Array, base: jax.Array):
    """Books emitted[r, :count[r]] ([R, W]) of the listed rows [R] (B: none) at positions
    base[r] + 1 + j, cut after a stop id or at max_new (then done): the one place stops are
    decided. Rows not running book nothing. Returns (state, count [R] booked, done [R])."""
    B, W = state.last_token.shape[0], emitted.shape[1]
    j = jnp.arange(W, dtype=jnp.int32)[None, :]
    generated = _take(state.num_generated, rows)
    max_new, stop_ids = _take(state.rows.max_new, rows), _take(state.rows.stop_ids, rows)
    count = jnp.clip(jnp.minimum(count, max_new - generated), 0, W)
    is_stop = jnp.any(emitted[..., None] == stop_ids[:, None, :], axis=-1) & (j < count[:, None])
    hit_stop = jnp.any(is_stop, axis=1)
    count = jnp.where(hit_stop, jnp.argmax(is_stop, axis=1) + 1, count)
    count = jnp.where(running, count, 0)
    done = running & (hit_stop | (generated + count >= max_new))
    keep = j < count[:, None]
    row_ix = jnp.where(keep, rows[:, None], B)                              # [R, W]
    last = jnp.take_along_axis(emitted, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    history = state.history
    if history is not None:
        history = history.at[row_ix, base[:, None] + 1 + j].set(emitted, mode="drop")
    state = state.replace(
        last_token=_put(state.last_token, jnp.where(count > 0, rows, B), last),
        num_generated=_put(state.num_generated, rows, generated + count),
        seen=state.seen.at[row_ix, jnp.where(keep, emitted, 0)].set(True, mode="drop"),
        history=history)
    return state, count, done
