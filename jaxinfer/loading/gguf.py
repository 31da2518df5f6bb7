"""Reading GGUF files: metadata, model config and (dequantized) weights.

GGUF stores a 2-D weight of logical shape [out, in] with `shape == [in, out]` (ggml order) and
the data laid out row-major as [out, in]. Llama-family Q and K projections are stored permuted
for interleaved ("GPT-J style") RoPE; `_unpermute_qk` restores the half-rotation layout that the
model uses (the layout of HF checkpoints).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jaxinfer.config import ModelConfig

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


class ModelFileError(ValueError):
    """A model file is missing, empty, truncated, corrupt or of an unsupported kind."""


def _open_reader(path: str):
    import gguf

    if not os.path.exists(path):
        raise ModelFileError(f"model file {path!r} does not exist")
    size = os.path.getsize(path)
    if size == 0:
        raise ModelFileError(f"model file {path!r} is empty (0 bytes)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFileError(
            f"model file {path!r} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # gguf raises assorted errors on damaged files
        raise ModelFileError(f"model file {path!r} is truncated or corrupt: {e}") from e
    # A truncated file can still parse its header; check that every tensor lies inside the file.
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ModelFileError(
                f"model file {path!r} is truncated: tensor {t.name!r} ends at byte {end}, "
                f"file has {size} bytes")
    return reader


def _field_value(field) -> Any:
    import gguf

    types = field.types
    if types and types[0] == gguf.GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    value = field.contents()
    return value


def read_metadata(path: str) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values (str, int, float, bool, list)."""
    reader = _open_reader(path)
    return {name: _field_value(field) for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def config_from_metadata(meta: dict[str, Any], path: str = "<gguf>") -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(
            f"unsupported architecture {arch!r} in {path!r}; supported: {SUPPORTED_ARCHITECTURES}")

    def get(key, default=None, required=True):
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if required and default is None:
            raise ModelFileError(f"GGUF metadata of {path!r} lacks {full!r}")
        return default

    num_heads = int(get("attention.head_count"))
    d_model = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", d_model // num_heads, required=False))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    if not vocab:
        raise ModelFileError(f"GGUF metadata of {path!r} gives no vocabulary size")
    scaling = None
    if meta.get(f"{arch}.rope.scaling.type") == "llama3" or f"{arch}.rope.scaling.factor" in meta:
        raise ModelFileError(
            f"{path!r}: RoPE scaling in GGUF metadata is not supported; llama3 scaling comes "
            "from a rope_freqs tensor, which this loader does not read")
    window = get("attention.sliding_window", 0, required=False) or None
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        d_model=d_model,
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads, required=False)),
        head_dim=head_dim,
        ffn_dim=int(get("feed_forward_length")),
        rope_theta=float(get("rope.freq_base", 10000.0, required=False)),
        rope_scaling=scaling,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5, required=False)),
        max_position_embeddings=int(get("context_length", 2048, required=False)),
        tie_word_embeddings=True,  # corrected by load_weights when output.weight exists
        attention_bias=(arch == "qwen2"),
        sliding_window=int(window) if window else None,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    # w: [n_heads * hd, D] stored interleaved (pairs) per head -> half-rotation layout.
    out_dim, d = w.shape
    hd = out_dim // n_heads
    return w.reshape(n_heads, hd // 2, 2, d).swapaxes(1, 2).reshape(out_dim, d)


def _unpermute_qk_bias(b: np.ndarray, n_heads: int) -> np.ndarray:
    hd = b.shape[0] // n_heads
    return b.reshape(n_heads, hd // 2, 2).swapaxes(1, 2).reshape(-1)


def _dequantize(t) -> np.ndarray:
    import gguf

    # Logical shape, outermost first: reverse of ggml's [ne0, ne1, ...].
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                         gguf.GGMLQuantizationType.BF16):
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    else:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(arr, dtype=np.float32).reshape(shape)


# Per-layer GGUF tensor names -> (our name, transpose to [in, out]).
_LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm",
    "ffn_norm.weight": "mlp_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_output.weight": "wo",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
    "attn_q.bias": "bq",
    "attn_k.bias": "bk",
    "attn_v.bias": "bv",
}


def load_gguf(path: str) -> tuple[ModelConfig, dict[str, np.ndarray], dict[str, Any]]:
    """Loads a GGUF model.

    Returns (config, weights, metadata). weights uses the names of `jaxinfer.models.llama`:
    "embed" [V, D], "final_norm" [D], optional "lm_head" [D, V], and per layer i
    "layers.{i}.{name}" with linear weights as [in, out] float32 arrays.
    """
    reader = _open_reader(path)
    meta = {name: _field_value(field) for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}
    cfg = config_from_metadata(meta, path)
    tensors = {t.name: t for t in reader.tensors}
    permuted = cfg.architecture in ("llama", "mistral")  # convert_hf_to_gguf permutes these only

    def need(name):
        if name not in tensors:
            raise ModelFileError(f"model file {path!r} lacks tensor {name!r}")
        return _dequantize(tensors[name])

    weights: dict[str, np.ndarray] = {}
    weights["embed"] = need("token_embd.weight")
    weights["final_norm"] = need("output_norm.weight")
    if "output.weight" in tensors:
        weights["lm_head"] = need("output.weight").T
        cfg = cfg.replace(tie_word_embeddings=False)
    for i in range(cfg.num_layers):
        for gname, name in _LAYER_TENSORS.items():
            full = f"blk.{i}.{gname}"
            if full not in tensors:
                if name.startswith("b"):
                    continue
                raise ModelFileError(f"model file {path!r} lacks tensor {full!r}")
            w = _dequantize(tensors[full])
            if permuted and name in ("wq", "wk"):
                w = _unpermute_qk(w, cfg.num_heads if name == "wq" else cfg.num_kv_heads)
            if permuted and name in ("bq", "bk"):
                w = _unpermute_qk_bias(w, cfg.num_heads if name == "bq" else cfg.num_kv_heads)
            if w.ndim == 2:
                w = np.ascontiguousarray(w.T)  # [out, in] -> [in, out]
            weights[f"layers.{i}.{name}"] = w
    if any(k.endswith(".bq") for k in weights):
        cfg = cfg.replace(attention_bias=True)
    expected = (cfg.vocab_size, cfg.d_model)
    if weights["embed"].shape != expected:
        raise ModelFileError(
            f"model file {path!r}: token_embd has shape {weights['embed'].shape}, "
            f"metadata implies {expected}")
    return cfg, weights, meta
