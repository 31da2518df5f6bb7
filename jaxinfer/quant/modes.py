"""The quantization modes of `LLM(quantization=...)` and `quantize_model`, which applies them to
a model's host weights whatever they came from (GGUF, safetensors, a checkpoint).
"""

from __future__ import annotations

import os
from typing import Optional

from jaxinfer.quant.formats import (QuantizedWeight, dequantize_host, quantize_fp8,
                                    quantize_int4, quantize_int8)

MODES = ("int8", "int4", "int4-awq", "fp8")
# Elements per scale along the contraction axis, GGUF's Q8_0 and Q4_0 grades (int8's choice:
# docs/quantization.md). Read at call time, so a benchmark may set another before loading.
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
    """Whether an already quantized weight stays as it is under `mode`: one of its kind, and
    under int4 an int8 one too (requantizing to 4 bits would lose what the source holds)."""
    return w.kind == mode or (mode == "int4" and w.kind == "int8")


def quantize_weights(weights: dict, mode: str, group_size: Optional[int] = None) -> dict:
    """Every matrix of a model's host weights quantized by `mode`: "int8" symmetric in groups
    of `group_size` along the contraction axis (default GROUP_SIZE; 0: per output channel),
    "int4" asymmetric round to nearest in groups, "fp8" per output channel. A QuantizedWeight
    that `_keeps` is kept, any other requantized; norms and biases stay float."""
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
    """Host weights quantized by `mode`; None or `source_mode` (a converted checkpoint's mode)
    leaves them as they are. "int4-awq" calibrates CALIBRATION_SHAPE sequences of the package's
    calibration text on the float (or dequantized) weights."""
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
