"""The KV cache: one kind, a pool of pages addressed through block tables.

Shape legend: L layers, B batch rows (slots), P pages, Z page size, M block-table width,
K kv heads, H head dim, T tokens of a step.

Row b's position p lives at flat pool slot block_tables[b, (p // Z) % M] * Z + p % Z. Three
layouts share this rule:
  * paged (continuous batching): the host hands out pages (engine.page_allocator), M covers
    max_seq_len so the modulo never wraps; page 0 is the null page of unused entries;
  * a ring (PagedKVCache.ring): each row owns M consecutive pages and positions past M * Z wrap
    onto its oldest ones; ring_capacity sizes it so no key a query still sees is overwritten;
  * hybrid (sliding-window and global layers, e.g. Gemma 3): the global layers in the pool
    (k, v), the local layers in a ring of local_pages pages per row (local_k, local_v), sharing
    the rows' lengths (a layer's index in its part: models.base.pool_index).
A slot's position follows from the row's length, so attention reads keys by logical position
and masks them against the queries' (jaxinfer.backends.attention).

Per step: write_slots, per layer write_layer (in place, before it attends) and the attention,
then advance. k and v are float arrays, Bits16KV (16-bit floats as bits) or QuantizedKV (codes
and float32 scales); reads index their leading axes through jax.tree.map, serving all alike.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

# Quantized entries live with the rest of quantization; the cache writes and reads them.
from jaxinfer.quant.kv import KV_DTYPES, KV_MAX, QuantizedKV, quantize_kv  # noqa: F401


@flax.struct.dataclass
class Bits16KV:
    """16-bit float keys or values kept as uint16 bits (tuning.kv_16bit_as_bits): XLA:CPU
    scatters into a 16-bit float array by converting the whole array, but integers in place."""

    bits: jax.Array  # [..., K, H] uint16
    float_dtype: str = flax.struct.field(pytree_node=False, default="bfloat16")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.bits.shape

    @property
    def dtype(self):
        return jnp.dtype(self.float_dtype)

    @property
    def nbytes(self) -> int:
        return self.bits.nbytes

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return jax.lax.bitcast_convert_type(self.bits, self.dtype).astype(dtype)

    @staticmethod
    def encode(x: jax.Array, float_dtype) -> jax.Array:
        return jax.lax.bitcast_convert_type(x.astype(float_dtype), jnp.uint16)


def kv_buffer(shape: tuple[int, ...], dtype, zeros=jnp.zeros, bits16: bool = False,
              fp8_bits: bool = False):
    """An empty K or V buffer [..., K, H] of `dtype`: a QuantizedKV for a quantized dtype (fp8
    codes as uint8 with fp8_bits), Bits16KV for a 16-bit float with bits16, else an array."""
    if jnp.dtype(dtype) in KV_MAX:
        scale = zeros(shape[:-1], jnp.float32)
        if fp8_bits and jnp.dtype(dtype).itemsize == 1 and jnp.dtype(dtype) != jnp.int8:
            return QuantizedKV(codes=zeros(shape, jnp.uint8), scale=scale,
                               code_dtype=jnp.dtype(dtype).name)
        return QuantizedKV(codes=zeros(shape, dtype), scale=scale)
    if bits16 and jnp.dtype(dtype).itemsize == 2:
        return Bits16KV(bits=zeros(shape, jnp.uint16), float_dtype=jnp.dtype(dtype).name)
    return zeros(shape, dtype)


def kv_axes(buf, axes: tuple):
    """The logical axes of a K or V buffer whose arrays (codes) have `axes`."""
    if isinstance(buf, QuantizedKV):
        return QuantizedKV.logical_axes(axes, buf.code_dtype)
    if isinstance(buf, Bits16KV):
        return Bits16KV(bits=axes, float_dtype=buf.float_dtype)
    return axes


def dense(kv, dtype) -> jax.Array:
    """Keys or values as a float array: QuantizedKV and Bits16KV as dtype, an array as it is."""
    return kv.dequantize(dtype) if isinstance(kv, (QuantizedKV, Bits16KV)) else kv


def _set(buf, index, new: jax.Array):
    """buf.at[index].set(new, mode="drop"), new [..., K, H] float quantized first when buf is."""
    if isinstance(buf, QuantizedKV):
        q = quantize_kv(new, buf.dtype)
        return buf.replace(codes=buf.codes.at[index].set(buf.stored(q), mode="drop"),
                           scale=buf.scale.at[index].set(q.scale, mode="drop"))
    if isinstance(buf, Bits16KV):
        return buf.replace(bits=buf.bits.at[index].set(Bits16KV.encode(new, buf.dtype),
                                                       mode="drop"))
    return buf.at[index].set(new.astype(buf.dtype), mode="drop")


RING_PAGE_SIZE = 16  # a ring's page size (its capacity is rounded up to whole pages)


@flax.struct.dataclass
class PagedKVCache:
    # Pages flattened, [L, P * Z, K, H]: reshaping around each in-place write made XLA copy the
    # whole pool inside the decode loop.
    k: jax.Array             # [L, P * Z, K, H] (or QuantizedKV)
    v: jax.Array             # [L, P * Z, K, H]
    block_tables: jax.Array  # [B, M] int32: row b's pages in order; unused entries = 0 (null)
    lengths: jax.Array       # [B] int32: tokens written so far (= position of the next token)
    page_size: int = flax.struct.field(pytree_node=False, default=16)
    # A ring (identity tables, positions may wrap onto a row's oldest pages).
    wraps: bool = flax.struct.field(pytree_node=False, default=False)
    # A hybrid cache's ring of local layers, [L_local, B * local_pages * Z, K, H] (row b owns
    # pages b * local_pages ..); k / v then hold the global layers. local_pages 0: no ring.
    local_k: Any = None
    local_v: Any = None
    local_pages: int = flax.struct.field(pytree_node=False, default=0)

    @classmethod
    def create(cls, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
               head_dim: int, block_tables: jax.Array, dtype=jnp.float32,
               wraps: bool = False, xp=jnp) -> "PagedKVCache":
        """xp=numpy makes a host cache that one device_put places without compiling."""
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        block_tables = xp.asarray(block_tables, xp.int32)
        return cls(k=kv_buffer(shape, dtype, xp.zeros), v=kv_buffer(shape, dtype, xp.zeros),
                   block_tables=block_tables,
                   lengths=xp.zeros((block_tables.shape[0],), xp.int32), page_size=page_size,
                   wraps=wraps)

    @classmethod
    def ring(cls, num_layers: int, batch: int, capacity: int, num_kv_heads: int, head_dim: int,
             dtype=jnp.float32, page_size: int = RING_PAGE_SIZE, xp=jnp) -> "PagedKVCache":
        """A ring of `capacity` slots per row (whole pages): row b owns pages b * M .. + M - 1."""
        page_size = min(page_size, capacity)
        M = -(-capacity // page_size)
        return cls.create(num_layers, batch * M, page_size, num_kv_heads, head_dim,
                          ring_tables(batch, M), dtype, wraps=True, xp=xp)

    @property
    def num_pages(self) -> int:
        return self.k.shape[1] // self.page_size

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        """Slots of one row: its block-table width times the page size."""
        return self.block_tables.shape[1] * self.page_size

    KV_AXES = ("layers", "pages", "kv_heads", "head_dim")  # of k and v

    def logical_axes(self) -> "PagedKVCache":
        """Each array's logical axes (jaxinfer.sharding), in the cache's own structure."""
        kv = self.KV_AXES
        axes = lambda buf: None if buf is None else kv_axes(buf, kv)  # noqa: E731
        return PagedKVCache(k=axes(self.k), v=axes(self.v),
                            block_tables=("batch", "table"), lengths=("batch",),
                            page_size=self.page_size, wraps=self.wraps,
                            local_k=axes(self.local_k), local_v=axes(self.local_v),
                            local_pages=self.local_pages)

    def local_tables(self) -> jax.Array:
        """The local layers' ring tables [B, local_pages] (identity: row b owns its pages)."""
        return jnp.asarray(ring_tables(self.batch, self.local_pages))

    def ring_part(self) -> "PagedKVCache":
        """The local layers' ring as a cache of its own, sharing this cache's lengths."""
        return PagedKVCache(k=self.local_k, v=self.local_v, block_tables=self.local_tables(),
                            lengths=self.lengths, page_size=self.page_size, wraps=True)

    def write_slots(self, rows: jax.Array, positions: jax.Array) -> jax.Array:
        """Flat pool slots [T] of tokens at positions [T] of rows [T] (row B, padding: P * Z,
        past the pool, which scatters drop)."""
        Z, M = self.page_size, self.block_tables.shape[1]
        B = self.batch
        page = self.block_tables[jnp.minimum(rows, B - 1), (positions // Z) % M]
        return jnp.where(rows < B, page * Z + positions % Z, self.k.shape[1])

    @staticmethod
    def write_layer(buf, layer: int, new: jax.Array, slots: jax.Array):
        """buf [L, P * Z, K, H] with layer `layer`'s slots [T] set to new [T, K, H] (quantized
        when the cache is). Written before the layer reads the cache, so XLA updates the donated
        buffer in place. A single token gets a second, dropped entry: XLA:CPU turned a
        one-index scatter into a copy of the whole pool."""
        if slots.shape[0] == 1:
            slots = jnp.concatenate([slots, jnp.full((1,), jax.tree.leaves(buf)[0].shape[1],
                                                     slots.dtype)])
            new = jnp.concatenate([new, jnp.zeros_like(new)])
        return _set(buf, (layer, slots), new)

    def advance(self, k_all, v_all, num_new: jax.Array, local_k=None,
                local_v=None) -> "PagedKVCache":
        """num_new [B]: tokens written per row by this call; local_k, local_v: a hybrid
        cache's ring as written."""
        return self.replace(k=k_all, v=v_all, lengths=self.lengths + num_new,
                            local_k=local_k, local_v=local_v)

    def rollback(self, lengths: jax.Array) -> "PagedKVCache":
        """Forgets every position at or past lengths [B] (rejected drafts); nothing is copied."""
        return self.replace(lengths=lengths)

    def reset_rows(self, mask: jax.Array, start: jax.Array) -> "PagedKVCache":
        """Restarts rows where mask [B] is set at position start [B]: the tokens before it are
        already in the row's pages (prefix-cache hits; 0 for a ring)."""
        return self.replace(lengths=jnp.where(mask, start, self.lengths))

    def copy_pages(self, src: jax.Array, dst: jax.Array) -> "PagedKVCache":
        """Every layer's page src[i] copied into dst[i] (src, dst [C] int32; dst < 0: none):
        a fork's copy of a shared, partly filled page."""
        Z, P = self.page_size, self.num_pages
        z = jnp.arange(Z, dtype=jnp.int32)
        src_slots = (jnp.maximum(src, 0)[:, None] * Z + z).reshape(-1)
        dst_slots = jnp.where(dst[:, None] >= 0, dst[:, None] * Z + z, P * Z).reshape(-1)
        copy = lambda a: a.at[:, dst_slots].set(a[:, src_slots], mode="drop")  # noqa: E731
        return self.replace(k=jax.tree.map(copy, self.k), v=jax.tree.map(copy, self.v))

    def copy_rows(self, src_rows: jax.Array, dst_rows: jax.Array) -> "PagedKVCache":
        """A ring's rows src_rows [C] copied whole into dst_rows [C] (B or more: none)."""
        B, M = self.block_tables.shape
        src = self.block_tables[jnp.minimum(src_rows, B - 1)].reshape(-1)
        dst = jnp.where(dst_rows[:, None] < B, self.block_tables[jnp.minimum(dst_rows, B - 1)],
                        -1).reshape(-1)
        return self.copy_pages(src, dst)

    def fork(self, src_rows: jax.Array, dst_rows: jax.Array, src_pages: jax.Array,
             dst_pages: jax.Array) -> "PagedKVCache":
        """Rows dst_rows [C] forked from src_rows [C]: a ring's rows are copied whole, a pool's
        pages src_pages [C'] into dst_pages [C'] (the partly filled page a fork cannot share)."""
        if self.wraps:
            cache = self.copy_rows(src_rows, dst_rows)
        else:
            cache = self.copy_pages(src_pages, dst_pages)
        if self.local_pages:
            ring = self.ring_part().copy_rows(src_rows, dst_rows)
            cache = cache.replace(local_k=ring.k, local_v=ring.v)
        return cache


def ring_capacity(window: int, tokens_per_step: int) -> int:
    """Slots per row a ring needs: a step writing positions s .. s + n - 1 overwrites those up
    to s + n - 1 - capacity while its first query sees back to s - window + 1, so capacity >=
    window + n - 1."""
    if window < 1 or tokens_per_step < 1:
        raise ValueError(f"need window >= 1 and tokens_per_step >= 1, got {window} and "
                         f"{tokens_per_step}")
    return window + tokens_per_step - 1


def ring_tables(batch: int, pages_per_row: int) -> np.ndarray:
    """A ring's block tables (numpy): row b owns pages b * M .. b * M + M - 1."""
    return np.arange(batch * pages_per_row, dtype=np.int32).reshape(batch, pages_per_row)
