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

    def view(self, kv_view: int | None):
        """(k, v, positions) restricted to the first kv_view slots (static), for short contexts.

        Valid only while no row has wrapped past kv_view, which the caller guarantees by choosing
        kv_view >= every row's length (or kv_view == capacity).
        """
        if kv_view is None or kv_view >= self.capacity:
            return self.k, self.v, self.positions
        return self.k[:, :, :kv_view], self.v[:, :, :kv_view], self.positions[:, :kv_view]

    def write(self, k_new: jax.Array, v_new: jax.Array, num_new: jax.Array) -> "RingKVCache":
        """Appends per row the first num_new[b] of T new tokens (at positions lengths[b] + t).

        k_new, v_new [L, B, T, K, H]; num_new [B] int32. When T exceeds the capacity only the last
        C tokens of a row are kept, so no two writes of one call land in the same slot.
        """
        L, B, T = k_new.shape[:3]
        C = self.capacity
        t = jnp.arange(T, dtype=jnp.int32)[None, :]                    # [1, T]
        pos = self.lengths[:, None] + t                                 # [B, T]
        keep = (t < num_new[:, None]) & (t >= num_new[:, None] - C)
        slot = jnp.where(keep, pos % C, C)                              # C = out of range: dropped
        rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
        k = self.k.at[:, rows, slot].set(k_new.astype(self.k.dtype), mode="drop")
        v = self.v.at[:, rows, slot].set(v_new.astype(self.v.dtype), mode="drop")
        positions = self.positions.at[rows, slot].set(pos, mode="drop")
        return RingKVCache(k=k, v=v, positions=positions, lengths=self.lengths + num_new)
