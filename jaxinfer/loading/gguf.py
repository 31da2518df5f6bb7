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
    """ModelConfig from GGUF metadata. Llama-3 RoPE scaling is not metadata but the
    `rope_freqs.weight` tensor; `load_gguf` adds it as `rope_freq_factors`."""
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
    value_dim = int(get("attention.value_length", head_dim, required=False))
    if value_dim != head_dim:
        raise ModelFileError(f"{path!r}: {arch}.attention.value_length {value_dim} differs from "
                             f"the key length {head_dim}, which is not supported")
    rope_dim = int(get("rope.dimension_count", head_dim, required=False))
    if rope_dim != head_dim:
        raise ModelFileError(f"{path!r}: {arch}.rope.dimension_count {rope_dim} differs from the "
                             f"head dim {head_dim}; partial rotary embeddings are not supported")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    if not vocab:
        raise ModelFileError(f"GGUF metadata of {path!r} gives no vocabulary size")
    # llama.cpp writes linear/yarn/longrope scaling as metadata (and old files a bare
    # `rope.scale_linear` factor); Llama-3 scaling comes as the rope_freqs tensor instead.
    scaling_type = get("rope.scaling.type", "none", required=False)
    if scaling_type != "none":
        raise ModelFileError(f"{path!r}: unsupported RoPE scaling type {scaling_type!r} "
                             f"({arch}.rope.scaling.type); supported: 'none' and Llama-3 "
                             "scaling given by a rope_freqs tensor")
    for key in ("rope.scaling.factor", "rope.scale_linear"):
        factor = get(key, 0.0, required=False)
        if float(factor) not in (0.0, 1.0):
            raise ModelFileError(f"{path!r}: unsupported RoPE scaling factor {factor!r} "
                                 f"({arch}.{key})")
    window = get("attention.sliding_window", 0, required=False) or None
    try:
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
            rope_scaling=None,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5, required=False)),
            max_position_embeddings=int(get("context_length", 2048, required=False)),
            tie_word_embeddings=True,  # corrected by load_gguf when output.weight exists
            attention_bias=(arch == "qwen2"),  # corrected by load_gguf from the tensors present
            sliding_window=int(window) if window else None,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        )
    except ValueError as e:  # ModelConfig's own consistency checks
        raise ModelFileError(f"{path!r}: {e}") from None


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    # w: [n_heads * hd, D] stored interleaved (pairs) per head -> half-rotation layout.
    out_dim, d = w.shape
    hd = out_dim // n_heads
    return w.reshape(n_heads, hd // 2, 2, d).swapaxes(1, 2).reshape(out_dim, d)


def _unpermute_qk_bias(b: np.ndarray, n_heads: int) -> np.ndarray:
    hd = b.shape[0] // n_heads
    return b.reshape(n_heads, hd // 2, 2).swapaxes(1, 2).reshape(-1)


def _logical_shape(t) -> tuple[int, ...]:
    """Shape outermost first: the reverse of ggml's [ne0, ne1, ...]."""
    return tuple(int(x) for x in reversed(t.shape.tolist()))


def _dequantize(t) -> np.ndarray:
    import gguf

    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(arr, dtype=np.float32).reshape(_logical_shape(t))


# Per-layer GGUF tensor names -> our names.
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
}
_BIASES = {"attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv"}
# Biases the model has no slot for: accepted only when all zero.
_UNSUPPORTED_BIASES = ("attn_output.bias", "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias")


def load_gguf(path: str) -> tuple[ModelConfig, dict[str, np.ndarray], dict[str, Any]]:
    """Loads a GGUF model.

    Returns (config, weights, metadata). weights uses the names of `jaxinfer.models.llama`:
    "embed" [V, D], "final_norm" [D], optional "lm_head" [D, V], and per layer i
    "layers.{i}.{name}" with linear weights as [in, out] float32 arrays. Every tensor's shape is
    checked against the metadata before it is read. A `rope_freqs.weight` tensor (Llama-3 RoPE
    scaling as llama.cpp stores it) becomes `config.rope_freq_factors`.
    """
    reader = _open_reader(path)
    meta = {name: _field_value(field) for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}
    cfg = config_from_metadata(meta, path)
    tensors = {t.name: t for t in reader.tensors}
    permuted = cfg.architecture in ("llama", "mistral")  # convert_hf_to_gguf permutes these only
    arch = cfg.architecture
    H = cfg.head_dim
    dims = {"V": cfg.vocab_size, "D": cfg.d_model, "F": cfg.ffn_dim, "Q": cfg.q_dim,
            "KV": cfg.kv_dim, "H/2": H // 2}
    dim_sources = {  # the metadata that fixes each dimension, for error messages
        "V": f"{arch}.vocab_size={dims['V']}", "D": f"{arch}.embedding_length={dims['D']}",
        "F": f"{arch}.feed_forward_length={dims['F']}",
        "Q": f"{arch}.attention.head_count={cfg.num_heads} x head dim {H}",
        "KV": f"{arch}.attention.head_count_kv={cfg.num_kv_heads} x head dim {H}",
        "H/2": f"head dim {H} / 2",
    }
    layer_shapes = {  # logical shapes, [out, in] for linear weights
        "attn_norm.weight": ("D",), "ffn_norm.weight": ("D",),
        "attn_q.weight": ("Q", "D"), "attn_k.weight": ("KV", "D"), "attn_v.weight": ("KV", "D"),
        "attn_output.weight": ("D", "Q"), "ffn_gate.weight": ("F", "D"),
        "ffn_up.weight": ("F", "D"), "ffn_down.weight": ("D", "F"), "attn_q.bias": ("Q",),
        "attn_k.bias": ("KV",), "attn_v.bias": ("KV",), "attn_output.bias": ("D",),
        "ffn_gate.bias": ("F",), "ffn_up.bias": ("F",), "ffn_down.bias": ("D",),
    }

    def read(name: str, symbols: tuple[str, ...]) -> np.ndarray:
        if name not in tensors:
            raise ModelFileError(f"model file {path!r} lacks tensor {name!r}")
        got, shape = _logical_shape(tensors[name]), tuple(dims[s] for s in symbols)
        if got != shape:
            why = ", ".join(dim_sources[s] for s in dict.fromkeys(symbols))
            raise ModelFileError(f"model file {path!r}: tensor {name!r} has shape {got}; the "
                                 f"metadata implies {shape} ({why})")
        return _dequantize(tensors[name])

    weights: dict[str, np.ndarray] = {}
    weights["embed"] = read("token_embd.weight", ("V", "D"))
    weights["final_norm"] = read("output_norm.weight", ("D",))
    if "output.weight" in tensors:
        weights["lm_head"] = np.ascontiguousarray(read("output.weight", ("V", "D")).T)
    cfg = cfg.replace(tie_word_embeddings="output.weight" not in tensors)

    if "rope_freqs.weight" in tensors:
        factors = read("rope_freqs.weight", ("H/2",))
        if not np.all(np.isfinite(factors) & (factors > 0)):
            raise ModelFileError(f"model file {path!r}: tensor 'rope_freqs.weight' has "
                                 f"non-positive or non-finite factors {factors.tolist()}")
        if np.any(factors != 1.0):
            cfg = cfg.replace(rope_freq_factors=tuple(float(f) for f in factors))

    # Qwen2 always has q/k/v biases; llama-family files may carry them (attention_bias).
    has_bias = cfg.architecture == "qwen2" or any(
        f"blk.{i}.{b}" in tensors for i in range(cfg.num_layers) for b in _BIASES)
    cfg = cfg.replace(attention_bias=has_bias)
    for i in range(cfg.num_layers):
        for gname, name in (_LAYER_TENSORS | (_BIASES if has_bias else {})).items():
            full = f"blk.{i}.{gname}"
            if name.startswith("b") and full not in tensors and cfg.architecture != "qwen2":
                # llama.cpp treats each llama bias as optional: an absent one is zero.
                w = np.zeros([dims[d] for d in layer_shapes[gname]], np.float32)
            else:
                w = read(full, layer_shapes[gname])
            if permuted and name in ("wq", "wk"):
                w = _unpermute_qk(w, cfg.num_heads if name == "wq" else cfg.num_kv_heads)
            if permuted and name in ("bq", "bk"):
                w = _unpermute_qk_bias(w, cfg.num_heads if name == "bq" else cfg.num_kv_heads)
            if w.ndim == 2:
                w = np.ascontiguousarray(w.T)  # [out, in] -> [in, out]
            weights[f"layers.{i}.{name}"] = w
        for gname in _UNSUPPORTED_BIASES:
            full = f"blk.{i}.{gname}"
            if full in tensors and np.any(read(full, layer_shapes[gname])):
                raise ModelFileError(f"model file {path!r}: a non-zero {full!r} is not supported")
    return cfg, weights, meta
