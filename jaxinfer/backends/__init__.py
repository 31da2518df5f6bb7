"""The backend seam: what depends on the platform a model runs on, decided once.

`resolve()` (called when an LLM is built, or by `default()` for a user's own `jaxinfer.step`)
returns a frozen, hashable `Backend`, a static argument of every jitted program. The model, the
layers and the sampler take from it every op whose implementation differs by platform:

  dot, gated_hidden        float products and a gated MLP's hidden activations (products.py)
  attend                   a layer's key/value write and its ragged attention (attention.py)
  argmax, top, sort        the sampler's reductions (sort.py)
  row_sum                  the norms' and the sampler's sums (one order per row where invariant)
  activation_dtype, kv_bits16, kv_fp8_bits, tuning      the dtype and storage policy

Nothing outside this package imports cpu_kernels or reads XLA_FLAGS; process-wide XLA flags are
set by `set_xla_flags()` (LLM() and the launchers call it), never by importing jaxinfer.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

import jax
import jax.numpy as jnp

from jaxinfer.backends import tuning
from jaxinfer.backends.tuning import StepTuning

log = logging.getLogger(__name__)

ATTENTION = ("auto", "reference", "pallas")
PALLAS_HEAD_DIMS = (32, 64, 128, 256)  # the head dims the Pallas attention kernels take


@dataclasses.dataclass(frozen=True)
class Backend:
    """The implementations a model's programs use on one platform.

    kernels: the native CPU kernels' build digest where they serve (one CPU device), else None;
    batch_invariant: they serve every bf16 product, gated MLP and (through tiles of one query)
    attention, each output summed in one order whatever else the step holds (AVX512-BF16;
    docs/architecture.md, "Batch invariance"). attention: "reference" (the jnp work list, with
    the native decode kernel where `kernels`) or "pallas". one_scratch_buffer: XLA:CPU's
    memory-minimizing scheduler is on (bigger dequantization tiles then fit)."""

    platform: str
    tuning: StepTuning
    kernels: Optional[str] = None
    batch_invariant: bool = False
    attention: str = "reference"
    one_scratch_buffer: bool = False

    # ---- products -------------------------------------------------------------------------

    def dot(self, x: jax.Array, w: jax.Array, spec: str) -> jax.Array:
        """einsum(spec, x, w) for a float weight, in w's dtype with float32 accumulation."""
        from jaxinfer.backends import products
        return products.dot(self, x, w, spec)

    def gated_hidden(self, x, w_gate, w_up, activation: str) -> Optional[jax.Array]:
        """act(x @ w_gate) * (x @ w_up) from one kernel where one serves, else None."""
        from jaxinfer.backends import products
        return products.gated_hidden(self, x, w_gate, w_up, activation)

    def attends_per_query(self, pool, num_heads: int) -> bool:
        """Whether every query of a step, prefill and verification included, goes alone through
        the native attention kernel (tiles of one query): on a batch-invariant backend where the
        kernel reads this pool, so a query's keys are summed in one order whatever its chunk."""
        if not (self.batch_invariant and self.attention == "reference"):
            return False
        from jaxinfer.backends import cpu_kernels
        return cpu_kernels.attention_supports(pool, num_heads)

    def row_sum(self, x: jax.Array, squares: bool = False) -> jax.Array:
        """float32 sums over x's last axis (of x * x with squares). On a batch-invariant backend
        one native order per row, fixed by the row's width alone (XLA orders a reduction by the
        whole array's shape: a row is summed one way alone and another among eight); appended
        zeros leave a sum unchanged."""
        x = x.astype(jnp.float32)
        if self.batch_invariant:
            from jaxinfer.backends import cpu_kernels
            return cpu_kernels.row_sums(x, squares)
        return jnp.sum(x * x if squares else x, axis=-1)

    def quantized_tiles(self) -> bool:
        """Whether quantized weights are dequantized in tiles inside the step: on CPU, where XLA
        does not fuse the dequantization into the dot."""
        return self.platform == "cpu"

    def tile_elements(self) -> int:
        """The most elements of one dequantized tile (quant.compute)."""
        from jaxinfer.backends import products
        return products.tile_elements(self)

    @property
    def fp8_activations(self) -> bool:
        """fp8 weights multiply fp8 activations (W8A8): where the hardware has fp8 matmuls."""
        return self.platform == "gpu"

    # ---- attention ------------------------------------------------------------------------

    def attend(self, q, k, v, slots, k_all, v_all, layer, tables, meta, write, **kw):
        """Writes k, v [T, K, H] at slots [T] of the pools and attends q [T, N, H] over them:
        (out [T, N, H], k_all, v_all). See backends.attention.attend."""
        from jaxinfer.backends import attention
        return attention.attend(self, q, k, v, slots, k_all, v_all, layer, tables, meta,
                                write, **kw)

    # ---- sampling -------------------------------------------------------------------------

    def argmax(self, x: jax.Array) -> jax.Array:
        """jnp.argmax over the last axis, as int32."""
        from jaxinfer.backends import sort
        return sort.argmax(self, x)

    def native_sort(self, x: jax.Array) -> bool:
        """Whether sort/top of x are the native sort's (equal values by index, -0.0 == 0.0,
        NaN last) rather than lax.top_k's and argsort's order."""
        return self.kernels is not None and x.dtype == jnp.float32

    def sort(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Each row of x [B, V] in descending order: (values, indices) [B, V]."""
        from jaxinfer.backends import sort
        return sort.sort_descending(self, x)

    def top(self, x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
        """The first k of sort(x): (values, indices) [B, k]."""
        from jaxinfer.backends import sort
        return sort.top(self, x, k)

    # ---- dtypes and storage ---------------------------------------------------------------

    def activation_dtype(self, dtype) -> jnp.dtype:
        """The activations' dtype for weights of `dtype` (float32 under
        tuning.float32_activations)."""
        dtype = jnp.dtype(dtype)
        if self.tuning.float32_activations and dtype.itemsize == 2:
            return jnp.dtype(jnp.float32)
        return dtype

    kv_bits16 = property(lambda self: self.tuning.kv_16bit_as_bits)
    kv_fp8_bits = property(lambda self: self.tuning.kv_fp8_as_bits)

    def describe(self) -> dict:
        """Which implementation each op uses, for LLM.describe()."""
        native = self.kernels is not None
        attention = ("Pallas ragged paged attention" if self.attention == "pallas" else
                     "native decode kernel + jnp work list" if native else "jnp work list")
        return {
            "platform": self.platform,
            "cpu_kernels": self.kernels or "off",
            "products": ("native bf16 kernels for every row count" if self.batch_invariant
                         else "native 1-row bf16 kernels, XLA dots beyond") if native
                        else "XLA dots",
            "gated_mlp": "native gate and up" if self.batch_invariant else "XLA",
            "batch_invariant": self.batch_invariant,
            "attention": attention,
            "argmax_top_sort": "native" if native else "XLA",
            "activations": "float32" if self.tuning.float32_activations else "weights' dtype",
            "kv_storage": f"16-bit floats as bits: {self.kv_bits16}; fp8 codes as bits: "
                          f"{self.kv_fp8_bits}",
        }


def platform() -> str:
    """jax's default platform (starts a backend)."""
    return jax.default_backend()


def resolve(attention: str = "auto", num_devices: Optional[int] = None,
            head_dim: Optional[int] = None) -> Backend:
    """The Backend of programs on jax's default platform over `num_devices` devices (default:
    all; the native CPU kernels serve one). attention: "auto", "reference" or "pallas"; a
    head_dim outside PALLAS_HEAD_DIMS is a ValueError for "pallas", the reference for "auto"."""
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    name = platform()
    tune = tuning.for_platform(name)
    devices = jax.device_count() if num_devices is None else num_devices
    kernels, invariant = None, False
    if tune.cpu_kernels and devices == 1:
        from jaxinfer.backends import cpu_kernels
        kernels = cpu_kernels.digest()
        invariant = kernels is not None and cpu_kernels.bf16_pairs_supported()
    impl = tune.default_attention if attention == "auto" else attention
    if impl == "pallas" and head_dim is not None and head_dim not in PALLAS_HEAD_DIMS:
        if attention == "pallas":
            raise ValueError(f"attention='pallas' needs a head dim in {PALLAS_HEAD_DIMS}; "
                             f"this model's is {head_dim}")
        impl = "reference"
    return Backend(platform=name, tuning=tune, kernels=kernels, batch_invariant=invariant,
                   attention=impl, one_scratch_buffer=tuning.cpu_keeps_one_scratch_buffer())


def default_dtype() -> str:
    """LLM(dtype=None)'s dtype on this platform (backends.tuning)."""
    return tuning.for_platform(platform()).default_dtype


def default() -> Backend:
    """resolve() with the defaults, for a step or scoring forward called without a backend."""
    return resolve()


def signature() -> str:
    """The XLA flags and the platform with its devices: part of the programs cache's key."""
    devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
    return f"{os.environ.get('XLA_FLAGS', '')}|{platform()}|{devices!r}"


def set_xla_flags() -> list[str]:
    """Adds the platform's process-wide XLA flags (backends.tuning) to XLA_FLAGS before any
    backend starts (else logs once that it is too late). Returns the flags added."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        if tuning.cpu_xla_flags_missing() and not _told:
            _told.append(True)
            log.info("jaxinfer: a jax backend started before LLM(); its XLA flags stay as they "
                     "are (call jaxinfer.backends.set_xla_flags() first to tune them)")
        return []
    return tuning.set_cpu_xla_flags()


_told: list = []


__all__ = ["ATTENTION", "Backend", "StepTuning", "default", "default_dtype", "platform",
           "resolve", "set_xla_flags", "signature"]
