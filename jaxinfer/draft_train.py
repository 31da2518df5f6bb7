"""Draft-model distillation for speculative decoding (`python -m jaxinfer.launch.train_draft`):
a draft of a few of the target's layers, sharing its frozen embedding, head and final norm, is
trained on the forward KL(p_target || q_draft) over the full vocabulary.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxinfer.config import ModelConfig
from jaxinfer.models import ModelParams, sequence_logits


def draft_from_target(params: ModelParams, cfg: ModelConfig, num_layers: int):
    """A num_layers draft: the target's layers at evenly spaced depths (first and last
    included), its embedding, head and final norm shared. Returns (params, config)."""
    if not 1 <= num_layers <= cfg.num_layers:
        raise ValueError(f"num_layers must be in [1, {cfg.num_layers}], got {num_layers}")
    picks = np.unique(np.round(np.linspace(0, cfg.num_layers - 1, num_layers)).astype(int))
    draft_cfg = cfg.replace(num_layers=num_layers)
    return params.replace(layers=tuple(params.layers[i] for i in picks)), draft_cfg


def kl_loss(trainable, frozen, draft_cfg: ModelConfig, tokens, mask, target_logp):
    """Mean over mask [B, T] of KL(p_target || q_draft) at each position; trainable = (layers,
    final_norm), frozen = the draft's params otherwise; target_logp [B, T, V]."""
    layers, final_norm = trainable
    params = frozen.replace(layers=layers, final_norm=final_norm)
    logq = jax.nn.log_softmax(sequence_logits(params, draft_cfg, tokens), axis=-1)
    kl = jnp.sum(jnp.exp(target_logp) * (target_logp - logq), axis=-1)
    return jnp.sum(kl * mask) / jnp.maximum(jnp.sum(mask), 1)


def make_train_step(draft_cfg: ModelConfig, target_cfg: ModelConfig, optimizer):
    @jax.jit
    def step(trainable, opt_state, frozen, target_params, tokens, mask):
        target_logp = jax.nn.log_softmax(
            sequence_logits(target_params, target_cfg, tokens), axis=-1)
        loss, grads = jax.value_and_grad(kl_loss)(trainable, frozen, draft_cfg, tokens, mask,
                                                  target_logp)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss
    return step


def batches(seqs: list[list[int]], batch_size: int, seq_len: int, rng: np.random.Generator):
    """Endless padded batches (tokens [B, T] int32, mask [B, T] float32), reshuffled per pass."""
    while True:
        order = rng.permutation(len(seqs))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            chosen = [seqs[j][:seq_len] for j in order[i:i + batch_size]]
            T = max(len(s) for s in chosen)
            tokens = np.zeros((batch_size, T), np.int32)
            mask = np.zeros((batch_size, T), np.float32)
            for b, s in enumerate(chosen):
                tokens[b, :len(s)] = s
                mask[b, :len(s) - 1] = 1.0  # position t predicts token t + 1
            yield tokens, mask


def train(target_params, target_cfg: ModelConfig, seqs: list[list[int]], *, num_layers: int,
          steps: int, batch_size: int, seq_len: int, learning_rate: float, seed: int,
          log_every: int = 10, log=print):
    """Distils a draft on token sequences; returns (draft params, draft config, losses)."""
    draft, draft_cfg = draft_from_target(target_params, target_cfg, num_layers)
    trainable = (draft.layers, draft.final_norm)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, min(10, steps // 5), steps)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, weight_decay=0.0))
    opt_state = optimizer.init(trainable)
    step_fn = make_train_step(draft_cfg, target_cfg, optimizer)
    data = batches(seqs, min(batch_size, len(seqs)), seq_len, np.random.default_rng(seed))
    losses = []
    t0 = time.perf_counter()
    for i in range(steps):
        tokens, mask = next(data)
        trainable, opt_state, loss = step_fn(trainable, opt_state, draft, target_params, tokens,
                                             mask)
        losses.append(float(loss))
        if log_every and (i % log_every == 0 or i == steps - 1):
            log(f"step {i:4d}  KL {losses[-1]:.4f}  ({time.perf_counter() - t0:.0f} s)")
    layers, final_norm = trainable
    return draft.replace(layers=layers, final_norm=final_norm), draft_cfg, losses


def read_prompts(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        prompts = [line.strip() for line in f if line.strip()]
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def acceptance(model: str, draft_dir: str, prompts: list[str], *, num_draft: int,
               max_tokens: int) -> dict:
    """Greedy speculative decoding of prompts with a draft checkpoint, through the public API:
    acceptance rate and accepted drafts per verification step."""
    import jaxinfer as ji

    llm = ji.LLM(model, max_seq_len=512, max_num_seqs=min(8, len(prompts)),
                 speculative=ji.SpeculativeConfig("draft", num_draft_tokens=num_draft,
                                                  draft_model=draft_dir))
    llm.generate(prompts, ji.SamplingParams(max_tokens=max_tokens))
    s = llm.stats()
    return {"acceptance_rate": round(s["acceptance_rate"], 4),
            "accepted_per_step": round(s["mean_accepted_tokens"], 4),
            "draft_tokens": s["draft_tokens"]}
