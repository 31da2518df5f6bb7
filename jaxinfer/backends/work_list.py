"""The jnp attention's page loop over a work list (backends.attention's
paged_loop_attention): a step's tiles need their own numbers of blocks of pages, and a loop
walks the list of (tile, block) pairs, folding each iteration's pairs into their tiles' online
softmax. docs/architecture.md ("Attention") has the measurements behind the shapes chosen here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


# The most (tile, block) pairs a work-list iteration takes: Nt (the step's tile bound) up to
# this. The engine's steps at the defaults stay below it (16-512 tokens in tiles of 16, or 16
# decode rows), so an iteration holds every tile; a batch of thousands of rows (a scoring
# forward) is walked in windows of this many pairs rather than one [Nt, Nt] fold.
MAX_PAIRS = 256


def _work_list(tiles, static_blocks, C: int):
    """The (tile, block) pairs of a work list, C an iteration: tile t needs tiles.blocks[t]
    blocks, listed tile after tile (every listed tile needs at least one, so C consecutive pairs
    span at most C consecutive tiles). Returns (trips, pairs), pairs(i) giving iteration i's
    tile ids t [C] (ascending; Nt: past the end of the list), the same clipped to a tile, and
    each pair's first logical page j0 [C]."""
    Nt = tiles.blocks.shape[0]
    ends = jnp.cumsum(tiles.blocks)                      # [Nt]
    trips = (ends[-1] + C - 1) // C if static_blocks is None else -(-Nt * static_blocks // C)

    def pairs(i):
        w = i * C + jnp.arange(C, dtype=jnp.int32)                  # the pairs' list indices
        t = jnp.searchsorted(ends, w, side="right").astype(jnp.int32)   # Nt: past the list
        tc = jnp.minimum(t, Nt - 1)
        j0 = tiles.first_page[tc] + (w - ends[tc] + tiles.blocks[tc]) * tiles.pages_per_block
        return t, tc, j0
    return trips, pairs


def _fold(carry, t, pair_max, weigh, Nt: int):
    """Folds one work-list iteration's C pairs into their tiles' online softmax.

    carry: (m, l, acc), [Nt + pad, *stats] and [Nt + pad, *stats, H] (pad: C rows when C < Nt,
    else none); t [C]: the pairs' tiles, ascending (Nt: no pair); pair_max [C, *stats]: each
    pair's highest score (-inf where it sees no key); weigh(m_pair) -> (p_sum [C, *stats],
    pv [C, *stats, H]): each pair's probability sums and value product given its tile's new
    running maximum m_pair [C, *stats]. With C = Nt the fold is a [Nt, C] one-hot of tiles by
    pairs; with C < Nt the pairs' tiles lie in the window of C tiles from t[0], and the fold
    works on that window alone through a [C, C] one-hot."""
    m, l, acc = carry
    C = t.shape[0]
    if C == Nt:
        t0, window, put = 0, lambda a: a, lambda a, w: w  # noqa: E731
    else:
        t0 = jnp.minimum(t[0], Nt)
        window = lambda a: jax.lax.dynamic_slice_in_dim(a, t0, C)  # noqa: E731
        put = lambda a, w: jax.lax.dynamic_update_slice_in_dim(a, w, t0, 0)  # noqa: E731
    local = t - t0
    onehot = (local[None, :] == jnp.arange(C, dtype=jnp.int32)[:, None]) & (t < Nt)[None, :]
    mw, lw, aw = window(m), window(l), window(acc)
    expand = (slice(None), slice(None)) + (None,) * (pair_max.ndim - 1)
    m_new = jnp.maximum(mw, jnp.max(jnp.where(onehot[expand], pair_max[None], -jnp.inf),
                                    axis=1))
    m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p_sum, pv = weigh(m_use[jnp.minimum(local, C - 1)])
    corr = jnp.where(jnp.isfinite(mw), jnp.exp(mw - m_use), 0.0)
    sums = onehot.astype(jnp.float32)
    lw = lw * corr + jnp.tensordot(sums, p_sum, 1)
    aw = aw * corr[..., None] + jnp.tensordot(sums, pv, 1)
    return put(m, m_new), put(l, lw), put(acc, aw)


def _walk(tiles, static_blocks, stats: tuple, H: int, iteration):
    """Runs a work list: iteration(t, tc, j0) -> (pair_max, weigh) for the pairs of one
    iteration (see _fold). Returns the normalised output [Nt, *stats, H] float32."""
    Nt = tiles.blocks.shape[0]
    C = min(Nt, MAX_PAIRS)
    trips, pairs = _work_list(tiles, static_blocks, C)

    def body(i, carry):
        t, tc, j0 = pairs(i)
        pair_max, weigh = iteration(t, tc, j0)
        return _fold(carry, t, pair_max, weigh, Nt)

    rows = Nt + (C if C < Nt else 0)
    init = (jnp.full((rows,) + stats, -jnp.inf), jnp.zeros((rows,) + stats),
            jnp.zeros((rows,) + stats + (H,)))
    _, l, acc = jax.lax.fori_loop(0, trips, body, init)
    l, acc = l[:Nt], acc[:Nt]
    return acc / jnp.where(l == 0, 1.0, l)[..., None]


def tile_loop(qt, gather_block, tiles, static_blocks, softcap):
    """The jnp attention of tiles of Q queries (decode rows, prefill chunks, verification):
    qt [Nt, Q, K, G, H] (scaled), gather_block(t, j0) -> (k, v [C, S, K, H] float32, visible
    [C, Q, S]). Returns [Nt * Q, N, H] float32.

    Each iteration takes the next (tile, block) pairs of the work list (Nt of them, at most
    MAX_PAIRS), so empty tiles and short rows cost nothing: the trip count is ceil(sum of
    blocks / Nt), where a loop over block indices runs max(blocks) times for every tile (one
    row of 2,000 tokens among fifteen of 100 costs 2 iterations, not 16). static_blocks (a
    differentiable forward): every tile walks that many blocks, a static trip count.
    """
    Nt, Q, K, G, H = qt.shape

    def iteration(t, tc, j0):
        k, v, visible = gather_block(tc, j0)                # [C, S, K, H], same, [C, Q, S]
        s = jnp.einsum("cqkgh,cskh->ckgqs", qt[tc], k)
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        s = jnp.where((visible & (t < Nt)[:, None, None])[:, None, None], s, -jnp.inf)

        def weigh(m_pair):                                  # [C, K, G, Q]
            p = jnp.exp(s - m_pair[..., None])              # [C, K, G, Q, S]
            return jnp.sum(p, axis=-1), jnp.einsum("ckgqs,cskh->ckgqh", p, v)
        return jnp.max(s, axis=-1), weigh

    out = _walk(tiles, static_blocks, (K, G, Q), H, iteration)   # [Nt, K, G, Q, H]
    return out.transpose(0, 3, 1, 2, 4).reshape(Nt * Q, K * G, H)
