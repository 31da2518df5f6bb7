"""LoRA adapters on the host: read from the directory `peft` writes (adapter_config.json and
adapter_model.safetensors) or given as arrays, and checked against the model before any device
work. An Adapter holds per adapted layer field A [L, in, r] and B [L, r, out] (float32, zeros
for layers it leaves alone) and its scale: lora_alpha / r, or lora_alpha / sqrt(r) with
rsLoRA, as PEFT computes it.

PEFT stores lora_A.weight [r, in] and lora_B.weight [out, r] for a torch Linear y = x W^T: the
adapted weight is W + scale * B A. jaxinfer's weights are [in, out] (W^T), so A becomes
lora_A^T and B lora_B^T, and W^T + scale * A B is the same matrix.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Optional

import numpy as np

from jaxinfer.lora.weights import TARGETS
from jaxinfer.user_input import show

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# PEFT's tensor names: [...]layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}[.default].weight
_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                   r"(?:\.default)?\.weight$")
# adapter_config.json keys that would change the math if set: refused unless at their neutral
# value (DoRA, per-module ranks, trained biases or full modules are not LoRA as served here).
_NEUTRAL = {"use_dora": (False, None), "bias": ("none", None), "modules_to_save": (None, []),
            "fan_in_fan_out": (False, None), "rank_pattern": ({}, None),
            "alpha_pattern": ({}, None), "layers_to_transform": (None,),
            "layer_replication": (None,), "megatron_config": (None,)}


class AdapterError(ValueError):
    """An adapter that cannot serve this model: the message names the file, field or tensor."""


@dataclasses.dataclass
class Adapter:
    name: str
    rank: int
    scale: float
    a: dict                  # field -> [L, in, rank] float32
    b: dict                  # field -> [L, rank, out] float32
    path: Optional[str] = None

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.a.values()) + sum(x.nbytes for x in self.b.values())


def adaptable(family, cfg) -> dict:
    """The fields LoRA may adapt in this model: field -> ((in, out), (in axis, out axis)).
    Two-dimensional layer weights among TARGETS (a MoE layer's experts are not)."""
    specs = family.param_specs(cfg)
    out = {}
    for field in TARGETS.values():
        spec = specs.get(f"layers.{field}")
        if spec is not None and len(spec[0]) == 2:
            out[field] = spec
    return out


def _check_config(config: Any, where: str) -> tuple[int, float, bool, Any]:
    if not isinstance(config, dict):
        raise AdapterError(f"{where}: expected a JSON object, got {show(config)}")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {show(config.get('peft_type'))} is not LORA")
    for key, neutral in _NEUTRAL.items():
        if key in config and config[key] not in neutral:
            raise AdapterError(f"{where}: {key}={show(config[key])} is not supported (only "
                               f"{' or '.join(map(repr, neutral))})")
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise AdapterError(f"{where}: r must be an integer >= 1, got {show(r)}")
    alpha = config.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) \
            or not math.isfinite(alpha):
        raise AdapterError(f"{where}: lora_alpha must be a number, got {show(alpha)}")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterError(f"{where}: use_rslora must be a boolean, got {show(rslora)}")
    return r, float(alpha), rslora, config.get("target_modules")


def _targets(target_modules: Any, allowed: dict, where: str) -> set:
    """target_modules (a list of module names, one name, or "all-linear") -> the fields."""
    if target_modules == "all-linear":
        return set(allowed)
    names = [target_modules] if isinstance(target_modules, str) else target_modules
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise AdapterError(f"{where}: target_modules must be a list of module names, got "
                           f"{show(target_modules)}")
    fields = set()
    for n in names:
        field = TARGETS.get(n)
        if field is None or field not in allowed:
            names = sorted(k for k, v in TARGETS.items() if v in allowed)
            raise AdapterError(f"{where}: target module {show(n)} is not adaptable in this "
                               f"model; adaptable: {names}")
        fields.add(field)
    return fields


def from_peft_arrays(name: str, tensors: dict, *, r: int, lora_alpha: float,
                     use_rslora: bool = False, family, cfg, max_rank: int,
                     target_modules: Any = None, path: Optional[str] = None,
                     where: str = "adapter") -> Adapter:
    """An Adapter from PEFT-named tensors {name: array} (lora_A [r, in], lora_B [out, r]),
    checked against the model: every tensor names a layer and an adaptable module, shapes
    match the base weights, the rank is at most max_rank, every A has its B."""
    allowed = adaptable(family, cfg)
    if r > max_rank:
        raise AdapterError(f"{where}: rank r={r} exceeds max_lora_rank={max_rank}")
    fields = None if target_modules is None else _targets(target_modules, allowed, where)
    L = cfg.num_layers
    pairs: dict = {}
    for tname, arr in tensors.items():
        m = _NAME.search(tname)
        if m is None:
            raise AdapterError(f"{where}: tensor {show(tname)} is not a LoRA weight of a "
                               "decoder layer's projection (embedding, head and bias adapters "
                               "are not supported)")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        field = TARGETS.get(module)
        if field is None or field not in allowed or (fields is not None and field not in fields):
            why = "among target_modules" if field in allowed else "adaptable in this model"
            raise AdapterError(f"{where}: tensor {show(tname)}: module {show(module)} is not "
                               f"{why}")
        if not 0 <= layer < L:
            raise AdapterError(f"{where}: tensor {show(tname)}: layer {layer} outside the "
                               f"model's {L} layers")
        (fan_in, fan_out), _ = allowed[field]
        want = (r, fan_in) if which == "A" else (fan_out, r)
        arr = np.asarray(arr, np.float32)
        if arr.shape != want:
            raise AdapterError(f"{where}: tensor {show(tname)} has shape {arr.shape}; the base "
                               f"weight and r={r} need {want}")
        if not np.isfinite(arr).all():
            raise AdapterError(f"{where}: tensor {show(tname)} holds NaN or infinity")
        pairs.setdefault((field, layer), {})[which] = arr
    if not pairs:
        raise AdapterError(f"{where}: no LoRA tensors")
    a, b = {}, {}
    for (field, layer), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise AdapterError(f"{where}: layer {layer} {field}: lora_{missing} is missing")
        (fan_in, fan_out), _ = allowed[field]
        if field not in a:
            a[field] = np.zeros((L, fan_in, r), np.float32)
            b[field] = np.zeros((L, r, fan_out), np.float32)
        a[field][layer] = ab["A"].T
        b[field][layer] = ab["B"].T
    scale = lora_alpha / (math.sqrt(r) if use_rslora else r)
    return Adapter(name=name, rank=r, scale=scale, a=a, b=b, path=path)


def _read_json(name: str, path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"adapter {name!r}: cannot read {path}: {e}") from None


def read_peft(name: str, path: str, *, family, cfg, max_rank: int) -> Adapter:
    """The adapter `peft` saved in directory `path`, checked against the model."""
    from jaxinfer.loading.safetensors import _SafetensorsFile

    if not isinstance(path, str) or not os.path.isdir(path):
        raise AdapterError(f"adapter {name!r}: {show(path)} is not a directory")
    cfg_path, w_path = os.path.join(path, CONFIG), os.path.join(path, WEIGHTS)
    for p in (cfg_path, w_path):
        if not os.path.isfile(p):
            raise AdapterError(f"adapter {name!r}: {p} is missing")
    config = _read_json(name, cfg_path)
    r, alpha, rslora, targets = _check_config(config, cfg_path)
    try:
        st = _SafetensorsFile(w_path)
        tensors = {t: st.read(t) for t in st.entries}
    except ValueError as e:  # ModelFileError: truncated, corrupt, overlapping
        raise AdapterError(f"adapter {name!r}: {e}") from None
    return from_peft_arrays(name, tensors, r=r, lora_alpha=alpha, use_rslora=rslora,
                            family=family, cfg=cfg, max_rank=max_rank, target_modules=targets,
                            path=path, where=w_path)


# ---- jaxinfer's own form: the arrays as an orbax checkpoint beside a small JSON -------------

ORBAX_META = "jaxinfer_lora.json"
ORBAX_ARRAYS = "arrays"
FORMAT_VERSION = 1


def is_orbax_adapter(path: str) -> bool:
    return isinstance(path, str) and os.path.isfile(os.path.join(path, ORBAX_META))


def save_adapter(adapter: Adapter, path: str) -> None:
    """Writes `adapter` in jaxinfer's form (ValueError if `path` exists and is not empty): A
    [L, in, r] and B [L, r, out] per field with orbax, rank and scale in jaxinfer_lora.json."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    if os.path.exists(path) and os.listdir(path):
        raise ValueError(f"output directory {path!r} exists and is not empty")
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, ORBAX_ARRAYS), {"a": adapter.a, "b": adapter.b})
        ckptr.wait_until_finished()
    meta = {"format_version": FORMAT_VERSION, "rank": adapter.rank, "scale": adapter.scale,
            "shapes": {f: [list(adapter.a[f].shape), list(adapter.b[f].shape)]
                       for f in adapter.a}}
    with open(os.path.join(path, ORBAX_META), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)


def read_orbax(name: str, path: str, *, family, cfg, max_rank: int) -> Adapter:
    """An adapter save_adapter wrote, checked against the model as PEFT ones are."""
    import jax
    import orbax.checkpoint as ocp

    where = os.path.join(path, ORBAX_META)
    meta = _read_json(name, where)
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise AdapterError(f"{where}: not a format {FORMAT_VERSION} jaxinfer adapter")
    r, scale, shapes = meta.get("rank"), meta.get("scale"), meta.get("shapes")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1 or not isinstance(shapes, dict) \
            or isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise AdapterError(f"{where}: rank, scale and shapes are malformed")
    if r > max_rank:
        raise AdapterError(f"{where}: rank r={r} exceeds max_lora_rank={max_rank}")
    allowed = adaptable(family, cfg)
    L = cfg.num_layers
    for field, shape in shapes.items():
        if field not in allowed:
            raise AdapterError(f"{where}: field {show(field)} is not adaptable in this model")
        (fan_in, fan_out), _ = allowed[field]
        if shape != [[L, fan_in, r], [L, r, fan_out]]:
            raise AdapterError(f"{where}: {field} has shapes {show(shape)}; the model needs "
                               f"{[[L, fan_in, r], [L, r, fan_out]]}")
    abstract = {k: {f: jax.ShapeDtypeStruct(tuple(s[i]), np.float32)
                    for f, s in shapes.items()} for i, k in enumerate(("a", "b"))}
    try:
        with ocp.StandardCheckpointer() as ckptr:
            arrays = ckptr.restore(os.path.join(path, ORBAX_ARRAYS), abstract)
    except Exception as e:  # noqa: BLE001 - orbax's many error types: a corrupt adapter
        raise AdapterError(f"adapter {name!r}: cannot restore {path!r}: "
                           f"{type(e).__name__}: {e}") from None
    a = {f: np.asarray(x, np.float32) for f, x in arrays["a"].items()}
    b = {f: np.asarray(x, np.float32) for f, x in arrays["b"].items()}
    if not all(np.isfinite(x).all() for x in (*a.values(), *b.values())):
        raise AdapterError(f"adapter {name!r}: NaN or infinity in its arrays")
    return Adapter(name=name, rank=r, scale=float(scale), a=a, b=b, path=path)
