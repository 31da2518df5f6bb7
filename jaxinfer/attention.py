"""The one attention entry point of the models.

Shape legend: B batch, T query tokens, S key slots, N query heads, K kv heads, G = N // K,
H head dim.

Visibility is decided from absolute positions alone: key j is visible to query t iff
0 <= kpos[j] <= qpos[t] and, with a sliding window w, kpos[j] > qpos[t] - w. Padding queries or
keys carry position -1 (keys) and are masked out; a padding query's output is discarded by the
caller.

Implementations:
  "reference"  pure jnp, any segments (here);
  "flash"      pallas_kernels.flash_attention;
  "paged"      pallas_kernels.paged_attention (one query token per row);
  "pallas"     flash for chunks of several tokens, paged for single-token decode.
The kernels need keys laid out by position (slot j holds position j: a cache that has not
wrapped), which the caller states by passing `lengths`; otherwise the reference runs. On CPU the
kernels run in interpret mode.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxinfer import cpu_kernels, sharding
from jaxinfer.kv_cache import Bits16KV, QuantizedKV, dense
# ragged_meta and num_tiles_bound: kept importable from here, beside ragged_attention.
from jaxinfer.ragged_meta import RaggedMeta, Tiles, num_tiles_bound, ragged_meta  # noqa: F401
from jaxinfer.work_list import multi_query_loop, single_query_loop

KVSegment = tuple  # (k [B, S, K, H], v [B, S, K, H], k_positions [B, S])

IMPLEMENTATIONS = ("reference", "flash", "paged", "pallas")


def attention(q: jax.Array, q_positions: jax.Array, segments: Sequence[KVSegment], *,
              sliding_window: int | None = None, softcap: float | None = None,
              sm_scale: float | None = None, implementation: str = "reference",
              lengths: tuple[jax.Array, jax.Array] | None = None,
              pages: tuple[jax.Array, jax.Array, jax.Array] | None = None) -> jax.Array:
    """Causal GQA attention of q over the keys of one or more segments.

    q [B, T, N, H]; q_positions [B, T] int32; each segment is (k, v, k_positions) with
    k, v [B, S_i, K, H] and k_positions [B, S_i] int32 (-1 = empty). Segments let a chunk attend to
    the cache and to its own keys without first writing into (and possibly wrapping over) a ring.
    lengths = (q_offset [B], kv_lengths [B]) says that there is one segment whose slot j holds
    position j, with q[:, 0] at q_offset and kv_lengths valid keys: the layout the kernels take.
    pages = (k_pages [P, Z, K, H], v_pages, block_tables [B, M]) is the same keys as a page pool,
    for the paged kernel (single-token decode). Returns [B, T, N, H] in q.dtype.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {implementation!r}; "
                         f"available: {IMPLEMENTATIONS}")
    if implementation == "reference" or lengths is None or len(segments) != 1:
        return reference_attention(q, q_positions, segments, sliding_window=sliding_window,
                                   softcap=softcap, sm_scale=sm_scale)
    k, v, _ = segments[0]
    q_offset, kv_lengths = lengths
    interpret = jax.default_backend() == "cpu"
    T = q.shape[1]
    use_paged = implementation == "paged" or (implementation == "pallas" and T == 1)
    heads = "q_heads" if heads_split_evenly(q.shape[-2], k.shape[-2]) else None
    kv_heads = "kv_heads" if heads else None
    if use_paged and T == 1 and pages is not None:
        from pallas_kernels import paged_attention

        k_pages, v_pages, block_tables = pages
        kernel = functools.partial(paged_attention, sliding_window=sliding_window,
                                   softcap=softcap, sm_scale=sm_scale, interpret=interpret)
        page_axes = (None, None, kv_heads, None)
        k_pages, v_pages, scales, scale_axes = _split_scales(k_pages, v_pages, page_axes)
        out = _on_shards(lambda q, k, v, n, t, *sc: kernel(q, k, v, n, t, **_scale_kw(sc)),
                         ("batch", heads, None), page_axes, page_axes, ("batch",),
                         ("batch", None), *scale_axes)(
            q[:, 0], k_pages, v_pages, kv_lengths, block_tables, *scales)
        return out[:, None]
    from pallas_kernels import flash_attention

    kernel = functools.partial(flash_attention, causal=True, sliding_window=sliding_window,
                               softcap=softcap, sm_scale=sm_scale, interpret=interpret)
    q_axes, kv_axes = ("batch", None, heads, None), ("batch", None, kv_heads, None)
    k, v, scales, scale_axes = _split_scales(k, v, kv_axes)
    return _on_shards(lambda q, k, v, off, n, *sc: kernel(q, k, v, q_offset=off, kv_lengths=n,
                                                          **_scale_kw(sc)),
                      q_axes, kv_axes, kv_axes, ("batch",), ("batch",), *scale_axes)(
        q, k, v, q_offset, kv_lengths, *scales)


def _split_scales(k, v, axes):
    """(k codes, v codes, (k_scale, v_scale), their logical axes) of a quantized segment or
    pool, (k, v, (), ()) of a float one (16-bit floats kept as bits become floats again)."""
    if isinstance(k, Bits16KV):
        return k.dequantize(k.dtype), v.dequantize(v.dtype), (), ()
    if not isinstance(k, QuantizedKV):
        return k, v, (), ()
    return k.typed_codes, v.typed_codes, (k.scale, v.scale), (axes[:-1], axes[:-1])


def _scale_kw(scales: tuple) -> dict:
    return dict(zip(("k_scale", "v_scale"), scales))


def heads_split_evenly(num_heads: int, num_kv_heads: int) -> bool:
    """Whether query and kv heads both split over the context mesh's tensor axis (otherwise a
    kernel shard would pair its query heads with the wrong kv heads: both stay whole)."""
    mesh_shape = sharding.context_mesh_shape()
    t = mesh_shape.get("tensor", 1) if mesh_shape else 1
    return num_heads % t == 0 and num_kv_heads % t == 0


def _on_shards(kernel, *in_axes):
    """The kernel under jax.shard_map on the context mesh, with specs from the logical axes of
    its inputs (each shard: its batch rows and heads; keys whole along their sequence); its
    output is laid out like its first input, the queries. The kernel itself without a mesh."""
    mesh_shape = sharding.context_mesh_shape()
    if mesh_shape is None:
        return kernel

    def run(*args):
        specs = tuple(sharding.spec_for(a.shape, axes, mesh_shape)
                      for a, axes in zip(args, in_axes))
        return jax.shard_map(kernel, in_specs=specs, out_specs=specs[0],
                             check_vma=False)(*args)
    return run


def reference_attention(q, q_positions, segments, *, sliding_window=None, softcap=None,
                        sm_scale=None):
    B, T, N, H = q.shape
    K = segments[0][0].shape[2]
    G = N // K
    scale = sm_scale if sm_scale is not None else H ** -0.5
    qg = q.reshape(B, T, K, G, H)
    qp = q_positions[:, :, None]                                          # [B, T, 1]
    logits = []
    for k, _, k_positions in segments:
        k = dense(k, q.dtype)
        s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        kp = k_positions[:, None, :]                                      # [B, 1, S]
        visible = (kp >= 0) & (kp <= qp)
        if sliding_window is not None:
            visible &= kp > qp - sliding_window
        logits.append(jnp.where(visible[:, None, None], s, -jnp.inf))
    logits = jnp.concatenate(logits, axis=-1)                             # [B, K, G, T, S]
    # A query with no visible key (padding) would give NaN; give it zeros instead.
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = 0.0
    start = 0
    for _, v, k_positions in segments:
        v = dense(v, q.dtype)
        S = v.shape[1]
        # Empty slots may hold anything (a fresh page is not zeroed): 0 * NaN would leak.
        v = jnp.where((k_positions >= 0)[:, :, None, None], v, jnp.zeros((), v.dtype))
        out = out + jnp.einsum("BKGTS,BSKH->BTKGH", p[..., start:start + S].astype(v.dtype), v,
                               preferred_element_type=jnp.float32)
        start += S
    return out.reshape(B, T, N, H).astype(q.dtype)


def ragged_attention(q: jax.Array, k_all, v_all, layer, block_tables: jax.Array,
                     meta: RaggedMeta, *, page_size: int, sliding_window: int | None = None,
                     softcap: float | None = None, sm_scale: float | None = None,
                     implementation: str = "reference", wraps: bool = False) -> jax.Array:
    """Attention of a flat step's queries q [T, N, H] over layer `layer` (an int, or an int32
    scalar inside a jitted layer) of a page pool k_all, v_all [L, P * Z, K, H] (float or
    QuantizedKV), each query over its row's keys up to its own position (and within the
    window). Returns [T, N, H] in q.dtype; tokens of no row get zeros.

    implementation "reference": the jnp path (paged_loop_attention); "pallas": the ragged paged
    attention kernel (interpret mode on CPU). wraps: a ring, whose positions map to table entries
    modulo the table width (both paths read it so).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {implementation!r}; "
                         f"available: {IMPLEMENTATIONS}")
    if implementation == "reference":
        return paged_loop_attention(q, k_all, v_all, layer, block_tables, meta,
                                    page_size=page_size, sliding_window=sliding_window,
                                    softcap=softcap, sm_scale=sm_scale)
    from pallas_kernels import ragged_paged_attention

    P = jax.tree.leaves(k_all)[0].shape[1] // page_size
    pages = lambda a: a[layer].reshape((P, page_size) + a.shape[2:])  # noqa: E731
    k_pages, v_pages = jax.tree.map(pages, k_all), jax.tree.map(pages, v_all)
    kernel = functools.partial(ragged_paged_attention, sliding_window=sliding_window,
                               softcap=softcap, sm_scale=sm_scale, wraps=wraps,
                               interpret=jax.default_backend() == "cpu")
    heads = "q_heads" if heads_split_evenly(q.shape[-2], jax.tree.leaves(k_all)[0].shape[-2]) \
        else None
    kv_heads = "kv_heads" if heads else None
    page_axes = (None, None, kv_heads, None)
    k_pages, v_pages, scales, scale_axes = _split_scales(k_pages, v_pages, page_axes)
    return _on_shards(lambda q, k, v, n, t, s, c, *sc: kernel(q, k, v, n, t, s, c,
                                                              **_scale_kw(sc)),
                      (None, heads, None), page_axes, page_axes, (None,), (None, None),
                      (None,), (None,), *scale_axes)(
        q, k_pages, v_pages, meta.kv_lengths, block_tables, meta.query_start,
        meta.num_queries, *scales)


def paged_loop_attention(q, k_all, v_all, layer, block_tables, meta: RaggedMeta, *,
                         page_size: int, sliding_window=None, softcap=None, sm_scale=None,
                         out=None):
    """The jnp ragged attention, written for XLA:CPU: for each set of tiles (meta.singles, then
    meta.tiles), a while loop of dynamic trip count walks a work list of (tile, block of
    pages_per_block pages) pairs, each iteration gathering its pairs' pages straight from the
    pool (indexed by layer and page together: slicing the layer out first made XLA copy it
    whole) and folding them into an online softmax in float32. Work follows the blocks the
    tiles need, with no static page-count bucket. (On a mesh, multi-query tiles walk every
    tile to the longest row instead, split over devices; so do decode tiles under tensor
    parallelism, their heads split.)
    Logical page j of a row is table entry j % M, so a wrapping ring reads the same way.
    out: the output so far ([T, N, H], zeros by default), each set of tiles written over it at
    its own tokens."""
    T, N, H = q.shape
    scale = sm_scale if sm_scale is not None else H ** -0.5
    if out is None:
        out = jnp.zeros((T, N, H), q.dtype)
    for tiles in (meta.singles, meta.tiles):
        if tiles is None:
            continue
        if _native_singles(tiles, meta, k_all, v_all, N):
            # The native decode kernel (docs/cpu_kernels.md) reads each visible key once, and
            # takes the queries and gives the outputs in token order: no gather or scatter
            # around it (it zeroes the tokens of no single tile; the multi-query tiles follow).
            o = _native_call(cpu_kernels.decode_attention, q, (k_all, v_all, layer,
                             block_tables), tiles, page_size=page_size, scale=scale,
                             sliding_window=sliding_window, softcap=softcap)
            out = o.reshape(T, N, H).astype(q.dtype)
            continue
        o = _tile_attention(q, k_all, v_all, layer, block_tables, tiles, meta, page_size=page_size,
                            sliding_window=sliding_window, softcap=softcap, scale=scale)
        out = out.at[tiles.index.reshape(-1)].set(o.astype(q.dtype), mode="drop")
    return out


def write_and_attend(q, k, v, slots, k_all, v_all, layer, block_tables, meta: RaggedMeta, *,
                     page_size: int, sliding_window=None, softcap=None, sm_scale=None):
    """The step's new keys and values k, v [T, K, H] written into layer `layer`'s slots [T]
    of the pools (kv_cache.PagedKVCache.write_layer's effect), then ragged_attention's
    reference path over them, with the native decode kernel doing the writes and the decode
    tiles in one call (cpu_kernels.decode_attention_writing: no XLA scatter per pool) where
    it serves them (_native_singles, float32 or bf16 pools). Returns (out [T, N, H], k_all,
    v_all), or None where the kernel does not serve them (the caller writes and attends)."""
    T, N, H = q.shape
    tiles = meta.singles
    if (tiles is None or not _native_singles(tiles, meta, k_all, v_all, N)
            or not cpu_kernels.writing_supports(k_all)
            or not cpu_kernels.writing_supports(v_all)):
        return None
    scale = sm_scale if sm_scale is not None else H ** -0.5
    o, k_all, v_all = _native_call(
        functools.partial(cpu_kernels.decode_attention_writing, k_new=k, v_new=v, slots=slots),
        q, (k_all, v_all, layer, block_tables), tiles, page_size=page_size, scale=scale,
        sliding_window=sliding_window, softcap=softcap)
    out = o.reshape(T, N, H).astype(q.dtype)
    if meta.tiles is not None:
        out = paged_loop_attention(q, k_all, v_all, layer, block_tables,
                                   meta.replace(singles=None), page_size=page_size,
                                   sliding_window=sliding_window, softcap=softcap,
                                   sm_scale=sm_scale, out=out)
    return out, k_all, v_all


def _native_singles(tiles: Tiles, meta: RaggedMeta, k_all, v_all, num_heads: int) -> bool:
    """Whether cpu_kernels.decode_attention serves these tiles: single-query tiles, a dynamic
    trip count (not a differentiable forward), kernels built and the pools readable by it."""
    return (tiles.query_tile == 1 and meta.static_pages is None and cpu_kernels.enabled()
            and cpu_kernels.attention_supports(k_all, num_heads)
            and cpu_kernels.attention_supports(v_all, num_heads))


def _native_call(kernel, q, pools_layer_tables, tiles: Tiles, **kw):
    """kernel (a cpu_kernels decode attention) over the single-query tiles, q [T, N, H] viewed
    as [T, K, G, H] with the pools' K."""
    T, N, H = q.shape
    k_all, v_all, layer, block_tables = pools_layer_tables
    K = jax.tree.leaves(k_all)[0].shape[-2]
    return kernel(q.reshape(T, K, N // K, H), k_pool=k_all, v_pool=v_all, layer=layer,
                  tables=block_tables, token=tiles.index[:, 0], row=tiles.row,
                  pos=tiles.pos[:, 0], **kw)


def _tile_attention(q, k_all, v_all, layer, block_tables, tiles: Tiles, meta: RaggedMeta,
                    *, page_size, sliding_window, softcap, scale):
    """paged_loop_attention over one set of tiles: [Nt * Q, N, H] float32 in tile order."""
    T, N, H = q.shape
    Z, pb = page_size, tiles.pages_per_block
    K = jax.tree.leaves(k_all)[0].shape[-2]
    G, (Nt, Q), B = N // K, tiles.pos.shape, block_tables.shape[0]
    M, S = block_tables.shape[1], pb * Z
    qt = q.at[tiles.index].get(mode="fill", fill_value=0)                 # [Nt, Q, N, H]
    qt = (qt.astype(jnp.float32) * scale).reshape(Nt, Q, K, G, H)
    # Sequence parallelism: the tiles split over `sequence` as the step's tokens do.
    qt = sharding.constrain(qt, ("rows", None, "kv_heads", None, None))
    table = block_tables[jnp.minimum(tiles.row, B - 1)]                   # [Nt, M]
    # Float (and 16-bit-as-bits) pools are viewed as pages [L, P, Z, K * H]: with a single kv
    # head (Gemma 3 270M), a view keeping the size-1 K axis made XLA:CPU copy the whole pool
    # at every layer's gather (16 decode rows of Gemma 3 270M: 2.2 s a step instead of 0.2).
    merge = not isinstance(k_all, QuantizedKV)

    def view(a):
        if merge:
            return a.reshape(a.shape[0], -1, Z, a.shape[2] * a.shape[3])
        return a.reshape((a.shape[0], -1, Z) + a.shape[2:])
    k_pool, v_pool = jax.tree.map(view, k_all), jax.tree.map(view, v_all)
    z = jnp.arange(Z, dtype=jnp.int32)

    def gather_block(t, j0, key_dtype=jnp.float32):
        """The block of pb pages from logical page j0[c] of tile t[c], for C (tile, page)
        pairs: keys [C, S, K, H] in key_dtype (as stored where the pool already holds it),
        values [C, S, K, H] in float32 (zeroed where no query of the tile sees the key) and
        visible [C, Q, S]."""
        C = t.shape[0]
        j = j0[:, None] + jnp.arange(pb, dtype=jnp.int32)[None]           # [C, pb]
        pages = table[t[:, None], j % M]
        gather = lambda a: a[layer, pages]                  # noqa: E731  [C, pb, Z, K(, H)]
        k = dense(jax.tree.map(gather, k_pool), key_dtype).reshape(C, S, K, H)
        k = k.astype(key_dtype)
        v = dense(jax.tree.map(gather, v_pool), jnp.float32).reshape(C, S, K, H)
        kpos = (j[:, :, None] * Z + z).reshape(C, 1, S)
        qpos = tiles.pos[t][:, :, None]                                    # [C, Q, 1]
        visible = kpos <= qpos
        if sliding_window is not None:
            visible &= kpos > qpos - sliding_window
        # Unwritten slots may hold anything (a fresh page is not zeroed): 0 * NaN would leak.
        v = jnp.where(jnp.any(visible, axis=1)[:, :, None, None], v, 0.0)
        return k, v, visible

    def block(i):
        """Block i of every tile's pages (gather_block of every tile)."""
        return gather_block(jnp.arange(Nt, dtype=jnp.int32), tiles.first_page + i * pb)

    static_blocks = None if meta.static_pages is None else -(-meta.static_pages // pb)
    mesh_shape = sharding.context_mesh_shape()
    if Q == 1 and (mesh_shape is None or mesh_shape.get("tensor", 1) == 1):
        # Decode keys multiply in bf16 where the pool holds bf16 (single_query_loop).
        key_dtype = (jnp.bfloat16 if not isinstance(k_all, QuantizedKV)
                     and k_all.dtype == jnp.bfloat16 else jnp.float32)
        return single_query_loop(qt.reshape(Nt, K, G, H), gather_block, tiles, static_blocks,
                                  softcap, key_dtype)
    # On a mesh, multi-query tiles keep the loop over every tile, whose tile axis the
    # partitioner splits over `sequence` (and `data`); a work list's pairs would be computed
    # whole on every device (a prefill chunk's per-device FLOPs on 2 sequence devices: 0.61 of
    # one device's with the work list, 0.50 without).
    if Q > 1 and (mesh_shape is None or all(n == 1 for n in mesh_shape.values())):
        return multi_query_loop(qt, gather_block, tiles, static_blocks, softcap)
    trips = tiles.num_blocks if static_blocks is None else static_blocks

    def body(i, carry):
        m, l, acc = carry                                   # [Nt, K, G, Q], same, [.., H]
        k, v, visible = block(i)
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
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(Nt * Q, N, H)
