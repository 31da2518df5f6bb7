"""Model families, by architecture name."""

from jaxinfer.models import llama

# Architecture name (GGUF general.architecture or HF model_type) -> model module.
REGISTRY = {"llama": llama, "mistral": llama, "qwen2": llama}


def get_model(architecture: str):
    if architecture not in REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(REGISTRY)}")
    return REGISTRY[architecture]
