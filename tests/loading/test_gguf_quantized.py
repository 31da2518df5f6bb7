"""Native quantized GGUF weights (`jaxinfer.quant.from_gguf`, `load_gguf(quantized=True)`)
against gguf-py: each block type's codes, regrouped into a QuantizedWeight, must dequantize to
`gguf.quants.dequantize`'s values bit for bit, and the quantized loader's weights to the float
loader's (itself checked against gguf-py in test_gguf_file.py), on the real SmolLM2 file (Q4_1
and Q8_0) and on a small file holding every type.

Measured differences: none for Q8_0, Q4_1, Q4_K and Q6_K (bit for bit, eager and jitted; a
fused multiply-add cannot change them because q * scale is exact in float32). Q4_0 differs only
in the sign of zero: ggml's d * (q - 8) gives -0 where d < 0 and q = 8, our q * d + (-8 * d)
gives +0; the values compare equal.
"""

import gguf
import jax
import numpy as np
import pytest

from jaxinfer import quant
from jaxinfer.loading.gguf import load_gguf

QT = gguf.GGMLQuantizationType
# Offsets of the f16 fields (d, and dmin where there is one) in the blocks that random bytes
# fill; gguf-py can quantize only Q8_0, Q4_0 and Q4_1 of these.
F16_FIELDS = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}


def raw_blocks(qtype, out: int, n_in: int, seed: int = 0) -> np.ndarray:
    """A [out, n_in] matrix of type qtype as bytes [out, row bytes]: gguf-py's quantization of
    random weights, or for the K-quants random bytes with finite f16 scales."""
    rng = np.random.default_rng(seed)
    if qtype not in F16_FIELDS:
        w = (rng.standard_normal((out, n_in)) * 0.05).astype(np.float32)
        w[rng.random(w.shape) < 0.01] *= 20
        return gguf.quants.quantize(w, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (out, n_in // block, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:  # signed scales of varied size, subnormal ones included
        d = (rng.standard_normal(raw.shape[:2]) * 10.0 ** rng.integers(-8, -1, raw.shape[:2]))
        raw[..., at:at + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(out, -1)


def bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


CASES = {  # type -> (kind, group size, scale dtype, has offset)
    QT.Q8_0: ("int8", 32, np.float16, False),
    QT.Q4_0: ("int4", 32, np.float16, True),
    QT.Q4_1: ("int4", 32, np.float16, True),
    QT.Q4_K: ("int4", 32, np.float32, True),
    QT.Q6_K: ("int8", 16, np.float32, False),
}


@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("qtype", list(CASES), ids=lambda t: t.name)
def test_from_gguf_matches_gguf_py(qtype, transposed):
    out, n_in = 24, 512
    raw = raw_blocks(qtype, out, n_in)
    expected = gguf.quants.dequantize(raw, qtype).reshape(out, n_in)
    expected = expected.T if transposed else expected
    qw = quant.from_gguf(raw, int(qtype), (out, n_in), transposed)
    kind, group, scale_dtype, has_offset = CASES[qtype]
    axis = 0 if transposed else 1
    assert (qw.kind, qw.group_size, qw.axis, qw.shape) == (kind, group, axis, expected.shape)
    assert qw.scale.dtype == scale_dtype and (qw.offset is not None) == has_offset
    assert qw.scale.shape[axis] == n_in // group and qw.scale.shape[1 - axis] == out
    assert all(a.flags.c_contiguous for a in jax.tree.leaves(qw))
    per_group = np.dtype(scale_dtype).itemsize * (2 if has_offset else 1)
    code_bytes = out * n_in // (2 if kind == "int4" else 1)
    assert quant.nbytes(qw) == code_bytes + out * n_in // group * per_group
    for got in (quant.dequantize(qw), jax.jit(quant.dequantize)(qw)):
        if qtype == QT.Q4_0:  # equal values; only the sign of a zero may differ (see above)
            np.testing.assert_array_equal(np.asarray(got), expected)
            nonzero = expected != 0
            np.testing.assert_array_equal(bits(got)[nonzero], bits(expected)[nonzero])
        else:
            np.testing.assert_array_equal(bits(got), bits(expected))


def test_from_gguf_errors():
    raw = raw_blocks(QT.Q8_0, 4, 64)
    with pytest.raises(ValueError, match="Q5_K"):
        quant.from_gguf(raw_blocks(QT.Q5_K, 4, 256), int(QT.Q5_K), (4, 256), True)
    with pytest.raises(ValueError, match="272 bytes, got 271"):
        quant.from_gguf(raw.reshape(-1)[:-1], int(QT.Q8_0), (4, 64), True)
    with pytest.raises(ValueError, match="not a whole number"):
        quant.from_gguf(raw, int(QT.Q8_0), (8, 48), True)
    big = raw_blocks(QT.Q4_0, 1, 32)
    big[0, :2] = np.array([9000], np.float16).view(np.uint8)
    with pytest.raises(ValueError, match="overflow"):
        quant.from_gguf(big, int(QT.Q4_0), (1, 32), False)


def assert_same_weights(float_weights, quantized_weights):
    """Every weight of the quantized load dequantizes to the float load's, bit for bit
    (neither file below has Q4_0); returns the names that came quantized."""
    assert list(quantized_weights) == list(float_weights)
    deq = jax.jit(quant.dequantize)
    names = []
    for name, w in quantized_weights.items():
        expected = float_weights[name]
        if isinstance(w, quant.QuantizedWeight):
            names.append(name)
            got = deq(w)
            assert got.shape == expected.shape, name
            np.testing.assert_array_equal(bits(got), bits(expected), err_msg=name)
        else:
            assert w.dtype == np.float32 and w.shape == expected.shape, name
            np.testing.assert_array_equal(bits(w), bits(expected), err_msg=name)
    return names


def test_smollm2_quantized_load_is_lossless(smollm2_gguf):
    """The real file (Q4_1 matrices, a Q8_0 embedding): the quantized weights are the float
    loader's model exactly, with the Q/K output columns un-permuted the same way."""
    cfg, float_weights, _ = load_gguf(smollm2_gguf)
    qcfg, quantized, _ = load_gguf(smollm2_gguf, quantized=True)
    assert qcfg == cfg
    names = assert_same_weights(float_weights, quantized)
    assert len(names) == 1 + 7 * cfg.num_layers  # the embedding and every linear weight
    embed, wq = quantized["embed"], quantized["layers.0.wq"]
    assert (embed.kind, embed.axis, embed.group_size) == ("int8", 1, 32)
    assert (wq.kind, wq.axis, wq.q.shape) == ("int4", 0, (cfg.d_model // 2, cfg.q_dim))
    total = sum(quant.nbytes(w) if isinstance(w, quant.QuantizedWeight) else w.nbytes
                for w in quantized.values())
    assert total < sum(w.nbytes for w in float_weights.values()) / 5


def write_small_model(path) -> dict:
    """A one-layer llama GGUF with a matrix of each type; returns {tensor name: type}."""
    D, F, V, n_head, n_kv = 256, 512, 64, 4, 2
    hd = D // n_head
    types = {
        "token_embd.weight": (QT.Q4_K, (V, D)), "output.weight": (QT.Q6_K, (V, D)),
        "blk.0.attn_q.weight": (QT.Q4_K, (D, D)), "blk.0.attn_k.weight": (QT.Q6_K, (n_kv * hd, D)),
        "blk.0.attn_v.weight": (QT.Q5_K, (n_kv * hd, D)),  # no quantized form: float
        "blk.0.attn_output.weight": (QT.Q8_0, (D, D)), "blk.0.ffn_gate.weight": (QT.Q4_1, (F, D)),
        "blk.0.ffn_up.weight": (QT.Q4_K, (F, D)), "blk.0.ffn_down.weight": (QT.F16, (D, F)),
    }
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 1, "context_length": 128, "embedding_length": D,
                       "feed_forward_length": F, "attention.head_count": n_head,
                       "attention.head_count_kv": n_kv, "vocab_size": V}.items():
        writer.add_key_value(f"llama.{key}", value, gguf.GGUFValueType.UINT32)
    rng = np.random.default_rng(3)
    for i, (name, (qtype, shape)) in enumerate(types.items()):
        if qtype == QT.F16:
            writer.add_tensor(name, rng.standard_normal(shape).astype(np.float16))
        else:
            writer.add_tensor(name, raw_blocks(qtype, *shape, seed=i), raw_dtype=qtype)
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        writer.add_tensor(name, rng.standard_normal(D).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def test_every_type_and_lm_head(tmp_path):
    path = tmp_path / "small.gguf"
    write_small_model(path)
    cfg, float_weights, _ = load_gguf(str(path))
    _, quantized, _ = load_gguf(str(path), quantized=True)
    names = assert_same_weights(float_weights, quantized)
    assert sorted(names) == sorted(["embed", "lm_head", "layers.0.wq", "layers.0.wk",
                                    "layers.0.wo", "layers.0.w_gate", "layers.0.w_up"])
    kinds = {n: (quantized[n].kind, quantized[n].axis, quantized[n].group_size) for n in names}
    assert kinds["embed"] == ("int4", 1, 32) and kinds["lm_head"] == ("int8", 0, 16)
    assert kinds["layers.0.wk"] == ("int8", 0, 16) and kinds["layers.0.wo"] == ("int8", 0, 32)
    assert quantized["lm_head"].shape == (cfg.d_model, cfg.vocab_size)
