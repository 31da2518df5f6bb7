"""GRPO with a LoRA adapter on SmolLM2-135M-Instruct, with jaxinfer as the sampler.

Each step samples G completions for each of P prompts under the current adapter
(`llm.generate(..., lora="policy")` with `token_logprobs=True`), scores them with a programmatic
reward, normalizes the rewards within each prompt's group, takes one optax step on the
policy-gradient loss computed with `jax.grad` through `jaxinfer.models.sequence_logits(...,
lora=)`, and hands the new adapter to the engine with `llm.update_weights(lora, lora="policy")`
(no recompilation). The base weights stay frozen; only the adapter trains.

The task: "What is a + b? Reply with only the number." The reward gives partial credit, up to
1.0 for a reply that is the correct number and nothing else:
  0.5 if the correct sum appears in the reply as a number,
  0.5 if the reply is a bare number, or less for a short reply that stopped by itself
      (0.25 * (1 - words / 8)); nothing for a reply cut off at max_tokens.
SmolLM2-135M mostly answers with a sentence ("To find 3 + 8, we add ..."), so the start is
low and the format is what the adapter learns first.

    python examples/grpo.py --steps 30 --out /tmp/grpo_curve.json

The loss is the PPO-style clipped objective with the sampler's `sampling_logprobs` as the old
log-probabilities: with one update per batch the ratio is about 1, and the mean
|logp_train - logp_sampler| over the completion tokens is logged as a consistency figure
between the training forward and the engine. Batches are padded to a fixed number of rows
(P * G) and to the smallest of a few fixed lengths (--buckets), so the gradient compiles once
per length.
"""

from __future__ import annotations

import json
import re
import time
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxinfer as ji
from jaxinfer.lora.trainable import LoraParams
from jaxinfer.models import sequence_logits

SYSTEM = "Answer with only the number."
QUESTION = "What is {a} + {b}? Reply with only the number."
_NUMBER = re.compile(r"-?\d+")
_BARE = re.compile(r"\s*-?\d+\.?\s*")


# ---------------------------------------------------------------------------------------------
# Task and reward

class Problem(NamedTuple):
    a: int
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b

    @property
    def question(self) -> str:
        return QUESTION.format(a=self.a, b=self.b)


def make_problems(rng: np.random.Generator, num: int, low: int = 2, high: int = 20
                  ) -> list[Problem]:
    """num addition problems with operands in [low, high)."""
    return [Problem(int(rng.integers(low, high)), int(rng.integers(low, high)))
            for _ in range(num)]


def chat_prompt(tokenizer, problem: Problem) -> str:
    return tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": problem.question}],
                                         add_generation_prompt=True)


def reward(text: str, answer: int, finish_reason: Optional[str]) -> float:
    """Partial credit in [0, 1]: 0.5 for the correct number anywhere in the reply, 0.5 for a
    bare number (0.25 * (1 - words / 8) for a short reply; 0 when cut off at max_tokens)."""
    r = 0.5 if str(answer) in _NUMBER.findall(text) else 0.0
    if finish_reason == "length":
        return r
    if _BARE.fullmatch(text):
        return r + 0.5
    return r + 0.25 * max(0.0, 1.0 - len(text.split()) / 8.0)


def group_advantages(rewards: np.ndarray, eps: float = 1e-4) -> np.ndarray:
    """rewards [P, G] -> (reward - group mean) / (group std + eps), per group."""
    rewards = np.asarray(rewards, np.float32)
    mean = rewards.mean(axis=1, keepdims=True)
    std = rewards.std(axis=1, keepdims=True)
    return (rewards - mean) / (std + eps)


# ---------------------------------------------------------------------------------------------
# Batches

class Batch(NamedTuple):
    """Fixed-shape training rows: tokens [B, T] (prompt + completion, right-padded), mask
    [B, T] (1 where the token at t+1 is a completion token: the logits at t predict it),
    old_logp [B, T] (the sampler's log-probability of token t+1, aligned with mask) and
    advantages [B]."""

    tokens: np.ndarray
    mask: np.ndarray
    old_logp: np.ndarray
    advantages: np.ndarray


def bucket_length(length: int, buckets: Sequence[int]) -> int:
    for b in sorted(buckets):
        if length <= b:
            return b
    raise ValueError(f"a sequence of {length} tokens is longer than the largest bucket "
                     f"{max(buckets)}")


def build_batch(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                old_logprobs: Sequence[np.ndarray], advantages: Sequence[float],
                buckets: Sequence[int], rows: Optional[int] = None, pad_id: int = 0,
                stop_ids: Optional[Sequence[Optional[int]]] = None) -> Batch:
    """Right-pads prompt + completion rows to the smallest bucket length that fits them all,
    and to `rows` rows (padding rows have an all-zero mask). stop_ids: per row, the stop id
    that ended the completion (CompletionOutput.stop_token_id: token_ids leave it out, the
    log-probability arrays end with it), or None; it is appended so the loss also trains when
    to stop."""
    n = len(prompt_ids)
    if stop_ids is not None:
        completion_ids = [list(c) + ([e] if e is not None else [])
                          for c, e in zip(completion_ids, stop_ids)]
    rows = n if rows is None else rows
    if rows < n:
        raise ValueError(f"{n} sequences do not fit in {rows} rows")
    T = bucket_length(max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)), buckets)
    tokens = np.full((rows, T), pad_id, np.int32)
    mask = np.zeros((rows, T), np.float32)
    old = np.zeros((rows, T), np.float32)
    adv = np.zeros((rows,), np.float32)
    for i, (p, c, lp, a) in enumerate(zip(prompt_ids, completion_ids, old_logprobs, advantages)):
        seq = list(p) + list(c)
        tokens[i, :len(seq)] = seq
        # logits at position t predict token t + 1: completion token j sits at len(p) + j.
        start = len(p) - 1
        mask[i, start:start + len(c)] = 1.0
        old[i, start:start + len(c)] = np.asarray(lp, np.float32)[:len(c)]
        adv[i] = a
    return Batch(tokens, mask, old, adv)


# ---------------------------------------------------------------------------------------------
# Loss and one optimizer step

def token_logprobs(params, cfg, lora: LoraParams, tokens: jax.Array) -> jax.Array:
    """log p(token t+1 | tokens <= t) under base + adapter: [B, T] (the last column is 0)."""
    logits = sequence_logits(params, cfg, tokens, lora=lora)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    return jnp.take_along_axis(logp, nxt[..., None], axis=-1)[..., 0]


def grpo_loss(lora: LoraParams, params, cfg, batch: Batch, clip_eps: float = 0.2):
    """The clipped policy-gradient loss, averaged over each sequence's completion tokens and
    then over sequences. Returns (loss, aux) with aux the mean |logp - old_logp| and the mean
    ratio over completion tokens."""
    logp = token_logprobs(params, cfg, lora, batch.tokens)
    old = batch.old_logp
    ratio = jnp.exp(logp - old)
    adv = batch.advantages[:, None]
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -jnp.minimum(unclipped, clipped) * batch.mask
    lengths = batch.mask.sum(axis=1)
    live = (lengths > 0).astype(jnp.float32)
    per_seq = per_token.sum(axis=1) / jnp.maximum(lengths, 1.0)
    loss = (per_seq * live).sum() / jnp.maximum(live.sum(), 1.0)
    ntok = jnp.maximum(batch.mask.sum(), 1.0)
    aux = {"logp_gap": (jnp.abs(logp - old) * batch.mask).sum() / ntok,
           "ratio": (ratio * batch.mask).sum() / ntok}
    return loss, aux


def make_train_step(params, cfg, optimizer: optax.GradientTransformation,
                    clip_eps: float = 0.2):
    """A (lora, opt_state, *batch) -> (lora, opt_state, loss, aux) step, jitted. The frozen
    base weights go in as an argument, not closed over: a closed-over array would be embedded
    in the program as a constant (a slow compile, and a cache key the size of the model)."""

    @jax.jit
    def step(lora, opt_state, params, tokens, mask, old_logp, advantages):
        batch = Batch(tokens, mask, old_logp, advantages)
        (loss, aux), grads = jax.value_and_grad(grpo_loss, has_aux=True)(
            lora, params, cfg, batch, clip_eps)
        updates, opt_state = optimizer.update(grads, opt_state, lora)
        lora = optax.apply_updates(lora, updates)
        aux["grad_norm"] = optax.tree.norm(grads)
        return lora, opt_state, loss, aux

    return lambda lora, opt_state, *batch: step(lora, opt_state, params, *batch)


# ---------------------------------------------------------------------------------------------
# One GRPO step: sample, score, train, update the engine

class Trainer:
    """Holds the engine, the adapter, the optimizer and the jitted step."""

    def __init__(self, llm: "ji.LLM", *, rank: int = 8, alpha: Optional[float] = None,
                 targets: Sequence[str] = ("q_proj", "v_proj"), lr: float = 2e-3,
                 prompts_per_step: int = 2, group_size: int = 8, max_tokens: int = 16,
                 buckets: Sequence[int] = (64, 96), clip_eps: float = 0.2, seed: int = 0,
                 train_dtype: Optional[str] = None, adapter: str = "policy",
                 reward_fn=None):
        self.llm, self.cfg = llm, llm.model_config
        self.P, self.G, self.max_tokens = prompts_per_step, group_size, max_tokens
        self.buckets, self.seed, self.adapter = tuple(buckets), seed, adapter
        self.reward_fn = reward if reward_fn is None else reward_fn  # (text, answer, reason)
        params = llm.params
        if train_dtype is not None:  # e.g. a float32 copy of the (bf16) engine weights
            dt = jnp.dtype(train_dtype)
            params = jax.tree.map(
                lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
        self.params = params
        self.lora = LoraParams.init(jax.random.PRNGKey(seed), self.cfg, rank, targets=targets,
                                    alpha=alpha)
        self.optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr))
        self.opt_state = self.optimizer.init(self.lora)
        # Committed to the weights' device, as the step's outputs are: the second step then
        # finds the first step's program instead of compiling another for uncommitted inputs.
        device = next(iter(params.final_norm.devices()))
        self.lora, self.opt_state = jax.device_put((self.lora, self.opt_state), device)
        self._step = make_train_step(params, self.cfg, self.optimizer, clip_eps)
        self.step_index = 0
        llm.update_weights(self.lora, lora=adapter)  # loads the adapter (identity at init)

    def sample(self, problems: Sequence[Problem], step: int):
        """G completions per problem under the current adapter; seeds depend on (seed, step,
        prompt) alone."""
        tok = self.llm.tokenizer
        prompts = [chat_prompt(tok, p) for p in problems]
        base = (self.seed * 1_000_003 + step * len(problems) * self.G) % (2**32 - 2**20)
        params = [ji.SamplingParams(n=self.G, temperature=1.0, max_tokens=self.max_tokens,
                                    seed=base + i * self.G, token_logprobs=True)
                  for i in range(len(problems))]
        return prompts, self.llm.generate(prompts, params, lora=self.adapter)

    def step(self, problems: Sequence[Problem]) -> dict:
        """One GRPO step on these problems; returns the step's record."""
        t0 = time.perf_counter()
        _, outs = self.sample(problems, self.step_index)
        t_sample = time.perf_counter() - t0

        rewards = np.array([[self.reward_fn(c.text, p.answer, c.finish_reason)
                             for c in o.outputs] for p, o in zip(problems, outs)], np.float32)
        adv = group_advantages(rewards)
        prompt_ids, comp_ids, stops, old, advs, versions = [], [], [], [], [], set()
        for o, a in zip(outs, adv):
            for c, ai in zip(o.outputs, a):
                prompt_ids.append(o.prompt_token_ids)
                comp_ids.append(c.token_ids)
                stops.append(c.stop_token_id)
                old.append(c.sampling_logprobs)
                advs.append(ai)
                versions.add(c.weight_version)
        batch = build_batch(prompt_ids, comp_ids, old, advs, self.buckets,
                            rows=self.P * self.G, stop_ids=stops)

        t1 = time.perf_counter()
        self.lora, self.opt_state, loss, aux = self._step(self.lora, self.opt_state, *batch)
        loss = float(loss)
        aux = {k: float(v) for k, v in aux.items()}
        t_train = time.perf_counter() - t1

        t2 = time.perf_counter()
        self.llm.update_weights(self.lora, lora=self.adapter)
        t_update = time.perf_counter() - t2
        self.step_index += 1
        return {
            "step": self.step_index - 1,
            "mean_reward": float(rewards.mean()),
            "rewards": rewards.tolist(),
            "loss": loss,
            "logp_gap": aux["logp_gap"],
            "ratio": aux["ratio"],
            "grad_norm": aux["grad_norm"],
            "sample_s": t_sample,
            "train_s": t_train,
            "update_s": t_update,
            "seq_len": int(batch.tokens.shape[1]),
            "mean_completion_tokens": float(np.mean([len(c) for c in comp_ids])),
            "sampled_weight_version": sorted(versions),
            "weight_version": self.llm.weight_version,
            "example": outs[0].outputs[0].text,
        }


def _print(line: str) -> None:
    print(line, flush=True)


def run(llm: "ji.LLM", steps: int, log=_print, **trainer_kwargs) -> list[dict]:
    """steps GRPO steps on fresh problems each step (drawn from the trainer's seed)."""
    trainer = Trainer(llm, **trainer_kwargs)
    rng = np.random.default_rng(trainer.seed)
    records = []
    for _ in range(steps):
        rec = trainer.step(make_problems(rng, trainer.P))
        records.append(rec)
        if log is not None:
            log(f"step {rec['step']:3d}  reward {rec['mean_reward']:.3f}  "
                f"loss {rec['loss']:+.4f}  |dlogp| {rec['logp_gap']:.4f}  "
                f"sample {rec['sample_s']:.1f}s  train {rec['train_s']:.1f}s  "
                f"version {rec['weight_version']}  e.g. {rec['example']!r}")
    return records


def main(argv):
    del argv
    from absl import flags

    F = flags.FLAGS
    t0 = time.perf_counter()
    llm = ji.LLM("smollm2-135m", dtype=F.dtype, max_seq_len=F.max_seq_len,
                 max_num_seqs=F.prompts * F.group, max_loras=1, max_lora_rank=F.rank)
    t_load = time.perf_counter() - t0
    records = run(llm, F.steps, rank=F.rank, alpha=F.alpha, targets=tuple(F.targets),
                  lr=F.lr, prompts_per_step=F.prompts, group_size=F.group,
                  max_tokens=F.max_tokens, buckets=tuple(int(b) for b in F.buckets),
                  clip_eps=F.clip_eps, seed=F.seed, train_dtype=F.train_dtype)
    wall = time.perf_counter() - t0
    k = min(5, len(records))
    first = float(np.mean([r["mean_reward"] for r in records[:k]]))
    last = float(np.mean([r["mean_reward"] for r in records[-k:]]))
    print(f"mean reward, first {k} steps {first:.3f} -> last {k} steps {last:.3f}; "
          f"wall {wall:.0f}s (load {t_load:.1f}s)")
    if F.out:
        config = {k2: F[k2].value for k2 in ("steps", "prompts", "group", "max_tokens", "lr",
                                             "rank", "alpha", "targets", "seed", "buckets",
                                             "clip_eps", "dtype", "train_dtype", "max_seq_len")}
        with open(F.out, "w") as f:
            json.dump({"config": config, "wall_s": wall, "load_s": t_load,
                       "first_mean_reward": first, "last_mean_reward": last,
                       "records": records}, f, indent=1)


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_integer("steps", 30, "GRPO steps.")
    flags.DEFINE_integer("prompts", 2, "Prompts per step (P).")
    flags.DEFINE_integer("group", 8, "Completions per prompt (G).")
    flags.DEFINE_integer("max_tokens", 16, "Most tokens per completion.")
    flags.DEFINE_float("lr", 2e-3, "Adam learning rate.")
    flags.DEFINE_integer("rank", 8, "LoRA rank.")
    flags.DEFINE_float("alpha", None, "LoRA alpha (default: the rank, scale 1).")
    flags.DEFINE_list("targets", ["q_proj", "v_proj"], "LoRA target modules.")
    flags.DEFINE_list("buckets", ["64", "96"], "Padded training lengths.")
    flags.DEFINE_float("clip_eps", 0.2, "PPO ratio clip.")
    flags.DEFINE_integer("seed", 0, "Seed for problems, adapter init and sampling.")
    flags.DEFINE_string("dtype", "bfloat16", "Engine dtype.")
    flags.DEFINE_string("train_dtype", None, "Training forward's weight dtype (default: the "
                        "engine's weights as they are).")
    flags.DEFINE_integer("max_seq_len", 128, "Engine max_seq_len.")
    flags.DEFINE_string("out", None, "Write the per-step records to this JSON file.")
    app.run(main)
