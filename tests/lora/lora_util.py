"""Shared by the LoRA tests: random PEFT-named adapters for a model directory, the same
adapters merged into a copy of its weights (the independent reference), and PEFT files."""

import json
import os
import shutil

import numpy as np

HF_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
              "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def peft_tensors(weights: dict, modules, r: int, seed: int, std: float = 0.2) -> dict:
    """Random lora_A [r, in] / lora_B [out, r] for every layer's `modules`, named as peft
    saves them, shaped after the HF weights [out, in] in `weights`."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, w in weights.items():
        parts = name.split(".")
        if len(parts) < 5 or parts[-1] != "weight" or parts[-2] not in modules:
            continue
        prefix = "base_model.model." + name[:-len(".weight")]
        fan_out, fan_in = w.shape
        out[prefix + ".lora_A.weight"] = (rng.standard_normal((r, fan_in)) * std
                                          ).astype(np.float32)
        out[prefix + ".lora_B.weight"] = (rng.standard_normal((fan_out, r)) * std
                                          ).astype(np.float32)
    return out


def merged(weights: dict, tensors: dict, scale: float) -> dict:
    """The HF weights with W + scale * B A for each adapted module."""
    out = dict(weights)
    for name in tensors:
        if name.endswith(".lora_A.weight"):
            base = name[len("base_model.model."):-len(".lora_A.weight")] + ".weight"
            b = tensors[name.replace("lora_A", "lora_B")]
            out[base] = (weights[base].astype(np.float64)
                         + scale * b.astype(np.float64) @ tensors[name].astype(np.float64)
                         ).astype(np.float32)
    return out


def write_model(src_dir: str, dst_dir: str, weights: dict) -> str:
    """A copy of the HF model directory src_dir with its weights replaced."""
    from safetensors.numpy import save_file

    os.makedirs(dst_dir, exist_ok=True)
    for f in os.listdir(src_dir):
        if f.endswith(".json"):
            shutil.copy(os.path.join(src_dir, f), dst_dir)
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()},
              os.path.join(dst_dir, "model.safetensors"))
    return dst_dir


def write_peft(dst_dir: str, tensors: dict, r: int, alpha: float, modules,
               rslora: bool = False) -> str:
    """A PEFT adapter directory as peft's save_pretrained writes it."""
    from safetensors.numpy import save_file

    os.makedirs(dst_dir, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
              "target_modules": sorted(modules), "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": rslora, "use_dora": False,
              "modules_to_save": None, "base_model_name_or_path": "tiny"}
    with open(os.path.join(dst_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(dst_dir, "adapter_model.safetensors"))
    return dst_dir


def read_weights(model_dir: str) -> dict:
    from safetensors.numpy import load_file

    return {k: v.astype(np.float32) for k, v in
            load_file(os.path.join(model_dir, "model.safetensors")).items()}
