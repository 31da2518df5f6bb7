"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3) as pure functions.

Shape legend: T tokens of a step, R rows of a dense block, N query heads, K kv heads, H head dim,
D model dim, F ffn dim, V vocab.

One layer: x = rms_norm(h); q, k, v projections (biases: Qwen2; per-head RMSNorm of q and k:
Qwen3, cfg.qk_norm), half-rotation RoPE; h += wo(attention); h += down(silu(gate(x)) * up(x))
with x = rms_norm(h). models.moe shares the attention block. The module-level functions are
the family's methods, for callers that know they hold a Llama.
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax

from jaxinfer import sharding
from jaxinfer.config import ModelConfig
from jaxinfer.layers import apply_rope, gated_mlp, linear, rms_norm
from jaxinfer.models.base import DENSE_QUERY_TILE, Context, Family, ModelParams, attend, rows

LlamaParams = ModelParams


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
    q_norm: Optional[jax.Array] = None  # [H] (Qwen3)
    k_norm: Optional[jax.Array] = None  # [H]


def attention_specs(cfg: ModelConfig) -> dict:
    """The attention block's parameters (one layer), as in param_specs."""
    D, H = cfg.d_model, cfg.head_dim
    q, kv = cfg.q_dim, cfg.kv_dim
    specs = {
        "layers.attn_norm": ((D,), ("embed",)),
        "layers.wq": ((D, q), ("embed", "q_heads")),
        "layers.wk": ((D, kv), ("embed", "kv_heads")),
        "layers.wv": ((D, kv), ("embed", "kv_heads")),
        "layers.wo": ((q, D), ("q_heads", "embed")),
        "layers.mlp_norm": ((D,), ("embed",)),
    }
    if cfg.attention_bias:
        specs["layers.bq"] = ((q,), ("q_heads",))
        specs["layers.bk"] = ((kv,), ("kv_heads",))
        specs["layers.bv"] = ((kv,), ("kv_heads",))
    if cfg.qk_norm:
        specs["layers.q_norm"] = ((H,), ("head_dim",))
        specs["layers.k_norm"] = ((H,), ("head_dim",))
    return specs


def vocab_specs(cfg: ModelConfig) -> dict:
    D, V = cfg.d_model, cfg.vocab_size
    specs = {"embed": ((V, D), ("vocab", "embed")), "final_norm": ((D,), ("embed",))}
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ((D, V), ("embed", "vocab"))
    return specs


def attention_block(lp, cfg: ModelConfig, i: int, h: jax.Array, ctx: Context,
                    linear_inputs: Optional[dict] = None) -> tuple[jax.Array, Context]:
    """h + wo(attention(rms_norm(h))) for the step's tokens h [T, D]."""
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    T = h.shape[0]
    cos, sin = ctx.angles(cfg, i)
    with jax.named_scope("attention"):
        x = rms_norm(h, lp.attn_norm, cfg.rms_norm_eps, ctx.backend)
        q = linear(x, lp.wq, lp.bq, backend=ctx.backend).reshape(1, T, N, H)
        k = linear(x, lp.wk, lp.bk, backend=ctx.backend).reshape(1, T, K, H)
        v = linear(x, lp.wv, lp.bv, backend=ctx.backend).reshape(T, K, H)
        if lp.q_norm is not None:
            q = rms_norm(q, lp.q_norm, cfg.rms_norm_eps, ctx.backend)
            k = rms_norm(k, lp.k_norm, cfg.rms_norm_eps, ctx.backend)
        q = sharding.constrain(apply_rope(q, cos, sin)[0], (None, "q_heads", None))
        o, ctx = attend(ctx, cfg, i, q, apply_rope(k, cos, sin)[0], v)
        o = o.reshape(T, N * H)
        if linear_inputs is not None:
            linear_inputs.update(x_attn=x, attn_out=o)
        return rows(h + linear(o, lp.wo, backend=ctx.backend)), ctx


class Llama(Family):
    name = "llama"
    layer_class = LayerParams

    def param_specs(self, cfg: ModelConfig):
        """Every parameter once: name -> (shape, logical axes); "layers.*": each layer's."""
        D, F = cfg.d_model, cfg.ffn_dim
        return {**vocab_specs(cfg), **attention_specs(cfg),
                "layers.w_gate": ((D, F), ("embed", "ffn")),
                "layers.w_up": ((D, F), ("embed", "ffn")),
                "layers.w_down": ((F, D), ("ffn", "embed"))}

    def layer(self, lp, cfg, i, h, ctx, linear_inputs=None):
        h, ctx = attention_block(lp, cfg, i, h, ctx, linear_inputs)
        with jax.named_scope("mlp"):
            x = rms_norm(h, lp.mlp_norm, cfg.rms_norm_eps, ctx.backend)
            if linear_inputs is not None:
                linear_inputs.update(x_mlp=x)
            return rows(h + gated_mlp(x, lp.w_gate, lp.w_up, lp.w_down, "silu",
                                         backend=ctx.backend, linear_inputs=linear_inputs)), ctx

    def hf_config(self, hf, path):
        return {"qk_norm": self.name == "qwen3"}

    def hf_layer(self, read, cfg, i):
        return read_attention_hf(read, cfg, i) | read_mlp_hf(read, cfg, i)


class Qwen3(Llama):
    """Qwen3 (dense): Llama's layer with RMSNorm over each query and key head and no q/k/v
    biases."""
    name = "qwen3"

    def gguf_config(self, meta, get, path):
        return {"qk_norm": True}

    def gguf_layer(self, read, cfg, i):
        p, D, F, H = f"blk.{i}.", cfg.d_model, cfg.ffn_dim, cfg.head_dim
        return {**read_attention_gguf(read, cfg, i),
                "q_norm": read(p + "attn_q_norm.weight", (H,)),
                "k_norm": read(p + "attn_k_norm.weight", (H,)),
                "mlp_norm": read(p + "ffn_norm.weight", (D,)),
                "w_gate": read(p + "ffn_gate.weight", (F, D), True),
                "w_up": read(p + "ffn_up.weight", (F, D), True),
                "w_down": read(p + "ffn_down.weight", (D, F), True)}


def read_attention_hf(read, cfg: ModelConfig, i: int) -> dict:
    """The attention block's weights of HF layer i (read: see Family.hf_layer)."""
    p, D, H = f"model.layers.{i}.", cfg.d_model, cfg.head_dim
    q, kv = cfg.q_dim, cfg.kv_dim
    out = {"attn_norm": read(p + "input_layernorm.weight", (D,)),
           "mlp_norm": read(p + "post_attention_layernorm.weight", (D,)),
           "wq": read(p + "self_attn.q_proj.weight", (q, D), True),
           "wk": read(p + "self_attn.k_proj.weight", (kv, D), True),
           "wv": read(p + "self_attn.v_proj.weight", (kv, D), True),
           "wo": read(p + "self_attn.o_proj.weight", (D, q), True)}
    if cfg.attention_bias:
        out.update(bq=read(p + "self_attn.q_proj.bias", (q,)),
                   bk=read(p + "self_attn.k_proj.bias", (kv,)),
                   bv=read(p + "self_attn.v_proj.bias", (kv,)))
    if cfg.qk_norm:
        out.update(q_norm=read(p + "self_attn.q_norm.weight", (H,)),
                   k_norm=read(p + "self_attn.k_norm.weight", (H,)))
    return out


def read_mlp_hf(read, cfg: ModelConfig, i: int) -> dict:
    p, D, F = f"model.layers.{i}.mlp.", cfg.d_model, cfg.ffn_dim
    return {"w_gate": read(p + "gate_proj.weight", (F, D), True),
            "w_up": read(p + "up_proj.weight", (F, D), True),
            "w_down": read(p + "down_proj.weight", (D, F), True)}


def read_attention_gguf(read, cfg: ModelConfig, i: int) -> dict:
    """The attention projections and input norm of GGUF layer i (no permutation: only
    convert_hf_to_gguf's llama and mistral permute Q and K)."""
    p, D = f"blk.{i}.", cfg.d_model
    q, kv = cfg.q_dim, cfg.kv_dim
    return {"attn_norm": read(p + "attn_norm.weight", (D,)),
            "wq": read(p + "attn_q.weight", (q, D), True),
            "wk": read(p + "attn_k.weight", (kv, D), True),
            "wv": read(p + "attn_v.weight", (kv, D), True),
            "wo": read(p + "attn_output.weight", (D, q), True)}


LLAMA = Llama()
QWEN3 = Qwen3()

__all__ = ["DENSE_QUERY_TILE", "LLAMA", "LayerParams", "Llama", "LlamaParams", "QWEN3", "Qwen3",
           "attention_block", "attention_specs", "vocab_specs"]
