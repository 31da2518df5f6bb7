"""Gemma 3 (text): interleaved local (sliding-window) and global attention layers.

Shape legend: T tokens of a step, N query heads, K kv heads, H head dim, D model dim, F ffn dim,
V vocab.

Per layer, with norm(x, w) = rms_norm(x) * (1 + w) (Gemma's convention: the stored weights are
offsets from 1):
    x = norm(h, attn_norm); q, k, v = projections of x; q, k = norm over each head (q_norm,
    k_norm); RoPE with the layer's base; attention within the layer's window, scores scaled by
    query_pre_attn_scalar ** -0.5; h += norm(wo(attention), post_attn_norm)
    x = norm(h, mlp_norm); h += norm(down(gelu_tanh(gate(x)) * up(x)), post_mlp_norm)
The embedding is scaled by sqrt(D) (in the activations' dtype); the head is tied to it.

Layer i is global when (i + 1) % 6 == 0 unless the HF config lists layer_types. Local layers
have window `sliding_window` and RoPE base 10,000 (GGUF stores only the global base), global
ones none and the global base (cfg.layer_windows, cfg.layer_rope_thetas). GGUF stores each norm
weight as 1 + w; the loader subtracts the 1, so params hold w either way.
"""

from __future__ import annotations

import math
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import sharding
from jaxinfer.config import ModelConfig
from jaxinfer.layers import apply_rope, gated_mlp, linear
from jaxinfer.layers.norm import mean_square
from jaxinfer.models.base import Family, attend, rows
from jaxinfer.models.llama import read_attention_gguf, vocab_specs

LOCAL_ROPE_BASE = 10000.0
SLIDING_PATTERN = 6


@flax.struct.dataclass
class Gemma3LayerParams:
    attn_norm: jax.Array        # [D]
    wq: jax.Array               # [D, N*H]
    wk: jax.Array               # [D, K*H]
    wv: jax.Array               # [D, K*H]
    wo: jax.Array               # [N*H, D]
    q_norm: jax.Array           # [H]
    k_norm: jax.Array           # [H]
    post_attn_norm: jax.Array   # [D]
    mlp_norm: jax.Array         # [D]
    w_gate: jax.Array           # [D, F]
    w_up: jax.Array             # [D, F]
    w_down: jax.Array           # [F, D]
    post_mlp_norm: jax.Array    # [D]


def norm(x: jax.Array, w: jax.Array, eps: float, backend=None) -> jax.Array:
    """RMSNorm with Gemma's (1 + w) weights, in float32, back in x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(mean_square(xf, backend) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def layer_kinds(num_layers: int, window: int, global_base: float,
                types: Optional[list] = None) -> dict:
    """ModelConfig's per-layer windows and RoPE bases (HF layer_types, else the pattern)."""
    if types is None:
        types = ["full_attention" if (i + 1) % SLIDING_PATTERN == 0 else "sliding_attention"
                 for i in range(num_layers)]
    local = [t == "sliding_attention" for t in types]
    return {"layer_windows": tuple(window if loc else None for loc in local),
            "layer_rope_thetas": tuple(LOCAL_ROPE_BASE if loc else global_base
                                       for loc in local),
            "sliding_window": None}


class Gemma3(Family):
    name = "gemma3"
    layer_class = Gemma3LayerParams
    activation = "gelu_pytorch_tanh"

    def param_specs(self, cfg: ModelConfig):
        D, F, H = cfg.d_model, cfg.ffn_dim, cfg.head_dim
        q, kv = cfg.q_dim, cfg.kv_dim
        return {**vocab_specs(cfg),
                "layers.attn_norm": ((D,), ("embed",)),
                "layers.wq": ((D, q), ("embed", "q_heads")),
                "layers.wk": ((D, kv), ("embed", "kv_heads")),
                "layers.wv": ((D, kv), ("embed", "kv_heads")),
                "layers.wo": ((q, D), ("q_heads", "embed")),
                "layers.q_norm": ((H,), ("head_dim",)),
                "layers.k_norm": ((H,), ("head_dim",)),
                "layers.post_attn_norm": ((D,), ("embed",)),
                "layers.mlp_norm": ((D,), ("embed",)),
                "layers.w_gate": ((D, F), ("embed", "ffn")),
                "layers.w_up": ((D, F), ("embed", "ffn")),
                "layers.w_down": ((F, D), ("ffn", "embed")),
                "layers.post_mlp_norm": ((D,), ("embed",))}

    def init_value(self, name, shape, key, dtype):
        if name.endswith("norm"):  # (1 + w) = 1
            return jnp.zeros(shape, dtype)
        return super().init_value(name, shape, key, dtype)

    def embed(self, params, cfg, tokens):
        h = super().embed(params, cfg, tokens)
        return h * jnp.asarray(math.sqrt(cfg.d_model), h.dtype)

    def final_norm(self, params, cfg, h, backend=None):
        return norm(h, params.final_norm, cfg.rms_norm_eps, backend)

    def layer(self, lp, cfg, i, h, ctx, linear_inputs=None):
        N, K, H, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        T = h.shape[0]
        cos, sin = ctx.angles(cfg, i)
        bk = ctx.backend
        with jax.named_scope("attention"):
            x = norm(h, lp.attn_norm, eps, bk)
            q = norm(linear(x, lp.wq, backend=bk).reshape(1, T, N, H), lp.q_norm, eps, bk)
            k = norm(linear(x, lp.wk, backend=bk).reshape(1, T, K, H), lp.k_norm, eps, bk)
            v = linear(x, lp.wv, backend=ctx.backend).reshape(T, K, H)
            q = sharding.constrain(apply_rope(q, cos, sin)[0], (None, "q_heads", None))
            o, ctx = attend(ctx, cfg, i, q, apply_rope(k, cos, sin)[0], v)
            o = o.reshape(T, N * H)
            h = rows(h + norm(linear(o, lp.wo, backend=bk), lp.post_attn_norm, eps, bk))
        with jax.named_scope("mlp"):
            x2 = norm(h, lp.mlp_norm, eps, ctx.backend)
            y = gated_mlp(x2, lp.w_gate, lp.w_up, lp.w_down, "gelu_tanh",
                          backend=ctx.backend, linear_inputs=linear_inputs)
            h = rows(h + norm(y, lp.post_mlp_norm, eps, ctx.backend))
        if linear_inputs is not None:
            linear_inputs.update(x_attn=x, attn_out=o, x_mlp=x2)
        return h, ctx

    # -- files --------------------------------------------------------------------------------

    def hf_config(self, hf, path):
        from jaxinfer.loading.gguf_file import ModelFileError

        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if hf.get(key):
                raise ModelFileError(f"{path!r}: {key} is not supported")
        params = hf.get("rope_parameters") or {}
        full = params.get("full_attention", params)
        local = params.get("sliding_attention", {})
        for p in (full, local):
            if p.get("rope_type", "default") != "default":
                raise ModelFileError(f"{path!r}: RoPE type {p['rope_type']!r} is not supported")
        global_base = float(full.get("rope_theta", hf.get("rope_theta", 1e6)))
        out = layer_kinds(int(hf["num_hidden_layers"]), int(hf["sliding_window"]), global_base,
                          hf.get("layer_types"))
        local_base = float(local.get("rope_theta", hf.get("rope_local_base_freq",
                                                              LOCAL_ROPE_BASE)))
        out["layer_rope_thetas"] = tuple(local_base if w else t for w, t in
                                         zip(out["layer_windows"], out["layer_rope_thetas"]))
        out.update(qk_norm=True, tie_word_embeddings=True, rope_theta=global_base,
                   query_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5)
        return out

    def gguf_config(self, meta, get, path):
        out = layer_kinds(int(get("block_count")), int(get("attention.sliding_window", 512)),
                          float(get("rope.freq_base", 1e6)))
        # llama.cpp scales the queries by head_dim ** -0.5 for Gemma 3 below 27B, as HF's
        # query_pre_attn_scalar (= head dim for those sizes) does.
        out.update(qk_norm=True, query_scale=float(get("attention.key_length")) ** -0.5)
        return out

    def hf_layer(self, read, cfg, i):
        p, D, F, H = f"model.layers.{i}.", cfg.d_model, cfg.ffn_dim, cfg.head_dim
        q, kv = cfg.q_dim, cfg.kv_dim
        return {"attn_norm": read(p + "input_layernorm.weight", (D,)),
                "wq": read(p + "self_attn.q_proj.weight", (q, D), True),
                "wk": read(p + "self_attn.k_proj.weight", (kv, D), True),
                "wv": read(p + "self_attn.v_proj.weight", (kv, D), True),
                "wo": read(p + "self_attn.o_proj.weight", (D, q), True),
                "q_norm": read(p + "self_attn.q_norm.weight", (H,)),
                "k_norm": read(p + "self_attn.k_norm.weight", (H,)),
                "post_attn_norm": read(p + "post_attention_layernorm.weight", (D,)),
                "mlp_norm": read(p + "pre_feedforward_layernorm.weight", (D,)),
                "w_gate": read(p + "mlp.gate_proj.weight", (F, D), True),
                "w_up": read(p + "mlp.up_proj.weight", (F, D), True),
                "w_down": read(p + "mlp.down_proj.weight", (D, F), True),
                "post_mlp_norm": read(p + "post_feedforward_layernorm.weight", (D,))}

    def gguf_layer(self, read, cfg, i):
        p, D, F, H = f"blk.{i}.", cfg.d_model, cfg.ffn_dim, cfg.head_dim

        def offset(name, shape):  # stored as 1 + w
            return np.asarray(read(p + name, shape), np.float32) - np.float32(1.0)
        return {**read_attention_gguf(read, cfg, i),
                "attn_norm": offset("attn_norm.weight", (D,)),
                "q_norm": offset("attn_q_norm.weight", (H,)),
                "k_norm": offset("attn_k_norm.weight", (H,)),
                "post_attn_norm": offset("post_attention_norm.weight", (D,)),
                "mlp_norm": offset("ffn_norm.weight", (D,)),
                "w_gate": read(p + "ffn_gate.weight", (F, D), True),
                "w_up": read(p + "ffn_up.weight", (F, D), True),
                "w_down": read(p + "ffn_down.weight", (D, F), True),
                "post_mlp_norm": offset("post_ffw_norm.weight", (D,))}

    def gguf_final_norm(self, w: np.ndarray) -> np.ndarray:
        return np.asarray(w, np.float32) - np.float32(1.0)


GEMMA3 = Gemma3()
