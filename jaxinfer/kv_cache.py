"""KV caches.

Shape legend: L layers, B batch rows, C ring capacity, K kv heads, H head dim, T new tokens.

RingKVCache is a preallocated ring buffer: token at absolute position p of row b lives in slot
p % C. `positions[b, c]` records which absolute position slot c holds (-1 when empty), and
attention masks are built from those positions rather than slot indices. That is what lets a
sliding-window layer keep capacity == window and wrap: stale slots simply fall outside the window.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class RingKVCache:
    k: jax.Array          # [L, B, C, K, H]
    v: jax.Array          # [L, B, C, K, H]
    positions: jax.Array  # [B, C] int32: absolute position held by each slot, -1 if empty
    lengths: jax.Array    # [B] int32: tokens written so far (= position of the next token)

    @classmethod
    def create(cls, num_layers: int, batch: int, capacity: int, num_kv_heads: int,
               head_dim: int, dtype=jnp.float32) -> "RingKVCache":
        shape = (num_layers, batch, capacity, num_kv_heads, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   positions=jnp.full((batch, capacity), -1, jnp.int32),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def plan_write(self, num_new: jax.Array, T: int) -> "WritePlan":
        """Where the first num_new[b] of T new tokens of row b go (positions lengths[b] + t).

        When T exceeds the capacity only the last C tokens of a row are kept, so no two writes of
        one call land in the same slot. Dropped tokens get slot C, which scatters ignore.
        """
        B = self.lengths.shape[0]
        C = self.capacity
        t = jnp.arange(T, dtype=jnp.int32)[None, :]                    # [1, T]
        pos = self.lengths[:, None] + t                                 # [B, T]
        keep = (t < num_new[:, None]) & (t >= num_new[:, None] - C)
        return WritePlan(rows=jnp.broadcast_to(jnp.arange(B)[:, None], (B, T)),
                         slots=jnp.where(keep, pos % C, C), positions=pos,
                         key_positions=jnp.where(t < num_new[:, None], pos, -1))

    def write_positions(self, plan: "WritePlan") -> jax.Array:
        """positions [B, C] after the planned write."""
        return self.positions.at[plan.rows, plan.slots].set(plan.positions, mode="drop")

    @staticmethod
    def write_layer(buf: jax.Array, layer: int, new: jax.Array, plan: "WritePlan") -> jax.Array:
        """buf [L, B, C, K, H] with layer `layer` updated by new [B, T, K, H] as planned.

        Written inside the layer loop, before the layer reads the cache, so XLA updates the
        donated buffer in place: reading a layer's old keys after the write was issued made it
        copy the whole cache every decode step.
        """
        return buf.at[layer, plan.rows, plan.slots].set(new.astype(buf.dtype), mode="drop")


@flax.struct.dataclass
class WritePlan:
    rows: jax.Array           # [B, T] int32 row index of each new token
    slots: jax.Array          # [B, T] int32 ring slot, C where the token is not written
    positions: jax.Array      # [B, T] int32 absolute position of each new token
    key_positions: jax.Array  # [B, T] int32 the same, -1 for padding (invisible as a key)
