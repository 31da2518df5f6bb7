"""LoRA on the device: adapter slots held as stacked arrays, and the linear layer's low-rank
term for a batch whose rows use different adapters (or none).

All N slots of a target module are, per layer, one pair of arrays: A [in, N*R] (slot n's A in
columns n*R .. n*R+R-1) and B [N*R, out]; per layer rather than stacked over layers, so a
layer's products read them in place (a slice of a stack is copied out for the native products
every step, adapters or not). A step computes x @ A for every slot at once, keeps each
token's own slot's columns (scaled by that adapter's alpha/r) through a per-token mask, and
multiplies by B: one product pair of inner width N*R, no gather of per-token matrices. An
adapter of rank r < R fills r columns and leaves zeros, which add nothing. The mask is built
once per step from each token's row and each row's slot; a step with no adapter row skips the
term (lax.cond). docs/lora.md has the design and its cost.
"""

from __future__ import annotations

import functools
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.backends.tuning import program_jit

# Target modules: PEFT's names (the HF projections) and the layer fields they adapt.
TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
           "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
NO_SLOT = -1  # a row (or token) without an adapter


@flax.struct.dataclass
class LoraWeight:
    """A layer's weight with the step's low-rank term: linear() and gated_mlp() compute
    x @ base + ((x @ a) * mask) @ b, the term skipped when no token uses an adapter (a step
    without adapter rows reads none of a and b)."""

    base: object            # the weight as the layer holds it (float or quantized)
    a: jax.Array            # [in, N*R] in the weights' dtype
    b: jax.Array            # [N*R, out]
    mask: jax.Array         # [T, N*R] float32: the token's adapter scale on its slot's columns
    active: jax.Array       # [] bool: some token uses an adapter

    def delta(self, x: jax.Array, backend) -> jax.Array:
        """The low-rank term for x [T, in] -> [T, out] float32 (zeros when inactive), its
        products the backend's (as the base weight's)."""
        def term(x):
            h = backend.dot(x, self.a, "...i,io->...o") * self.mask
            return backend.dot(h.astype(x.dtype), self.b, "...i,io->...o")

        return jax.lax.cond(self.active, term,
                            lambda x: jnp.zeros(x.shape[:-1] + self.b.shape[-1:], jnp.float32),
                            x)


@flax.struct.dataclass
class LoraSlots:
    """N adapter slots of rank R on the device: per target field, a tuple of L arrays A
    [in, N*R] and of L arrays B [N*R, out] (in the base weights' float dtype), and each slot's
    scale [N] (alpha / r, or alpha / sqrt(r); float32)."""

    a: dict   # field -> (A of layer 0, ..., A of layer L-1)
    b: dict
    scale: jax.Array  # [N] float32
    num_slots: int = flax.struct.field(pytree_node=False, default=0)
    rank: int = flax.struct.field(pytree_node=False, default=0)

    @classmethod
    def zeros(cls, shapes: dict, num_layers: int, num_slots: int, rank: int,
              dtype=np.float32, xp=np) -> "LoraSlots":
        """Empty slots for targets {field: (in, out)}."""
        width = num_slots * rank
        return cls(a={f: tuple(xp.zeros((i, width), dtype) for _ in range(num_layers))
                      for f, (i, o) in shapes.items()},
                   b={f: tuple(xp.zeros((width, o), dtype) for _ in range(num_layers))
                      for f, (i, o) in shapes.items()},
                   scale=xp.zeros((num_slots,), np.float32), num_slots=num_slots, rank=rank)

    def logical_axes(self, weight_axes: dict) -> "LoraSlots":
        """Each array's logical axes: A's input and B's output axis follow the base weight's
        (weight_axes: field -> (in axis, out axis)), the slot columns replicated."""
        return LoraSlots(a={f: tuple((weight_axes[f][0], None) for _ in arrays)
                            for f, arrays in self.a.items()},
                         b={f: tuple((None, weight_axes[f][1]) for _ in arrays)
                            for f, arrays in self.b.items()},
                         scale=(None,), num_slots=self.num_slots, rank=self.rank)

    def token_mask(self, token_slot: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(mask [T, N*R] float32, active []) for tokens' slots [T] (NO_SLOT: none)."""
        cols = jnp.arange(self.num_slots * self.rank, dtype=jnp.int32) // self.rank
        hit = token_slot[:, None] == cols[None, :]
        return jnp.where(hit, self.scale[cols][None, :], 0.0), jnp.any(token_slot >= 0)

    def attach(self, lp, i: int, mask: jax.Array, active: jax.Array):
        """Layer i's params with each adapted weight a LoraWeight."""
        return lp.replace(**{f: LoraWeight(getattr(lp, f), self.a[f][i], self.b[f][i], mask,
                                           active) for f in self.a})


@flax.struct.dataclass
class LoraStep:
    """What a forward needs for LoRA: the slots and each cache row's slot [B] (NO_SLOT)."""

    slots: LoraSlots
    row_slot: jax.Array

    def token_mask(self, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The mask of tokens of cache rows `rows` [T] (B: padding, no adapter)."""
        B = self.row_slot.shape[0]
        slot = jnp.where(rows < B, self.row_slot[jnp.minimum(rows, B - 1)], NO_SLOT)
        return self.slots.token_mask(slot)


@functools.partial(program_jit, donate_argnums=(0,))
def write_slot(slots: LoraSlots, n: jax.Array, a: dict, b: dict,
               scale: jax.Array) -> LoraSlots:
    """slots with slot n [] set to an adapter: a {field: [L, in, R]}, b {field: [L, R, out]}
    (zeros for fields it does not adapt, and past its rank), scale []."""
    R = slots.rank

    def put(arrays, new, at):
        return tuple(jax.lax.dynamic_update_slice(x, new[i].astype(x.dtype), at)
                     for i, x in enumerate(arrays))

    new_a = {f: put(slots.a[f], a[f], (0, n * R)) for f in slots.a}
    new_b = {f: put(slots.b[f], b[f], (n * R, 0)) for f in slots.b}
    return slots.replace(a=new_a, b=new_b, scale=slots.scale.at[n].set(scale))


def is_lora(w) -> bool:
    return isinstance(w, LoraWeight)


def base_of(w):
    """The weight under a LoraWeight (the weight itself otherwise)."""
    return w.base if isinstance(w, LoraWeight) else w


