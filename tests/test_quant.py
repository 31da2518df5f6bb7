"""jaxinfer.quant: int4 packing, the int8 / int4 / fp8 quantizers, dequantization, matmul.

The quantizers are checked against the error bounds that follow from each scheme (computed in
float64 from the original weights), not against themselves: round to nearest on a grid of step
`scale` that covers the group puts every element within scale / 2 of a grid point; e4m3 rounding
keeps 3 mantissa bits. The packing is checked against its definition written out element by
element.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxinfer import quant
from jaxinfer.quant import QuantizedWeight

# q is rounded from the float32 quotient w / scale (or (w - offset) / scale), off the exact one
# by a few float32 ulps: at most 2^-16 of a code step for codes up to 127.
CODE_SLACK = 2.0 ** -16
# The float32 dequantization rounds q * scale + offset once (twice with float32 scales).
F32_REL = 2.0 ** -23


def weights(shape, seed=0, scale=0.05):
    """Weights like an LLM's: mostly small, a few outliers, one all-zero output channel."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * scale).astype(np.float32)
    w[rng.random(shape) < 0.01] *= 20
    w[:, 3] = 0.0 if len(shape) == 2 else w[:, 3]
    return w


def expand(a, w: QuantizedWeight):
    """A per-group array broadcast to every element of the float weight (float64)."""
    group = w.shape[w.axis] // a.shape[w.axis]
    return np.repeat(np.asarray(a, np.float64), group, axis=w.axis)


def error(w_float, qw):
    return np.abs(np.asarray(quant.dequantize(qw), np.float64) - w_float.astype(np.float64))


# -- packing --------------------------------------------------------------------------------------

@pytest.mark.parametrize("axis", [0, 1])
def test_pack_layout_and_round_trip(axis):
    rng = np.random.default_rng(1)
    shape = (64, 5) if axis == 0 else (5, 96)
    q = rng.integers(0, 16, shape, dtype=np.uint8)
    packed = quant.pack_int4(q, axis)
    assert packed.dtype == np.uint8
    assert packed.shape == ((32, 5) if axis == 0 else (5, 48))
    # The definition: in each block of 32, byte j = element j | element j + 16 << 4.
    qm, pm = (q.T, packed.T) if axis == 0 else (q, packed)
    for r in range(qm.shape[0]):
        for b in range(qm.shape[1] // 32):
            for j in range(16):
                expected = qm[r, 32 * b + j] | (qm[r, 32 * b + j + 16] << 4)
                assert pm[r, 16 * b + j] == expected
    np.testing.assert_array_equal(np.asarray(quant.unpack_int4(packed, axis)), q)
    unpacked_jit = jax.jit(quant.unpack_int4, static_argnums=1)(jnp.asarray(packed), axis)
    np.testing.assert_array_equal(np.asarray(unpacked_jit), q)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.pack_int4(np.zeros((16, 4), np.uint8), 0)
    with pytest.raises(ValueError, match="0..15"):
        quant.pack_int4(np.full((32, 4), 16), 0)


# -- quantizers -----------------------------------------------------------------------------------

@pytest.mark.parametrize("axis,group_size,scale_dtype", [
    (0, 0, np.float16), (1, 0, np.float16), (0, 32, np.float16), (1, 32, np.float32)])
def test_int8_error_within_half_a_step(axis, group_size, scale_dtype):
    w = weights((128, 96))
    qw = quant.quantize_int8(w, axis=axis, group_size=group_size, scale_dtype=scale_dtype)
    n_groups = 1 if group_size == 0 else w.shape[axis] // group_size
    assert qw.kind == "int8" and qw.q.dtype == np.int8 and qw.q.shape == w.shape
    assert qw.shape == w.shape and qw.axis == axis and qw.group_size == group_size
    assert qw.scale.dtype == scale_dtype and qw.offset is None
    assert qw.scale.shape[axis] == n_groups and qw.scale.shape[1 - axis] == w.shape[1 - axis]
    assert np.abs(qw.q).max() <= 127
    # scale = max|w| / 127, rounded up to its dtype
    amax = np.abs(w).reshape(qw.scale.shape[:axis + 1] + (-1,) + w.shape[axis + 1:]).max(axis + 1)
    ok = amax > 0
    ratio = qw.scale.astype(np.float64)[ok] / (amax[ok] / 127.0)
    assert np.all(ratio >= 1 - 2.0 ** -23) and np.all(ratio <= 1 + 2.0 ** -10)
    scale = expand(qw.scale, qw)
    assert np.all(error(w, qw) <= scale * (0.5 + CODE_SLACK) + F32_REL * np.abs(w))
    from_jax = quant.quantize_int8(jnp.asarray(w), axis=axis, group_size=group_size,
                                   scale_dtype=scale_dtype)  # jax input, same host result
    assert all(isinstance(a, np.ndarray) for a in jax.tree.leaves(from_jax))
    jax.tree.map(np.testing.assert_array_equal, from_jax, qw)


@pytest.mark.parametrize("axis,group_size", [(0, 32), (1, 64), (0, 0)])
def test_int4_asymmetric_error_within_half_a_step(axis, group_size):
    w = weights((128, 64)) + 0.3  # off-centre groups: the offset matters
    qw = quant.quantize_int4(w, axis=axis, group_size=group_size)
    n_groups = 1 if group_size == 0 else w.shape[axis] // group_size
    assert qw.kind == "int4" and qw.q.dtype == np.uint8
    expected_q = list(w.shape)
    expected_q[axis] //= 2
    assert qw.q.shape == tuple(expected_q) and qw.shape == w.shape
    assert qw.scale.shape == qw.offset.shape and qw.scale.shape[axis] == n_groups
    assert qw.scale.dtype == qw.offset.dtype == np.float16
    scale, offset = expand(qw.scale, qw), expand(qw.offset, qw)
    assert np.all(offset <= w)  # the offset is the group minimum, rounded down
    assert np.all(error(w, qw) <= scale * (0.5 + CODE_SLACK) + F32_REL * np.abs(w))


def test_int4_symmetric():
    w = weights((64, 48))
    qw = quant.quantize_int4(w, axis=0, group_size=32, symmetric=True)
    codes = np.asarray(quant.unpack_int4(qw.q, 0)).astype(int) - 8
    assert codes.min() >= -7 and codes.max() <= 7
    np.testing.assert_array_equal(qw.offset, qw.scale * np.float16(-8))
    assert np.all(codes[w == 0] == 0)
    scale = expand(qw.scale, qw)
    assert np.all(error(w, qw) <= scale * (0.5 + CODE_SLACK) + F32_REL * np.abs(w))


def test_zero_tiny_and_constant_groups():
    w = np.zeros((64, 4), np.float32)
    w[:, 1] = 3e-7        # float16 scales are subnormal here
    w[:32, 2] = 0.1       # a constant group that float16 cannot hold exactly
    w[32:, 2] = -7.5
    w[:, 3] = np.linspace(-1e-6, 2e-6, 64)
    for qw in (quant.quantize_int8(w, group_size=32), quant.quantize_int4(w),
               quant.quantize_int4(w, symmetric=True), quant.quantize_fp8(w)):
        deq = np.asarray(quant.dequantize(qw))
        assert np.all(np.isfinite(deq)), qw.kind
        assert np.all(deq[:, 0] == 0), qw.kind  # an all-zero group: scale 0, value exactly 0
        if qw.kind != "fp8":
            scale = expand(qw.scale, qw)
            assert np.all(error(w, qw) <= scale * (0.5 + CODE_SLACK) + F32_REL * np.abs(w))


def test_fp8_relative_error():
    w = weights((96, 40))
    w[:, 5] *= 1e-3  # per-channel scales: a small channel keeps its precision
    qw = quant.quantize_fp8(w, axis=0)
    assert qw.kind == "fp8" and qw.q.dtype == ml_dtypes.float8_e4m3fn and qw.q.shape == w.shape
    assert qw.scale.shape == (1, 40) and qw.offset is None and qw.group_size == 0
    assert not np.any(np.isnan(qw.q.astype(np.float32)))
    scale = expand(qw.scale, qw)
    codes = np.divide(np.abs(w), scale, out=np.zeros(w.shape), where=scale > 0)
    # e4m3: 3 mantissa bits, so round to nearest is within 2^-4 relative for normal codes
    # (|code| >= 2^-6) and within half the subnormal step 2^-9 below them.
    bound = np.where(codes >= 2.0 ** -6, 2.0 ** -4 * np.abs(w), 2.0 ** -10 * scale)
    assert np.all(error(w, qw) <= bound * (1 + 2.0 ** -20) + F32_REL * np.abs(w))
    assert codes.max() <= 448


def test_quantizer_errors():
    w = np.ones((96, 8), np.float32)
    with pytest.raises(ValueError, match="groups of 64"):
        quant.quantize_int8(w, group_size=64)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize_int4(w, group_size=48)
    with pytest.raises(ValueError, match="not finite"):
        quant.quantize_int8(np.full((32, 2), 1e7, np.float32))  # 1e7 / 127 > float16 max
    with pytest.raises(ValueError, match="2-D"):
        quant.quantize_int8(np.ones(32, np.float32))


# -- the QuantizedWeight pytree -------------------------------------------------------------------

def test_nbytes():
    w = weights((256, 64))
    assert quant.nbytes(quant.quantize_int4(w, group_size=32)) == 128 * 64 + 2 * (8 * 64 * 2)
    assert quant.nbytes(quant.quantize_int8(w)) == 256 * 64 + 64 * 2
    assert quant.nbytes(quant.quantize_fp8(w, axis=1)) == 256 * 64 + 256 * 2


@pytest.mark.parametrize("kind,axis", [("int8", 0), ("int4", 0), ("int4", 1), ("fp8", 1)])
def test_take_out_reorders_output_channels(kind, axis):
    w = weights((64, 96))
    qw = {"int8": lambda: quant.quantize_int8(w, axis, group_size=32),
          "int4": lambda: quant.quantize_int4(w, axis),
          "fp8": lambda: quant.quantize_fp8(w, axis)}[kind]()
    index = np.random.default_rng(2).permutation(w.shape[1 - axis])
    full = np.asarray(quant.dequantize(qw))
    expected = full[:, index] if axis == 0 else full[index]
    for tree in (qw, jax.tree.map(jnp.asarray, qw)):  # host and device arrays
        moved = quant.take_out(tree, index)
        assert type(moved.q) is type(tree.q)
        np.testing.assert_array_equal(np.asarray(quant.dequantize(moved)), expected)


def reference_dequantize(qw: QuantizedWeight) -> np.ndarray:
    """The value of every element from the format's definition, element by element: the
    code (int4: element e of a 32-element block sits in byte e % 16 of the block's 16 bytes,
    low nibble for e < 16), times its group's scale, plus its group's offset, in float64.
    q * scale is exact (at most 8 + 11 significant bits) and so is the sum, so this rounded
    once to float32 is the correctly rounded value the float32 dequantization must give."""
    a = qw.axis
    shape = qw.shape
    q = np.asarray(qw.q)
    if qw.kind == "fp8":
        codes = q.astype(np.float64)
    else:
        codes = np.empty(shape, np.float64)
        for idx in np.ndindex(*shape):
            e = idx[a]
            if qw.kind == "int4":
                byte_idx = list(idx)
                byte_idx[a] = (e // 32) * 16 + e % 16
                byte = int(q[tuple(byte_idx)])
                codes[idx] = (byte >> 4) if e % 32 >= 16 else (byte & 0x0F)
            else:
                codes[idx] = q[idx]
    group = shape[a] // qw.scale.shape[a]
    per_element = lambda g: np.repeat(np.asarray(g, np.float64), group, axis=a)  # noqa: E731
    value = codes * per_element(qw.scale)
    if qw.offset is not None:
        value = value + per_element(qw.offset)
    return value.astype(np.float32)


def test_dequantize_equals_the_format_definition():
    """dequantize (eager and jitted) and dequantize_host against reference_dequantize, bit for
    bit, for every kind, both grouped axes, one group and several; the bfloat16 output is
    that float32 value rounded to bfloat16."""
    w = weights((128, 64)) + 0.1
    for qw in (quant.quantize_int4(w, 0, 64), quant.quantize_int8(w, 1, 32),
               quant.quantize_int8(w, 0), quant.quantize_fp8(w, 0),
               quant.quantize_int4(w, 1, 32, symmetric=True)):
        want = reference_dequantize(qw)
        for got in (quant.dequantize(qw), jax.jit(quant.dequantize)(qw),
                    quant.dequantize_host(qw)):
            np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))
        bf16 = jax.jit(quant.dequantize, static_argnums=1)(qw, jnp.bfloat16)
        assert bf16.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(bf16), want.astype(jnp.bfloat16))


def test_pytree_and_logical_axes():
    w = weights((64, 96))
    per_group = quant.quantize_int4(w, axis=0, group_size=32)
    per_channel = quant.quantize_int8(w, axis=0)
    assert len(jax.tree.leaves(per_group)) == 3 and len(jax.tree.leaves(per_channel)) == 2
    axes = quant.logical_axes(per_group, ("embed", "q_heads"))
    assert (axes.q, axes.scale, axes.offset) == (("embed", "q_heads"),) * 3
    axes = quant.logical_axes(per_channel, ("embed", "q_heads"))
    assert axes.q == ("embed", "q_heads") and axes.scale == (None, "q_heads")
    assert axes.offset is None
    # The axes tree lines up leaf for leaf with the weight, as jax.tree.map needs.
    pairs = jax.tree.map(lambda a, ax: (a.shape, ax), per_channel, axes,
                         is_leaf=lambda x: isinstance(x, tuple))
    assert pairs.scale == ((1, 96), (None, "q_heads"))
    with pytest.raises(ValueError, match="do not match"):
        quant.logical_axes(per_group, ("embed",))


@pytest.mark.parametrize("tile_elements", [1 << 30, 64 * 24])   # one tile | 8 tiles
def test_matmul_equals_dense_product_of_the_dequantized_weight(monkeypatch, tile_elements):
    """matmul's per-tile dequantization (CPU) and its one-shot paths compute the same product
    as an einsum with the dequantized weight, for every kind and both orientations (linear
    [in, out] grouped on axis 0, the tied head [V, D] on axis 1). float32: the tiles' dots
    sum in another order, so equal to a few ulps of the result's magnitude (rtol 1e-5)."""
    from jaxinfer import backends
    from jaxinfer.backends import products

    monkeypatch.setattr(products, "TILE_ELEMENTS", tile_elements)
    monkeypatch.setattr(products, "TILE_ELEMENTS_ONE_BUFFER", tile_elements)
    backend = backends.default()
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    w = weights((64, 192))
    cases = [(quant.quantize_int8(w, 0), "ni,io->no"),
             (quant.quantize_int8(w, 0, 32), "ni,io->no"),
             (quant.quantize_int4(w, 0, 32), "ni,io->no"),
             (quant.quantize_int4(w, 0, 64), "ni,io->no"),
             (quant.quantize_fp8(w, 0), "ni,io->no"),
             (quant.quantize_int8(w.T, 1), "nd,vd->nv"),
             (quant.quantize_int8(w.T, 1, 32), "nd,vd->nv"),
             (quant.quantize_int4(w.T, 1, 32, symmetric=True), "nd,vd->nv")]
    for qw, spec in cases:
        got = jax.jit(lambda x, qw: quant.matmul(x, qw, spec, backend))(x, qw)
        want = jnp.einsum(spec, x, quant.dequantize(qw), precision="highest")
        assert got.shape == want.shape == (3, 192)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                                   atol=1e-5 * float(jnp.max(jnp.abs(want))))
    if tile_elements < 64 * 192:
        assert quant.compute._tile((64, 192), 1, tile_elements) == 24
        assert quant.compute._tile((192, 64), 0, tile_elements) == 24


def test_fp8_decoded_from_raw_bytes_exactly():
    """The integer decode matmul uses on CPU gives ml_dtypes' value for every e4m3fn byte
    (the two NaN codes aside), subnormals and signed zeros included."""
    b = np.arange(256, dtype=np.uint8)
    want = b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(jax.jit(quant.compute._fp8_from_bits)(jnp.asarray(b)))
    finite = ~np.isnan(want)
    assert finite.sum() == 254
    np.testing.assert_array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))


def test_fp8_weights_times_fp8_activations(monkeypatch):
    """The GPU path for fp8 weights (forced here on CPU, where XLA runs fp8 dots too): one
    fp8 x fp8 dot with x quantized per token. Its only error against the dequantized weight's
    product is x's e4m3 rounding, |x - x_hat| <= 2^-4 |x| (or 2^-10 of the token's scale below
    e4m3's normal range), so |y - x @ W| <= (2^-4 |x| + 2^-10 s) @ |W| (+ float32 slack)."""
    import dataclasses

    from jaxinfer import backends

    backend = dataclasses.replace(backends.default(), platform="gpu", kernels=None,
                                  batch_invariant=False)
    assert backend.fp8_activations
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    x[1] *= 1e-3                     # tokens of very different magnitude
    x[2] = 0.0                       # an all-zero token
    w = weights((64, 48))
    for qw, spec in [(quant.quantize_fp8(w, 0), "ni,io->no"),
                     (quant.quantize_fp8(w.T, 1), "nd,vd->nv")]:
        f = jax.jit(lambda x, qw: quant.matmul(x, qw, spec, backend))
        assert "f8E4M3FN" in f.lower(jnp.asarray(x), qw).as_text().split("dot_general")[1][:200]
        got = np.asarray(f(jnp.asarray(x), qw), np.float64)
        wd = np.asarray(quant.dequantize(qw), np.float64)
        wd = wd if spec == "ni,io->no" else wd.T
        want = x.astype(np.float64) @ wd
        s = np.abs(x).max(-1, keepdims=True) / quant.FP8_MAX
        bound = (2.0 ** -4 * np.abs(x) + 2.0 ** -10 * s) @ np.abs(wd)
        assert (np.abs(got - want) <= bound * (1 + 1e-5) + 1e-6).all()
        assert (got[2] == 0).all()
    grouped = quant.quantize_int4(w, 0, 32).replace(kind="fp8")
    with pytest.raises(ValueError, match="per-channel symmetric fp8 weight"):
        quant.matmul(jnp.asarray(x), grouped, "ni,io->no", backend)
