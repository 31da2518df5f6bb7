"""GGUF's quantized blocks: the one decoder of Q8_0, Q4_0, Q4_1, Q4_K and Q6_K data.

`from_gguf` regroups a tensor's blocks into a QuantizedWeight (codes kept, no float copy);
`to_float` dequantizes that on the host, bit for bit as gguf-py's `gguf.quants.dequantize`.
Other types go to gguf-py itself. Block layouts are ggml's block_* structs (little-endian):
Q8_0, Q4_0, Q4_1 hold 32 values and an f16 d (and m); Q4_K 256 values in 8 sub-blocks with f16
d, dmin and 6-bit sub-scales and mins; Q6_K 256 values in 16 sub-blocks, 6-bit q split into
ql and qh, int8 sub-scales and an f16 d.
"""

from __future__ import annotations

import gguf
import numpy as np

from jaxinfer.quant.formats import QuantizedWeight, dequantize_host, unpack_int4

QT = gguf.GGMLQuantizationType
BLOCKS = {
    QT.Q4_0: np.dtype([("d", "<f2"), ("qs", "u1", (16,))]),
    QT.Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))]),
    QT.Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", (32,))]),
    QT.Q4_K: np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)),
                       ("qs", "u1", (128,))]),
    QT.Q6_K: np.dtype([("ql", "u1", (128,)), ("qh", "u1", (64,)), ("scales", "i1", (16,)),
                       ("d", "<f2")]),
}
for _t, _dt in BLOCKS.items():  # our field layouts against gguf-py's table of block sizes
    assert gguf.GGML_QUANT_SIZES[_t][1] == _dt.itemsize, _t


def type_name(type_id: int) -> str:
    try:
        return QT(type_id).name
    except ValueError:
        return f"type {type_id}"


def _oriented(a: np.ndarray, transposed: bool) -> np.ndarray:
    """Per-block data [out, nb, k] -> C-contiguous [out, nb * k], or its transpose
    [nb * k, out] (one copy of the bytes either way)."""
    out, nb, k = a.shape
    if transposed:
        return np.ascontiguousarray(a.transpose(1, 2, 0)).reshape(nb * k, out)
    return np.ascontiguousarray(a).reshape(out, nb * k)


def _q4_k_sub_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[.., 12] bytes -> 6-bit (sc, m), [.., 8] each. Bytes 0-3 / 4-7: sc / m of sub-blocks
    0-3 in their low 6 bits and the top 2 bits of those of 4-7; bytes 8-11: the low 4 bits of
    sc (low nibble) and m (high nibble) of sub-blocks 4-7."""
    sc_lo, m_lo, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([sc_lo & 63, (rest & 15) | ((sc_lo >> 6) << 4)], axis=-1)
    m = np.concatenate([m_lo & 63, (rest >> 4) | ((m_lo >> 6) << 4)], axis=-1)
    return sc, m


def from_gguf(raw: np.ndarray, type_id: int, shape_out_in: tuple[int, int],
              transposed: bool, signed_q4_0: bool = False) -> QuantizedWeight:
    """A GGUF matrix of logical shape [out, in] (blocks along `in`) as a QuantizedWeight:
    [in, out] with axis 0 if transposed (linear weights), else [out, in] with axis 1.

    raw: the tensor's bytes. Q8_0 -> int8 / 32, Q4_0 and Q4_1 -> int4 / 32 with float16 scale
    and offset, Q4_K -> int4 / 32 and Q6_K -> int8 / 16 with float32 scales, each dequantizing
    bit for bit as ggml; other types raise ValueError. signed_q4_0: Q4_0 as int8 codes q - 8
    without offset, ggml's (q - 8) * d, which fits any scale and keeps ggml's signed zeros."""
    if type_id not in BLOCKS:
        raise ValueError(f"ggml type {type_name(type_id)} has no quantized form here; "
                         f"supported: {', '.join(t.name for t in BLOCKS)}")
    name = type_name(type_id)
    out, n_in = shape_out_in
    block = gguf.GGML_QUANT_SIZES[QT(type_id)][0]
    dtype = BLOCKS[type_id]
    if n_in % block:
        raise ValueError(f"{name} rows of {n_in} values are not a whole number of "
                         f"{block}-value blocks")
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if raw.size != out * (n_in // block) * dtype.itemsize:
        raise ValueError(f"{name} data of shape {shape_out_in} must have "
                         f"{out * (n_in // block) * dtype.itemsize} bytes, got {raw.size}")
    blocks = raw.view(dtype).reshape(out, n_in // block)
    axis = 0 if transposed else 1
    orient = lambda a: _oriented(a, transposed)
    per_block = lambda a: orient(a[..., None])  # [out, nb] -> [out, nb] or [nb, out]

    if type_id == QT.Q8_0:
        return QuantizedWeight(q=orient(blocks["qs"]), scale=per_block(blocks["d"]),
                               offset=None, kind="int8", axis=axis, group_size=32)
    if type_id in (QT.Q4_0, QT.Q4_1):
        d = per_block(blocks["d"]).astype(np.float16)
        if signed_q4_0 and type_id == QT.Q4_0:
            codes = unpack_int4(orient(blocks["qs"]), axis, np).astype(np.int8) - np.int8(8)
            return QuantizedWeight(q=codes, scale=d, offset=None, kind="int8", axis=axis,
                                   group_size=32)
        if type_id == QT.Q4_1:
            offset = per_block(blocks["m"]).astype(np.float16)
        else:
            with np.errstate(over="ignore"):
                offset = d * np.float16(-8)  # exact unless it overflows
            if not np.all(np.isfinite(offset)):
                raise ValueError("Q4_0 scales beyond 8188 overflow a float16 offset -8*d")
        return QuantizedWeight(q=orient(blocks["qs"]), scale=d, offset=offset, kind="int4",
                               axis=axis, group_size=32)
    if type_id == QT.Q4_K:
        sc, m = _q4_k_sub_scales(blocks["scales"])  # [out, nb, 8]
        scale = blocks["d"].astype(np.float32)[..., None] * sc  # exact: 11 + 6 bits
        offset = -(blocks["dmin"].astype(np.float32)[..., None] * m)
        qs = blocks["qs"].reshape(out, -1, 4, 32)
        # Run r: sub-block 2r in the low nibbles, 2r + 1 in the high ones -> our packing, where
        # byte j of a sub-block holds its values j (low) and j + 16 (high).
        low = (qs[..., :16] & 0x0F) | (qs[..., 16:] << 4)
        high = (qs[..., :16] >> 4) | (qs[..., 16:] & 0xF0)
        packed = np.stack([low, high], axis=3).reshape(out, -1, 16)  # [out, nb*8, 16]
        return QuantizedWeight(q=orient(packed), scale=per_block(scale.reshape(out, -1)),
                               offset=per_block(offset.reshape(out, -1)), kind="int4",
                               axis=axis, group_size=32)
    # Q6_K. Value e of a block (h = e // 128, r = e % 128): low 4 bits from ql byte
    # 64h + r % 64 (nibble r // 64), high 2 bits from qh byte 32h + r % 32 (bits 2 * (r // 32)).
    ql = blocks["ql"].reshape(out, -1, 2, 1, 64)
    qh = blocks["qh"].reshape(out, -1, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3)  # [out, nb, 2, 2, 64]
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3)  # [out, nb, 2, 4, 32]
    q = (low.reshape(out, -1, 256) | (high.reshape(out, -1, 256) << 4)).astype(np.int8) - 32
    scale = blocks["d"].astype(np.float32)[..., None] * blocks["scales"]  # exact: 11 + 8 bits
    return QuantizedWeight(q=orient(q.reshape(out, -1, 16)),
                           scale=per_block(scale.reshape(out, -1)), offset=None, kind="int8",
                           axis=axis, group_size=16)


def to_float(raw: np.ndarray, type_id: int, shape: tuple[int, ...],
             transposed: bool = False) -> np.ndarray:
    """float32 values of little-endian data of ggml type `type_id` and logical `shape`; with
    transposed=True a matrix [out, in] comes as [in, out], C-contiguous (BLOCKS types transpose
    their codes, not the floats). Other types go through gguf-py (NotImplementedError)."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if type_id in BLOCKS:
        if len(shape) == 2:
            return dequantize_host(from_gguf(raw, type_id, shape, transposed, True))
        n = int(np.prod(shape))  # a vector (or a tensor of more axes) as one row of blocks
        return dequantize_host(from_gguf(raw, type_id, (1, n), False, True)).reshape(shape)
    if type_id == QT.F32:
        flat = raw.view("<f4").astype(np.float32)
    elif type_id == QT.F16:
        flat = raw.view("<f2").astype(np.float32)
    else:
        flat = np.asarray(gguf.quants.dequantize(raw, QT(type_id)), np.float32).reshape(-1)
    w = flat.reshape(shape)
    return np.ascontiguousarray(w.T) if transposed else w
