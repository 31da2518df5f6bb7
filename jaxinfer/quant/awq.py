"""Activation-aware int4 weight quantization (AWQ, Lin et al. 2023) for the Llama and Qwen3
families.

Shape legend: B batch, T tokens, N query heads, K kv heads, G = N // K, H head dim, D model dim,
F ffn dim, C a linear's input channels, O its outputs.

Input channels that see large activations matter more, so each linear group's weight rows are
scaled by s = mean|x| ** alpha before int4 round to nearest (RTN), and 1 / s is folded into the
op that produces the input, leaving the float model unchanged: x @ W = (x / s) @ (diag(s) @ W).
alpha is searched per group on calibration data by the output error ||X W - X W_hat||^2, and
alpha 0 is RTN, so the result is never worse than RTN there. Groups, in search order (a
consumer before the producer its scale folds into), and where 1 / s goes: "o" (wo; into wv's
output columns, the scale tied per kv channel under GQA), "qkv" (attn_norm), "down" (w_up's
output columns), "gate_up" (mlp_norm). Scaling output columns commutes with quantizing along
the input axis, so a fold costs the group folded into nothing. Then each linear's int4 groups
are shrunk about their centre by a ratio searched per output channel (`search_clip`). The
vocabulary matrices get no scale (the embedding is also the lookup table) and stay int8.
docs/quantization.md has the measurements behind these choices.
"""

from __future__ import annotations

import functools
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import backends, quant
from jaxinfer.backends.tuning import program_jit
from jaxinfer.quant import formats
from jaxinfer.config import ModelConfig
from jaxinfer.device.kv_cache import PagedKVCache
from jaxinfer.models import get_model
from jaxinfer.models.base import DENSE_QUERY_TILE
from jaxinfer.device.token_batch import TokenBatch

LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
GROUPS = ("o", "qkv", "down", "gate_up")  # search (and fold) order within a layer
GROUP_LINEARS = {"o": ("wo",), "qkv": ("wq", "wk", "wv"), "down": ("w_down",),
                 "gate_up": ("w_gate", "w_up")}
GROUP_INPUTS = {"o": "attn_out", "qkv": "x_attn", "down": "hidden", "gate_up": "x_mlp"}


# -- calibration forward --------------------------------------------------------------------------

class LinearInputs(NamedTuple):
    """The inputs of one layer's linear groups, each [B, T, C]."""
    x_attn: jax.Array    # attn_norm output: input of wq, wk, wv       [B, T, D]
    attn_out: jax.Array  # attention output: input of wo                [B, T, N*H]
    x_mlp: jax.Array     # mlp_norm output: input of w_gate, w_up       [B, T, D]
    hidden: jax.Array    # silu(gate) * up: input of w_down             [B, T, F]


AWQ_FAMILIES = ("llama", "qwen3")  # layers whose norms and linears fold as above


def _check_family(cfg: ModelConfig) -> None:
    family = get_model(cfg.architecture).name
    if family not in AWQ_FAMILIES:
        raise ValueError(f"int4-awq supports the {AWQ_FAMILIES} families (their norms and "
                         f"linears fold as the module docstring says); {cfg.architecture!r} "
                         "is not one of them")


def _one_layer(cfg: ModelConfig, i: int) -> ModelConfig:
    """The config of layer i alone: its window and RoPE base, one cache layer."""
    return cfg.replace(num_layers=1, sliding_window=cfg.window(i), layer_windows=None,
                       rope_theta=cfg.layer_rope_theta(i), layer_rope_thetas=None)


# Compiled with the engine's compiler options (backends.tuning), as the model's forward is.
@functools.partial(program_jit, static_argnums=(1, 3))
def layer_forward(lp, layer_cfg: ModelConfig, h: jax.Array,
                  backend: backends.Backend) -> tuple[jax.Array, LinearInputs]:
    """One decoder layer over full causal sequences h [B, T, D] from an empty cache: (output
    [B, T, D], its linear inputs). layer_cfg (`_one_layer`) lets alike layers share a program."""
    B, T, D = h.shape
    model = get_model(layer_cfg.architecture)
    cache = PagedKVCache.ring(1, B, T, layer_cfg.num_kv_heads, layer_cfg.head_dim, h.dtype)
    batch = TokenBatch.dense(jnp.zeros((B, T), jnp.int32), jnp.full((B,), T, jnp.int32),
                             None, B)
    tile = min(T, DENSE_QUERY_TILE)
    ctx = model.context(layer_cfg, batch, cache, backend=backend, query_tile=tile,
                        num_tiles=B * -(-T // tile), differentiable=True)
    linear_inputs = {}
    out, _ = model.layer(lp, layer_cfg, 0, h.reshape(B * T, D), ctx, linear_inputs)
    return out.reshape(B, T, D), LinearInputs(
        *(linear_inputs[name].reshape(B, T, -1) for name in LinearInputs._fields))


def run_layers(params, cfg: ModelConfig,
               tokens: jax.Array) -> Iterator[tuple[jax.Array, LinearInputs]]:
    """tokens [B, T] -> yields (output [B, T, D], LinearInputs) of each layer in turn."""
    h = get_model(cfg.architecture).embed(params, cfg, tokens)
    backend = backends.default()
    for i, lp in enumerate(params.layers):
        h, inputs = layer_forward(lp, _one_layer(cfg, i), h, backend)
        yield h, inputs


@jax.jit
def _input_stats(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [B, T, C] -> (sum over rows of |x| [C], Gram matrix X^T X [C, C]), float32."""
    x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    return jnp.sum(jnp.abs(x), axis=0), jnp.matmul(x.T, x, precision="highest")


# -- scale search and folding ---------------------------------------------------------------------

def _rtn(w: np.ndarray, group_size: int) -> np.ndarray:
    """w [C, O] through int4 round to nearest along C and back (float32)."""
    return quant.dequantize_host(quant.quantize_int4(w, axis=0, group_size=group_size))


def output_error(gram: np.ndarray, w: np.ndarray, w_hat: np.ndarray) -> float:
    """||X w - X w_hat||^2 summed over rows and outputs, from gram = X^T X [C, C]."""
    e = np.asarray(w - w_hat, np.float32)
    return float(np.sum((gram @ e) * e, dtype=np.float64))


def search_scale(mean_abs: np.ndarray, gram: np.ndarray, w: np.ndarray, group_size: int,
                 grid: int) -> tuple[np.ndarray, float, float, float]:
    """The AWQ scale of one linear group: mean_abs [C] mean |x| per input channel, gram [C, C]
    X^T X, w [C, O] the group's weights side by side -> (s [C] float32, alpha, its error, RTN's
    error), errors as in `output_error`."""
    a = np.asarray(mean_abs, np.float64)
    # A channel that is (almost) never active would get s -> 0 and an infinite 1 / s.
    a = np.maximum(a, max(a.max(), 1e-30) * 1e-5)
    best = None
    for alpha in np.linspace(0.0, 1.0, grid, endpoint=False):
        s = a ** alpha
        # Centred on 1, so the float16 scales of the scaled weights neither overflow nor
        # underflow; a common factor changes no group's relative rounding.
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        w_hat = _rtn(w * s[:, None], group_size) / s[:, None]
        err = output_error(gram, w, w_hat)
        if alpha == 0.0:
            rtn_err = err
        if best is None or err < best[2]:
            best = (s, float(alpha), err)
    return best + (rtn_err,)


def _expand_kv(s_kv: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """A per-kv-channel vector [K*H] -> the matching wo input channels [N*H]."""
    G = cfg.num_heads // cfg.num_kv_heads
    return np.repeat(s_kv.reshape(cfg.num_kv_heads, 1, cfg.head_dim), G, axis=1).reshape(-1)


def fold_group(cfg: ModelConfig, weights: dict[str, np.ndarray], layer: int, group: str,
               s: np.ndarray) -> None:
    """Folds s into one group in place: its weights' rows times s, their input's producer
    divided by s. For "o" s is per kv channel [K*H], otherwise per input channel."""
    p = f"layers.{layer}."
    if group == "o":
        weights[p + "wo"] = weights[p + "wo"] * _expand_kv(s, cfg)[:, None]
        weights[p + "wv"] = weights[p + "wv"] / s[None, :]
        if weights.get(p + "bv") is not None:
            weights[p + "bv"] = weights[p + "bv"] / s
        return
    if group == "down":
        weights[p + "w_down"] = weights[p + "w_down"] * s[:, None]
        weights[p + "w_up"] = weights[p + "w_up"] / s[None, :]
        return
    norm = {"qkv": "attn_norm", "gate_up": "mlp_norm"}[group]
    weights[p + norm] = weights[p + norm] / s
    for name in GROUP_LINEARS[group]:
        weights[p + name] = weights[p + name] * s[:, None]


def _stats_by_layer(cfg: ModelConfig, weights: dict[str, np.ndarray],
                    calibration: list[list[int]]):
    """Per layer, {input name: (mean |x| [C], X^T X [C, C])} over every calibration token
    (numpy float32); sequences of one length run as one batch."""
    if not calibration or not all(calibration):
        raise ValueError("calibration needs at least one non-empty token sequence")
    _check_family(cfg)
    params = get_model(cfg.architecture).params_from_weights(cfg, weights)
    by_length: dict[int, list[list[int]]] = {}
    for seq in calibration:
        by_length.setdefault(len(seq), []).append(seq)
    runs = [run_layers(params, cfg, jnp.asarray(seqs, jnp.int32)) for seqs in by_length.values()]
    rows = sum(len(seq) for seq in calibration)
    for _ in range(cfg.num_layers):
        sums = {}
        for run in runs:
            _, inputs = next(run)
            for name, x in inputs._asdict().items():
                abs_sum, gram = _input_stats(x)
                prev = sums.get(name, (0.0, 0.0))
                sums[name] = (prev[0] + abs_sum, prev[1] + gram)
        yield {name: (np.asarray(a) / rows, np.asarray(g)) for name, (a, g) in sums.items()}


# -- clipping search ------------------------------------------------------------------------------

CLIP_RATIOS = tuple(round(1.0 - 0.02 * i, 2) for i in range(16))  # 1.0, 0.98, ..., 0.7


def _clipped_int4(w: np.ndarray, group_size: int, ratio) -> tuple[np.ndarray, ...]:
    """Asymmetric int4 of w [C, O] along C with each group's [min, max] shrunk about its centre
    to `ratio` (scalar or [O]) times its width; ratio 1 is `quant.quantize_int4` bit for bit.
    Returns (codes uint8 [C, O], scale float16 [C / group_size, O], offset likewise, value
    float32 [C, O] as `quant.dequantize` computes it)."""
    C, O = w.shape
    g = np.asarray(w, np.float32).reshape(C // group_size, group_size, O)
    lo = g.min(axis=1, keepdims=True).astype(np.float64)
    hi = g.max(axis=1, keepdims=True).astype(np.float64)
    # Exactly 0 at ratio 1, where centre +- half-width would round.
    shrink = (1.0 - np.asarray(ratio, np.float64)) * (hi - lo) / 2
    offset = formats.round_down(lo + shrink, np.float16)
    formats.check_finite(offset, "int4 offsets", np.float16)
    scale = formats.round_up((hi - shrink - offset.astype(np.float64)) / 15, np.float16)
    formats.check_finite(scale, "int4 scales", np.float16)
    off32 = offset.astype(np.float32)
    q = np.clip(np.rint(formats.divide(g - off32, scale)), 0, 15).astype(np.uint8)
    value = q.astype(np.float32) * scale.astype(np.float32) + off32
    return (q.reshape(C, O), scale[:, 0], offset[:, 0], value.reshape(C, O))


def quantize_int4_clipped(w: np.ndarray, group_size: int, ratio) -> quant.QuantizedWeight:
    """`_clipped_int4` as a QuantizedWeight in `quant.quantize_int4(w, axis=0)`'s layout."""
    q, scale, offset, _ = _clipped_int4(w, group_size, ratio)
    return quant.QuantizedWeight(q=quant.pack_int4(q, 0), scale=scale, offset=offset,
                                 kind="int4", axis=0, group_size=group_size)


def column_errors(gram: np.ndarray, w: np.ndarray, w_hat: np.ndarray) -> np.ndarray:
    """||X w[:, o] - X w_hat[:, o]||^2 per output channel o [O] (float64), gram = X^T X."""
    d = np.asarray(w - w_hat, np.float32)
    return np.sum((gram @ d) * d, axis=0, dtype=np.float64)


def search_clip(gram: np.ndarray, w: np.ndarray, group_size: int,
                ratios=CLIP_RATIOS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per output channel of w [C, O] (final, scaled weights; gram [C, C] of its final inputs),
    the ratio of `ratios` (starting with 1.0; ties keep the earlier, so never worse than RTN)
    with the least `column_errors`: (ratio [O] float32, its error [O], ratio 1's error [O])."""
    if not ratios or ratios[0] != 1.0:
        raise ValueError(f"clip ratios must start with 1.0, got {tuple(ratios)}")
    best_r = best_err = unclipped = None
    for r in ratios:
        err = column_errors(gram, w, _clipped_int4(w, group_size, r)[3])
        if unclipped is None:
            unclipped = err
            best_r, best_err = np.full(err.shape, r, np.float32), err
            continue
        better = err < best_err
        best_r = np.where(better, np.float32(r), best_r)
        best_err = np.where(better, err, best_err)
    return best_r, best_err, unclipped


# -- the quantizer --------------------------------------------------------------------------------

def _check_embed_bits(embed_bits: int) -> None:
    if embed_bits not in (4, 8) or isinstance(embed_bits, bool):
        raise ValueError(f"embed_bits {embed_bits!r} must be 8 or 4")


def _vocab_matrices(weights: dict[str, np.ndarray], group_size: int,
                    embed_bits: int) -> dict:
    """"embed" [V, D] (and an untied "lm_head" [D, V]) along their contraction axis: int8 per
    channel, the default, since at int4 they cost more than all the linears; or int4 RTN."""
    def q(w, axis):
        if embed_bits == 8:
            return quant.quantize_int8(w, axis=axis)
        return quant.quantize_int4(w, axis=axis, group_size=group_size)
    out = {"embed": q(weights["embed"], 1)}
    if weights.get("lm_head") is not None:
        out["lm_head"] = q(weights["lm_head"], 0)
    return out


def awq_int4(cfg: ModelConfig, weights: dict[str, np.ndarray], calibration: list[list[int]],
             group_size: int = 32, grid: int = 20, clip: bool = True,
             embed_bits: int = 8) -> tuple[dict, dict]:
    """AWQ int4 of a Llama- or Qwen3-family model.

    weights: float32 host weights named as `params_from_weights` takes them (linear [in, out]);
    calibration: token sequences; group_size: int4 group along the input axis (a multiple of
    32); grid: alphas searched, linspace(0, 1, grid) without 1; clip: search clipping ratios
    too; embed_bits: the vocabulary matrices int8 per channel (8) or int4 RTN in groups (4).

    Returns (new_weights, report). new_weights: the same keys, linears as int4 QuantizedWeights
    (axis 0) of the scaled weights, norms (and bv) float32 with the scales folded in. report,
    errors ||X W - X W_hat||^2 on the calibration rows: "layers.{i}.{group}": "alpha", "scale",
    "rtn_error", "scale_error" (no clip), "awq_error" (final weights); with clip,
    "layers.{i}.{linear}": "clip_ratio" [O] float32, "error", "unclipped_error".
    """
    for what, n in (("d_model", cfg.d_model), ("q_dim", cfg.q_dim), ("ffn_dim", cfg.ffn_dim)):
        if group_size <= 0 or n % group_size or group_size % quant.INT4_BLOCK:
            raise ValueError(f"group_size {group_size} must be a multiple of "
                             f"{quant.INT4_BLOCK} that divides {what} {n}")
    _check_embed_bits(embed_bits)
    w = {k: np.asarray(v, np.float32) if v is not None else None for k, v in weights.items()}
    report, linears = {}, {}
    G = cfg.num_heads // cfg.num_kv_heads
    for i, stats in enumerate(_stats_by_layer(cfg, weights, calibration)):
        p = f"layers.{i}."
        for group in GROUPS:
            mean_abs, gram = stats[GROUP_INPUTS[group]]
            if group == "o":  # tie the scale across the query heads that share a v channel
                mean_abs = mean_abs.reshape(cfg.num_kv_heads, G, cfg.head_dim).mean(1)
                mean_abs = _expand_kv(mean_abs.reshape(-1), cfg)
            stacked = np.concatenate([w[p + name] for name in GROUP_LINEARS[group]], axis=1)
            s, alpha, err, rtn_err = search_scale(mean_abs, gram, stacked, group_size, grid)
            s_in = s  # per input channel of the group's linears
            if group == "o":
                s = s.reshape(cfg.num_kv_heads, G, cfg.head_dim)[:, 0].reshape(-1)
            fold_group(cfg, w, i, group, s)
            entry = {"alpha": alpha, "scale_error": err, "awq_error": err, "rtn_error": rtn_err,
                     "scale": s}
            report[p + group] = entry
            if not clip:
                for name in GROUP_LINEARS[group]:
                    linears[p + name] = quant.quantize_int4(w[p + name], axis=0,
                                                            group_size=group_size)
                continue
            # No later fold changes these weights; their inputs X / s have Gram gram / (s s^T).
            final_gram = gram / s_in[:, None] / s_in[None, :]
            entry["awq_error"] = 0.0
            for name in GROUP_LINEARS[group]:
                ratio, col_err, unclipped = search_clip(final_gram, w[p + name], group_size)
                linears[p + name] = quantize_int4_clipped(w[p + name], group_size, ratio)
                report[p + name] = {"clip_ratio": ratio, "error": float(col_err.sum()),
                                    "unclipped_error": float(unclipped.sum())}
                entry["awq_error"] += report[p + name]["error"]
    out = dict(w)
    out.update(linears)
    out.update(_vocab_matrices(w, group_size, embed_bits))
    return out, report


def rtn_int4(cfg: ModelConfig, weights: dict[str, np.ndarray], group_size: int = 32,
             embed_bits: int = 8) -> dict:
    """The baseline: every linear int4 round to nearest, in `awq_int4`'s layout."""
    _check_embed_bits(embed_bits)
    out = dict(weights)
    for i in range(cfg.num_layers):
        for name in LINEARS:
            key = f"layers.{i}.{name}"
            out[key] = quant.quantize_int4(weights[key], axis=0, group_size=group_size)
    out.update(_vocab_matrices(weights, group_size, embed_bits))
    return out


# -- evaluation -----------------------------------------------------------------------------------

def dequantized(weights: dict) -> dict[str, np.ndarray]:
    """weights with every QuantizedWeight replaced by its float32 value."""
    return {k: quant.dequantize_host(v) if isinstance(v, quant.QuantizedWeight) else v
            for k, v in weights.items()}
