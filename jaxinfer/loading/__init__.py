"""Model loading: one entry point from a model spec to (config, params, tokenizer).

A spec is an alias ("smollm2-135m"), a path to a .gguf file, an HF directory (config.json and
*.safetensors, sharded index allowed), or an orbax checkpoint directory written by
`python -m jaxinfer.launch.convert`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.loading.gguf import ModelFileError
from jaxinfer.loading.hub import is_alias, resolve_alias


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: object          # the model family's params pytree, on device
    tokenizer: Optional[object]
    source: str             # resolved path


def load_model(spec: str, dtype=jnp.float32, partitioner=None,
               quantization: Optional[str] = None) -> LoadedModel:
    """Loads a model from a spec. Raises ValueError (ModelFileError) for anything unusable.

    quantization ("int8", "int4", "fp8"; see jaxinfer.quant.quantize_weights): the matrices
    are quantized on the host before they reach the device. A GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K
    blocks load natively, with no float copy of the model, and are kept where they are of the
    requested kind ("int4" on a Q4_1 file keeps the file's blocks). "int4-awq"
    (jaxinfer.awq) quantizes the float (or dequantized) weights with activation-aware scales
    calibrated on the package's calibration text: a calibration forward and a search on the
    host, about a minute for SmolLM2 on a CPU.

    partitioner (jaxinfer.sharding.Partitioner): weights go straight into their shardings on
    its mesh (each device receives its own shard, from host memory or from the checkpoint);
    a tensor degree that does not split the model raises ValueError first. Where the tensor
    degree exceeds the kv heads they are replicated (the returned config says how many).
    """
    from jaxinfer.models import get_model

    if not isinstance(spec, (str, os.PathLike)):
        raise ValueError(f"model must be an alias or a path, got {type(spec).__name__}")
    spec = os.fspath(spec)
    path = os.path.expanduser(spec)
    if not os.path.exists(path):
        if is_alias(spec):
            path = resolve_alias(spec)
        elif spec.endswith(".gguf") or os.sep in spec or spec.startswith("."):
            raise ModelFileError(f"model path {spec!r} does not exist")
        else:
            from jaxinfer.loading.hub import ALIASES
            raise ValueError(f"unknown model {spec!r}: not a known alias ({sorted(ALIASES)}) "
                             "and no such file or directory")

    if os.path.isdir(path):
        from jaxinfer.loading import checkpoint, safetensors

        if checkpoint.is_checkpoint_dir(path):
            if quantization is not None:
                raise NotImplementedError("quantizing an orbax checkpoint is not supported yet; "
                                          "load the GGUF or HF model it came from")
            cfg, params, tokenizer = checkpoint.load_checkpoint(path, dtype=dtype,
                                                                partitioner=partitioner)
            return LoadedModel(cfg, params, tokenizer, path)
        if os.path.exists(os.path.join(path, "config.json")):
            cfg, weights = safetensors.load_hf_dir(path)
            tokenizer = None
            if os.path.exists(os.path.join(path, "tokenizer.json")):
                from jaxinfer.loading.tokenizer import Tokenizer
                tokenizer = Tokenizer.from_hf_dir(path)
            weights = _quantized(cfg, weights, quantization, tokenizer)
            cfg, params = _build(cfg, weights, dtype, partitioner)
            return LoadedModel(cfg, params, tokenizer, path)
        raise ModelFileError(
            f"directory {path!r} is neither an HF model (config.json + *.safetensors) nor a "
            "jaxinfer checkpoint")

    from jaxinfer.loading.gguf import load_gguf
    from jaxinfer.loading.tokenizer import Tokenizer

    # Activation-aware int4 starts from float weights (the file's blocks dequantized).
    native = quantization is not None and quantization != "int4-awq"
    cfg, weights, meta = load_gguf(path, quantized=native)
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    cfg, params = _build(cfg, _quantized(cfg, weights, quantization, tokenizer), dtype,
                         partitioner)
    return LoadedModel(cfg, params, tokenizer, path)


CALIBRATION_TEXT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data",
                                "calibration.txt")
CALIBRATION_SHAPE = (8, 256)  # sequences x tokens of "int4-awq" calibration


def _quantized(cfg: ModelConfig, weights: dict, quantization: Optional[str],
               tokenizer) -> dict:
    """Host weights quantized by `quantization`. "int4-awq" calibrates on the package's
    calibration text (jaxinfer/data/calibration.txt: prose, code, dialogue, notes; about
    2,200 SmolLM2 tokens), CALIBRATION_SHAPE sequences of it."""
    if quantization is None:
        return weights
    from jaxinfer import quant

    if quantization != "int4-awq":
        return quant.quantize_weights(weights, quantization)
    from jaxinfer import awq

    if tokenizer is None:
        raise ValueError("quantization='int4-awq' calibrates on text and needs the model's "
                         "tokenizer; this model has none (no tokenizer.json)")
    with open(CALIBRATION_TEXT, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read())
    n, T = CALIBRATION_SHAPE
    n = min(n, len(ids) // T)
    calibration = [ids[i * T:(i + 1) * T] for i in range(n)]
    return awq.awq_int4(cfg, weights, calibration)[0]


def _build(cfg: ModelConfig, weights: dict, dtype, partitioner):
    """(config, params) from host weights, placed by the partitioner when there is one."""
    from jaxinfer.models import get_model

    model = get_model(cfg.architecture)
    if partitioner is None:
        return cfg, model.params_from_weights(cfg, weights, dtype)
    from jaxinfer import sharding

    sharding.check_divisible(cfg, partitioner.mesh_config)
    cfg, weights = sharding.replicate_kv_heads(cfg, weights, partitioner.mesh_config.tensor)
    return cfg, model.params_from_weights(cfg, weights, dtype, place=partitioner.place)
