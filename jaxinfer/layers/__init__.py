"""Device math shared by every model family: norms, rotary embeddings, linear layers, MLPs."""

from jaxinfer.layers.linear import float_matmul, linear
from jaxinfer.layers.mlp import gated_mlp, swiglu_mlp
from jaxinfer.layers.norm import rms_norm
from jaxinfer.layers.rope import apply_rope, rope_angles, rope_inv_freq

__all__ = ["apply_rope", "float_matmul", "gated_mlp", "linear", "rms_norm", "rope_angles",
           "rope_inv_freq", "swiglu_mlp"]
