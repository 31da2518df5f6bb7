"""Reading Hugging Face model directories: config.json plus *.safetensors (sharded or not).

The safetensors container is parsed here (numpy has no bfloat16 for the `safetensors` package)
and every byte range checked, so a truncated or crafted file is refused with a clear error
before anything is read or allocated on its word. Tensors are memory-mapped, then converted to
float32; linear weights come as [in, out] under `load_gguf`'s names (HF's Q and K need no
unpermuting).
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.loading.gguf import ModelFileError
from jaxinfer.models import REGISTRY, get_model

SUPPORTED_MODEL_TYPES = tuple(sorted(REGISTRY))

_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
# Bytes per element of every dtype the format defines, to check tensors this loader skips too.
_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
# The format's own limit on the JSON header, checked before it is read.
MAX_HEADER_BYTES = 100_000_000


def eos_token_ids(hf: dict) -> list[int]:
    """All end-of-sequence ids of an HF config (its eos_token_id may be an int or a list)."""
    eos = hf.get("eos_token_id")
    if eos is None:
        return []
    return [int(i) for i in (eos if isinstance(eos, list) else [eos])]


def _rope(hf: dict, path: str) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 nests theta and scaling in rope_parameters; older configs use
    # rope_theta and rope_scaling.
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type"))
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise ModelFileError(f"{path!r}: unsupported RoPE type {kind!r}; supported: "
                             "'default', 'llama3'")
    try:
        return theta, RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    except KeyError as e:
        raise ModelFileError(f"{path!r}: llama3 RoPE scaling lacks {e.args[0]!r}") from None


def _sliding_window(hf: dict, arch: str, num_layers: int, path: str) -> int | None:
    window = hf.get("sliding_window")
    if arch in ("mistral", "mixtral"):
        return int(window) if window else None
    if arch != "qwen2" or not hf.get("use_sliding_window") or not window:
        return None
    # Qwen2 windows only layers >= max_window_layers; the model runs one window for all layers.
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", 0) else "full_attention"
        for i in range(num_layers)]
    if all(t == "full_attention" for t in types):
        return None
    if all(t == "sliding_attention" for t in types):
        return int(window)
    raise ModelFileError(f"{path!r}: mixed sliding/full attention layers ({types}) are not "
                         "supported")


def config_from_hf(hf: dict, path: str = "") -> ModelConfig:
    """ModelConfig from the dict of an HF config.json: the common fields here, the family's own
    (experts, per-layer attention, QK-norm) from its `hf_config` (jaxinfer.models)."""
    arch = hf.get("model_type")
    if arch not in SUPPORTED_MODEL_TYPES:
        raise ModelFileError(f"{path!r}: unsupported model_type {arch!r}; supported: "
                             f"{SUPPORTED_MODEL_TYPES}")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method")
        raise ModelFileError(f"{path!r}: quantized HF checkpoints ({method!r}) are not supported")
    model = get_model(arch)
    act = hf.get("hidden_act", hf.get("hidden_activation")) or model.activation
    if act != model.activation:
        raise ModelFileError(f"{path!r}: unsupported hidden activation {act!r} for {arch} "
                             f"(supported: {model.activation!r})")
    if hf.get("mlp_bias"):
        raise ModelFileError(f"{path!r}: mlp_bias=true is not supported")

    def need(key):
        if hf.get(key) is None:
            raise ModelFileError(f"{path!r}: config lacks {key!r}")
        return int(hf[key])

    d_model, num_heads, num_layers = need("hidden_size"), need("num_attention_heads"), \
        need("num_hidden_layers")
    theta, scaling = _rope(hf, path)
    eos = eos_token_ids(hf)
    try:
        common = dict(
            architecture=arch,
            vocab_size=need("vocab_size"),
            d_model=d_model,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or d_model // num_heads),
            ffn_dim=need("intermediate_size"),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            # The default of LlamaConfig, MistralConfig and Qwen2Config alike.
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(hf.get("attention_bias", False)),
            sliding_window=_sliding_window(hf, arch, num_layers, path),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos[0] if eos else None,
        )
        return ModelConfig(**(common | model.hf_config(hf, path)))
    except ModelFileError:
        raise
    except (ValueError, KeyError, TypeError) as e:  # ModelConfig's own consistency checks
        raise ModelFileError(f"{path!r}: {e}") from None


class _SafetensorsFile:
    """Header of one .safetensors file, validated against the file size; tensors read lazily."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isfile(path):
            raise ModelFileError(f"safetensors file {path!r} does not exist")
        size = os.path.getsize(path)
        if size < 8:
            raise ModelFileError(f"safetensors file {path!r} is truncated ({size} bytes)")
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                raise ModelFileError(f"safetensors file {path!r}: header length {n} bytes "
                                     f"exceeds the format's limit of {MAX_HEADER_BYTES}")
            if 8 + n > size:
                raise ModelFileError(f"safetensors file {path!r} is truncated or corrupt: header "
                                     f"of {n} bytes, file has {size}")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ModelFileError(f"safetensors file {path!r} has a corrupt header: {e}") from e
        if not isinstance(header, dict):
            raise ModelFileError(f"safetensors file {path!r} has a corrupt header")
        header.pop("__metadata__", None)
        self.data_start, self.entries = 8 + n, header
        ranges = []
        for name, e in header.items():
            try:
                begin, end = (int(x) for x in e["data_offsets"])
                dtype, shape = e["dtype"], tuple(int(s) for s in e["shape"])
            except (KeyError, TypeError, ValueError):
                raise ModelFileError(
                    f"safetensors file {path!r}: corrupt header entry for {name!r}") from None
            if begin < 0 or end < begin or min(shape, default=0) < 0:
                raise ModelFileError(
                    f"safetensors file {path!r}: tensor {name!r} has data_offsets "
                    f"[{begin}, {end}] and shape {shape}; offsets must satisfy 0 <= begin <= "
                    f"end and dimensions be >= 0")
            if dtype in _ITEM_BYTES and end - begin != math.prod(shape) * _ITEM_BYTES[dtype]:
                raise ModelFileError(f"safetensors file {path!r}: tensor {name!r} has "
                                     f"{end - begin} bytes for shape {shape} {dtype}, which "
                                     f"takes {math.prod(shape) * _ITEM_BYTES[dtype]}")
            if self.data_start + end > size:
                raise ModelFileError(
                    f"safetensors file {path!r} is truncated: tensor {name!r} ends at byte "
                    f"{self.data_start + end}, file has {size} bytes")
            ranges.append((begin, end, name))
        _check_disjoint(path, ranges)

    def read(self, name: str) -> np.ndarray:
        """The tensor as a float32 array of its stored shape."""
        e = self.entries[name]
        dtype = _DTYPES.get(e["dtype"])
        if dtype is None:
            raise ModelFileError(f"safetensors file {self.path!r}: tensor {name!r} has "
                                 f"unsupported dtype {e['dtype']!r}; supported: {list(_DTYPES)}")
        shape = tuple(e["shape"])
        begin = e["data_offsets"][0]
        if math.prod(shape) == 0:
            return np.zeros(shape, np.float32)
        arr = np.memmap(self.path, dtype=dtype, mode="r", offset=self.data_start + begin,
                        shape=shape)
        return np.asarray(arr, dtype=np.float32)


def _check_disjoint(path: str, ranges: list[tuple[int, int, str]]) -> None:
    """Tensors' byte ranges [begin, end) must not overlap: the format lays them end to end."""
    last_end, last = 0, None
    for begin, end, name in sorted(ranges):
        if begin < last_end and end > begin:
            raise ModelFileError(
                f"safetensors file {path!r}: tensor {name!r} at data_offsets [{begin}, {end}] "
                f"overlaps tensor {last!r}, which ends at {last_end}")
        if end > last_end:
            last_end, last = end, name


def _inside(directory: str, fname: Any, source: str) -> str:
    """The path of tensor file `fname` (named by `source`), which must resolve into `directory`
    (or, for the Hugging Face hub cache's snapshots/<revision>/, into ../../blobs/)."""
    if not isinstance(fname, str) or not fname or os.path.isabs(fname):
        raise ModelFileError(f"{source} names tensor file {fname!r}; it must be a relative "
                             f"path inside the model directory {directory!r}")
    root = os.path.realpath(directory)
    target = os.path.realpath(os.path.join(directory, fname))
    allowed = [root]
    if os.path.basename(os.path.dirname(root)) == "snapshots":
        allowed.append(os.path.join(os.path.dirname(os.path.dirname(root)), "blobs"))
    if not any(target.startswith(a + os.sep) for a in allowed):
        raise ModelFileError(f"{source} names tensor file {fname!r}, which resolves to "
                             f"{target!r}, outside the model directory {root!r}")
    return os.path.join(directory, fname)


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"cannot read {path!r}: {e}") from e


def _tensor_files(path: str) -> dict[str, _SafetensorsFile]:
    """HF tensor name -> the file holding it."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        data = _read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise ModelFileError(f"{index!r} has no weight_map")
        files: dict = {}
        for f in weight_map.values():  # _inside refuses a name that is not a string first
            if not isinstance(f, str) or f not in files:
                files[f] = _SafetensorsFile(_inside(path, f, f"{index!r} weight_map"))
        out = {}
        for name, fname in weight_map.items():
            if name not in files[fname].entries:
                raise ModelFileError(f"{index!r} places tensor {name!r} in {fname!r}, which "
                                     "does not contain it")
            out[name] = files[fname]
        return out
    if os.path.exists(single):
        names = ["model.safetensors"]
    else:
        names = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not names:
            raise ModelFileError(f"model directory {path!r} has no *.safetensors files")
    out = {}
    for fname in names:
        st = _SafetensorsFile(_inside(path, fname, f"model directory {path!r}"))
        out.update({name: st for name in st.entries})
    return out


def load_hf_dir(path: str) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Loads an HF model directory: (config, weights), weights float32 named as `load_gguf`'s
    ("embed" [V, D], "final_norm" [D], "lm_head" [D, V] unless tied, "layers.{i}.{name}")."""
    if not os.path.isdir(path):
        raise ModelFileError(f"model directory {path!r} does not exist")
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise ModelFileError(f"model directory {path!r} has no config.json")
    hf = _read_json(config_path)
    if not isinstance(hf, dict):
        raise ModelFileError(f"{config_path!r} is not a JSON object")
    cfg = config_from_hf(hf, config_path)
    files = _tensor_files(path)
    D, V = cfg.d_model, cfg.vocab_size

    def read(name: str, shape: tuple[int, ...], transpose: bool = False) -> np.ndarray:
        if name not in files:
            raise ModelFileError(f"model directory {path!r} lacks tensor {name!r}")
        st = files[name]
        got = tuple(st.entries[name]["shape"])
        if got != shape:
            raise ModelFileError(f"{st.path!r}: tensor {name!r} has shape {got}; config.json "
                                 f"implies {shape}")
        arr = st.read(name)
        return np.ascontiguousarray(arr.T) if transpose else arr

    weights = {"embed": read("model.embed_tokens.weight", (V, D)),
               "final_norm": read("model.norm.weight", (D,))}
    if not cfg.tie_word_embeddings:
        weights["lm_head"] = read("lm_head.weight", (V, D), transpose=True)
    model = get_model(cfg.architecture)
    for i in range(cfg.num_layers):
        for name, w in model.hf_layer(read, cfg, i).items():
            weights[f"layers.{i}.{name}"] = w
        # Llama's attention_bias also gives o_proj a bias, which the model has no slot for.
        o_bias = f"model.layers.{i}.self_attn.o_proj.bias"
        if o_bias in files and np.any(read(o_bias, (D,))):
            raise ModelFileError(f"{files[o_bias].path!r}: a non-zero {o_bias!r} is not "
                                 "supported")
    return cfg, weights
