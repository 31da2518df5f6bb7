"""Frozen configuration dataclasses, hashable so jitted functions take them as static arguments."""

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
    architecture: str  # a key of jaxinfer.models.REGISTRY
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
    # Divisors [head_dim/2] of the RoPE inverse frequencies: GGUF's Llama-3 scaling.
    rope_freq_factors: Optional[tuple[float, ...]] = None
    # Per-layer attention (Gemma 3's interleaved local and global layers): each layer's sliding
    # window (None: global) and RoPE base. None: every layer has sliding_window and rope_theta.
    layer_windows: Optional[tuple[Optional[int], ...]] = None
    layer_rope_thetas: Optional[tuple[float, ...]] = None
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)
    query_scale: Optional[float] = None  # attention score scale; None: head_dim ** -0.5
    # Mixture of experts: num_experts of width ffn_dim per layer, experts_per_token chosen by the
    # router, "topk_softmax" (Mixtral) or "softmax_topk" (Qwen3-MoE; renormalised to sum 1 when
    # norm_topk_prob).
    num_experts: int = 0
    experts_per_token: int = 0
    router: Optional[str] = None
    norm_topk_prob: bool = True
    # Copies of each kv head in the weights (sharding.replicate_kv_heads: a tensor degree above
    # the model's kv heads); num_kv_heads counts the copies.
    kv_head_copies: int = 1

    def __post_init__(self):
        if self.rope_freq_factors is not None:  # e.g. a list read back from JSON
            object.__setattr__(self, "rope_freq_factors",
                               tuple(float(f) for f in self.rope_freq_factors))
        for name, kind in (("layer_windows", int), ("layer_rope_thetas", float)):
            value = getattr(self, name)
            if value is not None:
                value = tuple(None if v is None else kind(v) for v in value)
                if len(value) != self.num_layers:
                    raise ValueError(f"{name} has {len(value)} entries for "
                                     f"{self.num_layers} layers")
                object.__setattr__(self, name, value)
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token {self.experts_per_token} must be in "
                             f"[1, num_experts {self.num_experts}]")
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

    def window(self, layer: int) -> Optional[int]:
        """Layer `layer`'s sliding window (None: it attends to every earlier key)."""
        return self.sliding_window if self.layer_windows is None else self.layer_windows[layer]

    def layer_rope_theta(self, layer: int) -> float:
        return self.rope_theta if self.layer_rope_thetas is None else \
            self.layer_rope_thetas[layer]

    @property
    def windows(self) -> tuple[Optional[int], ...]:
        """The distinct sliding windows of the layers (None: global), in layer order."""
        return tuple(dict.fromkeys(self.window(i) for i in range(self.num_layers)))

    @property
    def num_local_layers(self) -> int:
        """Layers with a sliding window (a hybrid KV cache keeps them in its ring)."""
        return sum(self.window(i) is not None for i in range(self.num_layers))


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


_METHODS = ("ngram", "draft")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """method "ngram": prompt lookup (the row's last n tokens matched in its prompt and output,
    the match's continuation proposed); "draft": a smaller model sharing the target's vocabulary
    (draft_model: an alias or a path). num_draft_tokens: k proposed per step. ngram_max: the
    longest suffix matched (down to min(2, ngram_max))."""

    method: str = "ngram"            # "ngram" | "draft"
    num_draft_tokens: int = 4
    draft_model: Optional[str] = None
    ngram_max: int = 3

    def __post_init__(self):
        if self.method not in _METHODS:
            raise ValueError(f"SpeculativeConfig.method must be one of {_METHODS}, "
                             f"got {self.method!r}")
        for name in ("num_draft_tokens", "ngram_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.num_draft_tokens > MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens={self.num_draft_tokens} exceeds the limit of "
                             f"{MAX_DRAFT_TOKENS}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("method 'draft' needs draft_model (an alias or a path)")

    @property
    def ngram_min(self) -> int:
        return min(2, self.ngram_max)


MAX_DRAFT_TOKENS = 16  # each value compiles its own verification step


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What the engine was built with (`LLM.engine_config`); the defaults are the LLM's own."""
    max_seq_len: int
    max_num_seqs: int
    prefill_chunk: int = 128
    decode_steps: int = 8  # decode steps per device dispatch
    max_num_batched_tokens: int = 512  # token budget of one mixed step (decodes + prefill)
    dtype: str = "float32"
    attention: str = "reference"
    speculative: Optional[SpeculativeConfig] = None
