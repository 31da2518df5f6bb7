"""The built-in presets --config resolves by name (NAME.json: the sections launch.common
describes) and data files the package needs (draft_prompts.txt), shipped in the package so they
resolve from an installed wheel. Deployment presets to copy and edit are in the repository's
configs/ folder (configs/README.md), passed by path.
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
