"""A trainer's weights into a running engine (LLM.update_weights; docs/rl.md).

New weights come as the model's params pytree (jaxinfer.models' tree, from any sharding) or a
mapping of params_from_weights' names ("embed", "layers.3.wq", ...) to arrays, possibly a
subset. Each is checked against the model's shapes before anything changes, then made into
what the engine holds in its place: kv heads repeated where the tensor degree exceeds them,
the engine's dtype (float32 norms and biases where activations are float32), quantized as the
engine's weights are, and placed in the old leaf's sharding. Float weights never leave the
devices: device_put moves them between shardings or meshes, a cast runs where they land. A
quantized engine quantizes on the host (the quantizers are numpy's), a round trip.

A converted leaf is always a buffer of the engine's own (a copy where the caller's array was
already right), so the trainer may donate or delete its arrays afterwards; donate=True lets
the engine keep such an array instead of copying it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.loading.checkpoint import _is_quantized, _name, named_leaves
from jaxinfer.sharding import replicate_kv_heads
from jaxinfer.user_input import show

MODES = ("wait", "abort", "keep", "restart")


def _as_stored(cfg):
    """The model's config as its checkpoints have it: each kv head once."""
    return cfg.replace(num_kv_heads=cfg.num_kv_heads // cfg.kv_head_copies, kv_head_copies=1)


def incoming(weights, cfg) -> dict:
    """The new weights as {name: array}, checked against the model's names and shapes as a
    checkpoint has them (cfg: the engine's config; its repeated kv heads counted once);
    ValueError names the weight and what it should be."""
    from jaxinfer.models import ModelParams, get_model

    if isinstance(weights, ModelParams):
        named = named_leaves(weights)
    elif isinstance(weights, Mapping):
        named = dict(weights)
    else:
        raise ValueError("weights must be the model's params pytree (jaxinfer.models."
                         "ModelParams) or a mapping of weight names to arrays, got "
                         f"{type(weights).__name__}")
    if not named:
        raise ValueError("weights is empty: nothing to update")
    specs = dict(get_model(cfg.architecture).expanded_specs(_as_stored(cfg)))
    out = {}
    for name, x in named.items():
        if not isinstance(name, str) or name not in specs:
            some = sorted(specs)[:4]
            raise ValueError(f"weight name {show(name)} is not one of this model's "
                             f"{len(specs)} weights (such as {some})")
        if _is_quantized(x):
            raise ValueError(f"weight {name!r} is quantized: update_weights takes float "
                             "weights and quantizes them as the engine is configured")
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"weight {name!r} must be an array, got {type(x).__name__}")
        shape = specs[name][0]
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"weight {name!r} has shape {tuple(x.shape)}; the model's is "
                             f"{tuple(shape)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"weight {name!r} has dtype {x.dtype}; a float dtype is needed")
        out[name] = x
    return out


def shares_buffers(a, b) -> bool:
    """Whether device arrays a and b hold a buffer in common (device_put may hand back the
    caller's buffers when they already sit where asked)."""
    if not isinstance(a, jax.Array) or not isinstance(b, jax.Array):
        return False
    mine = {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}
    return any(s.data.unsafe_buffer_pointer() in mine for s in b.addressable_shards)


def _place(x, like: jax.Array, dtype, donate: bool) -> jax.Array:
    """x in like's sharding and dtype, a buffer the caller does not hold unless donate. A
    float32 leaf of a 16-bit engine (norms, biases with float32 activations) is rounded to the
    engine's dtype first, as loading the weights rounds it."""
    moved = jax.device_put(x, like.sharding)
    if jnp.dtype(dtype).itemsize < jnp.dtype(like.dtype).itemsize and moved.dtype != dtype:
        moved = moved.astype(dtype)
    if moved.dtype != like.dtype:
        return moved.astype(like.dtype)
    if not donate and shares_buffers(moved, x):
        return jnp.copy(moved)
    return moved


def convert(new: dict, current, cfg, *, dtype, quantization: Optional[str],
            group_size: Optional[int] = None, donate: bool = False):
    """The engine's params with the weights in `new` (incoming's output) made into what it
    holds in their places (cfg: the engine's model config, its kv heads repeated
    cfg.kv_head_copies times; dtype: the engine's weight dtype). Returns (params, the
    replaced leaves of the old params)."""
    from jaxinfer import quant

    copies, source = cfg.kv_head_copies, _as_stored(cfg)

    def repeated(name, x, xp):  # wk / wv / bk / bv in the engine's kv-head layout
        return replicate_kv_heads(source, {name: x}, cfg.num_kv_heads, xp)[1][name]

    old = named_leaves(current)
    made = {}
    for name, x in new.items():
        like = old[name]
        if _is_quantized(like):
            host = repeated(name, np.asarray(jax.device_get(x), np.float32), np)
            q = quant.quantize_weights({name: host}, quantization, group_size)[name]
            made[name] = jax.tree.map(lambda part, o: jax.device_put(part, o.sharding), q, like)
        else:
            if copies > 1:  # repeated whole on every device, then laid out as the old leaf
                whole = jax.sharding.NamedSharding(like.sharding.mesh,
                                                   jax.sharding.PartitionSpec())
                x = repeated(name, jax.device_put(x, whole), jnp)
            made[name] = _place(x, like, dtype, donate)

    def pick(path, leaf):
        return made.get(_name(path), leaf)

    params = jax.tree_util.tree_map_with_path(pick, current, is_leaf=_is_quantized)
    return params, [old[name] for name in made if made[name] is not old[name]]


def delete(leaves) -> None:
    """Frees the device buffers of replaced leaves (pending computations finish first)."""
    for leaf in leaves:
        for x in jax.tree.leaves(leaf):
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()
