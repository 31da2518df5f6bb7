"""Sharding over a device mesh: the mesh, the logical-axis rules, and placement.

Every parameter and cache array declares its logical axes once (`llama.param_specs`,
`PagedKVCache.logical_axes`, `DecodeState.logical_axes`); a quantized weight's codes and scales
take its float form's axes (`quant.logical_axes`), a quantized cache's scales those of its codes
without the head dim (`QuantizedKV.logical_axes`). RULES map
each logical axis to a mesh axis; nothing else in the code names a mesh axis. A logical axis
whose size the mesh axis does not divide stays whole (replicated) on every device, so one rule
set serves every shape: a batch bucket of 1 row on a 2-way data axis, a vocabulary that 3 does
not divide.

The layout (Megatron-style tensor parallelism, expressed as shardings that XLA's SPMD
partitioner turns into per-device programs and collectives):
  - QKV and gate/up weights are column-parallel (their output axis is split over `tensor`),
    the attention output and down projections row-parallel (their input axis), so each block
    ends in one all-reduce; query heads (and kv heads, replicated first where there are fewer
    kv heads than the tensor degree: see `replicate_kv_heads`) live whole on one device;
  - the embedding and head are vocabulary-parallel;
  - batch rows (slots) are split over `data`, each replica holding its rows' cache;
  - the KV cache's sequence axis (ring slots, or the page pool) is split over `sequence`: a
    decode step attends to each shard's keys locally and the partial softmax statistics (max
    and sum) are combined across shards by the partitioner's all-reduces.

Jitted steps pin their outputs with `constrain` (a no-op without a mesh), so a state that went
through a step keeps the sharding it came in with and nothing recompiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxinfer.config import MeshConfig, ModelConfig

MESH_AXES = ("data", "sequence", "tensor")  # tensor innermost: neighbouring devices

# logical axis -> mesh axis (None: never split).
RULES: dict[str, Optional[str | tuple[str, ...]]] = {
    "batch": "data",
    "vocab": "tensor",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "ffn": "tensor",
    "experts": ("data", "tensor"),  # expert parallelism (jaxinfer.models.moe)
    "cache_seq": "sequence",   # a ring row's slots
    "pages": ("data", "sequence"),  # the page pool's slots: every replica's pages
    "embed": None,
    "head_dim": None,
    "layers": None,
    "tokens": None,
    "rows": "sequence",        # a step's flattened query tokens, through the matmuls
    "context": "sequence",     # a prompt's tokens under context-parallel attention
    "table": None,
    "history": None,
}


def make_mesh(mesh_cfg: MeshConfig, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """The (data, sequence, tensor) mesh of mesh_cfg over the first data*sequence*tensor
    devices (all processes' devices in a multi-process run). Auto axis types: shardings
    propagate through jit and the partitioner inserts the collectives."""
    devices = list(jax.devices() if devices is None else devices)
    need = mesh_cfg.data * mesh_cfg.sequence * mesh_cfg.tensor
    if need > len(devices):
        raise ValueError(f"mesh {mesh_cfg} needs {need} devices; {len(devices)} are available")
    grid = np.array(devices[:need], dtype=object).reshape(
        mesh_cfg.data, mesh_cfg.sequence, mesh_cfg.tensor)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def check_divisible(cfg: ModelConfig, mesh_cfg: MeshConfig) -> None:
    """ValueError unless the tensor degree splits the model: it must divide the query heads and
    the FFN width, and divide the kv heads or be a multiple of them (then kv heads are
    replicated, see replicate_kv_heads)."""
    t = mesh_cfg.tensor
    if t == 1:
        return
    if cfg.num_heads % t:
        raise ValueError(f"tensor degree {t} does not divide the {cfg.num_heads} query heads")
    if cfg.ffn_dim % t:
        raise ValueError(f"tensor degree {t} does not divide the FFN width {cfg.ffn_dim}")
    K = cfg.num_kv_heads
    if K % t and t % K:
        raise ValueError(f"tensor degree {t} neither divides the {K} kv heads nor is a "
                         "multiple of them")


def replicate_kv_heads(cfg: ModelConfig, weights: dict, tensor: int,
                       xp=np) -> tuple[ModelConfig, dict]:
    """Where the tensor degree exceeds the kv heads (a multiple of them), each kv head is
    repeated tensor // K times in wk, wv (and their biases), so every device holds whole copies
    of the kv heads its query heads read and the cache splits evenly. Query head n reads kv head
    n // (N // K) before and copy n // (N // tensor) of the same head after. Weights are named
    as in params_from_weights ([in, out] linear weights) or by their field ("wk"); xp is the
    array module (numpy for host weights, jax.numpy for arrays on devices). A quantized wk or
    wv repeats its output columns' codes and scales alike (quant.take_out)."""
    from jaxinfer.quant import QuantizedWeight, take_out

    K, H = cfg.num_kv_heads, cfg.head_dim
    if tensor <= K:
        return cfg, weights
    r = tensor // K
    columns = np.repeat(np.arange(K * H).reshape(K, H), r, axis=0).reshape(-1)
    out = dict(weights)
    for name, w in weights.items():
        if name.split(".")[-1] in ("wk", "wv", "bk", "bv"):
            if isinstance(w, QuantizedWeight):
                out[name] = take_out(w, columns)
                continue
            heads = w.reshape(w.shape[:-1] + (K, H))
            out[name] = xp.repeat(heads, r, axis=-2).reshape(w.shape[:-1] + (K * r * H,))
    return cfg.replace(num_kv_heads=K * r), out


@dataclasses.dataclass(frozen=True)
class Partitioner:
    """A mesh and the rules: logical axes -> PartitionSpec / NamedSharding, and placement."""

    mesh: Mesh

    @property
    def mesh_config(self) -> MeshConfig:
        s = self.mesh.shape
        return MeshConfig(data=s["data"], tensor=s["tensor"], sequence=s["sequence"])

    def spec(self, shape: Sequence[int], axes: Sequence[Optional[str]]) -> PartitionSpec:
        return spec_for(shape, axes, dict(self.mesh.shape))

    def sharding(self, shape: Sequence[int], axes: Sequence[Optional[str]]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(shape, axes))

    def place(self, array, axes: Sequence[Optional[str]], dtype=None) -> jax.Array:
        """A host array onto the mesh: each device receives only its own shard (no full copy
        on any one device)."""
        array = np.asarray(array)
        sharding = self.sharding(array.shape, axes)

        def shard(index):
            part = array[index]
            return part if dtype is None else part.astype(dtype)
        return jax.make_array_from_callback(array.shape, sharding, shard)

    def put_tree(self, tree, axes_tree):
        """device_put of a pytree whose leaves' logical axes come from axes_tree (the same
        structure, tuples of axis names as leaves)."""
        shardings = jax.tree.map(lambda x, a: self.sharding(x.shape, a), tree, axes_tree)
        return jax.device_put(tree, shardings)

    def zeros(self, shape: Sequence[int], dtype, axes: Sequence[Optional[str]]) -> jax.Array:
        """Zeros made shard by shard on the mesh (never whole on one device), from host
        buffers: no program is compiled for them."""
        sharding = self.sharding(shape, axes)
        part = sharding.shard_shape(tuple(shape))
        return jax.make_array_from_callback(tuple(shape), sharding,
                                            lambda _: np.zeros(part, dtype))

    @contextlib.contextmanager
    def active(self):
        """Makes the mesh the context of traced code: `constrain` resolves against it."""
        with jax.set_mesh(self.mesh):
            yield



def spec_for(shape: Sequence[int], axes: Sequence[Optional[str]],
             mesh_shape: dict[str, int]) -> PartitionSpec:
    """The PartitionSpec of an array of `shape` with logical `axes` on a mesh of `mesh_shape`:
    each logical axis takes its rule's mesh axis when that axis has more than one device,
    divides the size, and is not already used by an earlier axis of the array."""
    if len(shape) != len(axes):
        raise ValueError(f"shape {tuple(shape)} and logical axes {tuple(axes)} differ in rank")
    used, spec = set(), []
    for size, name in zip(shape, axes):
        if name is not None and name not in RULES:
            raise ValueError(f"unknown logical axis {name!r}; known: {sorted(RULES)}")
        rule = RULES.get(name) if name is not None else None
        rule = (rule,) if isinstance(rule, str) else (rule or ())
        mesh_axes = tuple(a for a in rule if mesh_shape.get(a, 1) > 1 and a not in used)
        n = int(np.prod([mesh_shape[a] for a in mesh_axes])) if mesh_axes else 1
        if n > 1 and size % n == 0:
            spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
            used.update(mesh_axes)
        else:
            spec.append(None)
    return PartitionSpec(*spec)


def context_mesh_shape() -> Optional[dict[str, int]]:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or set(mesh.axis_names) != set(MESH_AXES):
        return None
    return dict(mesh.shape)


def constrain(x: jax.Array, axes: Sequence[Optional[str]]) -> jax.Array:
    """Pins x (inside jit) to the sharding its logical axes give on the context mesh; the
    identity when no jaxinfer mesh is active (single-device runs trace exactly as before)."""
    mesh_shape = context_mesh_shape()
    if mesh_shape is None or x is None:
        return x
    return jax.lax.with_sharding_constraint(x, spec_for(x.shape, axes, mesh_shape))


def constrain_tree(tree, axes_tree):
    """constrain() over a pytree and the matching tree of logical axes."""
    if context_mesh_shape() is None:
        return tree
    return jax.tree.map(constrain, tree, axes_tree)


def param_axes(cfg: ModelConfig, params, specs: Callable[[ModelConfig], dict]):
    """The params pytree with each leaf replaced by its logical axes (from `specs`, the model
    family's param_specs table). A quantized weight gets a QuantizedWeight of axes
    (quant.logical_axes): its codes and scales split like the float weight would."""
    from jaxinfer.quant import QuantizedWeight, logical_axes

    table = {name: axes for name, (_, axes) in specs(cfg).items()}

    def axes_of(path, leaf):
        names = [p.name if hasattr(p, "name") else None for p in path]
        field = names[-1]
        key = f"layers.{field}" if names[0] == "layers" else field
        if isinstance(leaf, QuantizedWeight):
            return logical_axes(leaf, table[key])
        return table[key]
    return jax.tree_util.tree_map_with_path(
        axes_of, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))


def fetch(tree):
    """Device arrays -> numpy on the host, in every process. An array spread over devices of
    other processes (a multi-process mesh) is gathered from them: every process must call this
    for the same arrays in the same order, as the engine's identical host loop in each does."""
    def get(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.tree.map(get, tree)
