"""Activation-aware int4 weight quantization (AWQ, Lin et al. 2023) for the Llama family.

Shape legend: B batch, T tokens, R calibration rows (B * T), N query heads, K kv heads,
G = N // K, H head dim, D model dim, F ffn dim, C a linear's input channels, O its outputs.

Input channels that see large activations matter more to a linear's output than the others. AWQ
scales each input channel c of a weight W [C, O] up by s[c] before quantizing, which shrinks
that channel's relative rounding error, and scales the input down by s[c], folded into the op
that produces it, so the float model is unchanged:

    x @ W = (x / s) @ (diag(s) @ W)       quantized: (x / s) @ Q(diag(s) @ W)

s = a ** alpha for a = mean |x| per channel over calibration data, alpha chosen per linear group
from a grid on [0, 1) by the output error ||X W - X W_hat||^2 on that data. alpha = 0 is round to
nearest (RTN), so the chosen error is never worse than RTN's on the calibration data.

Groups and where 1 / s goes, per layer, searched in this order (a consumer before the producer
its scale folds into, so every reported error is that of the final weights):
  "o"        wo; its input is attention output, linear in v per head, so 1 / s goes into wv's
             output columns (and bv). With GQA one v channel (k, h) feeds the wo inputs (n, h) of
             every query head n of kv head k: the scale is tied per kv channel, searched with a
             averaged over the G query heads.
  "qkv"      wq, wk, wv (with "o" folded in) together: 1 / s into attn_norm.
  "down"     w_down; its input is silu(x @ w_gate) * (x @ w_up), so 1 / s goes into w_up's output
             columns.
  "gate_up"  w_gate, w_up (with "down" folded in) together: 1 / s into mlp_norm.
Scaling a weight's output columns commutes with quantizing along its input axis (each column's
groups scale as a whole; only the float16 rounding of their scales differs), so folding one
group's scale into the columns of the next searched group costs it nothing.

s is normalised by sqrt(max(s) * min(s)) so that it straddles 1. A common factor of s changes
no group's relative rounding; the normalisation only keeps the scaled weight's magnitude, so
that float16 scales and offsets neither overflow nor go subnormal whatever alpha.

Then AWQ's second step, clipping (`search_clip`, once a group's scale is chosen and folded; no
later fold touches a searched group's weights), on each of its linears' final weights W' =
diag(s) W with the Gram matrix of its final inputs X / s, gram / (s s^T): each int4 group's
[min, max] is shrunk about its centre to r times its width before round to nearest (weights
beyond it take the end codes), trading a larger error on a group's few extreme weights for a
finer grid for the rest. r is chosen per output channel o from CLIP_RATIOS by the channel's
output error d^T G d, d = W'[:, o] - W_hat[:, o]. 1.0 is in the grid and ties keep it, so no
channel's calibration error exceeds that of round to nearest of the same scaled weights.
  The grid, 1.0, 0.98, ..., 0.7: on SmolLM2 at group 64 a grid down to 0.5 chose nothing below
  0.76, and most channels choose 0.9 to 1.0, where a step of 0.05 is coarse (it leaves 0.83 of
  the unclipped calibration error, 0.02 leaves 0.78; perplexity the same within noise).
  Centre shrinking measured against the alternatives (same scales, group 64, step 0.05,
  GPL-3 4096 tokens): clamping to +-r * max|w| as the AWQ reference does, 28.01; scaling min
  and max by r, 27.74; about the centre, 27.28. One ratio per channel, not per channel and group
  by each group's own error block as the AWQ reference does: that lowered the calibration error
  (0.71 of unclipped against 0.83) but not perplexity (27.20 against 27.28; 27.40 at step 0.02)
  -- fitting the calibration tokens more than the model.

The vocabulary matrices (the tied embedding, or "embed" and "lm_head") get no AWQ scale: the
embedding is also the lookup table, whose rows a scale would change. They are int8 per channel
(embed_bits=8, the default): at int4 (embed_bits=4, round to nearest in groups) SmolLM2's
embedding alone costs 6% perplexity at group 32 (26.45 against 24.97; int8: 24.99).

Measured on SmolLM2-135M-Instruct (its Q4_1 GGUF, dequantized to float32; the linears are Q4_1,
int4 groups of 32 that round to nearest at group 32 reproduces exactly, so at group 32 AWQ finds
alpha 0 and ratio 1 everywhere: nothing to gain), calibration 8 x 256 tokens of Apache-2.0,
perplexity of the first 4096 (1024) tokens of GPL-3, windows of 512; int8 embedding unless said:

                        group 32        group 64
    float               24.97 (21.06)
    RTN                 24.99 (21.02)   33.67 (30.13)
    AWQ, clip=False     24.99 (21.02)   28.49 (24.93)
    AWQ                 24.99 (21.02)   27.18 (23.19)
    RTN, embed_bits=4   26.45 (-)       38.07 (33.35)
    AWQ, embed_bits=4   26.45 (-)       30.06 (25.73)   (clip=False: 31.44)

So int4-awq is within 5% of float at group 32 only (+0.1%); at group 64 it is +9%, clipping
taking it from +14%. awq_int4 took 45-95 s (clip=False) and 65-140 s (clip) there, on two CPU
cores shared with other work. The script (jaxinfer's venv, from the repository root):

    import os
    from jaxinfer.quant import awq
    from jaxinfer.loading.gguf import load_gguf
    from jaxinfer.loading.tokenizer import Tokenizer
    from jaxinfer.models import get_model
    cfg, weights, meta = load_gguf(os.path.expanduser(
        "~/.cache/jaxinfer/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    tok = Tokenizer.from_gguf_metadata(meta)
    enc = lambda name: tok.encode(open(f"/usr/share/common-licenses/{name}").read())
    calib, evaluation = enc("Apache-2.0"), enc("GPL-3")[:4096]  # [:1024]
    calibration = [calib[i * 256:(i + 1) * 256] for i in range(8)]
    w = awq.awq_int4(cfg, weights, calibration, group_size=64)[0]  # or clip=False, embed_bits=4;
    # awq.rtn_int4(cfg, weights, group_size=64); the float model: w = weights
    params = get_model(cfg.architecture).params_from_weights(cfg, awq.dequantized(w))
    print(awq.perplexity(params, cfg, evaluation, window=512))

Calibration inputs come from one float forward of the original model (full causal sequences,
no cache): the family's own layer (the model protocol's `layer(..., linear_inputs=...)`, which hands
back the inputs of its linear groups), one layer at a time.
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
from jaxinfer.evaluation import perplexity  # noqa: F401  (awq.perplexity, as before)
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
    """One decoder layer of the model's family (its protocol `layer`, with linear_inputs) over full
    sequences h [B, T, D] from an empty one-layer cache, causal; layer_cfg is the layer's own
    config (`_one_layer`), so layers alike share a program. Returns the layer's output
    [B, T, D] and its linear inputs."""
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


def calibration_logits(params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Logits [B, T, V] (float32) of the calibration forward: checks it against
    `models.sequence_logits`."""
    model = get_model(cfg.architecture)
    *_, (h, _) = run_layers(params, cfg, tokens)
    return model.head(params, model.final_norm(params, cfg, h), backends.default())


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
    """The AWQ scale of one linear group.

    mean_abs [C]: mean |x| per input channel; gram [C, C]: X^T X of the calibration inputs;
    w [C, O]: the group's weights side by side. Returns (s [C] float32, alpha, error of the
    chosen s, error of RTN), errors as in `output_error`.
    """
    a = np.asarray(mean_abs, np.float64)
    # A channel that is (almost) never active would get s -> 0 and an infinite 1 / s.
    a = np.maximum(a, max(a.max(), 1e-30) * 1e-5)
    best = None
    for alpha in np.linspace(0.0, 1.0, grid, endpoint=False):
        s = a ** alpha
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
    """Scales the inputs of one group's linears by s (in place, float): rows of the group's
    weights times s, the producer of their input divided by s. For "o", s is per kv channel
    [K*H]; otherwise per input channel."""
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


def fold_scales(cfg: ModelConfig, weights: dict[str, np.ndarray],
                scales: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A copy of weights with scales {"layers.{i}.{group}": s} folded in, in the order
    `awq_int4` folds them: the same float model, up to float32 rounding."""
    out = dict(weights)
    for i in range(cfg.num_layers):
        for group in GROUPS:
            if f"layers.{i}.{group}" in scales:
                fold_group(cfg, out, i, group, scales[f"layers.{i}.{group}"])
    return out


def _stats_by_layer(cfg: ModelConfig, weights: dict[str, np.ndarray],
                    calibration: list[list[int]]):
    """Yields, per layer, {input name: (mean |x| [C], X^T X [C, C])} as numpy float32,
    over every calibration token. Sequences of equal length run as one batch."""
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
    """Asymmetric int4 of w [C, O] along C (groups of group_size), each group's [min, max]
    shrunk about its centre to ratio times its width; ratio: a scalar or per output channel [O].
    Scales and offsets are rounded to float16 and the codes computed against them as
    `quant.quantize_int4` does, so ratio 1 gives its codes, scales and offsets bit for bit;
    elements outside the shrunk range get the nearest end code. Returns (codes uint8 [C, O],
    scale float16 [C / group_size, O], offset likewise, dequantized value float32 [C, O]
    computed as `quant.dequantize` does)."""
    C, O = w.shape
    g = np.asarray(w, np.float32).reshape(C // group_size, group_size, O)
    lo = g.min(axis=1, keepdims=True).astype(np.float64)
    hi = g.max(axis=1, keepdims=True).astype(np.float64)
    # (1 - ratio) * half-width off each end: exactly 0 at ratio 1, so the range is then [lo, hi]
    # exactly (a centre +- half-width would round).
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
    """AWQ's second step for one linear w [C, O] (its final, scaled weights) with gram = X^T X
    [C, C] of its final inputs: per output channel, the ratio of `ratios` (which must start
    with 1.0) whose `_clipped_int4` has the least `column_errors`. Returns (ratio [O] float32,
    its error [O], the error at ratio 1 [O]). Ties keep the earlier ratio, so a column whose
    clipping gains nothing keeps round to nearest, and no column's error exceeds ratio 1's."""
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
    """"embed" [V, D] (and an untied "lm_head" [D, V]) quantized along their contraction axis:
    int8 per channel (embed_bits 8) or int4 round to nearest in groups (4)."""
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

    weights: float32 host weights as the family's `params_from_weights` takes them (linear
    [in, out]);
    calibration: token sequences (sequences of one length are batched together); group_size:
    int4 group along the input axis (a multiple of 32); grid: alphas searched,
    linspace(0, 1, grid) without 1; clip: after the scales, search each linear's clipping
    ratios (`search_clip`, over CLIP_RATIOS); embed_bits: 8 or 4, see below.

    Returns (new_weights, report). new_weights has the same keys: every layer's linear weights
    are int4 QuantizedWeights (axis 0, `quant.quantize_int4`'s layout) of the scaled weights,
    clipped per output channel if `clip`; the norms (and bv) float32 with the scales folded in;
    "embed" (and "lm_head") along their contraction axis, int8 per channel (embed_bits 8) or
    int4 round to nearest in groups (embed_bits 4).

    report, errors ||X W - X W_hat||^2 over the calibration rows:
      "layers.{i}.{group}" (the groups of the module docstring): "alpha", "scale", "rtn_error"
        (alpha 0, no clip), "scale_error" (the chosen alpha, no clip), "awq_error" (the final
        weights: the chosen alpha, then the chosen clip ratios);
      "layers.{i}.{linear}" (with clip): "clip_ratio" [O] float32, "error" and
        "unclipped_error", that linear's share of "awq_error" and the same without clip.
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
            # No later fold changes this group's linears: their weights are final, and their
            # inputs X / s, whose Gram matrix is gram / (s s^T).
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
    """Every layer's linear weights int4 round to nearest, and the vocabulary matrices as
    `awq_int4` has them (embed_bits), in `awq_int4`'s layout: the baseline."""
    _check_embed_bits(embed_bits)
    out = dict(weights)
    for i in range(cfg.num_layers):
        for name in LINEARS:
            key = f"layers.{i}.{name}"
            out[key] = quant.quantize_int4(weights[key], axis=0, group_size=group_size)
    # The tied embedding is also the lookup table: a scale folded into its columns would change
    # the embeddings themselves, so the vocabulary matrices get no AWQ scales; int8 per channel
    # by default, since at int4 they cost more than all the linears (see the module docstring).
    out.update(_vocab_matrices(weights, group_size, embed_bits))
    return out


# -- evaluation -----------------------------------------------------------------------------------

def dequantized(weights: dict) -> dict[str, np.ndarray]:
    """weights with every QuantizedWeight replaced by its float32 value."""
    return {k: quant.dequantize_host(v) if isinstance(v, quant.QuantizedWeight) else v
            for k, v in weights.items()}
