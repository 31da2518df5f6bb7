"""One step's tokens as a flat batch: the input of the model's forward and of jaxinfer.step.

Shape legend: T tokens of the step (a bucketed size), B cache rows (slots).

Decode tokens and prefill chunks sit side by side in one [T] array, so every matmul runs over
[T, D] without per-request padding. Row b owns tokens query_start[b] .. + num_queries[b] - 1 at
positions cache.lengths[b] + i; rows[t] names token t's row (B: padding, which writes nothing).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class TokenBatch:
    tokens: jax.Array       # [T] int32 token ids (0 for padding)
    rows: jax.Array         # [T] int32 cache row of each token; B = padding
    query_start: jax.Array  # [B] int32 index of each row's first token in the batch
    num_queries: jax.Array  # [B] int32 tokens of each row in this step (0: none)

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    def positions(self, lengths: jax.Array) -> jax.Array:
        """[T] int32 positions from the rows' lengths [B] before the step (0 for padding)."""
        B = lengths.shape[0]
        r = jnp.minimum(self.rows, B - 1)
        t = jnp.arange(self.tokens.shape[0], dtype=jnp.int32)
        return jnp.where(self.rows < B, lengths[r] + t - self.query_start[r], 0)

    @classmethod
    def dense(cls, tokens: jax.Array, num_new: jax.Array, rows: jax.Array | None,
              num_rows: int) -> "TokenBatch":
        """A [R, T] block's batch: row i feeds cache row rows[i] (None: i) num_new[i] tokens."""
        R, T = tokens.shape
        rows = jnp.arange(R, dtype=jnp.int32) if rows is None else rows.astype(jnp.int32)
        real = jnp.arange(T, dtype=jnp.int32)[None, :] < num_new[:, None]
        token_rows = jnp.where(real, rows[:, None], num_rows).reshape(-1)
        start = jnp.zeros((num_rows,), jnp.int32).at[rows].set(
            jnp.arange(R, dtype=jnp.int32) * T, mode="drop")
        count = jnp.zeros((num_rows,), jnp.int32).at[rows].set(num_new.astype(jnp.int32),
                                                               mode="drop")
        return cls(tokens=tokens.reshape(-1).astype(jnp.int32), rows=token_rows,
                   query_start=start, num_queries=count)


def host_batch(num_tokens: int, num_rows: int, segments) -> TokenBatch:
    """A TokenBatch in numpy (nothing compiles for a new step) from (row, token ids) segments."""
    tokens = np.zeros(num_tokens, np.int32)
    rows = np.full(num_tokens, num_rows, np.int32)
    start = np.zeros(num_rows, np.int32)
    count = np.zeros(num_rows, np.int32)
    t = 0
    for row, ids in segments:
        n = len(ids)
        tokens[t:t + n] = ids
        rows[t:t + n] = row
        start[row], count[row] = t, n
        t += n
    if t > num_tokens:
        raise ValueError(f"the step holds {t} tokens; its batch has room for {num_tokens}")
    return TokenBatch(tokens=tokens, rows=rows, query_start=start, num_queries=count)
