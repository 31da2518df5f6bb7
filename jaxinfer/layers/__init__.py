"""Device math shared by every model family: norms, rotary embeddings, linear layers, MLPs."""

from jaxinfer.layers.linear import linear, product
from jaxinfer.layers.mlp import GATES, gated_mlp
from jaxinfer.layers.norm import rms_norm
from jaxinfer.layers.rope import apply_rope, rope_angles, rope_inv_freq

__all__ = ["GATES", "apply_rope", "gated_mlp", "linear", "product", "rms_norm", "rope_angles",
           "rope_inv_freq"]
