"""jaxinfer.backends.cpu_kernels: the native bf16 products (one row, and any number of rows)
against a numpy product of the same bf16 operands. Tolerance: float32 products and sums of K
terms, |err| <= 1e-5 times the sum of |x_k w_kn| (plus 1e-6), which float32 summation in any
order meets. With AVX512-BF16, a row's products are also bitwise the same whatever the rows
beside it (the batch invariance the engine relies on)."""

import functools
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import backends
from jaxinfer.backends import cpu_kernels
from jaxinfer.device.kv_cache import Bits16KV, PagedKVCache
from jaxinfer.layers import gated_mlp
from jaxinfer.quant.kv import QuantizedKV, quantize_kv

SUPPORTED = (cpu_kernels._cpu_flags() >= set(cpu_kernels.REQUIRED_CPU_FLAGS)
             and cpu_kernels._compiler() is not None
             and os.environ.get("JAXINFER_CPU_KERNELS", "1") != "0")
needs_kernels = pytest.mark.skipif(not SUPPORTED, reason="no AVX-512 or no C++ compiler")
ROWS_SUPPORTED = SUPPORTED and cpu_kernels.ROWS_CPU_FLAG in cpu_kernels._cpu_flags()
needs_rows_kernels = pytest.mark.skipif(not ROWS_SUPPORTED, reason="no AVX512-BF16")


def one_device():
    """The Backend of programs over one CPU device (the kernels' when they built)."""
    return backends.resolve(num_devices=1)


def test_kernels_build_wherever_the_cpu_and_a_compiler_allow():
    """They build where the CPU and a compiler allow, and then a backend of one device calls
    them from its products while one of several devices (no sharding rule) does not."""
    if not SUPPORTED:
        assert cpu_kernels.digest() is None and one_device().kernels is None
        return
    assert cpu_kernels.digest() is not None
    w = jnp.ones((64, 32), jnp.bfloat16)
    for backend, calls in ((one_device(), 1), (backends.resolve(num_devices=2), 0)):
        fn = jax.jit(lambda x, w, b=backend: b.dot(x, w, "...i,io->...o"))
        assert custom_calls(fn, jnp.ones((64,)), w) == calls


def operands(K, N, transposed, seed=0, rows=None):
    """x [K] (or [rows, K]), w, the float64 product and the sum of |products| of each output."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(K,) if rows is None else (rows, K)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(N, K) if transposed else (K, N)), jnp.bfloat16)
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    w64 = w64.T if transposed else w64
    return x, w, x64 @ w64, np.abs(x64) @ np.abs(w64)


# Shapes: SmolLM2's (q/o, k/v, gate/up, down, its tied head), column and row tails that are not
# multiples of 16 or 32, one element, and wider than a column panel (2,048).
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152), (577, 33), (33, 5000),
          (64, 2049), (1, 1), (130, 7), (17, 4099)]


@needs_kernels
@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("transposed", [False, True], ids=["w[K,N]", "w[N,K]"])
def test_kernel_matches_a_float64_product(K, N, transposed):
    x, w, want, scale = operands(K, N, transposed)
    kernel = functools.partial(cpu_kernels.product, w_transposed=transposed)
    got = np.asarray(jax.jit(kernel)(x, w))
    assert got.dtype == np.float32 and got.shape == (N,)
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-6)


@needs_rows_kernels
@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("transposed", [False, True], ids=["w[K,N]", "w[N,K]"])
def test_rows_kernel_matches_a_float64_product(K, N, transposed):
    # Row counts: below, at and above a register block (8 rows; 4 for w[N, K]), and many.
    kernel = jax.jit(functools.partial(cpu_kernels.product, w_transposed=transposed))
    for M in (2, 5, 9, 64, 131):
        x, w, want, scale = operands(K, N, transposed, seed=M, rows=M)
        got = np.asarray(kernel(x, w))
        assert got.dtype == np.float32 and got.shape == (M, N)
        assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-6), M


@needs_rows_kernels
@pytest.mark.parametrize("K,N", [(576, 1536), (1536, 576), (576, 49152), (577, 33), (33, 4099)])
@pytest.mark.parametrize("transposed", [False, True], ids=["w[K,N]", "w[N,K]"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_a_row_gets_the_same_bits_from_every_product_path(K, N, transposed, dtype):
    """Batch invariance: a row's products are bitwise the same alone (the one-row kernel, x
    [K]), as the first of 2, in the middle of 9 and at the end of 131 rows (register blocks
    of 8, 4 and 2 rows and one), so no row count changes a sum's order; bf16 and float32. The
    float32 results also lie within float32 summation error of float64's."""
    kernel = jax.jit(functools.partial(cpu_kernels.product, w_transposed=transposed))
    rng = np.random.default_rng(K + N)
    row = jnp.asarray(rng.normal(size=(K,)), dtype)
    w = jnp.asarray(rng.normal(size=(N, K) if transposed else (K, N)), dtype)
    w64 = np.asarray(w, np.float64).T if transposed else np.asarray(w, np.float64)
    alone = np.asarray(kernel(row, w))
    for M, at in ((2, 0), (9, 4), (131, 130), (131, 67)):
        x = jnp.asarray(rng.normal(size=(M, K)), dtype).at[at].set(row)
        got = np.asarray(kernel(x, w))
        np.testing.assert_array_equal(got[at], alone, err_msg=f"{M} {at}")
        x64 = np.asarray(x, np.float64)
        assert np.all(np.abs(got - x64 @ w64) <= 1e-5 * (np.abs(x64) @ np.abs(w64)) + 1e-6)


@needs_rows_kernels
@pytest.mark.parametrize("D", [1, 15, 64, 576, 640, 49152])
def test_row_sums_are_the_same_for_a_row_alone_and_among_many(D):
    """cpu_kernels.row_sums (the norms' and the sampler's sums): a row's sum and sum of
    squares are bitwise the same alone and among 2, 7, 9 and 300 rows, unchanged by zeros
    appended to the row, and within float32 summation error of float64's."""
    rng = np.random.default_rng(D)
    x = rng.normal(size=(300, D)).astype(np.float32)
    for squares in (False, True):
        f = jax.jit(functools.partial(cpu_kernels.row_sums, squares=squares))
        alone = np.asarray(f(jnp.asarray(x[5:6])))[0]
        for lo, hi in ((4, 6), (0, 7), (1, 10), (0, 300)):
            assert np.asarray(f(jnp.asarray(x[lo:hi])))[5 - lo] == alone, (squares, lo, hi)
        padded = np.concatenate([x[5:6], np.zeros((1, 37), np.float32)], axis=1)
        assert np.asarray(f(jnp.asarray(padded)))[0] == alone
        v = x[5].astype(np.float64)
        want, scale = (np.sum(v * v), np.sum(v * v)) if squares else (np.sum(v), np.sum(np.abs(v)))
        assert abs(alone - want) <= 1e-6 * scale * max(1, np.log2(D)) + 1e-30


@needs_rows_kernels
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_a_row_gets_the_same_bits_from_the_gated_kernel_at_every_row_count(activation):
    """The gated MLP's hidden activations of a row, alone and among 7, 64, 65 and 200 rows
    (past the kernel's 64-row blocks): bitwise equal."""
    kernel = jax.jit(cpu_kernels.gated_rows_times_matrices, static_argnums=3)
    x, wg, wu, _, _ = gated_operands(200, 576, 1536, seed=5, activation=activation)
    alone = np.asarray(kernel(x[130:131], wg, wu, activation))[0]
    for lo, hi in ((127, 134), (70, 134), (66, 131), (0, 200)):
        np.testing.assert_array_equal(np.asarray(kernel(x[lo:hi], wg, wu, activation))[130 - lo],
                                      alone, err_msg=f"{lo}:{hi}")


def _gate64(activation, g):
    """The gate in float64: silu, or GELU's tanh form as jax.nn.gelu(approximate=True) writes it."""
    if activation == "silu":
        return g / (1 + np.exp(-g))
    return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))


def gated_operands(M, K, F, seed=0, activation="silu"):
    """x [M, K], w_gate, w_up [K, F] (bf16), the float64 act(x @ w_gate) * (x @ w_up) and a
    bound on the kernel's error: float32 products as above, the gate's slope (below 1.1 for
    silu, 1.13 for GELU) and the product carrying them, and the rounding to bf16 (half an ulp,
    2^-9 of the value's binade, within 2^-8 of the value)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    wg, wu = (jnp.asarray(rng.normal(size=(K, F)) / np.sqrt(K) * 3, jnp.bfloat16)
              for _ in range(2))
    x64, g64, u64 = (np.asarray(a, np.float64) for a in (x, wg, wu))
    g, u = x64 @ g64, x64 @ u64
    eg = 1e-5 * (np.abs(x64) @ np.abs(g64)) + 1e-6
    eu = 1e-5 * (np.abs(x64) @ np.abs(u64)) + 1e-6
    act = _gate64(activation, g)
    want = act * u
    bound = 2.0 ** -8 * np.abs(want) + 1.13 * eg * (np.abs(u) + eu) + np.abs(act) * eu + 1e-30
    return x, wg, wu, want, bound


@needs_rows_kernels
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("K,F", [(576, 1536), (577, 33), (33, 70), (1, 1), (64, 2049)])
def test_gated_kernel_matches_a_float64_reference(K, F, activation):
    kernel = jax.jit(cpu_kernels.gated_rows_times_matrices, static_argnums=3)
    for M in (1, 2, 5, 9, 64, 131):
        x, wg, wu, want, bound = gated_operands(M, K, F, seed=M, activation=activation)
        got = kernel(x, wg, wu, activation)
        assert got.dtype == jnp.bfloat16 and got.shape == (M, F)
        assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound), (M, K, F)


def test_gated_kernel_names_an_unknown_activation():
    x = jnp.ones((2, 4), jnp.bfloat16)
    with pytest.raises(ValueError, match="'relu'.*silu"):
        cpu_kernels.gated_rows_times_matrices(x, x.T, x.T, "relu")


@needs_rows_kernels
def test_gated_kernel_at_the_edges_of_exp():
    # x = [1, 1] picks each gate column as it is: silu(g) * 1 for g where exp(-g) overflows,
    # underflows, is infinite or NaN, as g / (1 + exp(-g)) gives them in float32 (where exp(-g)
    # overflows, below about -88.7, silu is -0.0, as XLA's is).
    g = np.array([np.inf, -np.inf, np.nan, -100.0, 100.0, 0.0, -87.0, -90.0, 88.0, 3e38,
                  -3e38, 1e-3, -1e-3, 20.0, -20.0], np.float32)
    wg = jnp.asarray(g[None], jnp.bfloat16)
    got = np.asarray(cpu_kernels.gated_rows_times_matrices(
        jnp.ones((2, 1), jnp.bfloat16), wg, jnp.ones_like(wg)), np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        g32 = np.asarray(wg, np.float32)[0]
        want = np.asarray(jnp.asarray(g32 / (1 + np.exp(-g32)), jnp.bfloat16), np.float64)
    for row in got:
        np.testing.assert_array_equal(row, want)


@needs_rows_kernels
def test_gelu_gate_at_the_edges_of_exp():
    # As above for GELU's tanh form, which the kernel computes as g / (1 + exp(-z)), z = 2
    # sqrt(2 / pi) (g + 0.044715 g^3): against the tanh form in float64 (NaN at -inf, as
    # jax.nn.gelu gives: -inf times 0), within one bf16 rounding.
    g = np.array([np.inf, -np.inf, np.nan, -100.0, 100.0, 0.0, -87.0, -5.0, -3.0, 3e38,
                  -3e38, 1e-3, -1e-3, 20.0, -20.0, 0.5, -0.5], np.float32)
    wg = jnp.asarray(g[None], jnp.bfloat16)
    got = np.asarray(cpu_kernels.gated_rows_times_matrices(
        jnp.ones((2, 1), jnp.bfloat16), wg, jnp.ones_like(wg), "gelu_tanh"), np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        want = _gate64("gelu_tanh", np.asarray(wg, np.float64)[0])
    for row in got:
        np.testing.assert_allclose(row, want, rtol=2.0 ** -8, atol=0)
    assert np.isnan(got[0, 1]) and np.isnan(got[0, 2])


@needs_rows_kernels
def test_gated_mlp_calls_the_gated_kernel_for_float32_rows_against_bf16_weights():
    D, F = 64, 96
    rng = np.random.default_rng(3)
    w = [jnp.asarray(rng.normal(size=s) / 8, jnp.bfloat16) for s in ((D, F), (D, F), (F, D))]
    fn = jax.jit(lambda x, *w: gated_mlp(x, *w, "silu", backend=one_device()))
    gated = lambda x, *w: fn.lower(x, *w).as_text().count(  # noqa: E731
        "jaxinfer_gated_rows_times_matrices")
    assert gated(jnp.ones((2, 3, D)), *w) == 1
    assert gated(jnp.ones((64, D)), *w) == 1
    assert gated(jnp.ones((1, D)), *w) == 1
    assert gated(jnp.ones((300, D)), *w) == 1
    assert gated(jnp.ones((4, D), jnp.bfloat16), *w) == 0
    assert gated(jnp.ones((4, D)), *(a.astype(jnp.float32) for a in w)) == 0
    # The same MLP as XLA's (silu of float32 products, the hidden rounded to bf16 by the down
    # product): every hidden value within one bf16 rounding, so the outputs agree to about
    # 2^-8 of the terms' magnitude.
    x = jnp.asarray(rng.normal(size=(2, 3, D)), jnp.float32)
    got = fn(x, *w)
    ref = jax.jit(lambda x, wg, wu, wd: jnp.einsum(
        "...f,fd->...d", (jax.nn.silu(jnp.einsum("...d,df->...f", x.astype(jnp.bfloat16), wg,
                                                 preferred_element_type=jnp.float32))
                          * jnp.einsum("...d,df->...f", x.astype(jnp.bfloat16), wu,
                                       preferred_element_type=jnp.float32)
                          ).astype(jnp.bfloat16), wd, preferred_element_type=jnp.float32))
    assert got.dtype == jnp.float32 and got.shape == (2, 3, D)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref(x, *w)), rtol=0, atol=2e-2)


@needs_rows_kernels
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_kernel_under_vmap_and_grad(activation):
    x, wg, wu, want, bound = gated_operands(3, 48, 40, activation=activation)
    kernel = functools.partial(cpu_kernels.gated_rows_times_matrices, activation=activation)
    got = jax.jit(jax.vmap(kernel, in_axes=(0, None, None)))(jnp.stack([x, x]), wg, wu)
    for rows in np.asarray(got, np.float64):
        assert np.all(np.abs(rows - want) <= bound)
    loss = lambda x, g, u: jnp.sum(kernel(x, g, u).astype(jnp.float32) ** 2)  # noqa: E731
    # The same function written out here (not the kernel's JVP helper), so a JVP wired to the
    # wrong operands or function fails.
    dot = lambda a, b: jnp.einsum("mk,kf->mf", a, b,  # noqa: E731
                                  preferred_element_type=jnp.float32)
    gate = (jax.nn.silu if activation == "silu" else  # noqa: E731
            lambda g: 0.5 * g * (1 + jnp.tanh(0.7978845608 * (g + 0.044715 * g ** 3))))
    ref = lambda x, g, u: jnp.sum(  # noqa: E731
        (gate(dot(x, g)) * dot(x, u)).astype(jnp.bfloat16).astype(jnp.float32) ** 2)
    for g, r in zip(jax.grad(loss, (0, 1, 2))(x, wg, wu), jax.grad(ref, (0, 1, 2))(x, wg, wu)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   rtol=2e-2, atol=1e-2)


def custom_calls(fn, *args) -> int:
    return fn.lower(*args).as_text().count("jaxinfer_")


@needs_kernels
def test_dot_calls_the_kernels_for_bf16_rows_only():
    w = jnp.ones((64, 32), jnp.bfloat16)
    rows = int(ROWS_SUPPORTED)
    backend = one_device()
    assert backend.batch_invariant == ROWS_SUPPORTED
    for spec, weight in (("...i,io->...o", w), ("...D,VD->...V", w.T)):
        fn = jax.jit(lambda x, w, spec=spec: backend.dot(x, w, spec))
        assert custom_calls(fn, jnp.ones((1, 1, 64)), weight) == 1
        assert custom_calls(fn, jnp.ones((64,)), weight) == 1
        assert custom_calls(fn, jnp.ones((2, 64)), weight) == rows
        assert custom_calls(fn, jnp.ones((2, 32, 64)), weight) == rows
        assert custom_calls(fn, jnp.ones((1000, 64)), weight) == rows
        assert custom_calls(fn, jnp.ones((1, 64)), weight.astype(jnp.float32)) == rows
        assert custom_calls(fn, jnp.ones((300, 64)), weight.astype(jnp.float32)) == rows
        assert custom_calls(fn, jnp.ones((1, 64)), weight.astype(jnp.float16)) == 0
        assert custom_calls(fn, jnp.ones((4, 64)), weight.astype(jnp.float16)) == 0


@needs_rows_kernels
def test_without_avx512_bf16_xla_multiplies_the_rows(monkeypatch):
    flags = cpu_kernels._cpu_flags() - {cpu_kernels.ROWS_CPU_FLAG}
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: flags)
    backend = one_device()
    assert not backend.batch_invariant and backend.kernels is not None
    x, w, want, scale = operands(96, 200, False, rows=3)
    fn = jax.jit(lambda x, w: backend.dot(x, w, "...i,io->...o"))
    assert custom_calls(fn, x, w) == 0
    assert np.all(np.abs(np.asarray(fn(x, w)) - want) <= 1e-5 * scale + 1e-6)


@needs_kernels
def test_turned_off_the_padded_dot_serves(monkeypatch):
    monkeypatch.setitem(cpu_kernels._state, "digest", None)
    backend = one_device()
    assert backend.kernels is None and backend.describe()["cpu_kernels"] == "off"
    x, w, want, scale = operands(96, 200, False)
    fn = jax.jit(lambda x, w: backend.dot(x, w, "...i,io->...o"))
    assert custom_calls(fn, x[None], w) == 0
    got = np.asarray(fn(x[None], w))[0]
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-6)


@needs_kernels
def test_in_a_while_loop_under_vmap_and_grad():
    x, w, want, scale = operands(96, 96, False)

    def loop(x, w):
        def body(i, y):
            return cpu_kernels.product(y.astype(jnp.bfloat16), w) * 0.1
        return jax.lax.fori_loop(0, 3, body, x.astype(jnp.float32))

    y = x.astype(jnp.float32)
    for _ in range(3):
        y = jnp.einsum("k,kn->n", y.astype(jnp.bfloat16), w,
                       preferred_element_type=jnp.float32) * 0.1
    np.testing.assert_allclose(np.asarray(jax.jit(loop)(x, w)), np.asarray(y), rtol=1e-4,
                               atol=1e-5)

    xs = jnp.stack([x, -x, 2 * x])
    got = jax.jit(jax.vmap(cpu_kernels.product, in_axes=(0, None)))(xs, w)
    for row, sign in zip(np.asarray(got), (1, -1, 2)):
        assert np.all(np.abs(row - sign * want) <= abs(sign) * (1e-5 * scale + 1e-6))

    # Gradients go through XLA's dots (the kernel's JVP).
    loss = lambda x, w: jnp.sum(cpu_kernels.product(x, w, w_transposed=True) ** 2)  # noqa: E731
    ref = lambda x, w: jnp.sum(jnp.einsum("k,nk->n", x, w,  # noqa: E731
                                          preferred_element_type=jnp.float32) ** 2)
    wt = w.T
    for g, r in zip(jax.grad(loss, (0, 1))(x, wt), jax.grad(ref, (0, 1))(x, wt)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   rtol=2e-2, atol=1e-2)


@needs_rows_kernels
def test_rows_kernels_under_vmap_and_grad():
    x, w, want, scale = operands(96, 80, False, rows=3)
    got = jax.jit(jax.vmap(cpu_kernels.product, in_axes=(0, None)))(
        jnp.stack([x, -x]), w)
    for rows, sign in zip(np.asarray(got), (1, -1)):
        assert np.all(np.abs(rows - sign * want) <= 1e-5 * scale + 1e-6)
    loss = lambda x, w: jnp.sum(cpu_kernels.product(x, w, w_transposed=True) ** 2)  # noqa: E731
    ref = lambda x, w: jnp.sum(jnp.einsum("mk,nk->mn", x, w,  # noqa: E731
                                          preferred_element_type=jnp.float32) ** 2)
    for g, r in zip(jax.grad(loss, (0, 1))(x, w.T), jax.grad(ref, (0, 1))(x, w.T)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   rtol=2e-2, atol=1e-2)


@needs_kernels
def test_concurrent_calls_in_one_program():
    # Independent custom calls that XLA:CPU may run at once on its thread pool, each sharing
    # its rows with the pool's threads.
    ops = [operands(576, 1536, bool(i % 2), seed=i) for i in range(8)]

    def many(xs, ws):
        return [cpu_kernels.product(x, w, w_transposed=bool(i % 2))
                for i, (x, w) in enumerate(zip(xs, ws))]

    got = jax.jit(many)([o[0] for o in ops], [o[1] for o in ops])
    for g, (_, _, want, scale) in zip(got, ops):
        assert np.all(np.abs(np.asarray(g) - want) <= 1e-5 * scale + 1e-6)


def test_a_failed_build_leaves_the_kernels_off(monkeypatch, tmp_path):
    # A compiler that fails: digest() is None (logged), and nothing is left in the cache.
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        pytest.skip("the kernels build on x86-64 Linux only")
    fake = tmp_path / "cxx"
    fake.write_text("#!/bin/sh\necho broken >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(cpu_kernels, "_cpu_flags",
                        lambda: set(cpu_kernels.REQUIRED_CPU_FLAGS))
    assert cpu_kernels.digest() is None
    assert not (tmp_path / "cache" / "cpu_kernels").exists() or \
        not any((tmp_path / "cache" / "cpu_kernels").iterdir())


def attention_reference(q, k, v, layer, table, pos, Z, window, softcap):
    """Each tile's queries over its row's visible keys, in float64."""
    Nt, K, G, H = q.shape
    out = np.zeros(q.shape)
    for t in range(Nt):
        if pos[t] < 0:
            continue
        start = max(0, pos[t] - window + 1) if window else 0
        p = np.arange(start, pos[t] + 1)
        slots = table[t][(p // Z) % table.shape[1]] * Z + p % Z
        kk, vv = k[layer, slots].astype(np.float64), v[layer, slots].astype(np.float64)
        s = np.einsum("kgh,skh->kgs", q[t].astype(np.float64), kk)
        if softcap:
            s = softcap * np.tanh(s / softcap)
        w = np.exp(s - s.max(-1, keepdims=True))
        out[t] = np.einsum("kgs,skh->kgh", w / w.sum(-1, keepdims=True), vv)
    return out


# (kv heads, queries per kv head, head_dim, page size, window, softcap): SmolLM2's decode
# (3 x 3, 64), Gemma-like one kv head with a softcap, a window, 256 head dims, 5 queries a kv
# head (a group of four and one), pages larger than a group of 16 keys.
ATTENTION_CASES = [(3, 3, 64, 16, None, None), (1, 4, 128, 8, None, 30.0),
                   (2, 2, 32, 4, 10, None), (4, 1, 256, 32, None, None),
                   (2, 5, 64, 16, 21, None), (1, 3, 256, 4, None, 12.0)]


@needs_kernels
@pytest.mark.parametrize("pool", ["bf16 bits", "float32", "int8 codes", "fp8 codes"])
@pytest.mark.parametrize("K,G,H,Z,window,softcap", ATTENTION_CASES)
def test_decode_attention_matches_a_float64_reference(pool, K, G, H, Z, window, softcap):
    """Shuffled pages, NaN in every slot no query may see (in a pool of codes, its scales), an
    empty tile (position -1), a row at its first key, one at the last slot of its table, and
    rows past the table (a ring: logical page j is entry j % M); tiles in another order than
    their tokens and rows, a tile of no token and one of no row (both ignored), and tokens of
    no tile (zeros). Tolerance 1e-5 absolute: float32 products, sums and exponentials against
    float64 over the same keys and values (a pool's codes times their scales) and the
    queries times the scale in float32."""
    rng = np.random.default_rng(K * 100 + G * 10 + Z)
    L, P, M, layer = 3, 40, 12, 1
    pos = np.array([0, 5, Z * M - 1, -1, 37 % (Z * M), Z, Z * M + 3, 3, 4], np.int32)
    Nt, T, B = len(pos), len(pos) + 2, len(pos) + 1
    token = rng.permutation(T)[:Nt].astype(np.int32)
    row = rng.permutation(B)[:Nt].astype(np.int32)
    token[-2], row[-1] = T, B          # the last two tiles: no token, no row
    live = (pos >= 0) & (token < T) & (row < B)
    k = rng.normal(size=(L, P * Z, K, H)).astype(np.float32)
    v = rng.normal(size=(L, P * Z, K, H)).astype(np.float32)
    if pool == "bf16 bits":
        k, v = (np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32)) for a in (k, v))
    codes = {"int8 codes": jnp.int8, "fp8 codes": jnp.float8_e4m3fn}.get(pool)
    if codes is not None:
        quantized = [quantize_kv(jnp.asarray(a), codes) for a in (k, v)]
        k, v = (np.asarray(a.codes.astype(jnp.float32), np.float64)
                * np.asarray(a.scale, np.float64)[..., None] for a in quantized)
    tables = np.stack([rng.permutation(P)[:M] for _ in range(B)]).astype(np.int32)
    table = tables[np.minimum(row, B - 1)]                                 # each tile's
    seen = np.zeros(P * Z, bool)
    for t in np.flatnonzero(live):
        p = np.arange(max(0, pos[t] - window + 1) if window else 0, pos[t] + 1)
        seen[table[t][(p // Z) % M] * Z + p % Z] = True
    kn, vn = k.copy(), v.copy()
    kn[layer][~seen] = np.nan
    vn[layer][~seen] = np.nan
    q = rng.normal(size=(T, K, G, H)).astype(np.float32)
    scale = np.float32(0.7 * H ** -0.5)
    tile_pos = np.where(live, pos, -1)
    per_tile = attention_reference(q[np.minimum(token, T - 1)] * scale, k, v, layer, table,
                                   tile_pos, Z, window, softcap)
    want = np.zeros(q.shape)
    want[token[live]] = per_tile[live]
    if pool == "bf16 bits":
        kp, vp = (Bits16KV(bits=Bits16KV.encode(jnp.asarray(a), "bfloat16")) for a in (kn, vn))
    elif codes is not None:
        def unseen_scales_nan(a):
            scale = np.array(a.scale)
            scale[layer][~seen] = np.nan
            return QuantizedKV(codes=a.codes, scale=jnp.asarray(scale))
        kp, vp = (unseen_scales_nan(a) for a in quantized)
    else:
        kp, vp = jnp.asarray(kn), jnp.asarray(vn)
    assert cpu_kernels.attention_supports(kp, K * G)
    fn = jax.jit(lambda *a: cpu_kernels.decode_attention(
        *a, page_size=Z, scale=float(scale), sliding_window=window, softcap=softcap))
    got = np.asarray(fn(jnp.asarray(q), kp, vp, jnp.int32(layer), jnp.asarray(tables),
                        jnp.asarray(token), jnp.asarray(row), jnp.asarray(pos)))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    named = np.zeros(T, bool)
    named[token[live]] = True
    assert (got[~named] == 0).all()


def test_decode_attention_supports_only_what_it_reads():
    bits = lambda shape, dtype: Bits16KV(bits=jnp.zeros(shape, jnp.uint16),  # noqa: E731
                                         float_dtype=dtype)
    assert cpu_kernels.attention_supports(bits((1, 16, 3, 64), "bfloat16"), 9)
    assert not cpu_kernels.attention_supports(bits((1, 16, 3, 64), "float16"), 9)
    assert cpu_kernels.attention_supports(jnp.zeros((1, 16, 2, 128)), 8)
    assert not cpu_kernels.attention_supports(jnp.zeros((1, 16, 2, 128), jnp.bfloat16), 8)
    assert not cpu_kernels.attention_supports(jnp.zeros((1, 16, 2, 96)), 8)   # head_dim 96
    assert not cpu_kernels.attention_supports(jnp.zeros((1, 16, 8, 64)), 128)  # 128 heads
    codes = lambda dtype: QuantizedKV(codes=jnp.zeros((1, 16, 3, 64), dtype),  # noqa: E731
                                      scale=jnp.ones((1, 16, 3)))
    assert cpu_kernels.attention_supports(codes(jnp.int8), 9)
    assert cpu_kernels.attention_supports(codes(jnp.float8_e4m3fn), 9)
    assert not cpu_kernels.attention_supports(codes(jnp.float8_e5m2), 9)


@needs_kernels
def test_decode_attention_reads_every_fp8_code_exactly():
    """Each of the 256 float8 e4m3fn codes as a value with scale 1, under a single visible key
    (its probability is exactly 1): the output is the code's value as float32, exactly as
    jnp converts it (subnormals and NaN included; -0 reads as 0)."""
    L, K, G, H, Z = 1, 1, 1, 32, 4
    Nt = 256 // H                                   # one tile per 32 codes, each its own row
    every = np.arange(256, dtype=np.uint8).reshape(Nt, H)
    v_codes = np.zeros((L, Nt * Z, K, H), np.uint8)
    v_codes[0, ::Z, 0] = every                      # slot 0 of page t holds codes 32t..32t+31
    v = QuantizedKV(codes=jnp.asarray(v_codes).view(jnp.float8_e4m3fn),
                    scale=jnp.ones((L, Nt * Z, K)))
    k = QuantizedKV(codes=jnp.zeros((L, Nt * Z, K, H), jnp.float8_e4m3fn),
                    scale=jnp.ones((L, Nt * Z, K)))
    tables = np.arange(Nt, dtype=np.int32)[:, None]
    ar = jnp.arange(Nt, dtype=jnp.int32)
    got = cpu_kernels.decode_attention(
        jnp.ones((Nt, K, G, H), jnp.float32), k, v, jnp.int32(0), jnp.asarray(tables), ar, ar,
        jnp.zeros(Nt, jnp.int32), page_size=Z, scale=1.0)
    want = jnp.asarray(every).view(jnp.float8_e4m3fn).astype(jnp.float32)
    # Values, not bits: the weighted sum starts from +0, so the code -0 comes out as +0.
    np.testing.assert_array_equal(np.asarray(got).reshape(Nt, H), np.asarray(want))


@needs_kernels
@pytest.mark.parametrize("pool", ["bf16 bits", "float32"])
def test_decode_attention_writing_equals_xla_write_then_attention(pool):
    """decode_attention_writing: the pools afterwards equal XLA's scatter of the new keys and
    values (astype's rounding to bf16) bit for bit, untouched elsewhere, a slot past the pool
    dropped; its output is the float64 reference attention over those pools."""
    rng = np.random.default_rng(7)
    L, P, Z, K, G, H, M, layer = 2, 12, 8, 3, 3, 64, 4, 1
    T, B = 5, 4
    k = rng.normal(size=(L, P * Z, K, H)).astype(np.float32)
    v = rng.normal(size=(L, P * Z, K, H)).astype(np.float32)
    tables = np.stack([rng.permutation(P)[:M] for _ in range(B)]).astype(np.int32)
    lengths = np.array([3, 9, 0, 17], np.int32)           # each row's keys before the step
    # Tokens 0-3 are rows 3, 0, 2, 1 at their next positions; token 4 is padding (no slot).
    rows = np.array([3, 0, 2, 1, B], np.int32)
    pos = np.where(rows < B, lengths[np.minimum(rows, B - 1)], -1).astype(np.int32)
    slots = np.where(rows < B, tables[np.minimum(rows, B - 1), pos // Z] * Z + pos % Z, P * Z)
    k_new = rng.normal(size=(T, K, H)).astype(np.float32)
    v_new = rng.normal(size=(T, K, H)).astype(np.float32)
    q = rng.normal(size=(T, K, G, H)).astype(np.float32)
    wrap = ((lambda a: Bits16KV(bits=Bits16KV.encode(jnp.asarray(a), "bfloat16")))
            if pool == "bf16 bits" else jnp.asarray)
    token = np.arange(T, dtype=np.int32)
    kw = dict(page_size=Z, scale=H ** -0.5)
    common = lambda kp, vp: (kp, vp, jnp.int32(layer), jnp.asarray(tables), jnp.asarray(token),  # noqa: E731
                             jnp.asarray(rows), jnp.asarray(pos))
    out, kw_pool, vw_pool = jax.jit(lambda q, kn, vn, s, kp, vp: cpu_kernels.decode_attention_writing(
        q, kn, vn, s, *common(kp, vp), **kw))(q, k_new, v_new, jnp.asarray(slots, jnp.int32),
                                              wrap(k), wrap(v))
    write = lambda a, new: PagedKVCache.write_layer(a, layer, jnp.asarray(new),  # noqa: E731
                                                    jnp.asarray(slots, jnp.int32))
    k_want, v_want = write(wrap(k), k_new), write(wrap(v), v_new)
    leaves = lambda a: np.asarray(jax.tree.leaves(a)[0])  # noqa: E731
    np.testing.assert_array_equal(leaves(kw_pool), leaves(k_want))
    np.testing.assert_array_equal(leaves(vw_pool), leaves(v_want))
    # The attention over the written pools, against the float64 reference (tolerance as in
    # test_decode_attention_matches_a_float64_reference).
    k64, v64 = (np.asarray(jax.tree.leaves(a)[0]) for a in (k_want, v_want))
    if pool == "bf16 bits":
        k64, v64 = (np.asarray(Bits16KV(bits=jnp.asarray(a)).dequantize(jnp.float32))
                    for a in (k64, v64))
    live = rows < B
    want = attention_reference(q * np.float32(H ** -0.5), k64, v64, layer,
                               tables[np.minimum(rows, B - 1)], np.where(live, pos, -1), Z,
                               None, None)
    np.testing.assert_allclose(np.asarray(out)[live], want[live], rtol=0, atol=1e-5)
    assert (np.asarray(out)[~live] == 0).all()
    assert cpu_kernels.writing_supports(wrap(k))
    assert not cpu_kernels.writing_supports(quantize_kv(jnp.asarray(k), jnp.int8))


def argmax_rows(V: int, seed: int = 0) -> np.ndarray:
    """12 rows of V float32 values: random ones, and rows with ties, -inf, NaN and +inf where
    the first index of the maximum (NaN counting as the maximum) must win."""
    rng = np.random.default_rng(seed + V)
    x = rng.standard_normal((12, V)).astype(np.float32)
    x[3] = -np.inf                                  # nothing beats -inf: index 0
    x[6] = 1.0                                      # all equal: index 0
    if V > 2:
        x[1, [0, V - 1]] = 9.0                      # a tie, first and last entries
        x[2, [V // 3, (V // 3 + 16) % V]] = 9.0     # a tie 16 apart (one lane, two blocks)
        x[4, [V // 2, V - 2]] = np.nan              # NaN wins, the first one
        x[5, V - 1] = 50.0                          # the maximum in the last (partial) block
        x[7, :] = -np.inf
        x[7, V - 1] = -1e30                         # the only finite entry is the last
        x[8, [1, V - 1]] = [np.inf, np.nan]         # +inf before a NaN: the NaN wins
        x[9, [V - 2, 2]] = np.inf                   # two +inf: the first
        x[10, 1:] = -np.inf                         # the maximum first, -inf after it
        x[10, 0] = -5.0
        x[11, [V - 1, V - 2]] = -0.0, 0.0           # -0.0 == 0.0: the first of them
        x[11, :V - 2] = -1.0
    return x


@needs_kernels
@pytest.mark.parametrize("V", [1, 5, 16, 17, 64, 100, 1000, 49152])
def test_argmax_equals_numpy(V):
    """cpu_kernels.argmax against numpy's argmax, exactly: the first index of each row's
    maximum, NaN counting as the maximum; leading axes, and under vmap."""
    x = argmax_rows(V)
    f = jax.jit(cpu_kernels.argmax)
    got = f(jnp.asarray(x))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.argmax(x, axis=-1))
    x3 = x.reshape(3, 4, V)
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x3))), np.argmax(x3, axis=-1))
    np.testing.assert_array_equal(np.asarray(jax.vmap(f)(jnp.asarray(x3))),
                                  np.argmax(x3, axis=-1))


@needs_kernels
@pytest.mark.parametrize("V", [1, 2, 17, 1000, 49152])
def test_sort_descending_equals_numpy(V):
    """cpu_kernels.sort_descending against numpy's stable argsort of -x, exactly: descending
    values, equal values (many ties, -0.0 with 0.0) in index order, +inf first, -inf before the
    NaNs, NaN last; the sorted values bit for bit; leading axes, and under vmap."""
    rng = np.random.default_rng(V)
    x = rng.integers(-3, 4, (6, V)).astype(np.float32)  # ties
    x[1] = rng.standard_normal(V)
    special = rng.random((6, V))
    x[special < 0.05] = np.inf
    x[(special >= 0.05) & (special < 0.1)] = -np.inf
    x[(special >= 0.1) & (special < 0.15)] = np.nan
    x[(special >= 0.15) & (special < 0.2)] = -0.0
    # numpy's stable argsort of -x: NaN last, -0.0 equal to 0.0.
    want = np.argsort(-x, axis=-1, kind="stable")
    f = jax.jit(cpu_kernels.sort_descending)
    values, order = f(jnp.asarray(x))
    assert order.dtype == jnp.int32 and values.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(order), want)
    np.testing.assert_array_equal(np.asarray(values).view(np.uint32),
                                  np.take_along_axis(x, want, -1).view(np.uint32))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: jnp.argsort(-x, axis=-1))(x)),
                                  want)  # the order jnp gives too
    x3 = x.reshape(2, 3, V)
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x3))[1]), want.reshape(2, 3, V))
    np.testing.assert_array_equal(np.asarray(jax.vmap(f)(jnp.asarray(x3))[1]),
                                  want.reshape(2, 3, V))


@needs_kernels
@pytest.mark.parametrize("V", [1, 15, 17, 1000, 49152])
def test_top_descending_is_the_sorts_first_k(V):
    """cpu_kernels.top_k(x, k) against numpy's stable argsort of -x cut to k, exactly
    (as sort_descending: ties in index order, +inf first, NaN last, -0.0 equal to 0.0), for k
    of 1, inside and at the edge of a bucket of its histogram, and V; rows of ties, of one value,
    of specials and of many values in the top buckets; leading axes and vmap."""
    rng = np.random.default_rng(V)
    x = rng.integers(-3, 4, (6, V)).astype(np.float32)  # ties
    x[1] = rng.standard_normal(V)
    x[2] = 1.5  # one value throughout: every key in one bucket
    x[3] = rng.standard_normal(V) * 1e-3 + 7.0  # all in one or two buckets
    special = rng.random(V)
    x[4] = rng.standard_normal(V)
    x[4, special < 0.05] = np.inf
    x[4, (special >= 0.05) & (special < 0.1)] = -np.inf
    x[4, (special >= 0.1) & (special < 0.15)] = np.nan
    x[4, (special >= 0.15) & (special < 0.2)] = -0.0
    x[5, : V // 2] = np.nan
    want = np.argsort(-x, axis=-1, kind="stable")
    for k in sorted({1, min(7, V), min(256, V), V}):
        values, order = jax.jit(cpu_kernels.top_k, static_argnums=1)(jnp.asarray(x), k)
        assert order.shape == values.shape == (6, k) and order.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(order), want[:, :k])
        np.testing.assert_array_equal(np.asarray(values).view(np.uint32),
                                      np.take_along_axis(x, want[:, :k], -1).view(np.uint32))
    k = min(5, V)
    x3 = jnp.asarray(x.reshape(2, 3, V))
    np.testing.assert_array_equal(np.asarray(cpu_kernels.top_k(x3, k)[1]),
                                  want[:, :k].reshape(2, 3, k))
    np.testing.assert_array_equal(
        np.asarray(jax.vmap(lambda r: cpu_kernels.top_k(r, k))(x3)[1]),
        want[:, :k].reshape(2, 3, k))
    with pytest.raises(ValueError, match=f"k={V + 1} must be in \\[1, {V}\\]"):
        cpu_kernels.top_k(jnp.asarray(x), V + 1)


@needs_kernels
def test_decode_attention_refuses_page_ids_outside_the_pool():
    """A tile whose keys lie on a block-table entry outside [0, P) (negative, P, the largest
    int32, or reached through the ring) reads nothing and gives NaN; tiles whose pages are all
    in the pool, including one whose table has a bad entry past its keys, equal the float64
    reference over the same keys, as does the writing kernel's output."""
    rng = np.random.default_rng(11)
    L, P, Z, K, G, H, M = 1, 6, 4, 1, 2, 32, 3
    tables = np.array([[0, 1, 2],                    # in range: positions 0..9
                       [1, -1, 3],                   # page -1 at positions 4..5
                       [2, P, 3],                    # page P at positions 4..7
                       [3, 2**31 - 1, 4],            # bad entry past its keys (0..3): fine
                       [4, 5, -7]], np.int32)        # the ring reaches entry 2 at 8..13
    pos = np.array([9, 5, 7, 3, 13], np.int32)
    bad = np.array([False, True, True, False, True])
    B = T = len(pos)
    token = row = np.arange(T, dtype=np.int32)
    k = rng.normal(size=(L, P * Z, K, H)).astype(np.float32)
    v = rng.normal(size=(L, P * Z, K, H)).astype(np.float32)
    q = rng.normal(size=(T, K, G, H)).astype(np.float32)
    common = (jnp.int32(0), jnp.asarray(tables), jnp.asarray(token), jnp.asarray(row),
              jnp.asarray(pos))
    kw = dict(page_size=Z, scale=H ** -0.5)
    got = np.asarray(cpu_kernels.decode_attention(q, jnp.asarray(k), jnp.asarray(v), *common,
                                                  **kw))
    assert np.isnan(got[bad]).all()
    want = attention_reference(q * np.float32(H ** -0.5), k, v, 0,
                               np.where(bad[:, None], 0, tables), np.where(bad, -1, pos), Z,
                               None, None)
    np.testing.assert_allclose(got[~bad], want[~bad], atol=1e-5, rtol=0)
    out, _, _ = cpu_kernels.decode_attention_writing(
        q, jnp.zeros((T, K, H)), jnp.zeros((T, K, H)), jnp.full((T,), -1, jnp.int32),
        jnp.asarray(k), jnp.asarray(v), *common, **kw)
    np.testing.assert_array_equal(np.asarray(out), got)
