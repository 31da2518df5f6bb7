"""LoRA parameters a JAX trainer optimizes: a pytree of A [L, in, r] and B [L, r, out] per
adapted field, which `sequence_logits(..., lora=)` applies in the differentiable forward and
`LLM.update_weights(..., lora=name)` writes into an adapter's device slot (docs/rl.md).

The forward computes each adapted layer as x @ W + scale * (x @ A) @ B: the same product pair
the engine's slots compute, with one slot and every token on it.
"""

from __future__ import annotations

from typing import Iterable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.lora.weights import TARGETS, LoraSlots, LoraStep


@flax.struct.dataclass
class LoraParams:
    """A LoRA adapter as arrays: a {field: [L, in, r]}, b {field: [L, r, out]} (fields as the
    layer names them: "wq", "wv", ...; PEFT's module names map through lora.TARGETS), and its
    scale (lora_alpha / r), a constant rather than a trained leaf."""

    a: dict
    b: dict
    scale: float = flax.struct.field(pytree_node=False, default=1.0)

    @property
    def rank(self) -> int:
        return next(iter(self.a.values())).shape[-1]

    @classmethod
    def init(cls, key: jax.Array, cfg, rank: int, targets: Iterable[str] = ("q_proj", "v_proj"),
             alpha: Optional[float] = None, dtype=jnp.float32) -> "LoraParams":
        """PEFT's initialisation: A uniform in +-1/sqrt(in) (Kaiming-uniform with a = sqrt(5)),
        B zeros, so the adapter starts as the identity. targets: PEFT module names or layer
        fields; alpha defaults to rank (scale 1)."""
        from jaxinfer.lora.adapters import adaptable
        from jaxinfer.models import get_model

        allowed = adaptable(get_model(cfg.architecture), cfg)
        fields = [TARGETS.get(t, t) for t in targets]
        bad = [t for t, f in zip(targets, fields) if f not in allowed]
        if bad:
            raise ValueError(f"LoRA target {bad[0]!r} is not adaptable in this model; "
                             f"adaptable: {sorted(allowed)}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an int >= 1, got {rank!r}")
        L = cfg.num_layers
        a, b = {}, {}
        for i, f in enumerate(fields):
            (fan_in, fan_out), _ = allowed[f]
            bound = 1.0 / np.sqrt(fan_in)
            a[f] = jax.random.uniform(jax.random.fold_in(key, i), (L, fan_in, rank), dtype,
                                      -bound, bound)
            b[f] = jnp.zeros((L, rank, fan_out), dtype)
        return cls(a=a, b=b, scale=float(rank if alpha is None else alpha) / rank)

    def step(self, num_rows: int, dtype) -> LoraStep:
        """The forward's LoRA input: one slot holding this adapter, every row on it."""
        slots = LoraSlots(a={f: tuple(x.astype(dtype) for x in self.a[f]) for f in self.a},
                          b={f: tuple(x.astype(dtype) for x in self.b[f]) for f in self.b},
                          scale=jnp.full((1,), self.scale, jnp.float32), num_slots=1,
                          rank=self.rank)
        return LoraStep(slots=slots, row_slot=jnp.zeros((num_rows,), jnp.int32))
