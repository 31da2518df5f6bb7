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

Either cache's k and v are float arrays, or QuantizedKV (kv_cache_dtype "int8" / "fp8"): codes
of the same shape and one float32 scale per (slot, kv head), written by write_layer as each
token's keys are quantized and read as codes plus scales, so attention (the reference or the
kernels) dequantizes what it reads and the cache never holds a float copy. Reads index and
reshape the leading axes only, through jax.tree.map, so they serve both forms alike.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


KV_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
_KV_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


@flax.struct.dataclass
class QuantizedKV:
    """Quantized keys or values: value = codes * scale[..., None], one scale per kv head of
    each slot (symmetric, scale = max |x| over the head dim / the code range's max)."""

    codes: jax.Array  # [..., K, H] int8 | float8_e4m3fn
    scale: jax.Array  # [..., K] float32

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    @property
    def dtype(self):
        return self.codes.dtype

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.codes.astype(jnp.float32) * self.scale[..., None]).astype(dtype)


def quantize_kv(x: jax.Array, dtype) -> QuantizedKV:
    """x [..., K, H] as codes of `dtype` (int8 or float8_e4m3fn) with per-[..., K] scales."""
    top = _KV_MAX[jnp.dtype(dtype)]
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    y = x.astype(jnp.float32) / scale[..., None]
    if jnp.dtype(dtype) == jnp.int8:
        y = jnp.round(y)
    return QuantizedKV(codes=jnp.clip(y, -top, top).astype(dtype), scale=scale)


def kv_buffer(shape: tuple[int, ...], dtype, zeros=jnp.zeros):
    """An empty K or V buffer of `shape` [..., K, H]: a float array of `dtype`, or for a dtype
    in KV_DTYPES' values a QuantizedKV. zeros(shape, dtype) makes each array."""
    if jnp.dtype(dtype) in _KV_MAX:
        return QuantizedKV(codes=zeros(shape, dtype), scale=zeros(shape[:-1], jnp.float32))
    return zeros(shape, dtype)


def kv_axes(buf, axes: tuple):
    """The logical axes of a K or V buffer whose arrays (codes) have `axes`."""
    return QuantizedKV(codes=axes, scale=axes[:-1]) if isinstance(buf, QuantizedKV) else axes


def dense(kv, dtype) -> jax.Array:
    """Keys or values as a float array: QuantizedKV dequantized to dtype, an array as it is."""
    return kv.dequantize(dtype) if isinstance(kv, QuantizedKV) else kv


def _set(buf, index, new: jax.Array):
    """buf.at[index].set(new, mode="drop"), new [..., K, H] float quantized first when buf is."""
    if isinstance(buf, QuantizedKV):
        q = quantize_kv(new, buf.codes.dtype)
        return QuantizedKV(codes=buf.codes.at[index].set(q.codes, mode="drop"),
                           scale=buf.scale.at[index].set(q.scale, mode="drop"))
    return buf.at[index].set(new.astype(buf.dtype), mode="drop")


@flax.struct.dataclass
class RingKVCache:
    k: jax.Array          # [L, B, C, K, H] (or QuantizedKV)
    v: jax.Array          # [L, B, C, K, H]
    positions: jax.Array  # [B, C] int32: absolute position held by each slot, -1 if empty
    lengths: jax.Array    # [B] int32: tokens written so far (= position of the next token)

    @classmethod
    def create(cls, num_layers: int, batch: int, capacity: int, num_kv_heads: int,
               head_dim: int, dtype=jnp.float32) -> "RingKVCache":
        shape = (num_layers, batch, capacity, num_kv_heads, head_dim)
        return cls(k=kv_buffer(shape, dtype), v=kv_buffer(shape, dtype),
                   positions=jnp.full((batch, capacity), -1, jnp.int32),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    KV_AXES = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")  # of k and v

    def logical_axes(self) -> "RingKVCache":
        """Each array's logical axes (jaxinfer.sharding), in the cache's own structure."""
        return RingKVCache(k=kv_axes(self.k, self.KV_AXES), v=kv_axes(self.v, self.KV_AXES),
                           positions=("batch", "cache_seq"),
                           lengths=("batch",))

    def plan_write(self, num_new: jax.Array, T: int, rows: jax.Array | None = None) -> "WritePlan":
        """Where the first num_new[g] of T new tokens of query row g go (positions lengths + t).

        rows [G]: the cache row of each query row (None: query row b is cache row b; an index
        past the last row marks a padding query row, whose num_new must be 0). When T exceeds
        the capacity only the last C tokens of a row are kept, so no two writes of one call land
        in the same slot. Dropped tokens get slot C, which scatters ignore.
        """
        C = self.capacity
        rows, lengths = _rows_and_lengths(self.lengths, num_new, rows)
        t = jnp.arange(T, dtype=jnp.int32)[None, :]                    # [1, T]
        pos = lengths[:, None] + t                                      # [G, T]
        keep = (t < num_new[:, None]) & (t >= num_new[:, None] - C)
        return WritePlan(rows=jnp.broadcast_to(rows[:, None], pos.shape),
                         slots=jnp.where(keep, pos % C, C), positions=pos,
                         key_positions=jnp.where(t < num_new[:, None], pos, -1))

    def write_positions(self, plan: "WritePlan", positions: jax.Array | None = None) -> jax.Array:
        """positions [B, C] (default: the cache's) after the planned write."""
        positions = self.positions if positions is None else positions
        return positions.at[plan.rows, plan.slots].set(plan.positions, mode="drop")

    def layer_keys(self, k_all, v_all, layer: int, S: int, kpos: jax.Array,
                   rows: jax.Array | None = None):
        """(k, v [G, S, K, H], key positions [G, S]) of the first S slots of a layer for cache
        rows `rows` (None: all rows); kpos is write_positions() of this call's plan."""
        if rows is None:
            pick = lambda a: a[layer, :, :S]  # noqa: E731
            return jax.tree.map(pick, k_all), jax.tree.map(pick, v_all), kpos[:, :S]
        rows = _clip_rows(rows, kpos.shape[0])
        pick = lambda a: a[layer][rows, :S]  # noqa: E731
        return jax.tree.map(pick, k_all), jax.tree.map(pick, v_all), kpos[rows, :S]

    def kernel_pages(self, k_all, v_all, layer: int, S: int, rows: jax.Array | None = None,
                     page_size: int = 16):
        """The first S slots of each of `rows` as a page pool for the paged kernel, or None when
        S is not a multiple of page_size. Only valid while slot j holds position j (no wrap)."""
        if S % page_size:
            return None
        k, v, _ = self.layer_keys(k_all, v_all, layer, S, self.positions, rows)
        G = k.shape[0]
        per_row = S // page_size
        as_pages = lambda a: a.reshape((G * per_row, page_size) + a.shape[2:])  # noqa: E731
        tables = jnp.arange(G * per_row, dtype=jnp.int32).reshape(G, per_row)
        return jax.tree.map(as_pages, k), jax.tree.map(as_pages, v), tables

    def advance(self, k_all, v_all, kpos, num_new) -> "RingKVCache":
        """num_new [B]: tokens written per cache row by this call."""
        return RingKVCache(k=k_all, v=v_all, positions=kpos, lengths=self.lengths + num_new)

    def rollback(self, lengths: jax.Array) -> "RingKVCache":
        """Forgets every position at or past lengths [B] (rejected speculative tokens): their
        slots become empty. Nothing is copied. Slots those tokens overwrote held positions at
        least the ring's capacity older; a sliding-window ring must be sized window + the most
        tokens written past the kept length (the engine adds the draft length)."""
        return self.replace(positions=jnp.where(self.positions >= lengths[:, None], -1,
                                                self.positions), lengths=lengths)

    def pad_rows(self, batch: int) -> "RingKVCache":
        """The cache with empty rows appended up to `batch` rows."""
        pad = lambda a: _pad(a, batch, 0, axis=1)  # noqa: E731
        return RingKVCache(k=jax.tree.map(pad, self.k), v=jax.tree.map(pad, self.v),
                           positions=_pad(self.positions, batch, -1),
                           lengths=_pad(self.lengths, batch, 0))

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
        return _set(buf, (layer, plan.rows, plan.slots), new)


def _pad(x: jax.Array, batch: int, fill, axis: int = 0) -> jax.Array:
    """x with rows of `fill` appended along axis until it has `batch` of them."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, batch - x.shape[axis])
    return jnp.pad(x, widths, constant_values=fill)


def _clip_rows(rows: jax.Array, B: int) -> jax.Array:
    """Padding query rows (index B) read row B - 1; their outputs are discarded."""
    return jnp.minimum(rows, B - 1)


def _rows_and_lengths(lengths: jax.Array, num_new: jax.Array, rows: jax.Array | None):
    """The cache row of each query row and its length before the write."""
    B = lengths.shape[0]
    if rows is None:
        return jnp.arange(B, dtype=jnp.int32), lengths
    rows = rows.astype(jnp.int32)
    return rows, lengths[_clip_rows(rows, B)]


@flax.struct.dataclass
class WritePlan:
    """Where one call's new tokens go. Fields are [G, T] for one query group, or flat [N] once
    several groups are merged (write_layer and write_positions take either)."""

    rows: jax.Array           # cache row of each new token (B for padding rows)
    slots: jax.Array          # ring slot (C where not written) / flat pool slot (P*Z: dropped)
    positions: jax.Array      # int32 absolute position of each new token
    key_positions: jax.Array  # the same, -1 for padding (invisible as a key)

    @staticmethod
    def merge(plans: "list[WritePlan]") -> "WritePlan | None":
        """One flat plan writing everything the given plans write (None for no plans)."""
        if not plans:
            return None
        if len(plans) == 1:
            return plans[0]
        return jax.tree.map(lambda *xs: jnp.concatenate([x.reshape(-1) for x in xs]), *plans)

    def tokens_per_row(self, B: int) -> jax.Array:
        """[B] int32: how many real tokens this plan writes into each cache row."""
        real = (self.key_positions >= 0).astype(jnp.int32).reshape(-1)
        return jnp.zeros((B,), jnp.int32).at[self.rows.reshape(-1)].add(real, mode="drop")


@flax.struct.dataclass
class PagedKVCache:
    # The pool is stored with pages flattened, [L, P * Z, K, H]: a view as [L, P, Z, K, H] is
    # free, but reshaping around each layer's in-place write made XLA copy the whole pool
    # inside the decode loop.
    k: jax.Array             # [L, P * Z, K, H] (or QuantizedKV)
    v: jax.Array             # [L, P * Z, K, H]
    block_tables: jax.Array  # [B, M] int32: row b's pages in order; unused entries = 0 (null)
    lengths: jax.Array       # [B] int32: tokens written so far
    page_size: int = flax.struct.field(pytree_node=False, default=16)

    @classmethod
    def create(cls, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
               head_dim: int, block_tables: jax.Array, dtype=jnp.float32) -> "PagedKVCache":
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        block_tables = jnp.asarray(block_tables, jnp.int32)
        return cls(k=kv_buffer(shape, dtype), v=kv_buffer(shape, dtype),
                   block_tables=block_tables,
                   lengths=jnp.zeros((block_tables.shape[0],), jnp.int32), page_size=page_size)

    @property
    def num_pages(self) -> int:
        return self.k.shape[1] // self.page_size

    KV_AXES = ("layers", "pages", "kv_heads", "head_dim")  # of k and v

    def logical_axes(self) -> "PagedKVCache":
        """Each array's logical axes (jaxinfer.sharding), in the cache's own structure."""
        kv = self.KV_AXES
        return PagedKVCache(k=None if self.k is None else kv_axes(self.k, kv),
                            v=None if self.v is None else kv_axes(self.v, kv),
                            block_tables=("batch", "table"), lengths=("batch",),
                            page_size=self.page_size)

    @property
    def capacity(self) -> int:
        """Most tokens a row can hold: its block-table width times the page size."""
        return self.block_tables.shape[1] * self.page_size

    def plan_write(self, num_new: jax.Array, T: int, rows: jax.Array | None = None) -> WritePlan:
        """Token t of query row g (t < num_new[g]) goes to flat slot page * Z + offset of the
        pool; padding goes to P * Z, past the pool, which scatters drop. rows as for the ring."""
        Z = self.page_size
        B = self.lengths.shape[0]
        rows, lengths = _rows_and_lengths(self.lengths, num_new, rows)
        t = jnp.arange(T, dtype=jnp.int32)[None, :]
        pos = lengths[:, None] + t                                      # [G, T]
        real = t < num_new[:, None]
        page_idx = jnp.clip(pos // Z, 0, self.block_tables.shape[1] - 1)
        page = jnp.take_along_axis(self.block_tables[_clip_rows(rows, B)], page_idx, axis=1)
        return WritePlan(rows=jnp.broadcast_to(rows[:, None], pos.shape),
                         slots=jnp.where(real, page * Z + pos % Z, self.k.shape[1]),
                         positions=pos, key_positions=jnp.where(real, pos, -1))

    def write_positions(self, plan: WritePlan, positions: jax.Array | None = None) -> jax.Array:
        """Key positions of row slots 0..capacity-1 after the write: slot j holds position j.
        (positions: unused, a paged row's positions follow from its length.)"""
        del positions
        B = self.lengths.shape[0]
        j = jnp.arange(self.capacity, dtype=jnp.int32)[None, :]
        after = self.lengths + plan.tokens_per_row(B)
        return jnp.where(j < after[:, None], j, -1)

    @staticmethod
    def write_layer(buf: jax.Array, layer: int, new: jax.Array, plan: WritePlan) -> jax.Array:
        """buf [L, P * Z, K, H] with the planned slots of one layer set to new [B, T, K, H]."""
        return _set(buf, (layer, plan.slots), new)

    def _tables(self, S: int, rows: jax.Array | None) -> jax.Array:
        """The first S/Z block-table entries of `rows` (None: all rows): [G, S/Z]."""
        tables = self.block_tables[:, :S // self.page_size]
        return tables if rows is None else tables[_clip_rows(rows, tables.shape[0])]

    def layer_keys(self, k_all, v_all, layer: int, S: int, kpos: jax.Array,
                   rows: jax.Array | None = None):
        """The first S positions of cache rows `rows` (None: all) gathered through their block
        tables: (k, v [G, S, K, H], key positions [G, S])."""
        tables = self._tables(S, rows)                                   # [G, S/Z]
        kpos = kpos[:, :S] if rows is None else kpos[_clip_rows(rows, kpos.shape[0]), :S]
        # Whole pages are gathered (contiguous blocks), not single slots: several times faster
        # on XLA:CPU. Viewing the flat pool as pages for reading is free.
        P, Z = self.num_pages, self.page_size
        gather = lambda a: a[layer].reshape((P, Z) + a.shape[2:])[tables].reshape(  # noqa: E731
            (tables.shape[0], S) + a.shape[2:])
        return jax.tree.map(gather, k_all), jax.tree.map(gather, v_all), kpos

    def page_list(self, lengths: jax.Array, num_pages: int, rows: jax.Array | None = None):
        """The pages holding the first lengths[g] positions of cache rows `rows` (None: all),
        as one flat list of num_pages entries (static): (page_rows [num_pages] indexing
        lengths, page ids, page_starts (first position)). Entry g contributes
        ceil(lengths[g] / Z) pages, in order; the tail is padding (page_rows = len(lengths),
        the null page). The caller guarantees that the total fits in num_pages."""
        Z = self.page_size
        tables = self._tables(self.capacity, rows)
        B, M = tables.shape
        counts = (lengths + Z - 1) // Z
        ends = jnp.cumsum(counts)
        i = jnp.arange(num_pages, dtype=jnp.int32)
        page_rows = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)  # B past the end
        row = jnp.minimum(page_rows, B - 1)
        j = jnp.clip(i - (ends - counts)[row], 0, M - 1)
        pages = jnp.where(page_rows < B, tables[row, j], 0)
        # Computed once per step; unbarriered, XLA would fuse the search into every layer's
        # gathers and redo it per element.
        return jax.lax.optimization_barrier((page_rows, pages, j * Z))

    def gather_pages(self, buf: jax.Array, layer: int, pages: jax.Array) -> jax.Array:
        """Layer `layer`'s listed pages of buf [L, P * Z, K, H]: [len(pages), Z, K, H]."""
        Z = self.page_size

        def gather(a):
            flat = a[layer].reshape(self.num_pages, -1)[pages]
            # Materialised as whole rows: XLA:CPU would otherwise fuse the gather into its
            # consumers (with a transpose) and index element by element, several times slower.
            return jax.lax.optimization_barrier(flat).reshape((pages.shape[0], Z) + a.shape[2:])
        return jax.tree.map(gather, buf)

    def kernel_pages(self, k_all, v_all, layer: int, S: int, rows: jax.Array | None = None,
                     page_size: int = 16):
        """The pool as pages [P, Z, K, H] and the block tables of `rows` (first S/Z pages):
        what the paged kernel reads."""
        as_pages = lambda a: a[layer].reshape((self.num_pages, self.page_size)  # noqa: E731
                                              + a.shape[2:])
        return jax.tree.map(as_pages, k_all), jax.tree.map(as_pages, v_all), self._tables(S, rows)

    def rollback(self, lengths: jax.Array) -> "PagedKVCache":
        """Forgets every position at or past lengths [B]: a paged row's visible positions follow
        from its length, so the rejected tokens' K/V stay in their pages unseen until
        overwritten. Nothing is copied."""
        return self.replace(lengths=lengths)

    def advance(self, k_all, v_all, kpos, num_new) -> "PagedKVCache":
        """num_new [B]: tokens written per cache row by this call."""
        del kpos  # positions are implicit in a paged row
        return self.replace(k=k_all, v=v_all, lengths=self.lengths + num_new)

    def pad_rows(self, batch: int) -> "PagedKVCache":
        """The cache with empty rows (null-page block tables) appended up to `batch` rows."""
        return self.replace(block_tables=_pad(self.block_tables, batch, 0),
                            lengths=_pad(self.lengths, batch, 0))

    def reset_rows(self, mask: jax.Array, start: jax.Array) -> "PagedKVCache":
        """Restarts rows where mask [B] is set at position start [B]: the tokens before it are
        already in the row's pages (prefix-cache hits)."""
        return self.replace(lengths=jnp.where(mask, start, self.lengths))
