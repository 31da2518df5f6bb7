"""Where a flat step's queries sit: RaggedMeta, built once per forward and read by every layer's
attention (jaxinfer.backends.attention), with the jnp path's tiles and page blocks.

Shape legend: B rows, T flat tokens, Nt tiles, Q queries a tile, Z page size.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


# Keys the jnp attention gathers per multi-query tile and iteration, in whole pages (so a larger
# page_size does not widen the blocks).
BLOCK_KEYS = 64
# The same for decode tiles, whose body does little work per key: larger blocks amortise the
# loop's cost per iteration, up to a point (docs/cpu_kernels.md has the sweep).
SINGLE_BLOCK_KEYS = 128


def block_pages(page_size: int, keys: int) -> int:
    """Pages of page_size tokens that hold `keys` keys (at least one)."""
    return max(1, keys // page_size)


@flax.struct.dataclass
class Tiles:
    """A step's queries cut into Nt tiles of Q queries, each within one row."""

    index: jax.Array       # [Nt, Q] flat token of each query (T: none)
    pos: jax.Array         # [Nt, Q] its position (-1: none)
    row: jax.Array         # [Nt] (B: an empty tile)
    first_page: jax.Array  # [Nt] the first logical page a tile's queries may see
    blocks: jax.Array      # [Nt] blocks of pages_per_block pages each tile needs from there
    pages_per_block: int = flax.struct.field(pytree_node=False)

    @property
    def query_tile(self) -> int:
        return self.index.shape[1]


@flax.struct.dataclass
class RaggedMeta:
    """Where a flat step's queries sit, built once per forward and read by every layer.

    The kernel's view: row b owns queries query_start[b] .. + num_queries[b] and has
    kv_lengths[b] keys once they are written. The jnp path's: `singles`, one tile per row that
    feeds one token (decode), and `tiles`, the rows that feed several, in tiles of query_tile
    queries, each set walked in its own blocks of pages (None where no row can have it).
    """

    query_start: jax.Array
    num_queries: jax.Array
    kv_lengths: jax.Array
    singles: Tiles | None
    tiles: Tiles | None
    # A static trip count covering static_pages pages, which reverse-mode differentiation can go
    # through (scoring and training forwards).
    static_pages: int | None = flax.struct.field(pytree_node=False, default=None)


def _tiles(query_start, counts, kv_lengths, num_queries, *, num_tokens: int, query_tile: int,
           num_tiles: int, page_size: int, sliding_window: int | None,
           pages_per_block: int) -> Tiles:
    """Tiles of query_tile queries over the rows' first counts[b] queries (0: a row left out);
    num_tiles must cover sum_b ceil(counts[b] / query_tile)."""
    B, Q, Z = query_start.shape[0], query_tile, page_size
    tiles = (counts + Q - 1) // Q                                         # [B]
    ends = jnp.cumsum(tiles)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    row = jnp.searchsorted(ends, t, side="right").astype(jnp.int32)      # B past the last tile
    r = jnp.minimum(row, B - 1)
    qi = (t - (ends - tiles)[r])[:, None] * Q + jnp.arange(Q, dtype=jnp.int32)[None, :]
    valid = (row < B)[:, None] & (qi < counts[r][:, None])
    index = jnp.where(valid, query_start[r][:, None] + qi, num_tokens)
    pos = jnp.where(valid, (kv_lengths - num_queries)[r][:, None] + qi, -1)
    last = jnp.max(pos, axis=1)                                           # -1: empty tile
    lo = jnp.where(valid, pos, jnp.iinfo(jnp.int32).max).min(axis=1)
    first = jnp.zeros_like(last) if sliding_window is None else \
        jnp.maximum(lo - sliding_window + 1, 0) // Z
    first = jnp.where(last >= 0, first, 0)
    span = jnp.where(last >= 0, last // Z + 1 - first, 0)                 # pages a tile needs
    blocks = (span + pages_per_block - 1) // pages_per_block
    return Tiles(index=index, pos=pos, row=jnp.where(last >= 0, row, B), first_page=first,
                 blocks=blocks, pages_per_block=pages_per_block)


def ragged_meta(query_start: jax.Array, num_queries: jax.Array, kv_lengths: jax.Array, *,
                num_tokens: int, query_tile: int, num_tiles: int, page_size: int,
                sliding_window: int | None = None, pages_per_block: int | None = None,
                single_pages_per_block: int | None = None,
                static_pages: int | None = None) -> RaggedMeta:
    """A step's RaggedMeta; num_tiles must cover sum_b ceil(num_queries[b] / query_tile)
    (num_tiles_bound). query_tile 1: every query is a single. pages_per_block and
    single_pages_per_block default to BLOCK_KEYS' and SINGLE_BLOCK_KEYS' pages."""
    if pages_per_block is None:
        pages_per_block = block_pages(page_size, BLOCK_KEYS)
    if single_pages_per_block is None:
        single_pages_per_block = block_pages(page_size, SINGLE_BLOCK_KEYS)
    B = query_start.shape[0]
    kw = dict(num_tokens=num_tokens, page_size=page_size, sliding_window=sliding_window)
    args = (query_start, kv_lengths, num_queries)
    one = num_queries if query_tile == 1 else (num_queries == 1).astype(num_queries.dtype)
    singles = _tiles(query_start, one, *args[1:], query_tile=1,
                     num_tiles=num_tiles if query_tile == 1 else min(B, num_tokens),
                     pages_per_block=single_pages_per_block, **kw)
    tiles = None if query_tile == 1 else _tiles(
        query_start, jnp.where(num_queries > 1, num_queries, 0), *args[1:],
        query_tile=query_tile, num_tiles=num_tiles, pages_per_block=pages_per_block, **kw)
    # Computed once per step: unbarriered, XLA fuses the searches into every layer's uses.
    return jax.lax.optimization_barrier(RaggedMeta(
        query_start=query_start, num_queries=num_queries, kv_lengths=kv_lengths,
        singles=singles, tiles=tiles, static_pages=static_pages))


def num_tiles_bound(num_tokens: int, query_tile: int, num_rows: int) -> int:
    """Tiles that any split of num_tokens queries over at most num_rows rows can need."""
    if query_tile == 1:
        return num_tokens
    return num_tokens // query_tile + min(num_rows, num_tokens)
