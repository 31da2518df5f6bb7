"""Scoring a model on text: perplexity and next-token (greedy) agreement between two models.
Text is scored in non-overlapping windows from an empty cache (a window's first token is not
predicted), padded to `window` tokens so one program serves them all.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.models import sequence_logits


@dataclasses.dataclass
class Scores:
    nll: np.ndarray       # [n] float64: -log p(token) of every predicted token
    argmax: np.ndarray    # [n] int32: the model's most likely token at each of those positions

    @property
    def perplexity(self) -> float:
        return float(np.exp(self.nll.mean()))


@jax.jit
def _window_scores(logits: jax.Array, targets: jax.Array):
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return nll, jnp.argmax(logits, axis=-1).astype(jnp.int32)


def score(params, cfg: ModelConfig, token_ids: list[int], window: int = 512,
          kv_cache_dtype: Optional[str] = None) -> Scores:
    """Scores of token_ids[1:] (within windows) under the model; kv_cache_dtype: attend to
    keys and values as a quantized cache holds them."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    nll, argmax = [], []
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start:start + window]
        if len(chunk) < 2:
            break
        padded = np.zeros((1, window), np.int32)
        padded[0, :len(chunk)] = chunk
        logits = sequence_logits(params, cfg, jnp.asarray(padded), kv_cache_dtype=kv_cache_dtype)
        n, a = _window_scores(logits[0, :-1], jnp.asarray(padded[0, 1:]))
        nll.append(np.asarray(n, np.float64)[:len(chunk) - 1])
        argmax.append(np.asarray(a)[:len(chunk) - 1])
    if not nll:
        raise ValueError(f"scoring needs at least 2 tokens, got {len(token_ids)}")
    return Scores(np.concatenate(nll), np.concatenate(argmax))


def perplexity(params, cfg: ModelConfig, token_ids: list[int], window: int = 512,
               kv_cache_dtype: Optional[str] = None) -> float:
    """exp(mean NLL) of token_ids under the model (see score)."""
    return score(params, cfg, token_ids, window, kv_cache_dtype).perplexity


def agreement(a: Scores, b: Scores) -> float:
    """Fraction of positions where two models' most likely next tokens agree."""
    if a.argmax.shape != b.argmax.shape:
        raise ValueError(f"scores of different texts: {a.argmax.shape} vs {b.argmax.shape}")
    return float(np.mean(a.argmax == b.argmax))
