"""The model protocol: what every family provides, and the decoder machinery they share.

Shape legend: T tokens of a step, B cache rows, R rows of a dense block, L layers, N query
heads, K kv heads, H head dim, D model dim, V vocab.

A family (`Family` subclass, one module per family under jaxinfer/models/, reached through
`jaxinfer.models.get_model(cfg.architecture)`) provides:
  config       `hf_config(hf, path)` / `gguf_config(meta, get, path)`: its ModelConfig fields
               beyond the common ones, from an HF config.json or GGUF metadata;
  weights      `hf_layer(read, cfg, i)` / `gguf_layer(read, cfg, i)`: one layer's named host
               weights from a file (linear weights [in, out]);
  param_specs  every parameter once: name -> (shape, logical axes); random init, placement,
               checkpoint restores and shardings all derive from it;
  embed        tokens [T] -> h [T, D];
  layer        `layer(lp, cfg, i, h, ctx, linear_inputs=None) -> (h, ctx)`: decoder layer i over the
               step's tokens, its attention through `ctx` (the cache and the step's metadata,
               `Context`); `linear_inputs`, a dict, receives the inputs of its linear groups (AWQ);
  final_norm, head   h [..., D] -> normed h; normed h -> logits [..., V] float32.
`forward_tokens` (the step's forward over a TokenBatch), `forward` (a dense [R, T] block) and
`sequence_logits` (the scoring forward) are built from those here, once for every family.

Attention is per layer: layer i has its own sliding window `cfg.window(i)` (None: global) and
RoPE base `cfg.layer_rope_theta(i)`. `Context` holds one RaggedMeta per distinct window and one
(cos, sin) per distinct base, computed once per step and shared by the layers that use them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import backends, sharding
from jaxinfer.backends import Backend
from jaxinfer.backends.tuning import program_jit
from jaxinfer.config import ModelConfig
from jaxinfer.device.kv_cache import PagedKVCache
from jaxinfer.layers import product, rope_angles, rope_inv_freq
from jaxinfer.quant import QuantizedWeight, take_rows
from jaxinfer.quant import logical_axes as quant_logical_axes
from jaxinfer.device.ragged_meta import RaggedMeta, num_tiles_bound, ragged_meta
from jaxinfer.device.token_batch import TokenBatch

Specs = dict[str, tuple[tuple[int, ...], tuple[Optional[str], ...]]]


@flax.struct.dataclass
class ModelParams:
    embed: jax.Array                    # [V, D]
    layers: tuple                       # L layer dataclasses (the family's)
    final_norm: jax.Array               # [D]
    lm_head: Optional[jax.Array] = None  # [D, V]; None when tied to embed


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["cache", "k_all", "v_all", "slots", "local_k_all",
                                "local_v_all", "local_slots", "metas", "rope", "layer"],
                   meta_fields=["backend"])
@dataclasses.dataclass(frozen=True)
class Context:
    """What a layer's attention needs of the step: the pools it writes and reads, where the
    step's tokens go, the per-window / per-base metadata computed once per step, and which
    layer runs. A pytree, so that a layer can be one jitted call (see forward_tokens)."""

    cache: PagedKVCache             # the step's cache as it came in, without its pools
    k_all: Any                      # [L, P * Z, K, H] pools as written so far
    v_all: Any
    slots: jax.Array                # [T] pool slot of each token
    # A hybrid cache's ring of sliding-window layers as written so far, and each token's slot
    # in it (None without a ring: every layer is in k_all / v_all).
    local_k_all: Any
    local_v_all: Any
    local_slots: Optional[jax.Array]
    metas: tuple                    # one RaggedMeta per window of cfg.windows, in its order
    rope: dict                      # RoPE base -> (cos, sin) [1, T, H/2]
    layer: Any                      # the running layer's index in its pool: int or int32 []
    backend: Backend                # the implementations of the step's ops (jaxinfer.backends)

    def angles(self, cfg: ModelConfig, i: int) -> tuple[jax.Array, jax.Array]:
        """(cos, sin) [1, T, H/2] of layer i's RoPE base."""
        return self.rope[cfg.layer_rope_theta(i)]

    def meta(self, cfg: ModelConfig, window: Optional[int]) -> RaggedMeta:
        """The RaggedMeta of the layers with this sliding window (None: global)."""
        return self.metas[cfg.windows.index(window)]

    def replace(self, **kw) -> "Context":
        return dataclasses.replace(self, **kw)

    def in_ring(self, cfg: ModelConfig, i: int) -> bool:
        """Whether layer i keeps its keys in the ring (a sliding-window layer of a hybrid
        cache) rather than in k_all / v_all."""
        return self.local_k_all is not None and cfg.window(i) is not None


def pool_index(cfg: ModelConfig, i: int, ring: bool) -> int:
    """Layer i's index in the pool that holds its keys: with a ring (a hybrid cache), its rank
    among the layers of its kind (sliding-window or global); without one, i."""
    if not ring:
        return i
    local = cfg.window(i) is not None
    return sum((cfg.window(j) is not None) == local for j in range(i))


def rows(x: jax.Array) -> jax.Array:
    """Sequence parallelism: the step's tokens split over `sequence` through every matmul."""
    return sharding.constrain(x, ("rows", "embed"))


def attend(ctx: Context, cfg: ModelConfig, i: int, q: jax.Array, k: jax.Array,
           v: jax.Array) -> tuple[jax.Array, Context]:
    """Writes the running layer's new keys and values k, v [T, K, H] into its part of the
    pools (ctx.layer), then attends the queries q [T, N, H] over it with layer i's window and
    score scale (i: a layer of the same kind, whose static properties these are). Returns
    [T, N, H] and the context holding the written pools."""
    window, cache = cfg.window(i), ctx.cache
    ring = ctx.in_ring(cfg, i)
    if ring:
        pools, slots, tables = (ctx.local_k_all, ctx.local_v_all), ctx.local_slots, \
            cache.local_tables()
    else:
        pools, slots, tables = (ctx.k_all, ctx.v_all), ctx.slots, cache.block_tables
    o, k_all, v_all = ctx.backend.attend(
        q, k, v, slots, *pools, ctx.layer, tables, ctx.meta(cfg, window), cache.write_layer,
        page_size=cache.page_size, sliding_window=window, sm_scale=cfg.query_scale,
        wraps=ring or cache.wraps)
    if ring:
        return o, ctx.replace(local_k_all=k_all, local_v_all=v_all)
    return o, ctx.replace(k_all=k_all, v_all=v_all)


class Family:
    """The protocol, with the parts every decoder shares. Subclasses set `name` and
    `layer_class` and provide param_specs, layer and the config / weight hooks."""

    name: str = ""
    layer_class: type = None
    activation: str = "silu"  # the MLP's gate activation, as HF configs name it

    # -- configuration and weights from files (overridden per family) --------------------------

    def hf_config(self, hf: dict, path: str) -> dict:
        """ModelConfig fields of this family beyond the common ones, from an HF config."""
        return {}

    def gguf_config(self, meta: dict, get: Callable, path: str) -> dict:
        """The same from GGUF metadata; get(key, default) reads "{arch}.{key}"."""
        return {}

    def hf_layer(self, read: Callable, cfg: ModelConfig, i: int) -> dict:
        """Layer i's weights, read(hf_name, shape [out, in] or [n], transpose) -> array."""
        raise NotImplementedError(f"{self.name} has no HF weight reader")

    def gguf_layer(self, read: Callable, cfg: ModelConfig, i: int) -> Optional[dict]:
        """Layer i's weights from GGUF tensors, read(gguf_name, logical shape, transposed);
        None: the loader's Llama tables apply."""
        return None

    def gguf_final_norm(self, w):
        """The final norm's weight as the family's params hold it, from the file's."""
        return w

    # -- parameters -----------------------------------------------------------------------------

    def param_specs(self, cfg: ModelConfig) -> Specs:
        raise NotImplementedError

    def expanded_specs(self, cfg: ModelConfig):
        """param_specs with the per-layer entries repeated as "layers.{i}.{field}"."""
        for name, spec in self.param_specs(cfg).items():
            if name.startswith("layers."):
                field = name.split(".", 1)[1]
                for i in range(cfg.num_layers):
                    yield f"layers.{i}.{field}", spec
            else:
                yield name, spec

    def assemble(self, cfg: ModelConfig, arrays: dict) -> ModelParams:
        """arrays: "embed", "final_norm", optional "lm_head", and "layers.{i}.{field}"."""
        layers = []
        for i in range(cfg.num_layers):
            prefix = f"layers.{i}."
            layers.append(self.layer_class(**{k[len(prefix):]: v for k, v in arrays.items()
                                              if k.startswith(prefix)}))
        return ModelParams(embed=arrays["embed"], layers=tuple(layers),
                           final_norm=arrays["final_norm"], lm_head=arrays.get("lm_head"))

    def init_value(self, name: str, shape: tuple, key: jax.Array, dtype) -> jax.Array:
        """A random parameter (norms at 1): fan-in scaled normals; the embedding unit normal."""
        if name.endswith("norm"):
            return jnp.ones(shape, dtype)
        if name == "embed":
            return jax.random.normal(key, shape).astype(dtype)
        fan_in = shape[-2] if len(shape) == 3 else shape[0]  # experts [E, in, out]
        return (fan_in ** -0.5 * jax.random.normal(key, shape)).astype(dtype)

    def init_params(self, cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> ModelParams:
        """Random weights of the right shapes, for benchmarks and tests."""
        arrays = {name: self.init_value(name, shape, jax.random.fold_in(key, i), dtype)
                  for i, (name, (shape, _)) in enumerate(sorted(self.expanded_specs(cfg)))}
        return self.assemble(cfg, arrays)

    def params_from_weights(self, cfg: ModelConfig, weights: dict, dtype=jnp.float32,
                            place=None) -> ModelParams:
        """Params from named host weights ("layers.{i}.{name}", linear weights [in, out]).
        place(array, logical_axes, dtype) -> jax.Array puts each weight where it belongs
        (e.g. sharding.Partitioner.place); default: the default device. A QuantizedWeight's
        codes, scales and offsets are placed with dtype None (each keeps its own) on the axes
        quant.logical_axes derives from the float weight's."""
        arrays = {}
        for name, (shape, axes) in self.expanded_specs(cfg):
            if name not in weights:
                raise ValueError(f"weight {name!r} is missing")
            arr = weights[name]
            if arr.shape != shape:
                raise ValueError(f"weight {name!r} has shape {arr.shape}; config implies {shape}")
            if isinstance(arr, QuantizedWeight):  # codes and scales keep their own dtypes
                arrays[name] = (jax.tree.map(jnp.asarray, arr) if place is None else
                                jax.tree.map(lambda x, a: place(x, a, None), arr,
                                             quant_logical_axes(arr, axes)))
                continue
            if place is None and isinstance(arr, np.ndarray) and arr.dtype != dtype:
                # Rounded on the host (numpy's casts round to nearest even, as XLA's): half the
                # bytes to copy for a 16-bit dtype, no float32 copy on the device, and no
                # conversion program per shape. SmolLM2's LLM() in bf16 took 0.65-0.89 s
                # against 0.70-0.87 s converting on the device (three alternating runs).
                arr = arr.astype(dtype)
            arrays[name] = (jnp.asarray(arr, dtype=dtype) if place is None
                            else place(arr, axes, dtype))
        return self.assemble(cfg, arrays)

    @staticmethod
    def activation_dtype(params: ModelParams):
        """The dtype activations (and the KV cache, unless quantized) take: the float weights'."""
        return params.final_norm.dtype

    @staticmethod
    def with_float32_activations(params: ModelParams) -> ModelParams:
        """params with the vectors (norm weights, biases) in float32 and the matrices as they
        are: activations and the KV cache then run in float32 while every matmul reads 16-bit
        weights (Backend.dot)."""
        def vec(x):
            if isinstance(x, jax.Array) and x.ndim == 1:
                return x.astype(jnp.float32)
            return x

        layers = tuple(layer.replace(**{f.name: vec(getattr(layer, f.name))
                                        for f in dataclasses.fields(layer)})
                       for layer in params.layers)
        return params.replace(layers=layers, final_norm=vec(params.final_norm))

    # -- the forward pieces ----------------------------------------------------------------------

    def embed(self, params: ModelParams, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
        """tokens [...] -> [..., D]."""
        dtype = self.activation_dtype(params)
        if isinstance(params.embed, QuantizedWeight):
            out = take_rows(params.embed, tokens.reshape(-1))
            return out.reshape(tokens.shape + out.shape[-1:]).astype(dtype)
        return jnp.take(params.embed, tokens, axis=0).astype(dtype)

    def layer(self, lp, cfg: ModelConfig, i: int, h: jax.Array, ctx: Context,
              linear_inputs: Optional[dict] = None) -> tuple[jax.Array, Context]:
        raise NotImplementedError

    def final_norm(self, params: ModelParams, cfg: ModelConfig, h: jax.Array) -> jax.Array:
        from jaxinfer.layers import rms_norm
        return rms_norm(h, params.final_norm, cfg.rms_norm_eps)

    def head(self, params: ModelParams, h: jax.Array,
             backend: Optional[Backend] = None) -> jax.Array:
        """h [..., D] (already normalised) -> logits [..., V] in float32 (backend: default
        backends.default())."""
        backend = backend if backend is not None else backends.default()
        if params.lm_head is None:
            return product(h, params.embed, "...D,VD->...V", backend)
        return product(h, params.lm_head, "...D,DV->...V", backend)

    # -- built from the pieces ---------------------------------------------------------------------

    def context(self, cfg: ModelConfig, batch: TokenBatch, cache: PagedKVCache, *,
                backend: Optional[Backend] = None, query_tile: int = 16,
                num_tiles: Optional[int] = None, differentiable: bool = False) -> Context:
        """The step's attention context (see Context), once per forward."""
        T, B, Z = batch.num_tokens, cache.batch, cache.page_size
        positions = batch.positions(cache.lengths)                         # [T]
        # The per-row metadata ([B] ints) is replicated on a mesh: every device builds the same
        # tiles locally. Left sharded over `data`, the tiles' searches gathered across devices
        # inside their loops, and XLA:CPU's simulated devices could deadlock on such nested
        # collectives (each device waiting in a different one).
        query_start, num_queries, lengths = (sharding.constrain(x, (None,)) for x in (
            batch.query_start, batch.num_queries, cache.lengths))
        kv_lengths = lengths + num_queries
        static = cache.block_tables.shape[1] if differentiable else None
        metas = tuple(ragged_meta(query_start, num_queries, kv_lengths,
                                  num_tokens=T, query_tile=query_tile,
                                  num_tiles=num_tiles or num_tiles_bound(T, query_tile, B),
                                  page_size=Z, sliding_window=w, static_pages=static)
                      for w in cfg.windows)
        thetas = dict.fromkeys(cfg.layer_rope_theta(i) for i in range(cfg.num_layers))
        rope = {t: rope_angles(positions[None], rope_inv_freq(
            cfg.head_dim, t, cfg.rope_scaling, cfg.rope_freq_factors)) for t in thetas}
        ring = cache.ring_part() if cache.local_pages else None
        return Context(cache=cache.replace(k=None, v=None, local_k=None, local_v=None),
                       k_all=cache.k, v_all=cache.v,
                       slots=cache.write_slots(batch.rows, positions),
                       local_k_all=cache.local_k, local_v_all=cache.local_v,
                       local_slots=None if ring is None else ring.write_slots(batch.rows,
                                                                              positions),
                       metas=metas, rope=rope, layer=0,
                       backend=backend if backend is not None else backends.default())

    def forward_tokens(self, params: ModelParams, cfg: ModelConfig, batch: TokenBatch,
                       cache: PagedKVCache, *, backend: Optional[Backend] = None,
                       query_tile: int = 16, num_tiles: Optional[int] = None,
                       differentiable: bool = False) -> tuple[jax.Array, PagedKVCache]:
        """Runs a flat step's tokens (jaxinfer.device.token_batch) through the model and appends their
        K/V to the cache. Returns the final-normed hidden states [T, D] and the cache with each
        row's length advanced by its num_queries. backend: the ops' implementations (default
        backends.default()).

        Every matmul sees [T, D] at once. Each layer writes its new K/V into the donated cache
        first (in place) and then attends over the cache alone: a ring is sized so that the
        write never overwrites a key the step's queries still see. query_tile (static): queries
        per attention tile (1 for decode); num_tiles (static) defaults to a bound that holds for
        any split of the batch. differentiable (static): the jnp attention loops over every
        page a row's table can hold (a fixed trip count, which jax.grad can go through).
        The layers are unrolled: on XLA:CPU a scan copies each layer's weights out of the
        stack before every matmul (docs/architecture.md, Model). Each layer is a call of one
        jitted function per kind of layer (its window and RoPE base), its index in the pools
        an argument: jax traces and lowers a kind once and reuses that for every layer of the
        kind (SmolLM2's 30 layers: one trace), and XLA inlines the calls, so the compiled
        program is the unrolled one."""
        ctx = self.context(cfg, batch, cache, backend=backend, query_tile=query_tile,
                           num_tiles=num_tiles, differentiable=differentiable)
        h = rows(self.embed(params, cfg, batch.tokens))
        kinds = {}
        for i, lp in enumerate(params.layers):
            kind = (cfg.window(i), cfg.layer_rope_theta(i))
            if kind not in kinds:  # jitted per forward: its trace cache lives as long as this
                # layer i's static properties serve its whole kind; ctx.layer says which runs
                kinds[kind] = jax.jit(lambda lp, h, ctx, i=i: self.layer(lp, cfg, i, h, ctx))
            index = pool_index(cfg, i, bool(cache.local_pages))
            with jax.named_scope(f"layer_{i}"):
                h, ctx = kinds[kind](lp, h, ctx.replace(layer=np.int32(index)))
        cache = cache.advance(ctx.k_all, ctx.v_all, batch.num_queries, ctx.local_k_all,
                              ctx.local_v_all)
        return self.final_norm(params, cfg, h), cache

    def forward(self, params: ModelParams, cfg: ModelConfig, tokens: jax.Array,
                cache: PagedKVCache, num_new: jax.Array, *,
                backend: Optional[Backend] = None, rows: jax.Array | None = None,
                differentiable: bool = False) -> tuple[jax.Array, PagedKVCache]:
        """forward_tokens for a block of tokens [R, T]: block row i feeds cache row rows[i]
        (None: row i) its first num_new[i] tokens, at positions cache.lengths[row] + t (the rest
        is padding). Returns the final-normed hidden states [R, T, D] and the cache."""
        R, T = tokens.shape
        batch = TokenBatch.dense(tokens, num_new, rows, cache.batch)
        tile = min(T, DENSE_QUERY_TILE)
        h, cache = self.forward_tokens(params, cfg, batch, cache, backend=backend,
                                       query_tile=tile, num_tiles=R * -(-T // tile),
                                       differentiable=differentiable)
        return h.reshape(R, T, -1), cache


# Queries per attention tile of a dense block: whole rows up to this, so decode (1) and
# verification (k + 1) blocks make one tile a row, and long prefills many.
DENSE_QUERY_TILE = 16


def sequence_logits(params: ModelParams, cfg: ModelConfig, tokens: jax.Array,
                    kv_cache_dtype: str | None = None,
                    backend: Optional[Backend] = None) -> jax.Array:
    """Logits [B, T, V] (float32) of full sequences tokens [B, T] from an empty cache, for any
    family (cfg.architecture picks it): the scoring forward (evaluation, perplexity, draft
    training, tests), differentiable. kv_cache_dtype "int8" / "fp8": every layer attends to
    its keys and values as a quantized cache stores them. backend: default backends.default()."""
    return _sequence_logits(params, cfg, tokens, kv_cache_dtype,
                            backend if backend is not None else backends.default())


@functools.partial(program_jit, static_argnums=(1, 3, 4))
def _sequence_logits(params: ModelParams, cfg: ModelConfig, tokens: jax.Array,
                     kv_cache_dtype: str | None, backend: Backend) -> jax.Array:
    from jaxinfer.device.kv_cache import KV_DTYPES
    from jaxinfer.models import get_model

    model = get_model(cfg.architecture)
    B, T = tokens.shape
    dtype = model.activation_dtype(params) if kv_cache_dtype is None else \
        KV_DTYPES[kv_cache_dtype]
    cache = PagedKVCache.ring(cfg.num_layers, B, T, cfg.num_kv_heads, cfg.head_dim, dtype)
    h, _ = model.forward(params, cfg, tokens, cache, jnp.full((B,), T, jnp.int32),
                         backend=backend, differentiable=True)
    return model.head(params, h, backend)


def stack_experts(arrays: list[np.ndarray]) -> np.ndarray:
    """Per-expert host weights [in, out] -> [E, in, out]."""
    return np.ascontiguousarray(np.stack(arrays))


__all__ = ["Context", "DENSE_QUERY_TILE", "Family", "ModelParams", "RaggedMeta", "attend",
           "rows", "sequence_logits", "stack_experts"]
