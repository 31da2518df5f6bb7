"""Native CPU kernels: XLA FFI handlers called inside jitted programs (products.cc, the decode
attention in attention.cc, argmax and sort in sampling.cc). Contracts: docs/cpu_kernels.md.

The sources are compiled on first use (`c++ -O3 -march=native`, or `$CXX`) into
`<cache dir>/cpu_kernels/<digest>.so`, the digest covering the sources, compiler, flags, jaxlib
and the CPU's instruction set. A library is code run in this process, so it is loaded only from
a directory private to this user; where that check fails (one warning), each process builds
its own in a private temporary directory. Handlers are registered under names carrying the
digest, so a cached program never runs another build.

The Backend (jaxinfer.backends) decides once whether they serve (the CPU's tuning, one device:
a custom call has no sharding rule). Without them (no compiler or AVX-512, a failed build,
`JAXINFER_CPU_KERNELS=0`) the same ops run as XLA dots and the jnp work list.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

_HERE = os.path.dirname(__file__)
# The files compiled into the library, and the headers they include.
SOURCES = tuple(os.path.join(_HERE, f) for f in ("products.cc", "attention.cc", "sampling.cc"))
HEADERS = tuple(os.path.join(_HERE, f) for f in ("common.h", "attention_blocks.h"))
CXX_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl")
# (python name, exported symbol) of each handler.
HANDLERS = (("row_times_matrix", "jaxinfer_row_times_matrix"),
            ("matrix_times_row", "jaxinfer_matrix_times_row"),
            ("decode_attention", "jaxinfer_decode_attention"),
            ("decode_attention_writing", "jaxinfer_decode_attention_writing"),
            ("rows_times_matrix", "jaxinfer_rows_times_matrix"),
            ("matrix_times_rows", "jaxinfer_matrix_times_rows"),
            ("argmax", "jaxinfer_argmax"),
            ("sort_descending", "jaxinfer_sort_descending"),
            ("gated_rows_times_matrices", "jaxinfer_gated_rows_times_matrices"),
            ("top_k", "jaxinfer_top_descending"),
            ("product_f32", "jaxinfer_product_f32"),
            ("row_sums", "jaxinfer_row_sums"))
# The products of several rows and the gated MLP need AVX512-BF16 (vdpbf16ps); with it, every
# product sums its outputs in vdpbf16ps's pairs whatever its row count.
ROWS_CPU_FLAG = "avx512_bf16"
# decode_attention: the head_dims it reads, and at most this many query heads.
ATTENTION_HEAD_DIMS = (32, 64, 128, 256)
ATTENTION_MAX_HEADS = 64

_lock = threading.Lock()
_state: dict = {}


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _digest(cxx: str, cpu_flags: set[str]) -> str:
    h = hashlib.sha256()
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    for part in (version.stdout, " ".join(CXX_FLAGS), importlib.metadata.version("jaxlib"),
                 " ".join(sorted(cpu_flags)), platform.machine()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _build(cxx: str, target: str) -> None:
    """Compiles SOURCES into `target`, atomically (a concurrent process never reads half)."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    try:
        cmd = [cxx, *CXX_FLAGS, "-I", jax.ffi.include_dir(), *SOURCES, "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _library(cxx: str, digest: str, directory: str) -> ctypes.CDLL:
    """The library of `digest` from `directory` where it is private (built there if missing
    or not private), else built, loaded and removed in a private temporary directory."""
    from jaxinfer.loading.hub import ensure_private_dir, not_private

    problem = ensure_private_dir(directory)
    if problem is None:
        path = os.path.join(directory, f"{digest}.so")
        if not os.path.exists(path):
            _build(cxx, path)
        elif bad := not_private(path):
            log.warning("jaxinfer CPU kernels: not loading %s (%s); building it anew", path, bad)
            _build(cxx, path)  # renamed over it: the directory is ours
        return ctypes.cdll.LoadLibrary(path)
    log.warning("jaxinfer CPU kernels: not loading from %s; building into a private temporary "
                "directory instead (each process builds its own)", problem)
    scratch = tempfile.mkdtemp(prefix="jaxinfer-cpu-kernels-")
    try:
        path = os.path.join(scratch, f"{digest}.so")
        _build(cxx, path)
        return ctypes.cdll.LoadLibrary(path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _load() -> str | None:
    """Builds and registers the kernels: their digest, or None (the reason logged once)."""
    from jaxinfer.loading.hub import cache_dir

    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    cpu_flags = _cpu_flags()
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in cpu_flags]
    if missing:
        log.info("jaxinfer CPU kernels off: the CPU lacks %s", ", ".join(missing))
        return None
    cxx = _compiler()
    if cxx is None:
        log.info("jaxinfer CPU kernels off: no C++ compiler (set CXX)")
        return None
    try:
        digest = _digest(cxx, cpu_flags)
        lib = _library(cxx, digest, os.path.join(cache_dir(), "cpu_kernels"))
        for name, symbol in HANDLERS:
            jax.ffi.register_ffi_target(f"{symbol}_{digest}",
                                        jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
    except Exception as e:  # noqa: BLE001 - any failure leaves XLA's dots in place
        log.warning("jaxinfer CPU kernels off: %s", e)
        return None
    _state["lib"] = lib
    return digest


def digest() -> str | None:
    """The loaded build's digest (building and registering it on first call), or None."""
    with _lock:
        if "digest" not in _state:
            _state["digest"] = (None if os.environ.get("JAXINFER_CPU_KERNELS", "1") == "0"
                                else _load())
        return _state["digest"]


def _target(name: str) -> str:
    return f"{dict(HANDLERS)[name]}_{digest()}"


def bf16_pairs_supported() -> bool:
    """Whether the CPU has AVX512-BF16, which the products of several rows and the gated MLP
    need."""
    return ROWS_CPU_FLAG in _cpu_flags()


def _product(name: str, out_axis: int, spec: str, **attrs):
    """The product kernel `name` (w's output axis out_axis), with XLA's einsum `spec` as its
    JVP, so gradients never enter the kernel."""
    @jax.custom_jvp
    def product(x: jax.Array, w: jax.Array) -> jax.Array:
        out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[out_axis],), jnp.float32)
        return jax.ffi.ffi_call(_target(name), out, vmap_method="sequential")(x, w, **attrs)

    @product.defjvp
    def _jvp(primals, tangents):
        (x, w), (dx, dw) = primals, tangents
        dot = functools.partial(jnp.einsum, spec, preferred_element_type=jnp.float32)
        return product(x, w), dot(dx, w) + dot(x, dw)

    return product


# The handlers, by (rows x [M, K] rather than x [K], w [N, K] rather than [K, N]): bf16, and
# float32 (one handler, any row count).
_PRODUCTS = {(False, False): _product("row_times_matrix", 1, "k,kn->n"),
             (False, True): _product("matrix_times_row", 0, "k,nk->n"),
             (True, False): _product("rows_times_matrix", 1, "mk,kn->mn"),
             (True, True): _product("matrix_times_rows", 0, "mk,nk->mn")}
_PRODUCTS_F32 = {(False, False): _product("product_f32", 1, "k,kn->n", transposed=np.int64(0)),
                 (False, True): _product("product_f32", 0, "k,nk->n", transposed=np.int64(1)),
                 (True, False): _product("product_f32", 1, "mk,kn->mn", transposed=np.int64(0)),
                 (True, True): _product("product_f32", 0, "mk,nk->mn", transposed=np.int64(1))}


def product(x: jax.Array, w: jax.Array, w_transposed: bool = False) -> jax.Array:
    """x @ w for x [K] or [M, K] (M >= 1) and w [K, N] (w [N, K] with w_transposed), both bf16
    (several rows: AVX512-BF16) or both float32 -> float32 [N] or [M, N]. Each output is summed
    in one order whatever M. Gradients go through XLA's dot."""
    table = _PRODUCTS_F32 if w.dtype == jnp.float32 else _PRODUCTS
    return table[(x.ndim == 2, w_transposed)](x, w)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def row_sums(x: jax.Array, squares: bool = False) -> jax.Array:
    """The sums over the last axis of float32 x [..., D] (of x * x with squares) -> [...], each
    in one order that depends on D alone (16 lanes in order, then a fixed tree). Its JVP is
    XLA's."""
    out = jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32)
    return jax.ffi.ffi_call(_target("row_sums"), out, vmap_method="broadcast_all")(
        x, squares=np.int64(bool(squares)))


@row_sums.defjvp
def _row_sums_jvp(squares, primals, tangents):
    (x,), (dx,) = primals, tangents
    return row_sums(x, squares), jnp.sum(2 * x * dx if squares else dx, axis=-1)


GATED_ACTIVATIONS = ("silu", "gelu_tanh")


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def gated_rows_times_matrices(x: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                              activation: str = "silu") -> jax.Array:
    """act(x @ w_gate) * (x @ w_up) for bf16 x [M, K] (M >= 1), w_gate, w_up
    [K, F] -> bf16 [M, F]: a gated MLP's hidden activations. act: "silu" or "gelu_tanh"
    (jax.nn.gelu(approximate=True)). Its JVP is XLA's."""
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"gated_rows_times_matrices: activation {activation!r} is not one of "
                         f"{GATED_ACTIVATIONS}")
    out = jax.ShapeDtypeStruct(x.shape[:-1] + w_gate.shape[-1:], jnp.bfloat16)
    return jax.ffi.ffi_call(_target("gated_rows_times_matrices"), out,
                            vmap_method="sequential")(
        x, w_gate, w_up, activation=np.int64(GATED_ACTIVATIONS.index(activation)))


def _gate(name: str, g: jax.Array) -> jax.Array:
    """The gate as XLA computes it (the kernel's JVP)."""
    return jax.nn.silu(g) if name == "silu" else jax.nn.gelu(g, approximate=True)


def _gated_reference(activation, x, w_gate, w_up):
    dot = functools.partial(jnp.einsum, "mk,kf->mf", preferred_element_type=jnp.float32)
    return (_gate(activation, dot(x, w_gate)) * dot(x, w_up)).astype(jnp.bfloat16)


@gated_rows_times_matrices.defjvp
def _gated_jvp(activation, primals, tangents):
    return (gated_rows_times_matrices(*primals, activation),
            jax.jvp(functools.partial(_gated_reference, activation), primals, tangents)[1])


def argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax(x, axis=-1) for float32 x [..., V] (V >= 1) -> int32 [...], in one pass."""
    out = jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32)
    return jax.ffi.ffi_call(_target("argmax"), out, vmap_method="broadcast_all")(x)


def sort_descending(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 x [..., V] (V >= 1) -> (sorted [..., V] float32, order [..., V] int32), order
    equal to jnp.argsort(-x, axis=-1) (stable; -0.0 equal to 0.0, NaN last). A radix sort."""
    out = (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(x.shape, jnp.int32))
    return tuple(jax.ffi.ffi_call(_target("sort_descending"), out,
                                  vmap_method="broadcast_all")(x))


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The first k (1 <= k <= V) of sort_descending(x)'s outputs, [..., k] each; only the
    values that can be among the k are sorted."""
    V = x.shape[-1]
    if not 1 <= k <= V:
        raise ValueError(f"top_k: k={k} must be in [1, {V}] (the rows' length)")
    shape = x.shape[:-1] + (k,)
    out = (jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.int32))
    return tuple(jax.ffi.ffi_call(_target("top_k"), out,
                                  vmap_method="broadcast_all")(x))


def _pool_kind(pool) -> str | None:
    """"bf16" (Bits16KV), "float32", "int8" or "fp8" (QuantizedKV): the pools the decode
    kernels read; None for others."""
    from jaxinfer.device.kv_cache import Bits16KV
    from jaxinfer.quant.kv import QuantizedKV

    if isinstance(pool, Bits16KV):
        return "bf16" if pool.float_dtype == "bfloat16" else None
    if isinstance(pool, QuantizedKV):
        return {jnp.dtype(jnp.int8): "int8",
                jnp.dtype(jnp.float8_e4m3fn): "fp8"}.get(jnp.dtype(pool.dtype))
    return "float32" if isinstance(pool, jax.Array) and pool.dtype == jnp.float32 else None


def attention_supports(pool, num_heads: int) -> bool:
    """Whether decode_attention reads this pool with these heads."""
    K, H = pool.shape[-2], pool.shape[-1]
    return (_pool_kind(pool) is not None and H in ATTENTION_HEAD_DIMS and num_heads % K == 0
            and num_heads <= ATTENTION_MAX_HEADS)


def decode_attention(q: jax.Array, k_pool, v_pool, layer, tables: jax.Array, token: jax.Array,
                     row: jax.Array, pos: jax.Array, *, page_size: int, scale: float,
                     sliding_window: int | None = None, softcap: float | None = None) -> jax.Array:
    """Single-query tiles over their rows' paged keys, in the step's token order
    (docs/cpu_kernels.md). q [T, K, G, H] unscaled; k_pool, v_pool [L, P * page_size, K, H];
    layer int32 []; tables [B, M] int32 (logical page j at tables[b, j % M]); token, row, pos
    [Nt] int32: tile t is token token[t]'s query, of row row[t], at position pos[t] (out of
    range or -1: no tile). Returns [T, K, G, H] float32, zeros at tokens of no tile, NaN for a
    tile whose pages lie outside the pool. Not differentiable."""
    (k, k_scale), (v, v_scale) = _stored(k_pool), _stored(v_pool)
    call = jax.ffi.ffi_call(_target("decode_attention"),
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), k, v, k_scale, v_scale,
                *_i32(layer, tables, token, row, pos),
                **_attention_attrs(page_size, scale, sliding_window, softcap))


def decode_attention_writing(q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                             slots: jax.Array, k_pool, v_pool, layer, tables: jax.Array,
                             token: jax.Array, row: jax.Array, pos: jax.Array, *,
                             page_size: int, scale: float, sliding_window: int | None = None,
                             softcap: float | None = None):
    """decode_attention after writing k_new, v_new [T, K, H] in place at layer `layer`'s slots
    [T] of float32 or bf16 pools (slots outside the pool dropped). Returns (out, k_pool,
    v_pool)."""
    from jaxinfer.device.kv_cache import Bits16KV

    (k, k_scale), (v, v_scale) = _stored(k_pool), _stored(v_pool)
    call = jax.ffi.ffi_call(
        _target("decode_attention_writing"),
        (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(k.shape, k.dtype),
         jax.ShapeDtypeStruct(v.shape, v.dtype)),
        input_output_aliases={1: 1, 2: 2})
    out, k, v = call(q.astype(jnp.float32), k, v, k_new.astype(jnp.float32),
                     v_new.astype(jnp.float32), jnp.asarray(slots, jnp.int32), k_scale, v_scale,
                     *_i32(layer, tables, token, row, pos),
                     **_attention_attrs(page_size, scale, sliding_window, softcap))
    wrap = lambda pool, a: pool.replace(bits=a) if isinstance(pool, Bits16KV) else a  # noqa: E731
    return out, wrap(k_pool, k), wrap(v_pool, v)


def writing_supports(pool) -> bool:
    """Whether decode_attention_writing writes this pool (float32, or Bits16KV of bf16)."""
    return _pool_kind(pool) in ("bf16", "float32")


def _stored(a):
    """A pool's stored elements and their scales ([L, P * page_size, K], or empty)."""
    from jaxinfer.device.kv_cache import Bits16KV
    from jaxinfer.quant.kv import QuantizedKV

    if isinstance(a, QuantizedKV):
        return a.codes, a.scale.astype(jnp.float32)
    return (a.bits if isinstance(a, Bits16KV) else a), jnp.zeros((0,), jnp.float32)


def _i32(*arrays):
    return tuple(jnp.asarray(a, jnp.int32) for a in arrays)


def _attention_attrs(page_size, scale, sliding_window, softcap) -> dict:
    return dict(page_size=int(page_size), window=int(sliding_window or 0),
                softcap=np.float32(softcap or 0.0), scale=np.float32(scale))
