"""jaxinfer checkpoints: a model's params saved with orbax, its config and its tokenizer.

    jaxinfer_config.json   {"format_version", "config": ModelConfig fields, "param_dtype",
                            optional "quantization": {"mode", "weights": {name: layout}}}
    params/                the params pytree, orbax StandardCheckpointer format
    tokenizer/             optional: tokenizer.json, tokenizer_config.json, generation_config.json

The config file is written last, so a directory is a checkpoint only once the params are
complete. Restoring builds the abstract params from the config and the recorded layouts, so a
quantized checkpoint (int4-awq included) restores as written, without calibration.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.loading.gguf import ModelFileError

FORMAT_VERSION = 1
CONFIG_FILE = "jaxinfer_config.json"
PARAMS_DIR = "params"
TOKENIZER_DIR = "tokenizer"


def config_from_json(d: dict[str, Any], path: str = "") -> ModelConfig:
    try:
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return ModelConfig(**d)
    except (TypeError, ValueError) as e:
        raise ModelFileError(f"{path!r}: invalid model config: {e}") from e


def save_tokenizer(tok, directory: str) -> None:
    """Writes `tok` as HF tokenizer files that `Tokenizer.from_hf_dir` reads back as equal."""
    os.makedirs(directory, exist_ok=True)
    tok._tok.save(os.path.join(directory, "tokenizer.json"))
    text = tok.id_to_token
    config = {
        "add_bos_token": bool(tok.add_bos),
        "add_eos_token": bool(tok.add_eos),
        "bos_token": text(tok.bos_token_id) if tok.bos_token_id is not None else None,
        "eos_token": text(tok.eos_token_id) if tok.eos_token_id is not None else None,
    }
    if tok.chat_template:
        config["chat_template"] = tok.chat_template
    # from_hf_dir takes the end-of-generation ids from generation_config.json.
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": list(tok.eos_token_ids)}
    for name, obj in (("tokenizer_config.json", config), ("generation_config.json", gen)):
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False, indent=1)


def _name(path) -> str:
    """A pytree path as "layers.3.wq" (params) or "layers.3.wq.q" (orbax's metadata tree)."""
    return ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))))
                    for k in path)


def _is_quantized(x) -> bool:
    from jaxinfer.quant import QuantizedWeight
    return isinstance(x, QuantizedWeight)


def named_leaves(params) -> dict:
    """A params pytree as {name: array or QuantizedWeight} in params_from_weights' names
    ("embed", "layers.3.wq", ...), the leaves as they are (a tied model has no lm_head)."""
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_quantized)
    return {_name(path): leaf for path, leaf in leaves}


def named_weights(params) -> dict:
    """named_leaves with every array on the host (numpy)."""
    import numpy as np

    return {name: jax.tree.map(np.asarray, leaf) for name, leaf in named_leaves(params).items()}


def save_checkpoint(path: str, cfg: ModelConfig, params, tokenizer=None, *,
                    overwrite: bool = False, quantization: Optional[str] = None) -> None:
    """Saves params (quantized weights as their codes, scales and offsets), config and the
    tokenizer if given; `quantization` records the params' mode, so loading with it keeps
    them. ValueError if `path` exists and is not empty, unless overwrite."""
    import shutil

    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    if os.path.exists(path) and os.listdir(path):
        if not overwrite:
            raise ValueError(f"output directory {path!r} exists and is not empty")
        if not is_checkpoint_dir(path):
            # Refuse to wipe a directory this module did not write.
            raise ValueError(f"{path!r} is not a jaxinfer checkpoint; not overwriting it")
        shutil.rmtree(path)
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, PARAMS_DIR), params)
        ckptr.wait_until_finished()
    if tokenizer is not None:
        save_tokenizer(tokenizer, os.path.join(path, TOKENIZER_DIR))
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_quantized)
    dtypes = sorted({str(leaf.dtype) for _, leaf in leaves if not _is_quantized(leaf)})
    meta = {"format_version": FORMAT_VERSION, "config": dataclasses.asdict(cfg),
            "param_dtype": dtypes[0] if len(dtypes) == 1 else dtypes}
    layouts = {_name(p): leaf.layout() for p, leaf in leaves if _is_quantized(leaf)}
    if layouts or quantization is not None:
        meta["quantization"] = {"mode": quantization, "weights": layouts}
    tmp = os.path.join(path, CONFIG_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(path, CONFIG_FILE))


def is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def read_checkpoint_config(path: str) -> ModelConfig:
    return config_from_json(_read_meta(path)["config"], os.path.join(path, CONFIG_FILE))


def read_checkpoint_quantization(path: str) -> dict:
    """{"mode": the quantization mode the checkpoint was written with (None: float or GGUF
    blocks as loaded), "weights": {name: QuantizedWeight layout}}."""
    return _read_meta(path).get("quantization") or {"mode": None, "weights": {}}


def _read_meta(path: str) -> dict:
    config_path = os.path.join(path, CONFIG_FILE)
    try:
        with open(config_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"cannot read checkpoint config {config_path!r}: {e}") from e
    if not isinstance(meta, dict) or "config" not in meta:
        raise ModelFileError(f"{config_path!r} is not a jaxinfer checkpoint config")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise ModelFileError(f"{config_path!r}: unsupported checkpoint format_version "
                             f"{version!r}; this jaxinfer reads {FORMAT_VERSION}")
    return meta


def _leaf_shapes(tree) -> dict[str, tuple[int, ...]]:
    """Maps "layers.0.wq" -> shape, for params trees and orbax's metadata tree (nested
    dicts); a quantized weight's arrays as "layers.0.wq.q", ".scale", ".offset"."""
    return {_name(p): tuple(leaf.shape) for p, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _abstract_params(model, cfg: ModelConfig, dtype, layouts: dict, stored: dict):
    """The params tree to restore into: float leaves from the model's initialiser in `dtype`,
    quantized ones of the stored shapes and dtypes (stored: orbax's metadata by _name)."""
    from jaxinfer.quant import QuantizedWeight

    floats = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0), dtype))

    def leaf(path, x):
        name = _name(path)
        if name not in layouts:
            return x
        arrays = {}
        for part in ("q", "scale", "offset"):
            m = stored.get(f"{name}.{part}")
            arrays[part] = None if m is None else jax.ShapeDtypeStruct(tuple(m.shape), m.dtype)
        if arrays["q"] is None or arrays["scale"] is None:
            raise ModelFileError(f"quantized weight {name!r} has no stored codes or scales")
        return QuantizedWeight(**arrays, **layouts[name])
    return jax.tree_util.tree_map_with_path(leaf, floats)


def _replicated_kv_heads(cfg: ModelConfig, params, model, partitioner):
    """Restored params with kv heads replicated for a tensor degree above their count."""
    from jaxinfer import sharding

    layers = []
    for lp in params.layers:
        fields = {k: v for k, v in vars(lp).items() if k in ("wk", "wv", "bk", "bv")
                  and v is not None}
        new_cfg, fields = sharding.replicate_kv_heads(cfg, fields, partitioner.mesh_config.tensor,
                                                      xp=jnp)
        layers.append(lp.replace(**fields))
    params = params.replace(layers=tuple(layers))
    axes = sharding.param_axes(new_cfg, params, model.param_specs)
    return new_cfg, partitioner.put_tree(params, axes)


def load_checkpoint(path: str, dtype=jnp.float32,
                    partitioner=None) -> tuple[ModelConfig, Any, Optional[Any]]:
    """Restores (config, params cast to dtype, Tokenizer or None) from a checkpoint directory,
    on the default device or straight into the partitioner's shardings."""
    import orbax.checkpoint as ocp

    from jaxinfer.models import get_model

    path = os.path.abspath(path)
    cfg = read_checkpoint_config(path)
    layouts = read_checkpoint_quantization(path)["weights"]
    params_dir = os.path.join(path, PARAMS_DIR)
    if not os.path.isdir(params_dir):
        raise ModelFileError(f"checkpoint {path!r} has no {PARAMS_DIR}/ directory")
    model = get_model(cfg.architecture)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            tree = ckptr.metadata(params_dir).item_metadata
        stored_meta = {_name(p): m for p, m in jax.tree_util.tree_leaves_with_path(tree)}
    except Exception as e:  # orbax raises many kinds for a damaged directory
        raise ModelFileError(
            f"cannot read params metadata from {params_dir!r}: {type(e).__name__}: {e}") from e
    # Orbax casts each stored array to the dtype of its target leaf; codes and scales keep
    # their stored dtypes.
    abstract = _abstract_params(model, cfg, dtype, layouts, stored_meta)
    if partitioner is None:
        single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: single, abstract)
    else:
        from jaxinfer import sharding

        sharding.check_divisible(cfg, partitioner.mesh_config)
        shardings = jax.tree.map(lambda s, axes: partitioner.sharding(s.shape, axes), abstract,
                                 sharding.param_axes(cfg, abstract, model.param_specs))
    abstract = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, shardings)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            stored = {name: tuple(m.shape) for name, m in stored_meta.items()}
            # Orbax restores only the leaves both trees share: a leaf the config expects but the
            # checkpoint lacks would come back as None, and an extra stored leaf is dropped.
            expected = _leaf_shapes(abstract)
            if stored != expected:
                diff = sorted(k for k in stored.keys() | expected.keys()
                              if stored.get(k) != expected.get(k))
                raise ModelFileError(f"the stored arrays do not match the config at {diff}: "
                                     f"stored {[stored.get(k) for k in diff]}, config implies "
                                     f"{[expected.get(k) for k in diff]}")
            params = ckptr.restore(params_dir, abstract)
    except Exception as e:  # orbax/tensorstore raise many kinds for damaged or mismatched data
        raise ModelFileError(
            f"cannot restore params from {params_dir!r}: {type(e).__name__}: {e}") from e
    if partitioner is not None and partitioner.mesh_config.tensor > cfg.num_kv_heads:
        cfg, params = _replicated_kv_heads(cfg, params, model, partitioner)

    tokenizer = None
    tok_dir = os.path.join(path, TOKENIZER_DIR)
    if os.path.isdir(tok_dir):
        from jaxinfer.loading.tokenizer import Tokenizer
        try:
            tokenizer = Tokenizer.from_hf_dir(tok_dir)
        except Exception as e:  # the tokenizers library raises a bare Exception on bad JSON
            raise ModelFileError(f"cannot read checkpoint tokenizer {tok_dir!r}: {e}") from e
    return cfg, params, tokenizer
