"""The quantization modes of `LLM(quantization=...)` and the one function that applies them to
a model's host weights (`quantize_model`), whatever the model came from: a GGUF file (its
blocks kept where they are of the mode's kind), HF safetensors, or an orbax checkpoint.
"""

from __future__ import annotations

import os
from typing import Optional

from jaxinfer.quant.formats import (QuantizedWeight, dequantize_host, quantize_fp8,
                                    quantize_int4, quantize_int8)

MODES = ("int8", "int4", "int4-awq", "fp8")
# Elements per scale along the contraction axis. int8 in groups of 32 is GGUF's Q8_0 grade
# (docs/quantization.md has the 32 / 64 / 128 / per-channel measurements); int4 groups of 32
# are Q4_0 / Q4_1's. Read at call time, so a benchmark may set another before loading.
GROUP_SIZE = {"int8": 32, "int4": 32, "int4-awq": 32}
_LINEAR_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")

CALIBRATION_TEXT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data",
                                "calibration.txt")
CALIBRATION_SHAPE = (8, 256)  # sequences x tokens of "int4-awq" calibration


def contraction_axis(name: str) -> Optional[int]:
    """The grouped axis of a named model weight that is quantized (linear weights [in, out]
    and lm_head [D, V]: 0; the embedding [V, D]: 1), None for the rest (norms, biases)."""
    if name == "embed":
        return 1
    if name == "lm_head" or name.split(".")[-1] in _LINEAR_FIELDS:
        return 0
    return None


def _keeps(w: QuantizedWeight, mode: str) -> bool:
    """Whether a weight already quantized stays as it is under `mode`: one of the mode's kind
    (GGUF's Q8_0 / Q6_K blocks under int8, Q4_0 / Q4_1 / Q4_K under int4, a checkpoint's
    weights), and under int4 an int8 one too (SmolLM2's Q8_0 embedding): requantizing it to
    4 bits would lose what the source holds."""
    return w.kind == mode or (mode == "int4" and w.kind == "int8")


def quantize_weights(weights: dict, mode: str, group_size: Optional[int] = None) -> dict:
    """Every matrix of a model's host weights (params_from_weights names) quantized by `mode`:
    "int8" symmetric in groups of `group_size` along the contraction axis (default
    GROUP_SIZE["int8"]; 0: per output channel), "int4" round to nearest in groups (asymmetric),
    "fp8" per output channel. A QuantizedWeight that `_keeps` is kept, lossless against its
    source; any other is dequantized on the host and quantized anew. Norms and biases stay
    float. ("int4-awq" needs calibration: `quantize_model`.)"""
    if mode not in ("int8", "int4", "fp8"):
        raise ValueError(f"unknown quantization {mode!r}; available: int8, int4, fp8")
    group = GROUP_SIZE.get(mode, 0) if group_size is None else group_size
    quantizers = {"int8": lambda w, a: quantize_int8(w, axis=a, group_size=group),
                  "int4": lambda w, a: quantize_int4(w, axis=a, group_size=group),
                  "fp8": lambda w, a: quantize_fp8(w, axis=a)}
    out = {}
    for name, w in weights.items():
        axis = contraction_axis(name)
        if axis is None:
            out[name] = w
            continue
        if isinstance(w, QuantizedWeight):
            if _keeps(w, mode):
                out[name] = w
                continue
            w = dequantize_host(w)
        out[name] = quantizers[mode](w, axis)
    return out


def float_weights(weights: dict) -> dict:
    """weights with every QuantizedWeight replaced by its float32 value (host numpy)."""
    return {k: dequantize_host(v) if isinstance(v, QuantizedWeight) else v
            for k, v in weights.items()}


def quantize_model(cfg, weights: dict, mode: Optional[str], tokenizer=None,
                   group_size: Optional[int] = None, source_mode: Optional[str] = None) -> dict:
    """Host weights quantized by `mode`; None, or the mode the weights were already quantized
    with (`source_mode`: a checkpoint written by `launch.convert --quantization`), leaves
    them as they are, so an int4-awq checkpoint loads without calibrating again. "int4-awq"
    calibrates on the package's calibration text (jaxinfer/data/calibration.txt: prose,
    code, dialogue, notes; about 2,200 SmolLM2 tokens), CALIBRATION_SHAPE sequences of it,
    starting from the float (or dequantized) weights."""
    if mode is None or mode == source_mode:
        return weights
    if mode != "int4-awq":
        return quantize_weights(weights, mode, group_size)
    from jaxinfer.quant import awq

    if tokenizer is None:
        raise ValueError("quantization='int4-awq' calibrates on text and needs the model's "
                         "tokenizer; this model has none (no tokenizer.json)")
    with open(CALIBRATION_TEXT, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read())
    n, T = CALIBRATION_SHAPE
    n = min(n, len(ids) // T)
    calibration = [ids[i * T:(i + 1) * T] for i in range(n)]
    group = GROUP_SIZE["int4-awq"] if group_size is None else group_size
    return awq.awq_int4(cfg, float_weights(weights), calibration, group_size=group)[0]

