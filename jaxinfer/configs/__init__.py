"""The built-in presets that --config resolves by name, and the data files the package itself
needs, shipped in the package so they resolve from an installed wheel, not only from a checkout.

    smollm2-cpu.json, smollm2-chat.json   presets: {"description": str, "model": {LLM kwargs},
                                          "sampling": {SamplingParams kwargs}, "chat": bool,
                                          "mesh": {"data": d, "tensor": t, "sequence": s}}
                                          (checked by launch.common.load_preset)
    draft_prompts.txt                     prompts for launch.train_draft

Deployment configs to copy and edit (model x mesh x engine) are in the repository's configs/
folder, passed by path (`--config configs/llama-3-8b-8xgpu-tp8.json`); model shapes as HF
config.json files (for the computed-scaling benchmarks) are in configs/models/.
"""

from __future__ import annotations

import os

CONFIGS_DIR = os.path.dirname(os.path.abspath(__file__))


def names() -> list[str]:
    """The preset names: the .json files here, without the extension."""
    return sorted(f[:-5] for f in os.listdir(CONFIGS_DIR) if f.endswith(".json"))


def path(name: str) -> str:
    """The file of a shipped name ("smollm2-cpu", or "draft_prompts.txt" with its extension);
    ValueError naming the available ones for an unknown name."""
    full = os.path.join(CONFIGS_DIR, name if os.path.splitext(name)[1] else name + ".json")
    if os.sep in name or not os.path.isfile(full):
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(names())}")
    return full
