"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) as pure functions.

Shape legend: B batch, T query tokens, S cache slots, L layers, N query heads, K kv heads,
H head dim, D model dim, F ffn dim, V vocab.

`forward(params, cfg, tokens, cache, num_new)` -> (hidden [B, T, D], new cache). Params are a
registered pytree with the layers stacked on a leading L axis and run by `lax.scan`, so the
compiled program has one copy of the layer whatever the depth.
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.attention import attention
from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import RingKVCache
from jaxinfer.layers import apply_rope, linear, rms_norm, rope_angles, rope_inv_freq, swiglu_mlp


@flax.struct.dataclass
class LayerParams:
    attn_norm: jax.Array            # [L, D]
    wq: jax.Array                   # [L, D, N*H]
    wk: jax.Array                   # [L, D, K*H]
    wv: jax.Array                   # [L, D, K*H]
    wo: jax.Array                   # [L, N*H, D]
    mlp_norm: jax.Array             # [L, D]
    w_gate: jax.Array               # [L, D, F]
    w_up: jax.Array                 # [L, D, F]
    w_down: jax.Array               # [L, F, D]
    bq: Optional[jax.Array] = None  # [L, N*H] (Qwen2)
    bk: Optional[jax.Array] = None  # [L, K*H]
    bv: Optional[jax.Array] = None  # [L, K*H]


@flax.struct.dataclass
class LlamaParams:
    embed: jax.Array                    # [V, D]
    layers: LayerParams
    final_norm: jax.Array               # [D]
    lm_head: Optional[jax.Array] = None  # [D, V]; None when tied to embed


def param_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Every parameter once: name -> (shape, logical axes). Initialisers and shardings derive
    from this table."""
    L, D, F, V = cfg.num_layers, cfg.d_model, cfg.ffn_dim, cfg.vocab_size
    q, kv = cfg.q_dim, cfg.kv_dim
    specs = {
        "embed": ((V, D), ("vocab", "embed")),
        "final_norm": ((D,), ("embed",)),
        "layers.attn_norm": ((L, D), ("layers", "embed")),
        "layers.wq": ((L, D, q), ("layers", "embed", "q_heads")),
        "layers.wk": ((L, D, kv), ("layers", "embed", "kv_heads")),
        "layers.wv": ((L, D, kv), ("layers", "embed", "kv_heads")),
        "layers.wo": ((L, q, D), ("layers", "q_heads", "embed")),
        "layers.mlp_norm": ((L, D), ("layers", "embed")),
        "layers.w_gate": ((L, D, F), ("layers", "embed", "ffn")),
        "layers.w_up": ((L, D, F), ("layers", "embed", "ffn")),
        "layers.w_down": ((L, F, D), ("layers", "ffn", "embed")),
    }
    if cfg.attention_bias:
        specs["layers.bq"] = ((L, q), ("layers", "q_heads"))
        specs["layers.bk"] = ((L, kv), ("layers", "kv_heads"))
        specs["layers.bv"] = ((L, kv), ("layers", "kv_heads"))
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ((D, V), ("embed", "vocab"))
    return specs


def _assemble(cfg: ModelConfig, arrays: dict[str, jax.Array]) -> LlamaParams:
    layer_fields = {k.split(".", 1)[1]: v for k, v in arrays.items() if k.startswith("layers.")}
    return LlamaParams(embed=arrays["embed"], layers=LayerParams(**layer_fields),
                       final_norm=arrays["final_norm"], lm_head=arrays.get("lm_head"))


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> LlamaParams:
    """Random weights of the right shapes (norms at 1), for benchmarks and tests."""
    arrays = {}
    for i, (name, (shape, _)) in enumerate(sorted(param_specs(cfg).items())):
        if name.endswith("norm"):
            arrays[name] = jnp.ones(shape, dtype)
        else:
            fan_in = shape[-2] if len(shape) >= 2 and name != "embed" else shape[-1]
            std = 1.0 if name == "embed" else fan_in ** -0.5
            arrays[name] = (std * jax.random.normal(jax.random.fold_in(key, i), shape)).astype(dtype)
    return _assemble(cfg, arrays)


def params_from_weights(cfg: ModelConfig, weights: dict[str, np.ndarray],
                        dtype=jnp.float32) -> LlamaParams:
    """Stacks per-layer weights ("layers.{i}.{name}", linear weights [in, out]) into LlamaParams."""
    specs = param_specs(cfg)
    arrays = {}
    for name, (shape, _) in specs.items():
        if name.startswith("layers."):
            field = name.split(".", 1)[1]
            arr = np.stack([weights[f"layers.{i}.{field}"] for i in range(cfg.num_layers)])
        else:
            arr = weights[name]
        if arr.shape != shape:
            raise ValueError(f"weight {name!r} has shape {arr.shape}; config implies {shape}")
        arrays[name] = jnp.asarray(arr, dtype=dtype)
    return _assemble(cfg, arrays)


def embed(params: LlamaParams, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] -> [B, T, D]."""
    return jnp.take(params.embed, tokens, axis=0)


def lm_head(params: LlamaParams, h: jax.Array) -> jax.Array:
    """h [..., D] (already normalised) -> logits [..., V] in float32."""
    if params.lm_head is None:
        return jnp.einsum("...D,VD->...V", h, params.embed, preferred_element_type=jnp.float32)
    return jnp.einsum("...D,DV->...V", h, params.lm_head, preferred_element_type=jnp.float32)


def forward(params: LlamaParams, cfg: ModelConfig, tokens: jax.Array, cache: RingKVCache,
            num_new: jax.Array, *, kv_view: int | None = None,
            attn_impl: str = "reference") -> tuple[jax.Array, RingKVCache]:
    """Runs T new tokens per row through the model and appends their K/V to the cache.

    tokens [B, T] int32, of which the first num_new[b] of row b are real (the rest padding);
    they sit at absolute positions cache.lengths[b] + t. kv_view (static) limits attention to
    the first kv_view cache slots (see RingKVCache.view). Returns the final-normed hidden states
    [B, T, D] and the cache with lengths advanced by num_new.
    """
    B, T = tokens.shape
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    positions = cache.lengths[:, None] + t                              # [B, T]
    new_kpos = jnp.where(t < num_new[:, None], positions, -1)          # padding keys: invisible
    cos, sin = rope_angles(positions, rope_inv_freq(H, cfg.rope_theta, cfg.rope_scaling))
    k_cache, v_cache, cache_kpos = cache.view(kv_view)

    def layer(h, xs):
        lp, k_c, v_c = xs                                               # k_c, v_c [B, S, K, H]
        with jax.named_scope("attention"):
            x = rms_norm(h, lp.attn_norm, cfg.rms_norm_eps)
            q = linear(x, lp.wq, lp.bq).reshape(B, T, N, H)
            k = linear(x, lp.wk, lp.bk).reshape(B, T, K, H)
            v = linear(x, lp.wv, lp.bv).reshape(B, T, K, H)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            o = attention(q, positions, [(k_c, v_c, cache_kpos), (k, v, new_kpos)],
                          sliding_window=cfg.sliding_window, implementation=attn_impl)
            h = h + linear(o.reshape(B, T, N * H), lp.wo)
        with jax.named_scope("mlp"):
            x = rms_norm(h, lp.mlp_norm, cfg.rms_norm_eps)
            h = h + swiglu_mlp(x, lp.w_gate, lp.w_up, lp.w_down)
        return h, (k, v)

    h = embed(params, tokens)
    h, (k_new, v_new) = jax.lax.scan(layer, h, (params.layers, k_cache, v_cache))
    cache = cache.write(k_new, v_new, num_new)
    return rms_norm(h, params.final_norm, cfg.rms_norm_eps), cache
