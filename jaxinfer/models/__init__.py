"""Model families, by architecture name (GGUF general.architecture or HF model_type).

Every family implements one protocol (jaxinfer.models.base.Family); everything outside this
package reaches a family only through `get_model(cfg.architecture)`.

    llama       Llama 2/3, SmolLM, Mistral, Qwen2                   models/llama.py
    qwen3       Qwen3 (dense): Llama's layer with QK-norm           models/llama.py
    mixtral     Mixtral: top-2 of 8 experts                         models/moe.py
    qwen3_moe   Qwen3-MoE: top-k of many small experts, QK-norm     models/moe.py
    gemma3      Gemma 3: interleaved local / global attention       models/gemma3.py
"""

from __future__ import annotations

from jaxinfer.models import gemma3, llama, moe
from jaxinfer.models.base import Family, ModelParams, sequence_logits

REGISTRY: dict[str, Family] = {
    "llama": llama.LLAMA, "mistral": llama.LLAMA, "qwen2": llama.LLAMA,
    "qwen3": llama.QWEN3,
    "mixtral": moe.MIXTRAL, "qwen3moe": moe.QWEN3_MOE, "qwen3_moe": moe.QWEN3_MOE,
    "gemma3": gemma3.GEMMA3, "gemma3_text": gemma3.GEMMA3,
}


def get_model(architecture: str) -> Family:
    if architecture not in REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; "
                         f"supported: {sorted(REGISTRY)}")
    return REGISTRY[architecture]


__all__ = ["Family", "ModelParams", "REGISTRY", "get_model", "sequence_logits"]
