"""Reading GGUF files: metadata, model config and weights.

GGUF stores a matrix of logical shape [out, in] row-major, with dims in ggml order. Llama and
Mistral files store Q and K permuted for interleaved RoPE; `_unpermute_qk` restores the
half-rotation layout of HF checkpoints that the model uses. The file is parsed by
`gguf_file` and every tensor decoded by `quant.gguf_blocks`, bit for bit as gguf-py.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Union

import numpy as np

from jaxinfer import quant
from jaxinfer.config import ModelConfig
from jaxinfer.models import REGISTRY, get_model
from jaxinfer.loading.gguf_file import (GGMLType, GGUFFile, ModelFileError, TensorInfo,
                                        ggml_type_name)
from jaxinfer.quant import gguf_blocks
from jaxinfer.quant.gguf_blocks import to_float

SUPPORTED_ARCHITECTURES = tuple(sorted(REGISTRY))
Weight = Union[np.ndarray, quant.QuantizedWeight]


def read_metadata(path: str) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values."""
    return dict(GGUFFile(path).metadata)


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
    family = gguf_family(meta)
    try:
        common = dict(
            architecture=family,
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
        # The family's own fields (experts, per-layer attention, QK-norm).
        return ModelConfig(**(common | get_model(family).gguf_config(meta, get, path)))
    except ModelFileError:
        raise
    except ValueError as e:  # ModelConfig's own consistency checks
        raise ModelFileError(f"{path!r}: {e}") from None


# Threads that dequantize tensors in a float load (numpy releases the GIL in the block
# arithmetic). Loads that keep the file's codes use one: a second gains little and raises the
# peak memory (docs/quantization.md).
LOAD_THREADS = 2


def _in_order(jobs: list[Callable[[], Any]], threads: int) -> list:
    """The jobs' results in order, run on `threads` threads (the first failure in order is
    raised); one thread is the caller's own (a worker's malloc arena kept its memory)."""
    if threads == 1:
        return [job() for job in jobs]
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
        futures = [pool.submit(job) for job in jobs]
        return [f.result() for f in futures]


def gguf_family(meta: dict[str, Any]) -> str:
    """The models registry name of a GGUF file: its general.architecture, but "mixtral" for a
    "llama" file with experts (how llama.cpp writes Mixtral)."""
    arch = meta.get("general.architecture")
    if arch == "llama" and int(meta.get("llama.expert_count") or 0) > 0:
        return "mixtral"
    return arch


def _permutes_qk(meta: dict[str, Any]) -> bool:
    """convert_hf_to_gguf permutes Q and K for interleaved RoPE in llama and mistral files
    only (Mixtral included, written as llama)."""
    return meta.get("general.architecture") in ("llama", "mistral")


def _unpermute_qk(w: Weight, n_heads: int) -> Weight:
    # w: [D, n_heads * hd] ([in, out]), columns interleaved (pairs) per head -> half-rotation.
    if isinstance(w, quant.QuantizedWeight):  # the same reordering of the output columns
        return quant.take_out(w, _unpermute_qk(np.arange(w.shape[1])[None], n_heads)[0])
    d, out_dim = w.shape
    hd = out_dim // n_heads
    return w.reshape(d, n_heads, hd // 2, 2).swapaxes(2, 3).reshape(d, out_dim)


def _unpermute_qk_bias(b: np.ndarray, n_heads: int) -> np.ndarray:
    hd = b.shape[0] // n_heads
    return b.reshape(n_heads, hd // 2, 2).swapaxes(1, 2).reshape(-1)


def _dequantize(gf: GGUFFile, t: TensorInfo, transposed: bool = False) -> np.ndarray:
    """A tensor as a float32 array of its logical shape (outermost first), or for a matrix
    [out, in] with transposed=True its transpose [in, out]."""
    if gf.byte_order != "<":
        if t.type not in (GGMLType.F32, GGMLType.F16):
            raise ModelFileError(f"model file {gf.path!r}: tensor {t.name!r} is "
                                 f"{ggml_type_name(t.type)} in a big-endian file, which is not "
                                 "supported (only F32 and F16 are)")
        w = gf.tensor_array(t.name).astype(np.float32)
        return np.ascontiguousarray(w.T) if transposed else w
    try:
        return to_float(gf.tensor_bytes(t.name), t.type, t.shape, transposed)
    except (NotImplementedError, ValueError) as e:  # a type gguf-py cannot decode
        raise ModelFileError(f"model file {gf.path!r}: tensor {t.name!r} has type "
                             f"{ggml_type_name(t.type)}, which cannot be dequantized: {e}") from e


def _read(gf: GGUFFile, t: TensorInfo, transposed: bool, quantized: bool) -> Weight:
    """`_dequantize`, but with quantized=True a matrix of a BLOCKS type comes back as a
    QuantizedWeight of the same orientation."""
    if (quantized and len(t.shape) == 2 and gf.byte_order == "<"
            and t.type in gguf_blocks.BLOCKS):
        try:
            return gguf_blocks.from_gguf(gf.tensor_bytes(t.name), t.type, t.shape, transposed)
        except ValueError as e:
            raise ModelFileError(f"model file {gf.path!r}: tensor {t.name!r} of type "
                                 f"{ggml_type_name(t.type)} cannot be loaded quantized: "
                                 f"{e}") from e
    return _dequantize(gf, t, transposed)


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


def load_gguf(path: str, *, quantized: bool = False
              ) -> tuple[ModelConfig, dict[str, Weight], dict[str, Any]]:
    """Loads a GGUF model: (config, weights, metadata), weights named as the family's
    params_from_weights takes them: "embed" [V, D], "final_norm" [D], optional "lm_head"
    [D, V], "layers.{i}.{name}" with linear weights [in, out], float32. Every tensor's shape is
    checked against the metadata before it is read. quantized=True: matrices of the BLOCKS
    types come as QuantizedWeights of the file's codes, grouped along the contraction axis,
    each dequantizing to what quantized=False gives.
    """
    gf = GGUFFile(path)
    meta = dict(gf.metadata)
    cfg = config_from_metadata(meta, path)
    tensors = gf.tensors
    permuted = _permutes_qk(meta)
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

    def checked(name: str, symbols: tuple[str, ...]) -> TensorInfo:
        if name not in tensors:
            raise ModelFileError(f"model file {path!r} lacks tensor {name!r}")
        got, shape = tensors[name].shape, tuple(dims[s] for s in symbols)
        if got != shape:
            why = ", ".join(dim_sources[s] for s in dict.fromkeys(symbols))
            raise ModelFileError(f"model file {path!r}: tensor {name!r} has shape {got}; the "
                                 f"metadata implies {shape} ({why})")
        return tensors[name]

    def read(name: str, symbols: tuple[str, ...], transposed: bool = False) -> Weight:
        return _read(gf, checked(name, symbols), transposed, quantized)

    weights: dict[str, Weight] = {}
    # The embedding, the largest tensor, is checked now and decodes beside the layers.
    embed_info = checked("token_embd.weight", ("V", "D"))
    threads = 1 if quantized else LOAD_THREADS
    read_embed = lambda: _read(gf, embed_info, False, quantized)  # noqa: E731
    weights["final_norm"] = read("output_norm.weight", ("D",))
    if "output.weight" in tensors:
        weights["lm_head"] = read("output.weight", ("V", "D"), transposed=True)
    cfg = cfg.replace(tie_word_embeddings="output.weight" not in tensors)

    if "rope_freqs.weight" in tensors:
        factors = read("rope_freqs.weight", ("H/2",))
        if not np.all(np.isfinite(factors) & (factors > 0)):
            raise ModelFileError(f"model file {path!r}: tensor 'rope_freqs.weight' has "
                                 f"non-positive or non-finite factors {factors.tolist()}")
        if np.any(factors != 1.0):
            cfg = cfg.replace(rope_freq_factors=tuple(float(f) for f in factors))

    model = get_model(cfg.architecture)
    weights["final_norm"] = model.gguf_final_norm(weights["final_norm"])

    def read_shape(name: str, shape: tuple[int, ...], transposed: bool = False) -> Weight:
        if name not in tensors:
            raise ModelFileError(f"model file {path!r} lacks tensor {name!r}")
        if tensors[name].shape != tuple(shape):
            raise ModelFileError(f"model file {path!r}: tensor {name!r} has shape "
                                 f"{tensors[name].shape}; the metadata implies {tuple(shape)}")
        return _read(gf, tensors[name], transposed, quantized)

    first = model.gguf_layer(read_shape, cfg, 0)
    if first is not None:  # the family reads its own layers
        embed, *rest = _in_order([read_embed] + [
            lambda i=i: model.gguf_layer(read_shape, cfg, i) for i in range(1, cfg.num_layers)],
            threads)
        weights["embed"] = embed
        for i, layer in enumerate([first] + rest):
            if permuted:  # Mixtral: llama's permuted Q and K
                layer["wq"] = _unpermute_qk(layer["wq"], cfg.num_heads)
                layer["wk"] = _unpermute_qk(layer["wk"], cfg.num_kv_heads)
            weights.update({f"layers.{i}.{name}": w for name, w in layer.items()})
        return cfg, weights, meta

    # Qwen2 always has q/k/v biases; llama-family files may carry them (attention_bias).
    has_bias = cfg.architecture == "qwen2" or any(
        f"blk.{i}.{b}" in tensors for i in range(cfg.num_layers) for b in _BIASES)
    cfg = cfg.replace(attention_bias=has_bias)

    def llama_layer(i: int) -> dict[str, Weight]:
        layer = {}
        for gname, name in (_LAYER_TENSORS | (_BIASES if has_bias else {})).items():
            full = f"blk.{i}.{gname}"
            if name.startswith("b") and full not in tensors and cfg.architecture != "qwen2":
                # llama.cpp treats each llama bias as optional: an absent one is zero.
                w = np.zeros([dims[d] for d in layer_shapes[gname]], np.float32)
            else:  # linear weights come transposed: [out, in] -> [in, out]
                w = read(full, layer_shapes[gname], transposed=len(layer_shapes[gname]) == 2)
            if permuted and name in ("wq", "wk"):
                w = _unpermute_qk(w, cfg.num_heads if name == "wq" else cfg.num_kv_heads)
            if permuted and name in ("bq", "bk"):
                w = _unpermute_qk_bias(w, cfg.num_heads if name == "bq" else cfg.num_kv_heads)
            layer[name] = w
        for gname in _UNSUPPORTED_BIASES:
            full = f"blk.{i}.{gname}"
            if full in tensors and np.any(read(full, layer_shapes[gname])):
                raise ModelFileError(f"model file {path!r}: a non-zero {full!r} is not supported")
        return layer

    embed, *layers = _in_order([read_embed] + [
        lambda i=i: llama_layer(i) for i in range(cfg.num_layers)], threads)
    weights["embed"] = embed
    for i, layer in enumerate(layers):
        weights.update({f"layers.{i}.{name}": w for name, w in layer.items()})
    return cfg, weights, meta
