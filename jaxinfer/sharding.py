"""Sharding over a device mesh: the mesh, the logical-axis rules, and placement.

Every array declares its logical axes once (param_specs, `PagedKVCache.logical_axes`,
`DecodeState.logical_axes`); RULES map them to mesh axes, and an axis the mesh axis does not
divide stays whole, so one rule set serves every shape. The layout is Megatron-style tensor
parallelism (QKV and gate/up split by output, attention output and down by input, embedding
and head by vocabulary), batch rows over `data`, the KV cache's sequence axis over `sequence`.
Jitted steps pin their outputs with `constrain`, so a state keeps its sharding.
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
    devices of all processes, with Auto axis types (the partitioner inserts collectives)."""
    devices = list(jax.devices() if devices is None else devices)
    need = mesh_cfg.data * mesh_cfg.sequence * mesh_cfg.tensor
    if need > len(devices):
        raise ValueError(f"mesh {mesh_cfg} needs {need} devices; {len(devices)} are available")
    grid = np.array(devices[:need], dtype=object).reshape(
        mesh_cfg.data, mesh_cfg.sequence, mesh_cfg.tensor)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def view_mesh(mesh: Mesh, axes: Optional[dict] = None) -> Mesh:
    """jaxinfer's (data, sequence, tensor) view of a caller's mesh: the same devices, each of
    jaxinfer's axes spanning the caller's axes mapped to it. axes: {jaxinfer axis: caller axis
    name or tuple of names}; by default a caller axis named data, sequence or tensor maps to
    itself. Every caller axis of more than one device must be mapped (ValueError), so the view
    spans the mesh; a trainer and the engine then share its devices in one process."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    if axes is None:
        axes = {a: a for a in MESH_AXES if a in names}
    if not isinstance(axes, dict):
        raise ValueError(f"mesh_axes must be a dict of jaxinfer axis -> mesh axis names, got "
                         f"{type(axes).__name__}")
    mapped: dict[str, tuple] = {}
    used: set = set()
    for ours, theirs in axes.items():
        if ours not in MESH_AXES:
            raise ValueError(f"mesh_axes key {ours!r} is not one of jaxinfer's axes "
                             f"{MESH_AXES}")
        theirs = (theirs,) if isinstance(theirs, str) else tuple(theirs)
        for t in theirs:
            if t not in names:
                raise ValueError(f"mesh_axes[{ours!r}] names axis {t!r}; the mesh has "
                                 f"{names}")
            if t in used:
                raise ValueError(f"mesh axis {t!r} is mapped twice in mesh_axes")
            used.add(t)
        mapped[ours] = theirs
    left = [n for n in names if n not in used and mesh.shape[n] > 1]
    if left:
        raise ValueError(f"mesh axis {left[0]!r} ({mesh.shape[left[0]]} devices) is not "
                         f"mapped to any of jaxinfer's axes {MESH_AXES}: pass mesh_axes, e.g. "
                         f"{{'data': {left[0]!r}}}")
    order = [n for ours in MESH_AXES for n in mapped.get(ours, ())]
    order += [n for n in names if n not in order]  # single-device axes, dropped below
    grid = np.transpose(mesh.devices, [names.index(n) for n in order])
    size = lambda ours: int(np.prod([mesh.shape[n] for n in mapped.get(ours, ())]))  # noqa
    return Mesh(grid.reshape([size(a) for a in MESH_AXES]), MESH_AXES,
                axis_types=(AxisType.Auto,) * 3)


def check_divisible(cfg: ModelConfig, mesh_cfg: MeshConfig) -> None:
    """ValueError unless the tensor degree divides the query heads and the FFN width, and
    divides the kv heads or is a multiple of them."""
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
    """Where the tensor degree exceeds the K kv heads, each is repeated tensor // K times in wk,
    wv and their biases (quantized ones through quant.take_out), so every device holds whole
    copies of the heads its query heads read. Weights are named as in params_from_weights or by
    field ("wk"); xp: numpy for host weights, jax.numpy on devices."""
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
    return cfg.replace(num_kv_heads=K * r, kv_head_copies=cfg.kv_head_copies * r), out


@dataclasses.dataclass(frozen=True)
class Partitioner:
    """A mesh and the rules: logical axes -> PartitionSpec / NamedSharding, and placement."""

    mesh: Mesh

    @property
    def mesh_config(self) -> MeshConfig:
        s = self.mesh.shape
        return MeshConfig(data=s["data"], tensor=s["tensor"], sequence=s["sequence"])

    def sharding(self, shape: Sequence[int], axes: Sequence[Optional[str]]) -> NamedSharding:
        return NamedSharding(self.mesh, spec_for(shape, axes, dict(self.mesh.shape)))

    def place(self, array, axes: Sequence[Optional[str]], dtype=None) -> jax.Array:
        """A host array onto the mesh, each device receiving only its own shard."""
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
        """Zeros made shard by shard from host buffers: never whole on one device, no program."""
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
    """The PartitionSpec of `shape` with logical `axes` on `mesh_shape`: each axis takes its
    rule's mesh axes where they have several devices, divide the size and are still unused."""
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
    """Pins x (inside jit) to its logical axes' sharding on the context mesh; the identity
    without one."""
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
    """The params pytree with each leaf replaced by its logical axes (`specs`: the family's
    param_specs), a quantized weight by a QuantizedWeight of axes (quant.logical_axes)."""
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
    """Device arrays -> numpy in every process, gathering arrays spread over other processes:
    every process must call it for the same arrays in the same order."""
    def get(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.tree.map(get, tree)
