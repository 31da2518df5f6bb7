"""Where a flat step's queries sit: the metadata (RaggedMeta) built once per forward and read
by every layer's attention (jaxinfer.backends.attention), and the jnp path's tiles and page blocks.

Shape legend: B rows, T flat tokens, Nt tiles, Q queries a tile, Z page size.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


# Keys the jnp attention gathers per multi-query tile and loop iteration: as many pages as hold
# them (at least one), so that a larger page_size does not widen the blocks (and the keys
# short prompts' tiles mask). Measured as 4 pages of 16.
BLOCK_KEYS = 64
# Keys per loop iteration for single-query (decode) tiles. Their body does little work per
# key, so larger blocks amortise the loop's per-iteration cost: over 16 rows of
# 128-384 tokens at SmolLM2's shapes (30 layers, one jitted program, a loop to the longest row),
# 8 pages of 16 took 44.3 ms against 49.6 for 4 and 65.0 for 16 with a float32 pool, 37.7
# against 44.4 and 61.9 with a bf16 one (a one-off sweep of the benchmarks/attention_gather.py
# setup); with the work list, the engine's 16-row float32 step ran 1.99x its matmul stack with
# 8 pages, 2.08x with 4 and 2.28x with 16 (one run each).
SINGLE_BLOCK_KEYS = 128


def block_pages(page_size: int, keys: int) -> int:
    """Pages of page_size tokens that hold `keys` keys (at least one)."""
    return max(1, keys // page_size)


@flax.struct.dataclass
class Tiles:
    """A step's queries cut into Nt tiles of Q queries, each tile within one row: index [Nt, Q]
    their flat token (T: none), pos [Nt, Q] their position (-1: none), row [Nt] (B: an empty
    tile), first_page [Nt] the first logical page (position // Z) a tile's queries may see,
    blocks [Nt] how many blocks of pages_per_block pages from there each tile needs (0: an
    empty tile), and num_blocks their maximum, the trip count of a page loop over every tile."""

    index: jax.Array
    pos: jax.Array
    row: jax.Array
    first_page: jax.Array
    num_blocks: jax.Array
    blocks: jax.Array
    pages_per_block: int = flax.struct.field(pytree_node=False)

    @property
    def query_tile(self) -> int:
        return self.index.shape[1]


@flax.struct.dataclass
class RaggedMeta:
    """Where a flat step's queries sit, built once per forward and read by every layer.

    The kernel's view: row b owns queries query_start[b] .. + num_queries[b] of the flat batch
    and has kv_lengths[b] keys once the step's tokens are written (its last query at position
    kv_lengths[b] - 1). The jnp path's view: two sets of Tiles, each walked by its own page
    loop over the blocks its tiles need: `singles`, one tile per row that
    feeds one token (decode), and `tiles`, the rows that feed several (prefill chunks,
    verification), in tiles of query_tile queries. Either is None when no row can have it.
    Each set walks its pages in blocks of its own pages_per_block (singles:
    the pages of SINGLE_BLOCK_KEYS keys; tiles: the pages_per_block given to ragged_meta).
    """

    query_start: jax.Array
    num_queries: jax.Array
    kv_lengths: jax.Array
    singles: Tiles | None
    tiles: Tiles | None
    # A static trip count instead, enough for static_pages pages (every page a row's table can
    # hold): a loop of fixed length that reverse-mode differentiation can go through (scoring
    # and training forwards).
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
                 num_blocks=jnp.max(blocks, initial=0), blocks=blocks,
                 pages_per_block=pages_per_block)


def ragged_meta(query_start: jax.Array, num_queries: jax.Array, kv_lengths: jax.Array, *,
                num_tokens: int, query_tile: int, num_tiles: int, page_size: int,
                sliding_window: int | None = None, pages_per_block: int | None = None,
                single_pages_per_block: int | None = None,
                static_pages: int | None = None) -> RaggedMeta:
    """RaggedMeta of a step (see there); num_tiles must cover sum_b ceil(num_queries[b] /
    query_tile) (num_tiles_bound gives a safe value). query_tile 1: every query is a single
    (no multi-query tiles). pages_per_block: pages per loop iteration of the multi-query tiles
    (None: the pages of BLOCK_KEYS keys), single_pages_per_block of the singles (None: of
    SINGLE_BLOCK_KEYS). static_pages: see RaggedMeta."""
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
