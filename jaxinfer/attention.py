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

from jaxinfer import sharding
from jaxinfer.kv_cache import QuantizedKV, dense

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
    pool, (k, v, (), ()) of a float one."""
    if not isinstance(k, QuantizedKV):
        return k, v, (), ()
    return k.codes, v.codes, (k.scale, v.scale), (axes[:-1], axes[:-1])


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


def ragged_paged_attention(q, k_pages, v_pages, page_rows, page_starts, lengths, *,
                           sliding_window=None, softcap=None, sm_scale=None):
    """Single-token decode attention over a flat list of pages: work in proportion to the
    pages rows actually hold, not to the longest row (the pure-jnp decode path of a paged
    cache; the Pallas kernel does the same per row on a device).

    q [B, N, H]: one query per row, at position lengths[b] - 1. k_pages, v_pages [Np, Z, K, H]:
    the listed pages, already gathered (float, or QuantizedKV dequantized here); page i
    belongs to row page_rows[i] (B marks a padding page, whose keys are all hidden) and holds
    positions page_starts[i] + z. A row's keys are its positions below lengths[b]. Returns
    [B, N, H] in q.dtype; a row with no listed keys gets zeros.
    """
    B, N, H = q.shape
    Np, Z, K, _ = k_pages.shape
    G = N // K
    scale = sm_scale if sm_scale is not None else H ** -0.5
    k_pages, v_pages = dense(k_pages, q.dtype), dense(v_pages, q.dtype)
    owner = jnp.minimum(page_rows, B - 1)
    kpos = page_starts[:, None] + jnp.arange(Z, dtype=jnp.int32)[None, :]       # [Np, Z]
    qpos = jnp.where(page_rows < B, lengths[owner], 0)[:, None] - 1             # [Np, 1]
    visible = (kpos <= qpos)
    if sliding_window is not None:
        visible &= kpos > qpos - sliding_window
    # Row selection as one-hot matmuls: XLA:CPU gathers and scatters of small slices are slow.
    onehot = (page_rows[:, None] == jnp.arange(B, dtype=page_rows.dtype)[None, :])
    onehot = onehot.astype(jnp.float32)                                         # [Np, B]
    qo = (onehot @ q.reshape(B, N * H).astype(jnp.float32)).reshape(Np, K, G, H)
    s = jnp.einsum("PKGH,PZKH->PZKG", qo, k_pages, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(visible[:, :, None, None], s, -jnp.inf)                       # [Np, Z, K, G]
    m = jax.ops.segment_max(jnp.max(s, axis=1), page_rows, num_segments=B)     # [B, K, G]
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m[owner][:, None])
    denom = jax.ops.segment_sum(jnp.sum(p, axis=1), page_rows, num_segments=B)
    # Hidden slots may hold anything (a page's unwritten tail): 0 * NaN would leak.
    v = jnp.where(visible[:, :, None, None], v_pages, jnp.zeros((), v_pages.dtype))
    o = jnp.einsum("PZKG,PZKH->PKGH", p, v, preferred_element_type=jnp.float32)
    out = (onehot.T @ o.reshape(Np, N * H)).reshape(B, K, G, H)
    out = out / jnp.where(denom == 0, 1.0, denom)[..., None]
    return out.reshape(B, N, H).astype(q.dtype)
