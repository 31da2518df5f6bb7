"""The model protocol: what every family provides, and the decoder machinery they share.

Shape legend: T tokens of a step, B cache rows, R rows of a dense block, L layers, N query
heads, K kv heads, H head dim, D model dim, V vocab.

A family (`Family` subclass, reached through `jaxinfer.models.get_model(cfg.architecture)`)
provides (docs/models.md has the table):
  config       `hf_config(hf, path)` / `gguf_config(meta, get, path)`: its ModelConfig fields
  weights      `hf_layer(read, cfg, i)` / `gguf_layer(read, cfg, i)`: layer i's host weights
  param_specs  every parameter once: name -> (shape, logical axes)
  embed        tokens [T] -> h [T, D]
  layer        `layer(lp, cfg, i, h, ctx, linear_inputs=None) -> (h, ctx)`: decoder layer i,
               attending through `ctx` (Context); linear_inputs receives its linears' inputs
  final_norm, head   h [..., D] -> normed h; normed h -> logits [..., V] float32.
`forward_tokens`, `forward` and `sequence_logits` are built from those, once for every family.
Layer i has its own window `cfg.window(i)` and RoPE base `cfg.layer_rope_theta(i)`; Context
holds one RaggedMeta per window and one (cos, sin) per base, computed once per step.
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
    """What a layer's attention needs of the step: the pools, where the step's tokens go, the
    per-window and per-base metadata, and which layer runs. A pytree, so a layer can be one
    jitted call."""

    cache: PagedKVCache             # the step's cache as it came in, without its pools
    k_all: Any                      # [L, P * Z, K, H] pools as written so far
    v_all: Any
    slots: jax.Array                # [T] pool slot of each token
    # A hybrid cache's ring of sliding-window layers, and each token's slot in it (None: no ring).
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
        """Whether layer i keeps its keys in a hybrid cache's ring."""
        return self.local_k_all is not None and cfg.window(i) is not None


def pool_index(cfg: ModelConfig, i: int, ring: bool) -> int:
    """Layer i's index in the pool holding its keys: with a ring, its rank among the layers of
    its kind (sliding-window or global); else i."""
    if not ring:
        return i
    local = cfg.window(i) is not None
    return sum((cfg.window(j) is not None) == local for j in range(i))


def rows(x: jax.Array) -> jax.Array:
    """Sequence parallelism: the step's tokens split over `sequence` through every matmul."""
    return sharding.constrain(x, ("rows", "embed"))


def attend(ctx: Context, cfg: ModelConfig, i: int, q: jax.Array, k: jax.Array,
           v: jax.Array) -> tuple[jax.Array, Context]:
    """Writes the running layer's k, v [T, K, H] into its pool, then attends q [T, N, H] with
    layer i's window and score scale. Returns ([T, N, H], the context with the written pools)."""
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
    """The protocol and the parts every decoder shares. Subclasses set `name` and `layer_class`
    and provide param_specs, layer and the file hooks."""

    name: str = ""
    layer_class: type = None
    activation: str = "silu"  # the MLP's gate activation, as HF configs name it

    # -- configuration and weights from files (overridden per family) --------------------------

    def hf_config(self, hf: dict, path: str) -> dict:
        """This family's ModelConfig fields beyond the common ones, from an HF config."""
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
        place(array, logical_axes, dtype) puts each (default: the default device); a
        QuantizedWeight's parts keep their dtypes."""
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
                # Rounded on the host (to nearest even, as XLA): fewer bytes to copy, no float32
                # copy on the device, no conversion program per shape.
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
        """params with vectors (norms, biases) in float32 and matrices as they are: float32
        activations and KV cache, 16-bit weights."""
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

    def final_norm(self, params: ModelParams, cfg: ModelConfig, h: jax.Array,
                   backend: Optional[Backend] = None) -> jax.Array:
        from jaxinfer.layers import rms_norm
        return rms_norm(h, params.final_norm, cfg.rms_norm_eps, backend)

    def head(self, params: ModelParams, h: jax.Array,
             backend: Optional[Backend] = None) -> jax.Array:
        """h [..., D] (normalised) -> logits [..., V] float32."""
        backend = backend if backend is not None else backends.default()
        if params.lm_head is None:
            return product(h, params.embed, "...D,VD->...V", backend)
        return product(h, params.lm_head, "...D,DV->...V", backend)

    # -- built from the pieces ---------------------------------------------------------------------

    def context(self, cfg: ModelConfig, batch: TokenBatch, cache: PagedKVCache, *,
                backend: Optional[Backend] = None, query_tile: int = 16,
                num_tiles: Optional[int] = None, differentiable: bool = False) -> Context:
        """The step's attention context (see Context), once per forward."""
        backend = backend if backend is not None else backends.default()
        if not differentiable and backend.attends_per_query(cache.k, cfg.num_heads):
            query_tile, num_tiles = 1, None
        T, B, Z = batch.num_tokens, cache.batch, cache.page_size
        positions = batch.positions(cache.lengths)                         # [T]
        # The per-row metadata is replicated on a mesh: sharded, the tiles' searches gathered
        # across devices inside loops, where XLA:CPU's simulated devices could deadlock.
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
                       metas=metas, rope=rope, layer=0, backend=backend)

    def forward_tokens(self, params: ModelParams, cfg: ModelConfig, batch: TokenBatch,
                       cache: PagedKVCache, *, backend: Optional[Backend] = None,
                       query_tile: int = 16, num_tiles: Optional[int] = None,
                       differentiable: bool = False,
                       lora=None) -> tuple[jax.Array, PagedKVCache]:
        """A flat step's tokens through the model, their K/V appended to the cache: (final-normed
        h [T, D], the cache with lengths advanced by num_queries).

        Each layer writes its K/V into the donated cache in place, then attends over it.
        query_tile, num_tiles (static): the attention's tiles; differentiable (static): a fixed
        trip count jax.grad can go through. The layers are unrolled (on XLA:CPU a scan copies
        each layer's weights: docs/architecture.md, "Compiled shapes"), each a call of one jitted function
        per kind (window, RoPE base), so a kind is traced once and XLA inlines the calls.
        lora: a jaxinfer.lora.LoraStep (adapter slots and each cache row's slot), whose
        low-rank terms join the adapted linear layers."""
        ctx = self.context(cfg, batch, cache, backend=backend, query_tile=query_tile,
                           num_tiles=num_tiles, differentiable=differentiable)
        h = rows(self.embed(params, cfg, batch.tokens))
        kinds = {}
        if lora is not None:
            mask, active = lora.token_mask(batch.rows)
        for i, lp in enumerate(params.layers):
            if lora is not None:
                lp = lora.slots.attach(lp, i, mask, active)
            kind = (cfg.window(i), cfg.layer_rope_theta(i))
            if kind not in kinds:  # layer i's static properties serve its whole kind
                kinds[kind] = jax.jit(lambda lp, h, ctx, i=i: self.layer(lp, cfg, i, h, ctx))
            index = pool_index(cfg, i, bool(cache.local_pages))
            with jax.named_scope(f"layer_{i}"):
                h, ctx = kinds[kind](lp, h, ctx.replace(layer=np.int32(index)))
        cache = cache.advance(ctx.k_all, ctx.v_all, batch.num_queries, ctx.local_k_all,
                              ctx.local_v_all)
        return self.final_norm(params, cfg, h, ctx.backend), cache

    def forward(self, params: ModelParams, cfg: ModelConfig, tokens: jax.Array,
                cache: PagedKVCache, num_new: jax.Array, *,
                backend: Optional[Backend] = None, rows: jax.Array | None = None,
                differentiable: bool = False, lora=None) -> tuple[jax.Array, PagedKVCache]:
        """forward_tokens for tokens [R, T]: row i feeds cache row rows[i] (None: i) its first
        num_new[i] tokens. Returns (h [R, T, D], cache)."""
        R, T = tokens.shape
        batch = TokenBatch.dense(tokens, num_new, rows, cache.batch)
        tile = min(T, DENSE_QUERY_TILE)
        h, cache = self.forward_tokens(params, cfg, batch, cache, backend=backend,
                                       query_tile=tile, num_tiles=R * -(-T // tile),
                                       differentiable=differentiable, lora=lora)
        return h.reshape(R, T, -1), cache


# Queries per attention tile of a dense block: one tile a row for decode and verification.
DENSE_QUERY_TILE = 16


def sequence_logits(params: ModelParams, cfg: ModelConfig, tokens: jax.Array,
                    kv_cache_dtype: str | None = None,
                    backend: Optional[Backend] = None, lora=None) -> jax.Array:
    """tokens [B, T] -> logits [B, T, V] float32 from an empty cache: the differentiable
    scoring forward. kv_cache_dtype "int8" / "fp8": keys and values as such a cache stores them.
    lora: a jaxinfer.lora.LoraParams applied to every row (differentiable in its arrays)."""
    return _sequence_logits(params, cfg, tokens, kv_cache_dtype,
                            backend if backend is not None else backends.default(), lora)


@functools.partial(program_jit, static_argnums=(1, 3, 4))
def _sequence_logits(params: ModelParams, cfg: ModelConfig, tokens: jax.Array,
                     kv_cache_dtype: str | None, backend: Backend, lora=None) -> jax.Array:
    from jaxinfer.device.kv_cache import KV_DTYPES
    from jaxinfer.models import get_model

    model = get_model(cfg.architecture)
    B, T = tokens.shape
    dtype = model.activation_dtype(params) if kv_cache_dtype is None else \
        KV_DTYPES[kv_cache_dtype]
    cache = PagedKVCache.ring(cfg.num_layers, B, T, cfg.num_kv_heads, cfg.head_dim, dtype)
    if lora is not None:  # the slots in the float weights' dtype, as the engine holds them
        w = getattr(params.layers[0].wq, "dtype", None)
        lora = lora.step(B, w if w is not None and jnp.issubdtype(w, jnp.floating)
                         else jnp.float32)
    h, _ = model.forward(params, cfg, tokens, cache, jnp.full((B,), T, jnp.int32),
                         backend=backend, differentiable=True, lora=lora)
    return model.head(params, h, backend)


def stack_experts(arrays: list[np.ndarray]) -> np.ndarray:
    """Per-expert host weights [in, out] -> [E, in, out]."""
    return np.ascontiguousarray(np.stack(arrays))


__all__ = ["Context", "DENSE_QUERY_TILE", "Family", "ModelParams", "RaggedMeta", "attend",
           "rows", "sequence_logits", "stack_experts"]
