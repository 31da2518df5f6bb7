"""Rotary position embeddings in the half-rotation layout (HF `rotate_half`).

Angles come from absolute token positions, so any cache layout (ring, paged) works unchanged.
"""

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                  freq_factors: Sequence[float] | None = None) -> np.ndarray:
    """Inverse frequencies [H/2] float32, with Llama-3 `scaling` (HF configs) or `freq_factors`
    [H/2] dividing each (GGUF's rope_freqs, the same scaling as llama.cpp stores it)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is not None and freq_factors is not None:
        raise ValueError("give RoPE scaling either as parameters or as frequency factors, not both")
    if scaling is not None:
        # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and the band in
        # between interpolated smoothly, so the context stretches without hurting local order.
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
                  / (scaling.high_freq_factor - scaling.low_freq_factor))
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        inv_freq = np.where(mid, blended, scaled)
    if freq_factors is not None:
        factors = np.asarray(freq_factors, dtype=np.float64)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"RoPE frequency factors have shape {factors.shape}; head_dim "
                             f"{head_dim} needs {inv_freq.shape}")
        if not np.all(np.isfinite(factors) & (factors > 0)):
            raise ValueError("RoPE frequency factors must be finite and positive")
        inv_freq = inv_freq / factors
    return inv_freq.astype(np.float32)


def rope_angles(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] int -> (cos, sin) each [B, T, H/2] float32."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, heads, H]; cos, sin [B, T, H/2]. Rotates the pairs (x[i], x[i + H/2])."""
    half = x.shape[-1] // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    c = cos[:, :, None, :]
    s = sin[:, :, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)
