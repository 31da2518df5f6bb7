"""The jnp attention's page loop (backends.attention.paged_loop_attention): one loop walks the
list of (tile, block of pages) pairs, folding each iteration's pairs into their tiles' online
softmax, so each tile costs the blocks it needs (docs/architecture.md, "Attention").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer import sharding

# The most (tile, block) pairs an iteration takes (Nt up to this): the engine's steps fit in one
# window; a batch of thousands of rows is walked in windows rather than one [Nt, Nt] fold.
MAX_PAIRS = 256


def _work_list(tiles, static_blocks, C: int):
    """The (tile, block) pairs, C an iteration, tile after tile (so C pairs span at most C
    tiles): (trips, pairs), pairs(i) -> iteration i's tiles t [C] (ascending, Nt past the end),
    t clipped to a tile, and each pair's first logical page j0 [C]."""
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
    """Folds one iteration's C pairs into their tiles' online softmax.

    carry: (m, l, acc) [Nt + pad, *stats(, H)] (pad C rows when C < Nt); t [C] the pairs' tiles
    (Nt: none); pair_max [C, *stats] each pair's top score; weigh(m_pair) -> (p_sum, pv) given
    its tile's new maximum. With C < Nt the fold works on the window of C tiles from t[0]."""
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
    """Runs the work list, iteration(t, tc, j0) -> (pair_max, weigh) (see _fold): the
    normalised output [Nt, *stats, H] float32."""
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


def _lockstep(qt, gather_block, tiles, static_blocks, softcap):
    """Every tile takes its i-th block at iteration i (max(blocks) trips): the tile axis stays
    an array axis through the loop, so a mesh that splits rows splits the work; [Nt, K, G, Q,
    H] float32."""
    Nt, Q, K, G, H = qt.shape
    every = jnp.arange(Nt, dtype=jnp.int32)
    trips = jnp.max(tiles.blocks) if static_blocks is None else static_blocks

    def body(i, carry):
        m, l, acc = carry                                   # [Nt, K, G, Q], same, [.., H]
        k, v, visible = gather_block(every, tiles.first_page + i * tiles.pages_per_block)
        s = jnp.einsum("tqkgh,tskh->tkgqs", qt, k)
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        s = jnp.where(visible[:, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_use[..., None])
        corr = jnp.where(jnp.isfinite(m), jnp.exp(m - m_use), 0.0)
        acc = acc * corr[..., None] + jnp.einsum("tkgqs,tskh->tkgqh", p, v)
        return m_new, l * corr + jnp.sum(p, axis=-1), acc

    stats = lambda x: sharding.constrain(x, ("rows", "kv_heads") + (None,) * (x.ndim - 2))  # noqa: E731
    init = (stats(jnp.full((Nt, K, G, Q), -jnp.inf)), stats(jnp.zeros((Nt, K, G, Q))),
            stats(jnp.zeros((Nt, K, G, Q, H))))
    _, l, acc = jax.lax.fori_loop(0, trips, body, init)
    return acc / jnp.where(l == 0, 1.0, l)[..., None]


def tile_loop(qt, gather_block, tiles, static_blocks, softcap, rows_split: bool = False):
    """Attention of tiles of Q queries: qt [Nt, Q, K, G, H] (scaled), gather_block(t, j0) ->
    (k, v [C, S, K, H] float32, visible [C, Q, S]) -> [Nt * Q, N, H] float32.

    The trip count is ceil(sum of blocks / C), not max(blocks), so empty tiles and short rows
    cost nothing. static_blocks (a differentiable forward): a static count of blocks a tile.
    rows_split (a mesh splits the tiles over `data` or `sequence`): the tiles walk their blocks
    in lockstep instead, as the work list's pairs would be computed whole on every device.
    """
    Nt, Q, K, G, H = qt.shape
    if rows_split:
        out = _lockstep(qt, gather_block, tiles, static_blocks, softcap)
        return out.transpose(0, 3, 1, 2, 4).reshape(Nt * Q, K * G, H)

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
