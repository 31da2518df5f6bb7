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
               quantization: Optional[str] = None,
               group_size: Optional[int] = None) -> LoadedModel:
    """Loads a model from a spec; ValueError (ModelFileError) for anything unusable.

    quantization (quant.MODES): the matrices are quantized on the host before they reach the
    device (quant.quantize_model); a GGUF's blocks of the requested kind are kept as they are.
    "int4-awq" calibrates on the host, which takes minutes, unless the model is a checkpoint
    converted with that mode. A checkpoint loads as written without `quantization`. group_size:
    elements per scale for "int8" / "int4" (default quant.GROUP_SIZE; 0: per channel).
    partitioner: weights go straight into their shardings on its mesh, kv heads replicated
    where the tensor degree exceeds them (the returned config says how many).
    """
    from jaxinfer import quant

    if not isinstance(spec, (str, os.PathLike)):
        raise ValueError(f"model must be an alias or a path, got {type(spec).__name__}")
    if quantization is not None and quantization not in quant.MODES:
        raise ValueError(f"quantization must be None or one of {quant.MODES}, got "
                         f"{quantization!r}")
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

    def quantized(cfg, weights, tokenizer, source_mode=None):
        return quant.quantize_model(cfg, weights, quantization, tokenizer, group_size,
                                    source_mode)

    if os.path.isdir(path):
        from jaxinfer.loading import checkpoint, safetensors

        if checkpoint.is_checkpoint_dir(path):
            stored = checkpoint.read_checkpoint_quantization(path)["mode"]
            if quantization is None or quantization == stored:
                cfg, params, tokenizer = checkpoint.load_checkpoint(path, dtype=dtype,
                                                                    partitioner=partitioner)
                return LoadedModel(cfg, params, tokenizer, path)
            # Another mode: through host weights, like any other source.
            cfg, params, tokenizer = checkpoint.load_checkpoint(path)
            weights = checkpoint.named_weights(params)
            del params
            cfg, params = _build(cfg, quantized(cfg, weights, tokenizer, stored), dtype,
                                 partitioner)
            return LoadedModel(cfg, params, tokenizer, path)
        if os.path.exists(os.path.join(path, "config.json")):
            cfg, weights = safetensors.load_hf_dir(path)
            tokenizer = None
            if os.path.exists(os.path.join(path, "tokenizer.json")):
                from jaxinfer.loading.tokenizer import Tokenizer
                tokenizer = Tokenizer.from_hf_dir(path)
            cfg, params = _build(cfg, quantized(cfg, weights, tokenizer), dtype, partitioner)
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
    cfg, params = _build(cfg, quantized(cfg, weights, tokenizer), dtype, partitioner)
    return LoadedModel(cfg, params, tokenizer, path)


def _build(cfg: ModelConfig, weights: dict, dtype, partitioner):
    """(config, params) from host weights, each put straight into its sharding when there is a
    partitioner, so no device holds a whole copy."""
    from jaxinfer.models import get_model

    model = get_model(cfg.architecture)
    if partitioner is None:
        return cfg, model.params_from_weights(cfg, weights, dtype)
    import jax

    from jaxinfer import quant, sharding

    sharding.check_divisible(cfg, partitioner.mesh_config)
    cfg, weights = sharding.replicate_kv_heads(cfg, weights, partitioner.mesh_config.tensor)
    axes = {name: spec_axes for name, (_, spec_axes) in model.param_specs(cfg).items()}
    placed = {}
    for name, w in weights.items():
        # "layers.{i}.{field}" is described once, as "layers.{field}".
        key = "layers." + name.split(".", 2)[2] if name.startswith("layers.") else name
        if key not in axes or w is None:
            placed[name] = w
        elif isinstance(w, quant.QuantizedWeight):  # codes and scales keep their dtypes
            placed[name] = jax.tree.map(partitioner.place, w, quant.logical_axes(w, axes[key]))
        else:
            placed[name] = partitioner.place(w, axes[key], dtype)
    # params_from_weights keeps arrays already placed in `dtype` where they are.
    return cfg, model.params_from_weights(cfg, placed, dtype)
