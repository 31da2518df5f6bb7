"""Quantization: weight formats, GGUF's blocks, products with quantized weights, the quantized
KV cache, the modes and activation-aware int4 (awq, imported on use: it builds on the model).
"""

from jaxinfer.quant.compute import matmul, take_rows
from jaxinfer.quant.formats import (FP8_MAX, INT4_BLOCK, QuantizedWeight, dequantize,
                                    dequantize_host, logical_axes, nbytes, pack_int4,
                                    quantize_fp8, quantize_int4, quantize_int8, take_out,
                                    unpack_int4)
from jaxinfer.quant.gguf_blocks import from_gguf
from jaxinfer.quant.kv import KV_DTYPES, QuantizedKV, quantize_kv
from jaxinfer.quant.modes import (GROUP_SIZE, MODES, contraction_axis, float_weights,
                                  quantize_model, quantize_weights)

__all__ = ["FP8_MAX", "GROUP_SIZE", "INT4_BLOCK", "KV_DTYPES", "MODES", "QuantizedKV",
           "QuantizedWeight", "contraction_axis", "dequantize", "dequantize_host",
           "float_weights", "from_gguf", "logical_axes", "matmul", "nbytes", "pack_int4",
           "quantize_fp8", "quantize_int4", "quantize_int8", "quantize_kv", "quantize_model",
           "quantize_weights", "take_out", "take_rows", "unpack_int4"]
