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
from typing import NamedTuple, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import sharding
from jaxinfer.attention import attention, ragged_paged_attention
from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import KV_DTYPES, PagedKVCache, RingKVCache, WritePlan
from jaxinfer.quant import QuantizedWeight, matmul, take_rows

KVCache = RingKVCache | PagedKVCache
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


class Query(NamedTuple):
    """One group of query rows for forward_groups.

    tokens [G, T] int32, of which the first num_new[g] of row g are real (the rest padding);
    rows [G] int32: the cache row each query row reads and appends to (None: query row b is
    cache row b, all rows). A rows entry equal to the cache's row count marks a padding row
    (num_new 0): it writes nothing and its output is meaningless.
    """

    tokens: jax.Array
    num_new: jax.Array
    rows: Optional[jax.Array] = None


def forward(params: LlamaParams, cfg: ModelConfig, tokens: jax.Array, cache: KVCache,
            num_new: jax.Array, *, kv_view: int | None = None,
            attn_impl: str = "reference",
            decode_pages: int | None = None) -> tuple[jax.Array, KVCache]:
    """Runs T new tokens per row through the model and appends their K/V to the cache.

    tokens [B, T] int32, of which the first num_new[b] of row b are real (the rest padding);
    they sit at absolute positions cache.lengths[b] + t. kv_view (static) limits attention to
    the first kv_view cache slots (positions, for a paged cache: a multiple of its page size);
    the caller guarantees that every slot a row uses, the new tokens' included, lies below it
    (or passes None / the capacity). The cache is a RingKVCache or a PagedKVCache. Returns the
    final-normed hidden states [B, T, D] and the cache with lengths advanced by num_new.
    decode_pages: see forward_groups.
    """
    (h,), cache = forward_groups(params, cfg, [Query(tokens, num_new)], cache, kv_view=kv_view,
                                 attn_impl=attn_impl, decode_pages=decode_pages)
    return h, cache


def _as_plan(parts: list[jax.Array], plan: WritePlan) -> jax.Array:
    """New K or V of the groups a plan writes ([G, T, K, H] each), shaped like the plan."""
    K, H = parts[0].shape[-2:]
    flat = jnp.concatenate([p.reshape(-1, K, H) for p in parts]) if len(parts) > 1 else parts[0]
    return flat.reshape(plan.rows.shape + (K, H))


def forward_groups(params: LlamaParams, cfg: ModelConfig, queries: Sequence[Query],
                   cache: KVCache, *, kv_view: int | None = None,
                   attn_impl: str = "reference",
                   decode_pages: int | None = None) -> tuple[list[jax.Array], KVCache]:
    """forward() for several groups of query rows with different token counts in one pass:
    e.g. one decode token for every running row and a prefill chunk for a few others.

    The groups' tokens go through every matmul together (one [sum G*T, D] activation), so a
    decode batch rides along with a prefill chunk for the price of the weights' one read;
    attention runs per group. No cache row may receive tokens from two groups. Returns the
    final-normed hidden states of each group ([G, T, D]) and the updated cache.

    decode_pages (static; a paged cache under the reference implementation): single-token
    groups attend through a flat list of this many pages, each row over its own pages only
    (ragged_paged_attention) instead of over kv_view slots. The caller guarantees that the
    pages of those rows, the new tokens' included, number at most decode_pages.
    """
    N, K, H, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_model
    B = cache.lengths.shape[0]
    S = cache.capacity if kv_view is None else min(kv_view, cache.capacity)
    shapes = [q.tokens.shape for q in queries]
    sizes = [G * T for G, T in shapes]
    plans = [cache.plan_write(q.num_new, T, q.rows) for q, (_, T) in zip(queries, shapes)]
    inv_freq = rope_inv_freq(H, cfg.rope_theta, cfg.rope_scaling, cfg.rope_freq_factors)
    angles = [rope_angles(p.positions, inv_freq) for p in plans]
    # Write each layer's new K/V before attending (one in-place update of the donated cache),
    # unless a sliding-window ring could overwrite keys that earlier tokens of this chunk still
    # need: then the chunk attends to the old cache and to itself, and is written afterwards.
    wraps = isinstance(cache, RingKVCache) and cfg.sliding_window is not None
    first = [T == 1 or not wraps for _, T in shapes]
    early = WritePlan.merge([p for p, f in zip(plans, first) if f])
    late = WritePlan.merge([p for p, f in zip(plans, first) if not f])
    kpos = cache.write_positions(early) if early is not None else cache.positions
    # Unless a ring wraps (the engine sizes full-attention rings to max_seq_len), row slot j
    # holds position j and the kernels can read the cache directly.
    lengths = [None if wraps else (p.positions[:, 0], p.positions[:, 0] + q.num_new)
               for p, q in zip(plans, queries)]  # a plan's first position is the row's length
    ragged = [decode_pages is not None and isinstance(cache, PagedKVCache) and T == 1
              and first[g] and attn_impl == "reference" for g, (_, T) in enumerate(shapes)]
    page_lists = [cache.page_list(jnp.where(q.num_new > 0, p.positions[:, 0] + q.num_new, 0),
                                  decode_pages, q.rows) if r else None
                  for q, p, r in zip(queries, plans, ragged)]
    k_all, v_all = cache.k, cache.v
    k_late, v_late = [], []

    def split(x, last_dims):
        parts = jnp.split(x, np.cumsum(sizes)[:-1], axis=0) if len(sizes) > 1 else [x]
        return [p.reshape(shape + last_dims) for p, shape in zip(parts, shapes)]

    # Sequence parallelism: the step's tokens split over `sequence` through every matmul;
    # attention gathers each chunk's queries (T x N x H: small) and leaves the keys where the
    # cache shards hold them, combining partial softmax statistics across shards (see
    # docs/scaling.md for why this beats moving K/V, by ring or all-gather, for chunks).
    rows = lambda x: sharding.constrain(x, ("rows", "embed"))
    h = rows(jnp.concatenate([embed(params, q.tokens).reshape(-1, D) for q in queries]))
    for i, lp in enumerate(params.layers):
        with jax.named_scope(f"layer_{i}"):
            with jax.named_scope("attention"):
                x = rms_norm(h, lp.attn_norm, cfg.rms_norm_eps)
                qs = split(linear(x, lp.wq, lp.bq), (N, H))
                ks = split(linear(x, lp.wk, lp.bk), (K, H))
                vs = split(linear(x, lp.wv, lp.bv), (K, H))
                qs = [sharding.constrain(apply_rope(q, *a), ("batch", None, "q_heads", None))
                      for q, a in zip(qs, angles)]
                ks = [apply_rope(k, *a) for k, a in zip(ks, angles)]
                if early is not None:
                    k_all = cache.write_layer(
                        k_all, i, _as_plan([k for k, f in zip(ks, first) if f], early), early)
                    v_all = cache.write_layer(
                        v_all, i, _as_plan([v for v, f in zip(vs, first) if f], early), early)
                outs = []
                for g, query in enumerate(queries):
                    if ragged[g]:
                        page_rows, pages, starts = page_lists[g]
                        o = ragged_paged_attention(
                            qs[g][:, 0], cache.gather_pages(k_all, i, pages),
                            cache.gather_pages(v_all, i, pages), page_rows, starts,
                            plans[g].positions[:, 0] + 1, sliding_window=cfg.sliding_window)
                        outs.append(o.reshape(-1, N * H))
                        continue
                    segments = [cache.layer_keys(k_all, v_all, i, S, kpos, query.rows)]
                    pages = None
                    if first[g]:
                        if attn_impl != "reference" and lengths[g] is not None:
                            pages = cache.kernel_pages(k_all, v_all, i, S, query.rows)
                    else:
                        segments.append((ks[g], vs[g], plans[g].key_positions))
                        k_late.append(ks[g])
                        v_late.append(vs[g])
                    o = attention(qs[g], plans[g].positions, segments,
                                  sliding_window=cfg.sliding_window, implementation=attn_impl,
                                  lengths=lengths[g] if first[g] else None, pages=pages)
                    outs.append(o.reshape(-1, N * H))
                h = rows(h + linear(jnp.concatenate(outs) if len(outs) > 1 else outs[0], lp.wo))
            with jax.named_scope("mlp"):
                x = rms_norm(h, lp.mlp_norm, cfg.rms_norm_eps)
                h = rows(h + swiglu_mlp(x, lp.w_gate, lp.w_up, lp.w_down))
    if late is not None:
        per_layer = len(k_late) // cfg.num_layers
        for i in range(cfg.num_layers):
            layer = slice(i * per_layer, (i + 1) * per_layer)
            k_all = cache.write_layer(k_all, i, _as_plan(k_late[layer], late), late)
            v_all = cache.write_layer(v_all, i, _as_plan(v_late[layer], late), late)
        kpos = cache.write_positions(late, kpos)
    written = WritePlan.merge(plans).tokens_per_row(B)
    cache = cache.advance(k_all, v_all, kpos, written)
    h = rms_norm(h, params.final_norm, cfg.rms_norm_eps)
    return split(h, (D,)), cache


@functools.partial(jax.jit, static_argnums=(1,), static_argnames=("kv_cache_dtype",))
def sequence_logits(params: LlamaParams, cfg: ModelConfig, tokens: jax.Array,
                    kv_cache_dtype: str | None = None) -> jax.Array:
    """Logits [B, T, V] (float32) of full sequences tokens [B, T] from an empty cache: the
    scoring forward (evaluation, perplexity, tests). kv_cache_dtype "int8" / "fp8": every
    layer attends to its keys and values as a quantized cache stores them."""
    B, T = tokens.shape
    dtype = activation_dtype(params) if kv_cache_dtype is None else KV_DTYPES[kv_cache_dtype]
    cache = RingKVCache.create(cfg.num_layers, B, T, cfg.num_kv_heads, cfg.head_dim, dtype)
    h, _ = forward(params, cfg, tokens, cache, jnp.full((B,), T, jnp.int32))
    return lm_head(params, h)
