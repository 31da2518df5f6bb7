"""KV caches.

Shape legend: L layers, B batch rows, C ring capacity, K kv heads, H head dim, T new tokens.

RingKVCache is a preallocated ring buffer: token at absolute position p of row b lives in slot
p % C. `positions[b, c]` records which absolute position slot c holds (-1 when empty), and
attention masks are built from those positions rather than slot indices. That is what lets a
sliding-window layer keep capacity == window and wrap: stale slots simply fall outside the window.

PagedKVCache is a pool of fixed-size pages shared by all rows: row b's position p lives in page
block_tables[b, p // page_size] at offset p % page_size (P pages, page size Z), i.e. at flat
pool slot block_tables[b, p // Z] * Z + p % Z. Pages are handed
out by the host (jaxinfer.engine.pages); page 0 is the null page that padding writes go to.

Both implement the protocol the model uses: plan_write -> write_layer (per layer, in place) ->
layer_keys (what attention reads) / kernel_pages (the paged kernel's layout) -> advance.
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

    def layer_keys(self, k_all, v_all, layer: int, S: int, kpos: jax.Array):
        """(k, v [B, S, K, H], key positions [B, S]) of the first S slots of a layer; kpos is
        write_positions() of this call's plan."""
        return k_all[layer, :, :S], v_all[layer, :, :S], kpos[:, :S]

    def kernel_pages(self, k_all, v_all, layer: int, S: int, page_size: int = 16):
        """The first S slots of each row as a page pool for the paged kernel, or None when S is
        not a multiple of page_size. Only valid while slot j holds position j (no wrap)."""
        if S % page_size:
            return None
        B = k_all.shape[1]
        per_row = S // page_size
        shape = (B * per_row, page_size) + k_all.shape[3:]
        tables = jnp.arange(B * per_row, dtype=jnp.int32).reshape(B, per_row)
        return k_all[layer, :, :S].reshape(shape), v_all[layer, :, :S].reshape(shape), tables

    def advance(self, k_all, v_all, kpos, num_new) -> "RingKVCache":
        return RingKVCache(k=k_all, v=v_all, positions=kpos, lengths=self.lengths + num_new)

    def reset_rows(self, mask: jax.Array, start: jax.Array) -> "RingKVCache":
        """Empties rows where mask [B] is set (a ring row always restarts at position 0)."""
        del start
        return self.replace(positions=jnp.where(mask[:, None], -1, self.positions),
                            lengths=jnp.where(mask, 0, self.lengths))

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


@flax.struct.dataclass
class PagedKVCache:
    # The pool is stored with pages flattened, [L, P * Z, K, H]: a view as [L, P, Z, K, H] is
    # free, but reshaping around each layer's in-place write made XLA copy the whole pool
    # inside the decode loop.
    k: jax.Array             # [L, P * Z, K, H]
    v: jax.Array             # [L, P * Z, K, H]
    block_tables: jax.Array  # [B, M] int32: row b's pages in order; unused entries = 0 (null)
    lengths: jax.Array       # [B] int32: tokens written so far
    page_size: int = flax.struct.field(pytree_node=False, default=16)

    @classmethod
    def create(cls, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
               head_dim: int, block_tables: jax.Array, dtype=jnp.float32) -> "PagedKVCache":
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        block_tables = jnp.asarray(block_tables, jnp.int32)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   block_tables=block_tables,
                   lengths=jnp.zeros((block_tables.shape[0],), jnp.int32), page_size=page_size)

    @property
    def num_pages(self) -> int:
        return self.k.shape[1] // self.page_size

    @property
    def capacity(self) -> int:
        """Most tokens a row can hold: its block-table width times the page size."""
        return self.block_tables.shape[1] * self.page_size

    def plan_write(self, num_new: jax.Array, T: int) -> WritePlan:
        """Token t of row b (t < num_new[b]) goes to flat slot page * Z + offset of the pool;
        padding goes to P * Z, past the pool, which scatters drop."""
        B = self.lengths.shape[0]
        Z = self.page_size
        t = jnp.arange(T, dtype=jnp.int32)[None, :]
        pos = self.lengths[:, None] + t                                 # [B, T]
        real = t < num_new[:, None]
        page_idx = jnp.clip(pos // Z, 0, self.block_tables.shape[1] - 1)
        page = jnp.take_along_axis(self.block_tables, page_idx, axis=1)
        return WritePlan(rows=jnp.broadcast_to(jnp.arange(B)[:, None], (B, T)),
                         slots=jnp.where(real, page * Z + pos % Z, self.k.shape[1]),
                         positions=pos, key_positions=jnp.where(real, pos, -1))

    def write_positions(self, plan: WritePlan) -> jax.Array:
        """Key positions of row slots 0..capacity-1 after the write: slot j holds position j."""
        j = jnp.arange(self.capacity, dtype=jnp.int32)[None, :]
        after = self.lengths + jnp.sum(plan.key_positions >= 0, axis=1, dtype=jnp.int32)
        return jnp.where(j < after[:, None], j, -1)

    @staticmethod
    def write_layer(buf: jax.Array, layer: int, new: jax.Array, plan: WritePlan) -> jax.Array:
        """buf [L, P * Z, K, H] with the planned slots of one layer set to new [B, T, K, H]."""
        return buf.at[layer, plan.slots].set(new.astype(buf.dtype), mode="drop")

    def _row_slots(self, S: int) -> jax.Array:
        """Flat pool slots of row positions 0..S-1: [B, S] (S a multiple of the page size)."""
        Z = self.page_size
        tables = self.block_tables[:, :S // Z]                           # [B, S/Z]
        return (tables[:, :, None] * Z + jnp.arange(Z, dtype=jnp.int32)).reshape(-1, S)

    def layer_keys(self, k_all, v_all, layer: int, S: int, kpos: jax.Array):
        """Row b's first S positions gathered through its block table: (k, v [B, S, K, H],
        key positions [B, S])."""
        slots = self._row_slots(S)
        return k_all[layer][slots], v_all[layer][slots], kpos[:, :S]

    def kernel_pages(self, k_all, v_all, layer: int, S: int, page_size: int = 16):
        """The pool as pages [P, Z, K, H] and the block tables (first S/Z pages): what the
        paged kernel reads."""
        shape = (self.num_pages, self.page_size) + k_all.shape[2:]
        return (k_all[layer].reshape(shape), v_all[layer].reshape(shape),
                self.block_tables[:, :S // self.page_size])

    def advance(self, k_all, v_all, kpos, num_new) -> "PagedKVCache":
        del kpos  # positions are implicit in a paged row
        return self.replace(k=k_all, v=v_all, lengths=self.lengths + num_new)

    def reset_rows(self, mask: jax.Array, start: jax.Array) -> "PagedKVCache":
        """Restarts rows where mask [B] is set at position start [B]: the tokens before it are
        already in the row's pages (prefix-cache hits)."""
        return self.replace(lengths=jnp.where(mask, start, self.lengths))
