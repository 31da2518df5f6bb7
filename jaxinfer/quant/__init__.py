"""Quantization: weight formats, GGUF's blocks, products with quantized weights, the quantized
KV cache, and activation-aware int4 (AWQ).

    formats      QuantizedWeight (codes, per-group scales and offsets), int4 packing, the
                 int8 / int4 / fp8 quantizers, dequantization on device and on the host
    gguf_blocks  GGUF's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K blocks as QuantizedWeights (the
                 loader's one block decoder)
    compute      matmul and take_rows: where a step multiplies quantized weights
    kv           QuantizedKV and quantize_kv: int8 / fp8 KV cache entries
    modes        the LLM's quantization modes and quantize_model, their one entry point
    awq          activation-aware int4 (imported on use: it builds on the model)
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
