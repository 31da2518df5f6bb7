"""GGUF loader against the tiny HF models of tests/data/tiny_models and their transformers logits.

Each tiny HF checkpoint is converted to GGUF here the way llama.cpp's convert_hf_to_gguf.py does
it: Llama and Mistral become architecture "llama" with Q/K rows permuted for interleaved RoPE,
Qwen2 stays "qwen2" (nothing permuted, q/k/v biases kept), Llama-3 RoPE scaling becomes a
`rope_freqs.weight` tensor of per-frequency factors, tied embeddings mean no `output.weight`.
The converted file goes through `load_gguf` and the model, and the logits must match the
golden.npz that HF transformers computed from the original checkpoint (see
tests/data/README.md). The conversion reads the checkpoints with the `safetensors` package,
not with jaxinfer's own loader.
"""

import json
import math
import os

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from jaxinfer.config import RopeScaling
from jaxinfer.layers.rope import rope_inv_freq
from jaxinfer.loading.gguf import load_gguf
from jaxinfer.models import llama
from jaxinfer.models import sequence_logits

TINY = os.path.join(os.path.dirname(__file__), "..", "data", "tiny_models")
ATOL = 1e-4
Q8 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32
VT = gguf.GGUFValueType

# HF per-layer tensor suffix -> GGUF per-layer name.
HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: half-rotation rows -> interleaved pairs, per head."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, old_context_len: int) -> np.ndarray:
    """The rope_freqs tensor of llama.cpp's LlamaModel.generate_extra_tensors (float32 math)."""
    freqs = 1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = np.float32(2 * math.pi) / freq
        if wavelen < high_freq_wavelen:
            out.append(1.0)
        elif wavelen > low_freq_wavelen:
            out.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor
                                                                      - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def convert(name: str, path: str, qtype=F32, *, sliding_window: bool = True,
            meta_changes: dict | None = None, drop: tuple = (),
            extra_tensors: dict | None = None) -> str:
    """Writes tiny_models/<name> as a GGUF file at `path`.

    qtype: type of the 2-D weights (norms, biases and rope_freqs stay F32, as in llama.cpp's
    Q8_0 output). sliding_window: write `{arch}.attention.sliding_window` for a Mistral model
    (llama.cpp's converter itself does not; see test_mistral_without_window_metadata).
    meta_changes / drop / extra_tensors: corrupt the file for the error tests.
    """
    src = os.path.join(TINY, name)
    with open(os.path.join(src, "config.json")) as f:
        hf = json.load(f)
    tensors = safetensors.numpy.load_file(os.path.join(src, "model.safetensors"))
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}[hf["model_type"]]
    rope = hf["rope_parameters"]
    n_head, n_kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_head

    meta = {  # key -> (value, type), as TextModel/LlamaModel/Qwen2Model.set_gguf_parameters
        "block_count": (hf["num_hidden_layers"], VT.UINT32),
        "context_length": (hf["max_position_embeddings"], VT.UINT32),
        "embedding_length": (hf["hidden_size"], VT.UINT32),
        "feed_forward_length": (hf["intermediate_size"], VT.UINT32),
        "attention.head_count": (n_head, VT.UINT32),
        "attention.head_count_kv": (n_kv, VT.UINT32),
        "rope.freq_base": (rope["rope_theta"], VT.FLOAT32),
        "attention.layer_norm_rms_epsilon": (hf["rms_norm_eps"], VT.FLOAT32),
        "attention.key_length": (head_dim, VT.UINT32),
        "attention.value_length": (head_dim, VT.UINT32),
    }
    if arch == "llama":  # Qwen2Model writes neither: the vocab size comes from the token list
        meta["vocab_size"] = (hf["vocab_size"], VT.UINT32)
        meta["rope.dimension_count"] = (head_dim, VT.UINT32)
    if hf["model_type"] == "mistral" and sliding_window and hf.get("sliding_window"):
        meta["attention.sliding_window"] = (hf["sliding_window"], VT.UINT32)
    for key, value in (meta_changes or {}).items():
        if value is None:
            meta.pop(key)
        else:
            meta[key] = (value, meta[key][1] if key in meta else
                         {int: VT.UINT32, float: VT.FLOAT32, str: VT.STRING}[type(value)])

    out = {"token_embd.weight": tensors["model.embed_tokens.weight"],
           "output_norm.weight": tensors["model.norm.weight"]}
    if "lm_head.weight" in tensors:
        out["output.weight"] = tensors["lm_head.weight"]
    if rope["rope_type"] == "llama3":
        # llama.cpp reads original_max_position_embeddings from the top-level config (default
        # 8192, which is what Llama 3.x has); this tiny model only has it in rope_parameters.
        out["rope_freqs.weight"] = llama3_rope_factors(
            head_dim, rope["rope_theta"], rope["factor"], rope["low_freq_factor"],
            rope["high_freq_factor"], rope["original_max_position_embeddings"])
    for i in range(hf["num_hidden_layers"]):
        for suffix, gname in HF_TO_GGUF.items():
            w = tensors.get(f"model.layers.{i}.{suffix}")
            if w is None:
                continue
            if arch == "llama" and gname.startswith("attn_q."):
                w = llama_cpp_permute(w, n_head)
            if arch == "llama" and gname.startswith("attn_k."):
                w = llama_cpp_permute(w, n_kv)
            out[f"blk.{i}.{gname}"] = w
    out.update(extra_tensors or {})

    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    for key, (value, vtype) in meta.items():
        writer.add_key_value(f"{arch}.{key}", value, vtype)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(hf["vocab_size"])])
    writer.add_bos_token_id(hf["bos_token_id"])
    writer.add_eos_token_id(hf["eos_token_id"])
    for tname, w in out.items():
        if tname in drop:
            continue
        w = np.ascontiguousarray(w, dtype=np.float32)
        if qtype != F32 and w.ndim == 2:
            writer.add_tensor(tname, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(tname, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def model_logits(cfg, weights, input_ids):
    """Logits [1, T, V] of one forward over all T tokens from an empty cache."""
    params = llama.LLAMA.params_from_weights(cfg, weights, jnp.float32)
    return np.asarray(sequence_logits(params, cfg, jnp.asarray(input_ids)))


def golden(name):
    return np.load(os.path.join(TINY, name, "golden.npz"))


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral_sw", "llama3_rope"])
def test_f32_logits_match_transformers(gguf_dir, name):
    cfg, weights, meta = load_gguf(convert(name, str(gguf_dir / f"{name}.gguf")))
    g = golden(name)
    logits = model_logits(cfg, weights, g["input_ids"])
    assert logits.shape == g["logits"].shape
    np.testing.assert_allclose(logits, g["logits"], rtol=0, atol=ATOL)


def test_config_and_weights(gguf_dir):
    cfg, weights, meta = load_gguf(convert("llama", str(gguf_dir / "llama_cfg.gguf")))
    assert meta["general.architecture"] == "llama"
    assert (cfg.architecture, cfg.vocab_size, cfg.d_model, cfg.num_layers) == ("llama", 256, 64, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim) == (4, 2, 16, 128)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.max_position_embeddings) == (1, 2, 512)
    assert not cfg.tie_word_embeddings and not cfg.attention_bias and cfg.sliding_window is None
    assert cfg.rope_freq_factors is None and cfg.rope_scaling is None
    # Q/K come back in the HF (half-rotation) layout: exactly the HF weights, transposed.
    hf = safetensors.numpy.load_file(os.path.join(TINY, "llama", "model.safetensors"))
    for ours, theirs in [("wq", "q_proj"), ("wk", "k_proj"), ("wo", "o_proj")]:
        np.testing.assert_array_equal(weights[f"layers.1.{ours}"],
                                      hf[f"model.layers.1.self_attn.{theirs}.weight"].T)
    np.testing.assert_array_equal(weights["lm_head"], hf["lm_head.weight"].T)

    cfg, weights, _ = load_gguf(convert("qwen2", str(gguf_dir / "qwen2_cfg.gguf")))
    assert cfg.architecture == "qwen2" and cfg.vocab_size == 256 and cfg.rope_theta == 1e6
    assert cfg.attention_bias and cfg.sliding_window is None
    hf = safetensors.numpy.load_file(os.path.join(TINY, "qwen2", "model.safetensors"))
    np.testing.assert_array_equal(weights["layers.0.bk"],  # not permuted for qwen2
                                  hf["model.layers.0.self_attn.k_proj.bias"])

    cfg, weights, _ = load_gguf(convert("llama3_rope", str(gguf_dir / "llama3_cfg.gguf")))
    assert cfg.tie_word_embeddings and "lm_head" not in weights
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is None
    assert len(cfg.rope_freq_factors) == 8 and cfg.rope_freq_factors[0] == 1.0
    assert cfg.rope_freq_factors[-1] == 8.0 and 1.0 < cfg.rope_freq_factors[1] < 8.0

    cfg, _, _ = load_gguf(convert("mistral_sw", str(gguf_dir / "mistral_cfg.gguf")))
    assert cfg.architecture == "llama" and cfg.sliding_window == 8


def test_mistral_without_window_metadata(gguf_dir):
    """llama.cpp's converter writes no sliding window for MistralForCausalLM. Such a file loads as
    full attention: the logits equal HF's within the window (positions 0-7) and not after."""
    path = convert("mistral_sw", str(gguf_dir / "mistral_nowin.gguf"), sliding_window=False)
    cfg, weights, _ = load_gguf(path)
    assert cfg.sliding_window is None
    g = golden("mistral_sw")
    logits = model_logits(cfg, weights, g["input_ids"])
    np.testing.assert_allclose(logits[:, :8], g["logits"][:, :8], rtol=0, atol=ATOL)
    assert np.abs(logits[:, 8:] - g["logits"][:, 8:]).max() > 1.0


def hf_weights(name: str) -> dict[str, np.ndarray]:
    """The HF checkpoint's tensors under jaxinfer's names, linear weights [in, out]."""
    hf = safetensors.numpy.load_file(os.path.join(TINY, name, "model.safetensors"))
    ours = {"attn_norm.weight": "attn_norm", "ffn_norm.weight": "mlp_norm",
            "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv",
            "attn_output.weight": "wo", "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up",
            "ffn_down.weight": "w_down", "attn_q.bias": "bq", "attn_k.bias": "bk",
            "attn_v.bias": "bv"}
    out = {"embed": hf["model.embed_tokens.weight"], "final_norm": hf["model.norm.weight"]}
    if "lm_head.weight" in hf:
        out["lm_head"] = hf["lm_head.weight"].T
    for key, w in hf.items():
        if key.startswith("model.layers."):
            i, suffix = key.split(".", 3)[2:]
            out[f"layers.{i}.{ours[HF_TO_GGUF[suffix]]}"] = w.T if w.ndim == 2 else w
    return out


def q8_0_roundtrip(rows: np.ndarray) -> np.ndarray:
    """gguf's dequantization of the Q8_0 encoding of `rows` (blocks of 32 along each row)."""
    return gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(rows), Q8), Q8)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_q8_0(gguf_dir, name):
    cfg, weights, _ = load_gguf(convert(name, str(gguf_dir / f"{name}_q8.gguf"), Q8))
    # The float model that the Q8_0 file stands for: the HF weights run through gguf's own
    # quantize/dequantize (HF's GGUF loading dequantizes with the same function). Computed on
    # the HF layout: Q8_0 blocks run along rows and llama.cpp's permutation only reorders rows,
    # so permuting commutes with quantizing.
    expected = {}
    for key, w in hf_weights(name).items():
        if key == "embed":
            expected[key] = q8_0_roundtrip(w)              # stored [V, D]: rows are tokens
        elif w.ndim == 2:
            expected[key] = q8_0_roundtrip(w.T).T          # stored [out, in]
        else:
            expected[key] = w                              # norms and biases stay F32
        assert w.ndim == 1 or not np.array_equal(expected[key], w), key  # really quantized
    assert weights.keys() == expected.keys()
    for key in weights:
        np.testing.assert_array_equal(weights[key], expected[key], err_msg=key)
    g = golden(name)
    logits = model_logits(cfg, weights, g["input_ids"])
    np.testing.assert_allclose(logits, model_logits(cfg, expected, g["input_ids"]),
                               rtol=0, atol=ATOL)
    # Against the float HF logits, quantization shows: measured max |diff| 0.35 (llama) and
    # 0.37 (qwen2), mean 0.04, on logits of std ~1.7 (these tiny models have large random
    # weights, initializer_range 0.2). A Q8_0 weight is off by up to 0.4% of its block's
    # largest one, about what scaling one layer's w_down by 1.01 does (max diff 0.36 here).
    # The bound of 1.0 still catches layout mistakes: one un-permuted Q gives 9.
    diff = np.abs(logits - g["logits"])
    assert ATOL < diff.max() < 1.0, diff.max()
    assert diff.mean() < 0.1, diff.mean()


LLAMA3 = [(16, 500000.0, RopeScaling(8.0, 1.0, 4.0, 64)),        # the tiny model: all 3 regimes
          (128, 500000.0, RopeScaling(8.0, 1.0, 4.0, 8192)),      # Llama 3.1
          (64, 500000.0, RopeScaling(32.0, 1.0, 4.0, 8192))]      # Llama 3.2


@pytest.mark.parametrize("head_dim, theta, s", LLAMA3)
def test_rope_freq_factors_equal_llama3_scaling(head_dim, theta, s):
    factors = llama3_rope_factors(head_dim, theta, s.factor, s.low_freq_factor,
                                  s.high_freq_factor, s.original_max_position_embeddings)
    from_factors = rope_inv_freq(head_dim, theta, freq_factors=tuple(factors.tolist()))
    from_scaling = rope_inv_freq(head_dim, theta, s)
    np.testing.assert_allclose(from_factors, from_scaling, rtol=1e-6, atol=0)
    assert not np.allclose(from_scaling, rope_inv_freq(head_dim, theta))


def test_rope_inv_freq_rejects_bad_factors():
    s = RopeScaling(8.0, 1.0, 4.0, 64)
    with pytest.raises(ValueError, match="not both"):
        rope_inv_freq(16, 1e4, s, freq_factors=(1.0,) * 8)
    with pytest.raises(ValueError, match=r"shape \(7,\)"):
        rope_inv_freq(16, 1e4, freq_factors=(1.0,) * 7)
    with pytest.raises(ValueError, match="positive"):
        rope_inv_freq(16, 1e4, freq_factors=(1.0,) * 7 + (0.0,))


@pytest.mark.parametrize("kwargs, needle", [
    ({"drop": ("blk.1.ffn_up.weight",)}, "lacks tensor 'blk.1.ffn_up.weight'"),
    ({"drop": ("token_embd.weight",)}, "lacks tensor 'token_embd.weight'"),
    ({"meta_changes": {"vocab_size": 300}},
     r"'token_embd.weight' has shape \(256, 64\); the metadata implies \(300, 64\) "
     r"\(llama.vocab_size=300, llama.embedding_length=64\)"),
    ({"meta_changes": {"embedding_length": 32, "attention.key_length": None,
                       "attention.value_length": None, "rope.dimension_count": None}},
     r"'token_embd.weight' has shape \(256, 64\); the metadata implies \(256, 32\)"),
    ({"meta_changes": {"attention.head_count_kv": 4}},
     r"'blk.0.attn_k.weight' has shape \(32, 64\); the metadata implies \(64, 64\) "
     r"\(llama.attention.head_count_kv=4"),
    ({"meta_changes": {"rope.scaling.type": "yarn"}}, "unsupported RoPE scaling type 'yarn'"),
    ({"meta_changes": {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}},
     "unsupported RoPE scaling type 'linear'"),
    ({"meta_changes": {"rope.scale_linear": 2.0}}, r"factor 2.0 \(llama.rope.scale_linear\)"),
    ({"meta_changes": {"rope.dimension_count": 8}}, "rope.dimension_count 8"),
    ({"extra_tensors": {"rope_freqs.weight": np.ones(7, np.float32)}},
     r"'rope_freqs.weight' has shape \(7,\); the metadata implies \(8,\)"),
    ({"extra_tensors": {"rope_freqs.weight": np.zeros(8, np.float32)}}, "non-positive"),
    ({"extra_tensors": {"blk.0.attn_output.bias": np.ones(64, np.float32)}},
     "non-zero 'blk.0.attn_output.bias'"),
])
def test_bad_files(gguf_dir, kwargs, needle):
    path = convert("llama", str(gguf_dir / "bad.gguf"), **kwargs)
    with pytest.raises(ValueError, match=needle) as e:
        load_gguf(path)
    assert "bad.gguf" in str(e.value)


def test_qwen2_requires_biases(gguf_dir):
    path = convert("qwen2", str(gguf_dir / "qwen2_nobias.gguf"), drop=("blk.1.attn_v.bias",))
    with pytest.raises(ValueError, match="lacks tensor 'blk.1.attn_v.bias'"):
        load_gguf(path)


def test_llama_biases_optional_each(gguf_dir):
    """llama.cpp treats each llama q/k/v bias as optional: a file with only some loads, the
    absent ones as zero, and a q bias is un-permuted like the q rows."""
    rng = np.random.default_rng(0)
    bq = rng.normal(size=64).astype(np.float32)
    path = convert("llama", str(gguf_dir / "llama_bq.gguf"),
                   extra_tensors={"blk.0.attn_q.bias": llama_cpp_permute(bq, 4)})
    cfg, weights, _ = load_gguf(path)
    assert cfg.attention_bias
    np.testing.assert_array_equal(weights["layers.0.bq"], bq)
    assert not weights["layers.0.bk"].any() and not weights["layers.1.bq"].any()
