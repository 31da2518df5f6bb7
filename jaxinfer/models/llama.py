"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) as pure functions.

Shape legend: B batch, T query tokens, S cache slots, L layers, N query heads, K kv heads,
H head dim, D model dim, F ffn dim, V vocab.

`forward(params, cfg, tokens, cache, num_new)` -> (hidden [B, T, D], new cache). Params are a
registered pytree holding one LayerParams per layer. The layers are unrolled rather than stacked
and scanned: on XLA:CPU a scan slices each layer's weights out of the stack with a copy before
every matmul, which costs ~20% of batch-1 decode time (measured: 16.9 vs 13.7 ms per step for
SmolLM2's matmuls alone).
"""

from __future__ import annotations

import functools
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import sharding
from jaxinfer.attention import (PAGES_PER_BLOCK, num_tiles_bound, ragged_attention,
                                ragged_meta)
from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import KV_DTYPES, PagedKVCache
from jaxinfer.quant import QuantizedWeight, matmul, take_rows
from jaxinfer.token_batch import TokenBatch
from jaxinfer.layers import (apply_rope, float_matmul, linear, rms_norm, rope_angles,
                             rope_inv_freq, swiglu_mlp)


@flax.struct.dataclass
class LayerParams:
    attn_norm: jax.Array            # [D]
    wq: jax.Array                   # [D, N*H]
    wk: jax.Array                   # [D, K*H]
    wv: jax.Array                   # [D, K*H]
    wo: jax.Array                   # [N*H, D]
    mlp_norm: jax.Array             # [D]
    w_gate: jax.Array               # [D, F]
    w_up: jax.Array                 # [D, F]
    w_down: jax.Array               # [F, D]
    bq: Optional[jax.Array] = None  # [N*H] (Qwen2)
    bk: Optional[jax.Array] = None  # [K*H]
    bv: Optional[jax.Array] = None  # [K*H]


@flax.struct.dataclass
class LlamaParams:
    embed: jax.Array                    # [V, D]
    layers: tuple[LayerParams, ...]     # L of them
    final_norm: jax.Array               # [D]
    lm_head: Optional[jax.Array] = None  # [D, V]; None when tied to embed


def param_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Every parameter once: name -> (shape, logical axes). "layers.*" entries describe one
    layer (each of the L layers has them). Initialisers and shardings derive from this table."""
    D, F, V = cfg.d_model, cfg.ffn_dim, cfg.vocab_size
    q, kv = cfg.q_dim, cfg.kv_dim
    specs = {
        "embed": ((V, D), ("vocab", "embed")),
        "final_norm": ((D,), ("embed",)),
        "layers.attn_norm": ((D,), ("embed",)),
        "layers.wq": ((D, q), ("embed", "q_heads")),
        "layers.wk": ((D, kv), ("embed", "kv_heads")),
        "layers.wv": ((D, kv), ("embed", "kv_heads")),
        "layers.wo": ((q, D), ("q_heads", "embed")),
        "layers.mlp_norm": ((D,), ("embed",)),
        "layers.w_gate": ((D, F), ("embed", "ffn")),
        "layers.w_up": ((D, F), ("embed", "ffn")),
        "layers.w_down": ((F, D), ("ffn", "embed")),
    }
    if cfg.attention_bias:
        specs["layers.bq"] = ((q,), ("q_heads",))
        specs["layers.bk"] = ((kv,), ("kv_heads",))
        specs["layers.bv"] = ((kv,), ("kv_heads",))
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ((D, V), ("embed", "vocab"))
    return specs


def _assemble(cfg: ModelConfig, arrays: dict[str, jax.Array]) -> LlamaParams:
    """arrays: "embed", "final_norm", optional "lm_head", and "layers.{i}.{field}"."""
    layers = []
    for i in range(cfg.num_layers):
        prefix = f"layers.{i}."
        layers.append(LayerParams(**{k[len(prefix):]: v for k, v in arrays.items()
                                     if k.startswith(prefix)}))
    return LlamaParams(embed=arrays["embed"], layers=tuple(layers),
                       final_norm=arrays["final_norm"], lm_head=arrays.get("lm_head"))


def _expanded_specs(cfg: ModelConfig):
    """param_specs with the per-layer entries repeated as "layers.{i}.{field}"."""
    for name, spec in param_specs(cfg).items():
        if name.startswith("layers."):
            field = name.split(".", 1)[1]
            for i in range(cfg.num_layers):
                yield f"layers.{i}.{field}", spec
        else:
            yield name, spec


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> LlamaParams:
    """Random weights of the right shapes (norms at 1), for benchmarks and tests."""
    arrays = {}
    for i, (name, (shape, _)) in enumerate(sorted(_expanded_specs(cfg))):
        if name.endswith("norm"):
            arrays[name] = jnp.ones(shape, dtype)
        elif name == "embed":
            arrays[name] = jax.random.normal(jax.random.fold_in(key, i), shape).astype(dtype)
        else:
            std = shape[0] ** -0.5  # fan-in of [in, out] weights; biases get the same scale
            arrays[name] = (std * jax.random.normal(jax.random.fold_in(key, i), shape)).astype(dtype)
    return _assemble(cfg, arrays)


def params_from_weights(cfg: ModelConfig, weights: dict[str, np.ndarray],
                        dtype=jnp.float32, place=None) -> LlamaParams:
    """Builds LlamaParams from named weights ("layers.{i}.{name}", linear weights [in, out]).

    place(array, logical_axes, dtype) -> jax.Array puts each weight where it belongs (e.g.
    `sharding.Partitioner.place`: each device receives only its shard); default: the default
    device.
    """
    arrays = {}
    for name, (shape, axes) in _expanded_specs(cfg):
        if name not in weights:
            raise ValueError(f"weight {name!r} is missing")
        arr = weights[name]
        if arr.shape != shape:
            raise ValueError(f"weight {name!r} has shape {arr.shape}; config implies {shape}")
        if isinstance(arr, QuantizedWeight):  # codes and scales keep their own dtypes
            if place is not None:
                raise NotImplementedError("quantized weights on a mesh are not supported yet")
            arrays[name] = jax.tree.map(jnp.asarray, arr)
            continue
        arrays[name] = (jnp.asarray(arr, dtype=dtype) if place is None
                        else place(arr, axes, dtype))
    return _assemble(cfg, arrays)


def embed(params: LlamaParams, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] -> [B, T, D]."""
    if isinstance(params.embed, QuantizedWeight):
        rows = take_rows(params.embed, tokens.reshape(-1))
        return rows.reshape(tokens.shape + rows.shape[-1:]).astype(activation_dtype(params))
    return jnp.take(params.embed, tokens, axis=0).astype(activation_dtype(params))


def activation_dtype(params: LlamaParams):
    """The dtype activations (and the KV cache, unless quantized) take: the float weights'."""
    return params.final_norm.dtype


def with_float32_activations(params: LlamaParams) -> LlamaParams:
    """params with the vectors (norm weights, biases) in float32 and the matrices as they are:
    activations and the KV cache then run in float32 (activation_dtype) while every matmul
    reads 16-bit weights (layers.float_matmul)."""
    def vec(x):
        return None if x is None else x.astype(jnp.float32)

    layers = tuple(layer.replace(attn_norm=vec(layer.attn_norm), mlp_norm=vec(layer.mlp_norm),
                                 bq=vec(layer.bq), bk=vec(layer.bk), bv=vec(layer.bv))
                   for layer in params.layers)
    return params.replace(layers=layers, final_norm=vec(params.final_norm))


def lm_head(params: LlamaParams, h: jax.Array) -> jax.Array:
    """h [..., D] (already normalised) -> logits [..., V] in float32."""
    if params.lm_head is None:
        if isinstance(params.embed, QuantizedWeight):
            return matmul(h, params.embed, "...D,VD->...V")
        return float_matmul(h, params.embed, "...D,VD->...V")
    if isinstance(params.lm_head, QuantizedWeight):
        return matmul(h, params.lm_head, "...D,DV->...V")
    return float_matmul(h, params.lm_head, "...D,DV->...V")


# Queries per attention tile of a dense block: whole rows up to this, so decode (1) and
# verification (k + 1) blocks make one tile a row, and long prefills many (which sequence
# parallelism splits over its shards).
DENSE_QUERY_TILE = 16


def forward(params: LlamaParams, cfg: ModelConfig, tokens: jax.Array, cache: PagedKVCache,
            num_new: jax.Array, *, rows: jax.Array | None = None,
            attn_impl: str = "reference",
            differentiable: bool = False) -> tuple[jax.Array, PagedKVCache]:
    """forward_tokens for a block of tokens [R, T]: block row i feeds cache row rows[i] (None:
    row i) its first num_new[i] tokens, at positions cache.lengths[row] + t (the rest is
    padding). Returns the final-normed hidden states [R, T, D] and the cache. differentiable:
    attention loops a fixed number of times (see forward_tokens)."""
    R, T = tokens.shape
    batch = TokenBatch.dense(tokens, num_new, rows, cache.batch)
    tile = min(T, DENSE_QUERY_TILE)
    h, cache = forward_tokens(params, cfg, batch, cache, attn_impl=attn_impl, query_tile=tile,
                              num_tiles=R * -(-T // tile), differentiable=differentiable)
    return h.reshape(R, T, -1), cache


def forward_tokens(params: LlamaParams, cfg: ModelConfig, batch: TokenBatch,
                   cache: PagedKVCache, *, attn_impl: str = "reference", query_tile: int = 16,
                   num_tiles: int | None = None,
                   differentiable: bool = False) -> tuple[jax.Array, PagedKVCache]:
    """Runs a flat step's tokens (jaxinfer.token_batch) through the model and appends their
    K/V to the cache. Returns the final-normed hidden states [T, D] and the cache with each
    row's length advanced by its num_queries.

    Every matmul sees [T, D] at once. Each layer writes its new K/V into the donated cache
    first (in place) and then attends over the cache alone (jaxinfer.attention.ragged_attention):
    a ring is sized so that the write never overwrites a key the step's queries still see.
    query_tile (static): queries per attention tile (the tokens a row feeds in one step: 1 for
    decode); num_tiles (static) defaults to a bound that holds for any split of the batch.
    differentiable (static): the jnp attention loops over every page a row's table can hold
    (a fixed trip count, which jax.grad can go through) instead of the step's longest row.
    """
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    T, B, Z = batch.num_tokens, cache.batch, cache.page_size
    positions = batch.positions(cache.lengths)                             # [T]
    slots = cache.write_slots(batch.rows, positions)                       # [T]
    kv_lengths = cache.lengths + batch.num_queries
    meta = ragged_meta(batch.query_start, batch.num_queries, kv_lengths, num_tokens=T,
                       query_tile=query_tile,
                       num_tiles=num_tiles or num_tiles_bound(T, query_tile, B),
                       page_size=Z, sliding_window=cfg.sliding_window,
                       static_blocks=-(-cache.block_tables.shape[1] // PAGES_PER_BLOCK) if differentiable
                       else None)
    inv_freq = rope_inv_freq(H, cfg.rope_theta, cfg.rope_scaling, cfg.rope_freq_factors)
    cos, sin = rope_angles(positions[None], inv_freq)
    k_all, v_all = cache.k, cache.v
    # Sequence parallelism: the step's tokens split over `sequence` through every matmul.
    rows = lambda x: sharding.constrain(x, ("rows", "embed"))  # noqa: E731
    h = rows(embed(params, batch.tokens[None])[0])
    for i, lp in enumerate(params.layers):
        with jax.named_scope(f"layer_{i}"):
            with jax.named_scope("attention"):
                x = rms_norm(h, lp.attn_norm, cfg.rms_norm_eps)
                q = apply_rope(linear(x, lp.wq, lp.bq).reshape(1, T, N, H), cos, sin)[0]
                k = apply_rope(linear(x, lp.wk, lp.bk).reshape(1, T, K, H), cos, sin)[0]
                v = linear(x, lp.wv, lp.bv).reshape(T, K, H)
                q = sharding.constrain(q, (None, "q_heads", None))
                k_all = cache.write_layer(k_all, i, k, slots)
                v_all = cache.write_layer(v_all, i, v, slots)
                o = ragged_attention(q, k_all, v_all, i, cache.block_tables, meta,
                                     page_size=Z, sliding_window=cfg.sliding_window,
                                     implementation=attn_impl, wraps=cache.wraps)
                h = rows(h + linear(o.reshape(T, N * H), lp.wo))
            with jax.named_scope("mlp"):
                x = rms_norm(h, lp.mlp_norm, cfg.rms_norm_eps)
                h = rows(h + swiglu_mlp(x, lp.w_gate, lp.w_up, lp.w_down))
    cache = cache.advance(k_all, v_all, batch.num_queries)
    return rms_norm(h, params.final_norm, cfg.rms_norm_eps), cache


@functools.partial(jax.jit, static_argnums=(1,), static_argnames=("kv_cache_dtype",))
def sequence_logits(params: LlamaParams, cfg: ModelConfig, tokens: jax.Array,
                    kv_cache_dtype: str | None = None) -> jax.Array:
    """Logits [B, T, V] (float32) of full sequences tokens [B, T] from an empty cache: the
    scoring forward (evaluation, perplexity, tests). kv_cache_dtype "int8" / "fp8": every
    layer attends to its keys and values as a quantized cache stores them."""
    B, T = tokens.shape
    dtype = activation_dtype(params) if kv_cache_dtype is None else KV_DTYPES[kv_cache_dtype]
    cache = PagedKVCache.ring(cfg.num_layers, B, T, cfg.num_kv_heads, cfg.head_dim, dtype)
    h, _ = forward(params, cfg, tokens, cache, jnp.full((B,), T, jnp.int32), differentiable=True)
    return lm_head(params, h)
