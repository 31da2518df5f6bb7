"""Attention of a prompt split along its tokens over the mesh's `sequence` axis (context
parallelism): two ways to let every shard's queries see the keys of the shards before it.

  "allgather"  each shard gathers the whole K/V (jax.lax.all_gather) and attends its queries
               to it: one collective, K/V held whole on every device for the layer;
  "ring"       K/V blocks travel round a ring (jax.lax.ppermute) in p steps while each shard
               folds every block into running softmax statistics (max, sum, weighted values):
               p - 1 neighbour exchanges, only two blocks held at a time.
Both move the same bytes per device, (p - 1) / p of the layer's K/V. They differ in what they
hold (the ring holds 2 blocks, the all-gather all p) and in when the bytes move (the ring can
overlap each exchange with the previous block's compute; the all-gather waits once). Measured
against each other in benchmarks/context_parallel.py; see docs/scaling.md.

A study kept beside its benchmark, not part of the engine: the engine's chunked prefill uses
neither, since its keys are already in a page pool split over the data and sequence axes and a
step's tokens split over `sequence` through the matmuls (docs/scaling.md).

Shapes: q [B, T, N, H], k and v [B, T, K, H], q_positions and k_positions [B, T] (-1: padding
key), T split over `sequence`, B over `data`, heads over `tensor`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxinfer import sharding
from jaxinfer.backends.attention import heads_split_evenly, reference_attention

METHODS = ("allgather", "ring")


def sequence_sharded_attention(q, k, v, q_positions, k_positions, *, method: str = "allgather",
                               sliding_window: int | None = None, sm_scale: float | None = None):
    """Causal attention of a token-split prompt on the context mesh (the reference attention
    without a jaxinfer mesh). Returns [B, T, N, H] laid out like q."""
    if method not in METHODS:
        raise ValueError(f"unknown context-parallel method {method!r}; available: {METHODS}")
    mesh_shape = sharding.context_mesh_shape()
    if mesh_shape is None or mesh_shape["sequence"] == 1:
        return reference_attention(q, q_positions, [(k, v, k_positions)],
                                   sliding_window=sliding_window, sm_scale=sm_scale)
    p = mesh_shape["sequence"]
    if q.shape[1] % p:
        raise ValueError(f"{q.shape[1]} prompt tokens do not split over a sequence degree "
                         f"of {p}")
    heads = "q_heads" if heads_split_evenly(q.shape[2], k.shape[2]) else None
    kv_heads = "kv_heads" if heads else None
    spec = lambda x, axes: sharding.spec_for(x.shape, axes, mesh_shape)
    q_spec = spec(q, ("batch", "context", heads, None))
    kv_spec = spec(k, ("batch", "context", kv_heads, None))
    pos_spec = spec(q_positions, ("batch", "context"))
    per_shard = functools.partial(_allgather if method == "allgather" else _ring,
                                  sliding_window=sliding_window, sm_scale=sm_scale)
    return jax.shard_map(per_shard, in_specs=(q_spec, kv_spec, kv_spec, pos_spec, pos_spec),
                         out_specs=q_spec, check_vma=False)(q, k, v, q_positions, k_positions)


def _allgather(q, k, v, q_positions, k_positions, *, sliding_window, sm_scale):
    gather = lambda x: jax.lax.all_gather(x, "sequence", axis=1, tiled=True)
    return reference_attention(q, q_positions, [(gather(k), gather(v), gather(k_positions))],
                               sliding_window=sliding_window, sm_scale=sm_scale)


def _ring(q, k, v, q_positions, k_positions, *, sliding_window, sm_scale):
    """Flash-style accumulation over the p K/V blocks as they pass round the ring."""
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    p = jax.lax.axis_size("sequence")
    scale = sm_scale if sm_scale is not None else H ** -0.5
    qg = q.reshape(B, T, K, G, H)
    qp = q_positions[:, None, None, :, None]                               # [B, 1, 1, T, 1]
    m = jnp.full((B, K, G, T, 1), -jnp.inf, jnp.float32)
    total = jnp.zeros((B, K, G, T, 1), jnp.float32)
    acc = jnp.zeros((B, K, G, T, H), jnp.float32)
    shift = [(i, (i + 1) % p) for i in range(p)]
    for step in range(p):
        s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32) * scale
        kp = k_positions[:, None, None, None, :]                          # [B, 1, 1, 1, S]
        visible = (kp >= 0) & (kp <= qp)
        if sliding_window is not None:
            visible &= kp > qp - sliding_window
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        w = jnp.exp(s - safe)
        corr = jnp.exp(jnp.where(jnp.isfinite(m), m - safe, -jnp.inf))
        total = total * corr + jnp.sum(w, axis=-1, keepdims=True)
        vz = jnp.where((k_positions >= 0)[:, :, None, None], v, jnp.zeros((), v.dtype))
        acc = acc * corr + jnp.einsum("BKGTS,BSKH->BKGTH", w.astype(v.dtype), vz,
                                      preferred_element_type=jnp.float32)
        m = m_new
        if step + 1 < p:  # pass this block on; receive the previous shard's
            k, v, k_positions = (jax.lax.ppermute(x, "sequence", shift)
                                 for x in (k, v, k_positions))
    out = acc / jnp.where(total == 0, 1.0, total)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H).astype(q.dtype)
