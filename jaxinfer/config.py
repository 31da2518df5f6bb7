"""Frozen, hashable configuration dataclasses.

They are hashable so jitted functions can take them as static arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (HF `rope_type="llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: Optional[int] = None
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    # Per-frequency divisors [head_dim/2] of the RoPE inverse frequencies: how GGUF files carry
    # Llama-3 scaling (the `rope_freqs` tensor). A tuple so the config stays hashable.
    rope_freq_factors: Optional[tuple[float, ...]] = None

    def __post_init__(self):
        if self.rope_freq_factors is not None:  # e.g. a list read back from JSON
            object.__setattr__(self, "rope_freq_factors",
                               tuple(float(f) for f in self.rope_freq_factors))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Ring-buffer KV cache sizing: `capacity` slots per row, `max_seq_len` tokens per request."""

    max_seq_len: int
    max_num_seqs: int
    capacity: int
    dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Degrees of the device mesh axes. Public: `ji.MeshConfig(data=, tensor=, sequence=)`."""

    data: int = 1
    tensor: int = 1
    sequence: int = 1

    def __post_init__(self):
        for name in ("data", "tensor", "sequence"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"MeshConfig.{name} must be a positive int, got {v!r}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_seq_len: int
    max_num_seqs: int
    prefill_chunk: int = 128
    decode_steps: int = 32  # decode steps per device dispatch
    max_num_batched_tokens: int = 512  # token budget of one mixed step (decodes + prefill)
    dtype: str = "float32"
    attention: str = "reference"
    speculative: Optional["SpeculativeConfig"] = None  # jaxinfer.speculative
