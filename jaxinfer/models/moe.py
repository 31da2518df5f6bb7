"""Mixture-of-experts decoders: Mixtral and Qwen3-MoE.

Shape legend: T tokens of a step, D model dim, F each expert's ffn dim, E experts (El on one
device), k experts per token, M = T * k token-expert assignments, m rows of a tile.

A layer is Llama's attention block (QK-norm for Qwen3-MoE) and, in place of the MLP, a router
(`route`: Mixtral's "topk_softmax", Qwen3-MoE's "softmax_topk") and E SwiGLU experts, run as
grouped matmuls over the assignments sorted by expert (`expert_ffn`): each expert multiplies
only its rows. The grouped matmul is per backend (`tuning.grouped_matmul`): "ragged_dot", or
"tiles" on XLA:CPU, whose ragged_dot multiplies every row by every expert: rounds of one batched
product over all experts (`_rounds_ffn`, few experts) or a loop over the occupied tiles of one
expert's rows (`_tiled_ffn`, many). docs/models.md has the measurements.

Expert parallelism: the "experts" axis splits over data x tensor. On a mesh each device routes
every token, runs its own El experts under shard_map, and a psum of [T, D] adds the partial
outputs, the only exchange since the tokens are on every device already (docs/models.md
compares it with all-to-all).
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer import sharding
from jaxinfer.config import ModelConfig
from jaxinfer.layers import rms_norm
from jaxinfer.models.base import Family, rows, stack_experts
from jaxinfer.models.llama import (attention_block, attention_specs, read_attention_gguf,
                                   read_attention_hf, vocab_specs)


@flax.struct.dataclass
class MoELayerParams:
    attn_norm: jax.Array            # [D]
    wq: jax.Array                   # [D, N*H]
    wk: jax.Array                   # [D, K*H]
    wv: jax.Array                   # [D, K*H]
    wo: jax.Array                   # [N*H, D]
    mlp_norm: jax.Array             # [D]
    router: jax.Array               # [D, E]
    w_gate: jax.Array               # [E, D, F]
    w_up: jax.Array                 # [E, D, F]
    w_down: jax.Array               # [E, F, D]
    bq: Optional[jax.Array] = None
    bk: Optional[jax.Array] = None
    bv: Optional[jax.Array] = None
    q_norm: Optional[jax.Array] = None  # [H] (Qwen3-MoE)
    k_norm: Optional[jax.Array] = None


def route(logits: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] (float32) -> (weights [T, k] float32, experts [T, k] int32)."""
    k = cfg.experts_per_token
    if cfg.router == "topk_softmax":
        top, experts = jax.lax.top_k(logits, k)
        return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)
    if cfg.router == "softmax_topk":
        weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
        if cfg.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, experts.astype(jnp.int32)
    raise ValueError(f"unknown router {cfg.router!r}")


def _ragged_ffn(xs, sizes, w_gate, w_up, w_down, rows=None, dot=None):
    """SwiGLU of the sorted rows xs [M, D] by lax.ragged_dot (rows past sum(sizes): 0); rows
    and dot are _cpu_ffn's, unused here."""
    def rd(x, w):
        if jnp.finfo(x.dtype).bits > jnp.finfo(w.dtype).bits:
            x = x.astype(w.dtype)
        return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
    hidden = jax.nn.silu(rd(xs, w_gate)) * rd(xs, w_up)
    return rd(hidden.astype(xs.dtype), w_down)


def tile_rows(num_rows: int, num_experts: int) -> int:
    """Rows per tile of the CPU grouped matmul: an expert's mean share as a power of two in
    [4, 64]."""
    share = -(-num_rows // num_experts)
    return int(min(64, max(4, 1 << (share - 1).bit_length())))


def _tiled_ffn(xs, sizes, w_gate, w_up, w_down, rows=None, dot=None):
    """SwiGLU of the sorted rows xs [M, D] (group e: sizes[e] rows), one tile of m rows of one
    expert per loop step over the occupied tiles, m sized for `rows` rows (default M)."""
    M, D = xs.shape
    E = sizes.shape[0]
    m = tile_rows(M if rows is None else rows, E)
    tiles = (sizes + m - 1) // m                                          # [E]
    ends = jnp.cumsum(tiles)
    starts = jnp.cumsum(sizes) - sizes                                    # [E]
    bound = -(-M // m) + E                                                # static tile bound
    t = jnp.arange(bound, dtype=jnp.int32)
    expert = jnp.minimum(jnp.searchsorted(ends, t, side="right"), E - 1).astype(jnp.int32)
    first = starts[expert] + (t - (ends - tiles)[expert]) * m             # [bound]
    last = starts[expert] + sizes[expert]
    offsets = jnp.arange(m, dtype=jnp.int32)

    def body(i, out):
        e = expert[i]
        r = first[i] + offsets                                            # [m]
        valid = r < last[i]
        x = jnp.where(valid[:, None], xs[jnp.minimum(r, M - 1)], 0)
        hidden = jax.nn.silu(dot(x, w_gate[e], "mD,DF->mF")) * dot(x, w_up[e], "mD,DF->mF")
        y = dot(hidden.astype(xs.dtype), w_down[e], "mF,FD->mD")
        return out.at[jnp.where(valid, r, M)].set(y, mode="drop")
    return jax.lax.fori_loop(0, ends[-1], body, jnp.zeros((M, D), jnp.float32))


def _rounds_ffn(xs, sizes, w_gate, w_up, w_down, rows=None, dot=None):
    """SwiGLU of the sorted rows xs [M, D] in rounds, each one batched product over all experts
    of m rows of every group, m twice the mean share of `rows` (a balanced step: one round)."""
    M, D = xs.shape
    E = sizes.shape[0]
    m = 2 * tile_rows(M if rows is None else rows, E)
    starts = jnp.cumsum(sizes) - sizes                                    # [E]
    offsets = jnp.arange(m, dtype=jnp.int32)

    def body(r, out):
        within = r * m + offsets                                          # [m]
        rows_ = starts[:, None] + within[None]                            # [E, m]
        valid = within[None] < sizes[:, None]
        x = jnp.where(valid[..., None], xs[jnp.minimum(rows_, M - 1)], 0)  # [E, m, D]
        hidden = (jax.nn.silu(dot(x, w_gate, "EmD,EDF->EmF"))
                  * dot(x, w_up, "EmD,EDF->EmF"))
        y = dot(hidden.astype(xs.dtype), w_down, "EmF,EFD->EmD")
        return out.at[jnp.where(valid, rows_, M).reshape(-1)].set(y.reshape(-1, D),
                                                                   mode="drop")
    return jax.lax.fori_loop(0, (jnp.max(sizes) + m - 1) // m, body,
                             jnp.zeros((M, D), jnp.float32))


def _cpu_ffn(xs, sizes, w_gate, w_up, w_down, rows=None, dot=None):
    """XLA:CPU's grouped matmul: _rounds_ffn where its E * m rows are at most 4 * rows (few
    experts), else _tiled_ffn. rows: this device's share of the M rows (default M); dot(x, w,
    spec): the backend's product."""
    M, E = xs.shape[0], sizes.shape[0]
    rows = M if rows is None else max(1, rows)
    rounds = E * 2 * tile_rows(rows, E) <= 4 * rows
    return (_rounds_ffn if rounds else _tiled_ffn)(xs, sizes, w_gate, w_up, w_down, rows, dot)


def _local_experts(x, weights, experts, w_gate, w_up, w_down, *, axes: tuple, k: int,
                   num_experts: int, backend):
    """This device's El experts' contribution to every token: x [T, D], weights and experts
    [T, k] -> [T, D] in x's dtype, psummed over the expert axes. Tiles are sized for the
    device's share of the assignments, T k El / num_experts (docs/models.md)."""
    T, D = x.shape
    El = w_gate.shape[0]
    e0 = jax.lax.axis_index(axes) * El if axes else 0
    local = experts - e0
    mine = (local >= 0) & (local < El)
    key = jnp.where(mine, local, El).reshape(-1)                          # [M]
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros((El + 1,), jnp.int32).at[key].add(1)[:El]
    token = order // k
    xs = x[token]                                                         # [M, D]
    grouped = _cpu_ffn if backend.tuning.grouped_matmul == "tiles" else _ragged_ffn
    ys = grouped(xs, sizes, w_gate, w_up, w_down, rows=-(-xs.shape[0] * El // num_experts),
                 dot=backend.dot)
    w = jnp.where(mine, weights, 0.0).reshape(-1)[order]
    out = jnp.zeros((T, D), jnp.float32).at[token].add(ys * w[:, None]).astype(x.dtype)
    # In the activations' dtype, as the partitioner's all-reduces of a tensor-parallel MLP.
    return jax.lax.psum(out, axes) if axes else out


def expert_ffn(x: jax.Array, lp: MoELayerParams, cfg: ModelConfig, backend) -> jax.Array:
    """The routed experts of one layer for the step's tokens x [T, D] -> [T, D]."""
    logits = backend.dot(x, lp.router, "TD,DE->TE")                       # [T, E] float32
    weights, experts = route(logits, cfg)
    k = cfg.experts_per_token
    mesh_shape = sharding.context_mesh_shape()
    split = None
    if mesh_shape is not None:
        split = sharding.spec_for(lp.w_gate.shape, ("experts", "embed", "ffn"), mesh_shape)[0]
    if not split:  # one device, or experts replicated (their ffn axis may split over tensor)
        return _local_experts(x, weights, experts, lp.w_gate, lp.w_up, lp.w_down, axes=(), k=k,
                              num_experts=cfg.num_experts, backend=backend)
    axes = (split,) if isinstance(split, str) else tuple(split)
    x_spec = sharding.spec_for(x.shape, ("rows", "embed"), mesh_shape)
    t_spec = P(x_spec[0], None)
    w_spec = P(split, None, None)
    fn = jax.shard_map(lambda *a: _local_experts(*a, axes=axes, k=k,
                                                 num_experts=cfg.num_experts, backend=backend),
                       in_specs=(x_spec, t_spec, t_spec, w_spec, w_spec, w_spec),
                       out_specs=x_spec, check_vma=False)
    return fn(x, weights, experts, lp.w_gate, lp.w_up, lp.w_down)


class MoE(Family):
    layer_class = MoELayerParams

    def __init__(self, name: str, router: str):
        self.name, self.router = name, router

    def param_specs(self, cfg: ModelConfig):
        D, F, E = cfg.d_model, cfg.ffn_dim, cfg.num_experts
        return {**vocab_specs(cfg), **attention_specs(cfg),
                "layers.router": ((D, E), ("embed", None)),
                "layers.w_gate": ((E, D, F), ("experts", "embed", "ffn")),
                "layers.w_up": ((E, D, F), ("experts", "embed", "ffn")),
                "layers.w_down": ((E, F, D), ("experts", "ffn", "embed"))}

    def params_from_weights(self, cfg, weights, dtype=jnp.float32, place=None):
        from jaxinfer.quant import QuantizedWeight

        for name, w in weights.items():
            if name.split(".")[-1] in ("w_gate", "w_up", "w_down", "router") \
                    and isinstance(w, QuantizedWeight):
                raise ValueError(f"{name}: quantized experts are not supported yet; load "
                                 "this model without quantization")
        return super().params_from_weights(cfg, weights, dtype, place)

    def layer(self, lp, cfg, i, h, ctx, linear_inputs=None):
        h, ctx = attention_block(lp, cfg, i, h, ctx, linear_inputs)
        with jax.named_scope("moe"):
            x = rms_norm(h, lp.mlp_norm, cfg.rms_norm_eps, ctx.backend)
            if linear_inputs is not None:
                linear_inputs.update(x_mlp=x)
            return rows(h + expert_ffn(x, lp, cfg, ctx.backend)), ctx

    # -- files --------------------------------------------------------------------------------

    def hf_config(self, hf, path):
        from jaxinfer.loading.gguf_file import ModelFileError

        # Qwen3-MoE's own configs say num_experts, transformers 5 writes num_local_experts.
        num = hf.get("num_local_experts") or hf.get("num_experts")
        k, ffn, norm = hf.get("num_experts_per_tok"), None, True
        if self.name != "mixtral":
            ffn, norm = hf.get("moe_intermediate_size"), bool(hf.get("norm_topk_prob", True))
            if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1:
                raise ModelFileError(f"{path!r}: dense layers among the sparse ones "
                                     "(mlp_only_layers, decoder_sparse_step) are not supported")
        if not num or not k:
            raise ModelFileError(f"{path!r}: the config gives no expert count or top-k")
        out = {"num_experts": int(num), "experts_per_token": int(k), "router": self.router,
               "norm_topk_prob": norm, "qk_norm": self.name != "mixtral"}
        if ffn:
            out["ffn_dim"] = int(ffn)
        return out

    def gguf_config(self, meta, get, path):
        out = {"num_experts": int(get("expert_count")),
               "experts_per_token": int(get("expert_used_count")), "router": self.router,
               "norm_topk_prob": True, "qk_norm": self.name != "mixtral"}
        ffn = get("expert_feed_forward_length", 0, required=False)
        if ffn:
            out["ffn_dim"] = int(ffn)
        return out

    def hf_layer(self, read, cfg, i):
        out = read_attention_hf(read, cfg, i)
        E, D, F = cfg.num_experts, cfg.d_model, cfg.ffn_dim
        if self.name == "mixtral":
            p = f"model.layers.{i}.block_sparse_moe."
            names = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}
        else:
            p = f"model.layers.{i}.mlp."
            names = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
        out["router"] = read(p + "gate.weight", (E, D), True)
        for ours, theirs in names.items():
            shape = (D, F) if ours == "w_down" else (F, D)
            out[ours] = stack_experts([read(f"{p}experts.{e}.{theirs}.weight", shape, True)
                                       for e in range(E)])
        return out

    def gguf_layer(self, read, cfg, i):
        p, E, D, F, H = f"blk.{i}.", cfg.num_experts, cfg.d_model, cfg.ffn_dim, cfg.head_dim
        out = read_attention_gguf(read, cfg, i)
        out["mlp_norm"] = read(p + "ffn_norm.weight", (D,))
        out["router"] = read(p + "ffn_gate_inp.weight", (E, D), True)
        for ours, theirs, shape in (("w_gate", "ffn_gate_exps", (E, F, D)),
                                    ("w_up", "ffn_up_exps", (E, F, D)),
                                    ("w_down", "ffn_down_exps", (E, D, F))):
            out[ours] = read(p + theirs + ".weight", shape).swapaxes(1, 2).copy()
        if cfg.qk_norm:
            out["q_norm"] = read(p + "attn_q_norm.weight", (H,))
            out["k_norm"] = read(p + "attn_k_norm.weight", (H,))
        return out


MIXTRAL = MoE("mixtral", "topk_softmax")
QWEN3_MOE = MoE("qwen3_moe", "softmax_topk")
