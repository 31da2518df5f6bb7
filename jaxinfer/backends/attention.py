"""Attention of a flat step, per backend: a layer's key/value write and its ragged attention
over the page pool (Backend.attend), and the dense jnp reference the tests compare against.

Shape legend: B batch, T query tokens, S key slots, N query heads, K kv heads, G = N // K,
H head dim, P pages, Z page size, L layers.

Backend.attention "pallas": pallas_kernels.ragged_paged_attention (interpreted on CPU, under
shard_map on a mesh); "reference": the jnp work list (backends.work_list), its decode tiles on
CPU sent to the native kernel, which also writes the step's keys and values in place.
Key j is visible to query t iff 0 <= kpos[j] <= qpos[t] (and kpos[j] > qpos[t] - window).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxinfer import sharding
from jaxinfer.backends.work_list import tile_loop
from jaxinfer.device.kv_cache import Bits16KV, QuantizedKV, dense
from jaxinfer.device.ragged_meta import RaggedMeta, Tiles


def attend(backend, q, k, v, slots, k_all, v_all, layer, tables, meta: RaggedMeta, write, *,
           page_size: int, sliding_window=None, softcap=None, sm_scale=None,
           wraps: bool = False):
    """Writes k, v [T, K, H] at slots [T] of layer `layer` of the pools k_all, v_all
    [L, P * Z, K, H] (write(pool, layer, new, slots) -> pool), then attends each query of
    q [T, N, H] over its row's keys up to its position (tables [B, M]; wraps: a ring, logical
    page j at entry j % M). Returns (out [T, N, H] in q.dtype, k_all, v_all)."""
    kw = dict(page_size=page_size, sliding_window=sliding_window, softcap=softcap,
              sm_scale=sm_scale)
    if backend.attention == "pallas":
        k_all, v_all = write(k_all, layer, k, slots), write(v_all, layer, v, slots)
        return _pallas(backend, q, k_all, v_all, layer, tables, meta, wraps=wraps, **kw), \
            k_all, v_all
    fused = _native_write_and_attend(backend, q, k, v, slots, k_all, v_all, layer, tables,
                                     meta, **kw)
    if fused is not None:
        return fused
    k_all, v_all = write(k_all, layer, k, slots), write(v_all, layer, v, slots)
    return paged_loop_attention(backend, q, k_all, v_all, layer, tables, meta, **kw), \
        k_all, v_all


def ragged_attention(backend, q, k_all, v_all, layer, block_tables, meta: RaggedMeta, *,
                     page_size: int, sliding_window=None, softcap=None, sm_scale=None,
                     wraps: bool = False):
    """attend's attention over pools already written: out [T, N, H] in q.dtype."""
    kw = dict(page_size=page_size, sliding_window=sliding_window, softcap=softcap,
              sm_scale=sm_scale)
    if backend.attention == "pallas":
        return _pallas(backend, q, k_all, v_all, layer, block_tables, meta, wraps=wraps, **kw)
    return paged_loop_attention(backend, q, k_all, v_all, layer, block_tables, meta, **kw)


def _pallas(backend, q, k_all, v_all, layer, block_tables, meta: RaggedMeta, *, page_size,
            sliding_window, softcap, sm_scale, wraps):
    """The ragged paged attention kernel over layer `layer` of the pools."""
    from pallas_kernels import ragged_paged_attention

    P = jax.tree.leaves(k_all)[0].shape[1] // page_size
    pages = lambda a: a[layer].reshape((P, page_size) + a.shape[2:])  # noqa: E731
    k_pages, v_pages = jax.tree.map(pages, k_all), jax.tree.map(pages, v_all)
    kernel = functools.partial(ragged_paged_attention, sliding_window=sliding_window,
                               softcap=softcap, sm_scale=sm_scale, wraps=wraps,
                               interpret=backend.platform == "cpu")
    heads = "q_heads" if heads_split_evenly(q.shape[-2], jax.tree.leaves(k_all)[0].shape[-2]) \
        else None
    kv_heads = "kv_heads" if heads else None
    page_axes = (None, None, kv_heads, None)
    k_pages, v_pages, scales, scale_axes = _split_scales(k_pages, v_pages, page_axes)
    return _on_shards(lambda q, k, v, n, t, s, c, *sc: kernel(
                          q, k, v, n, t, s, c, **dict(zip(("k_scale", "v_scale"), sc))),
                      (None, heads, None), page_axes, page_axes, (None,), (None, None),
                      (None,), (None,), *scale_axes)(
        q, k_pages, v_pages, meta.kv_lengths, block_tables, meta.query_start,
        meta.num_queries, *scales)


def _split_scales(k, v, axes):
    """(k codes, v codes, (k_scale, v_scale), their logical axes) of a quantized segment or
    pool, (k, v, (), ()) of a float one (16-bit floats kept as bits become floats again)."""
    if isinstance(k, Bits16KV):
        return k.dequantize(k.dtype), v.dequantize(v.dtype), (), ()
    if not isinstance(k, QuantizedKV):
        return k, v, (), ()
    return k.typed_codes, v.typed_codes, (k.scale, v.scale), (axes[:-1], axes[:-1])


def heads_split_evenly(num_heads: int, num_kv_heads: int) -> bool:
    """Whether query and kv heads both split over the mesh's tensor axis (else both stay whole,
    so no shard pairs query heads with the wrong kv heads)."""
    mesh_shape = sharding.context_mesh_shape()
    t = mesh_shape.get("tensor", 1) if mesh_shape else 1
    return num_heads % t == 0 and num_kv_heads % t == 0


def _on_shards(kernel, *in_axes):
    """The kernel under jax.shard_map on the context mesh (specs from its inputs' logical axes,
    the output laid out as the queries), or itself without a mesh."""
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
    """Dense attention of q [B, T, N, H] at q_positions [B, T] over segments of (k, v
    [B, S, K, H], k_positions [B, S]; -1: empty): [B, T, N, H] in q.dtype."""
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


def paged_loop_attention(backend, q, k_all, v_all, layer, block_tables, meta: RaggedMeta, *,
                         page_size: int, sliding_window=None, softcap=None, sm_scale=None,
                         out=None):
    """The jnp ragged attention over layer `layer` of the pools: the work list over each set of
    tiles (meta.singles, then meta.tiles), decode tiles to the native kernel where the backend
    has it. out: [T, N, H] so far (zeros), each set written over it at its own tokens. Returns
    [T, N, H] in q.dtype."""
    T, N, H = q.shape
    scale = sm_scale if sm_scale is not None else H ** -0.5
    if out is None:
        out = jnp.zeros((T, N, H), q.dtype)
    for tiles in (meta.singles, meta.tiles):
        if tiles is None:
            continue
        if _native_singles(backend, tiles, meta, k_all, v_all, N):
            from jaxinfer.backends import cpu_kernels

            # In token order, zeros at tokens of no single tile (the multi-query tiles follow).
            o = _native_call(cpu_kernels.decode_attention, q, (k_all, v_all, layer,
                             block_tables), tiles, page_size=page_size, scale=scale,
                             sliding_window=sliding_window, softcap=softcap)
            out = o.reshape(T, N, H).astype(q.dtype)
            continue
        o = _tile_attention(q, k_all, v_all, layer, block_tables, tiles, meta,
                            page_size=page_size, sliding_window=sliding_window,
                            softcap=softcap, scale=scale)
        out = out.at[tiles.index.reshape(-1)].set(o.astype(q.dtype), mode="drop")
    return out


def _native_write_and_attend(backend, q, k, v, slots, k_all, v_all, layer, block_tables,
                             meta: RaggedMeta, *, page_size: int, sliding_window=None,
                             softcap=None, sm_scale=None):
    """The write and the decode tiles in one native call (no XLA scatter per pool), then the
    multi-query tiles by the work list: (out [T, N, H], k_all, v_all), or None where the kernel
    does not serve the step."""
    T, N, H = q.shape
    tiles = meta.singles
    if tiles is None or not _native_singles(backend, tiles, meta, k_all, v_all, N):
        return None
    from jaxinfer.backends import cpu_kernels

    if not (cpu_kernels.writing_supports(k_all) and cpu_kernels.writing_supports(v_all)):
        return None
    scale = sm_scale if sm_scale is not None else H ** -0.5
    o, k_all, v_all = _native_call(
        functools.partial(cpu_kernels.decode_attention_writing, k_new=k, v_new=v, slots=slots),
        q, (k_all, v_all, layer, block_tables), tiles, page_size=page_size, scale=scale,
        sliding_window=sliding_window, softcap=softcap)
    out = o.reshape(T, N, H).astype(q.dtype)
    if meta.tiles is not None:
        out = paged_loop_attention(backend, q, k_all, v_all, layer, block_tables,
                                   meta.replace(singles=None), page_size=page_size,
                                   sliding_window=sliding_window, softcap=softcap,
                                   sm_scale=sm_scale, out=out)
    return out, k_all, v_all


def _native_singles(backend, tiles: Tiles, meta: RaggedMeta, k_all, v_all,
                    num_heads: int) -> bool:
    """Whether the native decode kernel serves these tiles: single queries, not differentiable,
    pools it reads."""
    if backend.kernels is None or tiles.query_tile != 1 or meta.static_pages is not None:
        return False
    from jaxinfer.backends import cpu_kernels

    return (cpu_kernels.attention_supports(k_all, num_heads)
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
    """The work list over one set of tiles: [Nt * Q, N, H] float32 in tile order."""
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
    # Float pools are viewed as [L, P, Z, K * H]: keeping a size-1 K axis made XLA:CPU copy the
    # whole pool at every gather.
    merge = not isinstance(k_all, QuantizedKV)

    def view(a):
        if merge:
            return a.reshape(a.shape[0], -1, Z, a.shape[2] * a.shape[3])
        return a.reshape((a.shape[0], -1, Z) + a.shape[2:])
    k_pool, v_pool = jax.tree.map(view, k_all), jax.tree.map(view, v_all)
    z = jnp.arange(Z, dtype=jnp.int32)

    def gather_block(t, j0):
        """Pages j0[c] .. + pb of tile t[c]: k, v [C, S, K, H] float32 (unseen values zeroed),
        visible [C, Q, S]."""
        C = t.shape[0]
        j = j0[:, None] + jnp.arange(pb, dtype=jnp.int32)[None]           # [C, pb]
        pages = table[t[:, None], j % M]
        # Layer and page indexed together: slicing the layer out first made XLA copy it whole.
        gather = lambda a: a[layer, pages]                  # noqa: E731  [C, pb, Z, K(, H)]
        k = dense(jax.tree.map(gather, k_pool), jnp.float32).reshape(C, S, K, H)
        v = dense(jax.tree.map(gather, v_pool), jnp.float32).reshape(C, S, K, H)
        kpos = (j[:, :, None] * Z + z).reshape(C, 1, S)
        qpos = tiles.pos[t][:, :, None]                                    # [C, Q, 1]
        visible = kpos <= qpos
        if sliding_window is not None:
            visible &= kpos > qpos - sliding_window
        # Unwritten slots may hold anything (a fresh page is not zeroed): 0 * NaN would leak.
        v = jnp.where(jnp.any(visible, axis=1)[:, :, None, None], v, 0.0)
        return k, v, visible

    static_blocks = None if meta.static_pages is None else -(-meta.static_pages // pb)
    mesh_shape = sharding.context_mesh_shape() or {}
    rows_split = mesh_shape.get("data", 1) * mesh_shape.get("sequence", 1) > 1
    return tile_loop(qt, gather_block, tiles, static_blocks, softcap, rows_split)
