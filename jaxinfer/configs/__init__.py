"""Presets and model configs shipped with the package (so they resolve from an installed
wheel, not only from a checkout).

    smollm2-cpu.json, smollm2-chat.json   presets: {"model": {LLM kwargs}, "sampling":
                                          {SamplingParams kwargs}, "chat": bool}
    llama-3-8b.json, llama-3-70b.json     HF config.json files (benchmarks/scaling.py)
    draft_prompts.txt                     prompts for launch.train_draft
"""

from __future__ import annotations

import os

CONFIGS_DIR = os.path.dirname(os.path.abspath(__file__))


def names() -> list[str]:
    """The preset and config names: the .json files here, without the extension."""
    return sorted(f[:-5] for f in os.listdir(CONFIGS_DIR) if f.endswith(".json"))


def path(name: str) -> str:
    """The file of a shipped name ("smollm2-cpu", or "draft_prompts.txt" with its extension);
    ValueError naming the available ones for an unknown name."""
    full = os.path.join(CONFIGS_DIR, name if os.path.splitext(name)[1] else name + ".json")
    if os.sep in name or not os.path.isfile(full):
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(names())}")
    return full
