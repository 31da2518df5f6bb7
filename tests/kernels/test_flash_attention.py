"""Flash-attention kernel vs its pure-jnp reference vs an independent float64 numpy attention.

TestFlashAttentionKernel runs twice: in Pallas interpret mode on CPU (default suite, small shapes)
and compiled through Triton on GPU (marked gpu, larger shapes). Every case checks
kernel == reference within the dtype tolerance below and reference == numpy float64.

Tolerances (max abs error, plus the same relative term):
  float32  1e-5     bfloat16  2e-2     float16  2e-3

Quantized K/V (int8 / float8_e4m3fn codes with per-(token, kv head) float32 scales): the kernel on
codes + scales == the reference on the same codes + scales (the dtype tolerance above; scales past
kv_lengths are NaN for the kernel, so dequantization must come before the mask), the reference ==
numpy on the dequantized values, and the quantization error against float attention on the
unquantized K/V stays under a stated bound (test_quantization_error_bound).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention import (BLOCK_SIZES, default_block_sizes, flash_attention,
                                            flash_attention_reference)

ON_GPU = jax.default_backend() == "gpu"
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-3}

reference = jax.jit(flash_attention_reference,
                    static_argnames=("causal", "sliding_window", "softcap", "sm_scale"))


def naive_attention(q, k, v, *, causal=True, q_offset=None, kv_lengths=None, sliding_window=None,
                    softcap=None, sm_scale=None):
    """Row by row, head by head, in float64."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    scale = H ** -0.5 if sm_scale is None else sm_scale
    q_offset = np.zeros(B, np.int64) if q_offset is None else np.asarray(q_offset, np.int64)
    kv_lengths = np.full(B, S, np.int64) if kv_lengths is None else np.asarray(kv_lengths)
    out = np.zeros((B, T, N, H))
    for b in range(B):
        for t in range(T):
            pos = q_offset[b] + t
            keys = [j for j in range(S)
                    if j < kv_lengths[b]
                    and (not causal or j <= pos)
                    and (sliding_window is None or j > pos - sliding_window)]
            if not keys:
                continue
            for n in range(N):
                logits = k[b, keys, n // G] @ q[b, t, n] * scale
                if softcap is not None:
                    logits = softcap * np.tanh(logits / softcap)
                w = np.exp(logits - logits.max())
                out[b, t, n] = (w / w.sum()) @ v[b, keys, n // G]
    return out


def make_qkv(seed, B, T, S, N, K, H, dtype, spread=1.0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, N, H)) * spread
    k = rng.standard_normal((B, S, K, H)) * spread
    v = rng.standard_normal((B, S, K, H))
    return tuple(jnp.asarray(x, jnp.float32).astype(dtype) for x in (q, k, v))


def i32(x):
    return None if x is None else jnp.asarray(x, jnp.int32)


def assert_close(actual, expected, dtype, what):
    tol = TOL[dtype]
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    assert np.isfinite(actual).all(), f"{what}: non-finite values"
    np.testing.assert_allclose(actual, expected, atol=tol, rtol=tol, err_msg=what)


def quantize(x, kind):
    """Symmetric per-(token, head) quantization of float x [..., H] -> (codes [..., H], float32
    scales [...]). int8: scale = amax / 127, codes = clip(round(x / scale), -127, 127); fp8: scale
    = amax / 448 (the largest finite float8_e4m3fn), codes = (x / scale) cast to float8_e4m3fn."""
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float32)
    scale = np.abs(x).max(axis=-1) / (127.0 if kind == "int8" else 448.0)
    y = x / np.where(scale > 0, scale, 1.0)[..., None]
    if kind == "int8":
        codes = jnp.asarray(np.clip(np.round(y), -127, 127).astype(np.int8))
    else:
        codes = jnp.asarray(y).astype(jnp.float8_e4m3fn)
    return codes, jnp.asarray(scale, jnp.float32)


def dequantize(codes, scale):
    return jnp.asarray(codes).astype(jnp.float32) * jnp.asarray(scale)[..., None]


@dataclasses.dataclass(frozen=True)
class Mode:
    interpret: bool
    blocks: tuple          # (block_q, block_k) settings swept
    L: int                 # a typical sequence length (not a block multiple)


INTERPRET = Mode(interpret=True, blocks=((16, 16), (32, 16)), L=37)
COMPILED = Mode(interpret=False, blocks=((64, 64), (32, 128)), L=301)
MODES = [
    pytest.param(INTERPRET, id="interpret"),
    pytest.param(COMPILED, id="compiled",
                 marks=[pytest.mark.gpu,
                        pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend")]),
]
BLOCK_INDEX = [0, 1]   # which of Mode.blocks a test uses


def check(mode, *, B=2, T, S, N=4, K=2, H=64, dtype=jnp.float32, blocks=None, seed=0,
          spread=1.0, **kw):
    """Kernel vs reference (dtype tolerance), reference vs numpy float64; returns the kernel
    output."""
    q, k, v = make_qkv(seed, B, T, S, N, K, H, dtype, spread)
    kw = {name: (i32(x) if name in ("q_offset", "kv_lengths") else x) for name, x in kw.items()}
    bq, bk = blocks if blocks is not None else (None, None)
    out = flash_attention(q, k, v, interpret=mode.interpret, block_q=bq, block_k=bk, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = reference(q, k, v, **kw)
    assert_close(out, ref, dtype, "kernel vs reference")
    assert_close(ref, naive_attention(q, k, v, **kw), dtype, "reference vs numpy float64")
    return out


def check_quantized(mode, kind, *, B=2, T, S, N=4, K=2, H=64, dtype=jnp.float32, blocks=None,
                    seed=0, kv_lengths=None, **kw):
    """Quantized K/V: kernel on codes + scales vs the reference on the same (dtype tolerance),
    reference vs numpy float64 on the dequantized K/V. Scales at or past kv_lengths are NaN for
    the kernel (a fresh cache slot) and 1 for the reference."""
    q, k, v = make_qkv(seed, B, T, S, N, K, H, jnp.float32)
    q = q.astype(dtype)
    (kc, ks), (vc, vs) = quantize(k, kind), quantize(v, kind)
    kv_lengths = [S] * B if kv_lengths is None else kv_lengths
    stale = jnp.asarray(np.arange(S)[None, :, None] >= np.asarray(kv_lengths)[:, None, None])
    kw = {name: (i32(x) if name == "q_offset" else x) for name, x in kw.items()}
    kw["kv_lengths"] = i32(kv_lengths)
    bq, bk = blocks if blocks is not None else (None, None)
    out = flash_attention(q, kc, vc, interpret=mode.interpret, block_q=bq, block_k=bk,
                          k_scale=jnp.where(stale, jnp.nan, ks),
                          v_scale=jnp.where(stale, jnp.nan, vs), **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    ks, vs = jnp.where(stale, 1.0, ks), jnp.where(stale, 1.0, vs)
    ref = reference(q, kc, vc, k_scale=ks, v_scale=vs, **kw)
    assert_close(out, ref, dtype, f"{kind} kernel vs reference")
    assert_close(ref, naive_attention(q, dequantize(kc, ks), dequantize(vc, vs), **kw), dtype,
                 f"{kind} reference vs numpy float64 on the dequantized K/V")
    return out


@pytest.mark.parametrize("mode", MODES)
class TestFlashAttentionKernel:

    @pytest.mark.parametrize("bi,causal", [(0, True), (0, False), (1, True)])
    @pytest.mark.parametrize("length", ["1", "block-1", "block", "block+1", "2*block+5"])
    def test_block_boundaries(self, mode, bi, causal, length):
        bq, bk = mode.blocks[bi]
        T = eval(length, {"block": bq})
        S = eval(length, {"block": bk})
        # causal: the chunk sits at the end of the keys (q_offset = S - T, may be negative)
        check(mode, T=T, S=S, causal=causal, blocks=(bq, bk), q_offset=[S - T, max(S - T, 0)])

    # every dtype meets every head ratio (1, 3, 8) and both head dims
    @pytest.mark.parametrize("dtype,N,K,H", [
        (jnp.float32, 4, 4, 64), (jnp.float32, 6, 2, 128), (jnp.float32, 8, 1, 64),
        (jnp.bfloat16, 4, 4, 128), (jnp.bfloat16, 6, 2, 64), (jnp.bfloat16, 8, 1, 128)])
    def test_dtypes_heads(self, mode, dtype, N, K, H):
        L = mode.L
        check(mode, T=L, S=L + 5, N=N, K=K, H=H, dtype=dtype, q_offset=[5, 0],
              kv_lengths=[L + 5, L - 3], blocks=mode.blocks[0])

    @pytest.mark.parametrize("H,dtype", [(32, jnp.float32), (256, jnp.float32),
                                         (256, jnp.bfloat16), (64, jnp.float16)])
    def test_other_head_dims_and_float16(self, mode, H, dtype):
        L = mode.L
        check(mode, T=L, S=L, N=2, K=1, H=H, dtype=dtype, kv_lengths=[L, L // 2])

    def test_default_block_sizes(self, mode):
        L = mode.L
        check(mode, T=L, S=2 * L, q_offset=[L, L // 2], kv_lengths=[2 * L, L + L // 2 + 1])

    @pytest.mark.parametrize("bi", BLOCK_INDEX)
    def test_chunk_at_end_of_prefix(self, mode, bi):
        # S = q_offset + T: the chunk attends to the whole cached prefix and causally to itself.
        T, P = mode.L, mode.L + 3
        check(mode, T=T, S=P + T, q_offset=[P, P], blocks=mode.blocks[bi])

    @pytest.mark.parametrize("bi", BLOCK_INDEX)
    @pytest.mark.parametrize("causal", [True, False])
    def test_chunk_inside_longer_cache(self, mode, bi, causal):
        # S > q_offset + T: rows at different offsets, keys past each row's length are ignored.
        T = mode.L // 2
        S = 2 * mode.L + 3
        offsets = [3, S - T - 1]
        check(mode, T=T, S=S, causal=causal, q_offset=offsets,
              kv_lengths=[o + T for o in offsets], blocks=mode.blocks[bi])

    @pytest.mark.parametrize("lengths", ["0,S", "S-1,1", "bk,bk+1"])
    @pytest.mark.parametrize("causal", [True, False])
    def test_ragged_kv_lengths(self, mode, lengths, causal):
        bq, bk = mode.blocks[0]
        S = mode.L + 11
        kv = [eval(x, {"S": S, "bk": bk}) for x in lengths.split(",")]
        out = check(mode, T=mode.L, S=S, causal=causal, q_offset=[S - mode.L] * 2,
                    kv_lengths=kv, blocks=(bq, bk))
        if kv[0] == 0:
            assert not np.asarray(out[0], np.float32).any(), "a row with no keys must be zero"

    @pytest.mark.parametrize("bi,window,causal", [
        (0, w, c) for w in ("small", "large", "whole") for c in (True, False)]
        + [(1, "small", True), (1, "large", True)])
    def test_sliding_window(self, mode, bi, window, causal):
        bq, bk = mode.blocks[bi]
        T, P = mode.L, mode.L + 2
        w = {"small": bk // 2 - 1, "large": bk + 7, "whole": 4 * (P + T)}[window]
        check(mode, T=T, S=P + T + 4, causal=causal, sliding_window=w, q_offset=[P, P // 3],
              kv_lengths=[P + T, P + T + 4], blocks=(bq, bk))

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    def test_softcap_and_scale(self, mode, dtype):
        L = mode.L
        check(mode, T=L, S=L + 9, dtype=dtype, spread=3.0, softcap=5.0, q_offset=[9, 0],
              blocks=mode.blocks[1])
        check(mode, T=L, S=L, dtype=dtype, spread=2.0, softcap=2.0, sm_scale=0.05,
              sliding_window=mode.blocks[1][1] + 1, blocks=mode.blocks[1])

    def test_rows_that_see_no_key_are_zero(self, mode):
        bq, bk = mode.blocks[0]
        T = bq + 3
        # row 0: negative offset, so its first queries precede every key; row 1: no keys at all.
        q_offset, kv_lengths = [-5, 0], [T, 0]
        out = np.asarray(check(mode, T=T, S=T, q_offset=q_offset, kv_lengths=kv_lengths,
                               blocks=(bq, bk)))
        ref = np.asarray(reference(*make_qkv(0, 2, T, T, 4, 2, 64, jnp.float32),
                                   q_offset=i32(q_offset), kv_lengths=i32(kv_lengths)))
        for o in (out, ref):
            assert not o[0, :5].any() and o[0, 5:].all() and not o[1].any()

    @pytest.mark.parametrize("bi", BLOCK_INDEX)
    def test_key_blocks_outside_the_visible_range_are_not_read(self, mode, bi):
        # NaNs in a masked-but-loaded block would leak through p @ v (0 * NaN); the kernel must
        # skip, not mask, key blocks past the causal frontier, past kv_length and before the
        # window.
        bq, bk = mode.blocks[bi]
        T, S, w = bq + 3, 6 * bk, bk - 3
        q_offset = np.array([3 * bk + 5, 2 * bk, bk], np.int32)
        kv_lengths = np.array([S, 2 * bk + 7, 0], np.int32)
        q, k, v = make_qkv(1, 3, T, S, 4, 2, 64, jnp.float32)
        expected = reference(q, k, v, q_offset=i32(q_offset), kv_lengths=i32(kv_lengths),
                             sliding_window=w)
        poison = np.zeros((3, S), bool)
        for b in range(3):
            lo = max(0, int(q_offset[b]) - w + 1) // bk * bk
            hi = -(-min(int(kv_lengths[b]), int(q_offset[b]) + T) // bk) * bk
            poison[b, :lo] = poison[b, hi:] = True
        assert poison.any(axis=1).all()
        mask = jnp.asarray(poison)[:, :, None, None]
        k, v = jnp.where(mask, jnp.nan, k), jnp.where(mask, jnp.nan, v)
        out = flash_attention(q, k, v, q_offset=i32(q_offset), kv_lengths=i32(kv_lengths),
                              sliding_window=w, interpret=mode.interpret, block_q=bq, block_k=bk)
        assert_close(out, expected, jnp.float32, "kernel with poisoned skipped blocks")

    def test_lengths_are_traced_not_static(self, mode, compile_recorder):
        T, S = mode.L, 2 * mode.L
        q, k, v = make_qkv(2, 2, T, S, 4, 2, 64, jnp.float32)
        f = functools.partial(flash_attention, interpret=mode.interpret, sliding_window=T)
        f(q, k, v, q_offset=i32([0, 1]), kv_lengths=i32([S, 1])).block_until_ready()
        with compile_recorder() as rec:
            for off, kv in (([T, 3], [S, T + 1]), ([S - T, 0], [S - 1, 0])):
                off, kv = i32(off), i32(kv)
                ref = reference(q, k, v, q_offset=off, kv_lengths=kv, sliding_window=T)
                rec.clear()   # the reference may compile; the kernel must not
                out = f(q, k, v, q_offset=off, kv_lengths=kv).block_until_ready()
                assert not rec.logs and not rec.events, rec.logs
                assert_close(out, ref, jnp.float32, f"q_offset={off} kv_lengths={kv}")

    def test_inside_an_outer_jit(self, mode):
        T, S = mode.L, mode.L + 4
        q, k, v = make_qkv(3, 1, T, S, 2, 1, 32, jnp.float32)

        @jax.jit
        def g(q, k, v, off):
            return flash_attention(q, k, v, q_offset=off, softcap=3.0, interpret=mode.interpret)

        assert_close(g(q, k, v, i32([4])), reference(q, k, v, q_offset=i32([4]), softcap=3.0),
                     jnp.float32, "under jit")

    @pytest.mark.parametrize("kind", ["int8", "fp8"])
    @pytest.mark.parametrize("case", ["gqa", "window", "mqa-bf16"])
    def test_quantized_kv(self, mode, kind, case):
        L = mode.L
        if case == "gqa":          # GQA 3, chunk over a cache, ragged kv_lengths
            check_quantized(mode, kind, T=L, S=L + 5, N=6, K=2, q_offset=[5, 0],
                            kv_lengths=[L + 5, L - 3], blocks=mode.blocks[0])
        elif case == "window":     # sliding window wider than a key block
            bk = mode.blocks[1][1]
            check_quantized(mode, kind, T=L, S=L + 9, q_offset=[9, 2], kv_lengths=[L + 9, L + 1],
                            sliding_window=bk + 3, blocks=mode.blocks[1])
        else:                      # MQA, bfloat16 queries, non-causal
            check_quantized(mode, kind, T=L, S=L + 3, N=4, K=1, dtype=jnp.bfloat16,
                            causal=False, kv_lengths=[L + 3, L // 2], blocks=mode.blocks[0])


@pytest.mark.slow
@pytest.mark.parametrize("N,K,H", [(8, 1, 128), (6, 3, 64)])
def test_interpret_longer_sequences(N, K, H):
    T, S = 384, 512
    check(INTERPRET, B=2, T=T, S=S, N=N, K=K, H=H, q_offset=[S - T, 17],
          kv_lengths=[S, 17 + T], sliding_window=100, blocks=(32, 64))


@pytest.mark.parametrize("dtype,H,kw", [
    (jnp.float32, 64, dict(sliding_window=100, softcap=30.0)),
    (jnp.bfloat16, 256, dict(causal=False)),
    (jnp.bfloat16, 128, dict(sliding_window=100, kv_dtype=jnp.int8)),
    (jnp.float32, 64, dict(kv_dtype=jnp.float8_e4m3fn)),
])
def test_lowers_through_triton(dtype, H, kw):
    """The kernel body lowers through Pallas' Triton path to one Triton custom call (checked
    without a GPU by lowering for the cuda platform); kv_dtype int8 / fp8: quantized K/V with
    [B, S, K] float32 scales."""
    kw = dict(kw)
    kv_dtype = kw.pop("kv_dtype", dtype)
    q = jax.ShapeDtypeStruct((2, 300, 8, H), dtype)
    kv = jax.ShapeDtypeStruct((2, 700, 2, H), kv_dtype)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    args = (q, kv, kv, lengths, lengths)
    if kv_dtype == dtype:
        f = jax.jit(lambda q, k, v, o, n: flash_attention(q, k, v, q_offset=o, kv_lengths=n,
                                                          **kw))
    else:
        args += (jax.ShapeDtypeStruct((2, 700, 2), jnp.float32),) * 2
        f = jax.jit(lambda q, k, v, o, n, ks, vs: flash_attention(
            q, k, v, q_offset=o, kv_lengths=n, k_scale=ks, v_scale=vs, **kw))
    # The CPU jaxlib carries the CUDA/Triton lowering too: a failure here is a real one.
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


class TestReferenceVsNumpy:
    """The reference against the float64 numpy attention on its own (fast, no kernel)."""

    @pytest.mark.parametrize("causal", [True, False])
    @pytest.mark.parametrize("window", [None, 1, 6])
    @pytest.mark.parametrize("softcap", [None, 1.5])
    def test_masks(self, causal, window, softcap):
        B, T, S, N, K, H = 2, 9, 21, 6, 3, 32
        q, k, v = make_qkv(4, B, T, S, N, K, H, jnp.float32, spread=2.0)
        kw = dict(causal=causal, sliding_window=window, softcap=softcap,
                  q_offset=i32([12, -3]), kv_lengths=i32([21, 10]))
        assert_close(reference(q, k, v, **kw), naive_attention(q, k, v, **kw), jnp.float32,
                     str(kw))

    def test_defaults_and_empty(self):
        q, k, v = make_qkv(5, 1, 5, 5, 8, 1, 256, jnp.float32)
        assert_close(reference(q, k, v, sm_scale=0.3), naive_attention(q, k, v, sm_scale=0.3),
                     jnp.float32, "defaults")
        for shape_q, shape_kv in (((1, 0, 2, 32), (1, 4, 1, 32)), ((1, 3, 2, 32), (1, 0, 1, 32))):
            q = jnp.ones(shape_q)
            kv = jnp.ones(shape_kv)
            for fn in (flash_attention_reference,
                       functools.partial(flash_attention, interpret=True)):
                out = fn(q, kv, kv)
                assert out.shape == shape_q and not np.asarray(out).any()


class TestValidation:
    q = jnp.zeros((1, 4, 4, 64), jnp.float32)
    kv = jnp.zeros((1, 6, 2, 64), jnp.float32)

    @pytest.mark.parametrize("fn", ["kernel", "reference"])
    @pytest.mark.parametrize("case", [
        "rank_q", "rank_k", "dtype_int", "dtype_f64", "dtype_mismatch", "heads", "head_dim_48",
        "kv_shape", "batch", "q_offset_dtype", "kv_lengths_dtype", "kv_lengths_shape", "window",
        "softcap",
    ])
    def test_invalid_inputs_raise(self, fn, case):
        q, k, v, kw = self.q, self.kv, self.kv, {}
        if case == "rank_q":
            q = q[0]
        elif case == "rank_k":
            k = k[..., None]
        elif case == "dtype_int":
            q, k, v = (x.astype(jnp.int32) for x in (q, k, v))
        elif case == "dtype_f64":
            q, k, v = (np.zeros(x.shape, np.float64) for x in (q, k, v))
        elif case == "dtype_mismatch":
            k = k.astype(jnp.bfloat16)
        elif case == "heads":
            q = jnp.zeros((1, 4, 3, 64), jnp.float32)
        elif case == "head_dim_48":
            q, k, v = (jnp.zeros(x.shape[:3] + (48,), jnp.float32) for x in (q, k, v))
        elif case == "kv_shape":
            v = jnp.zeros((1, 5, 2, 64), jnp.float32)
        elif case == "batch":
            q = jnp.zeros((2, 4, 4, 64), jnp.float32)
        elif case == "q_offset_dtype":
            kw["q_offset"] = np.zeros((1,), np.int64)
        elif case == "kv_lengths_dtype":
            kw["kv_lengths"] = jnp.zeros((1,), jnp.float32)
        elif case == "kv_lengths_shape":
            kw["kv_lengths"] = jnp.zeros((1, 1), jnp.int32)
        elif case == "window":
            kw["sliding_window"] = 0
        elif case == "softcap":
            kw["softcap"] = -1.0
        f = (functools.partial(flash_attention, interpret=True) if fn == "kernel"
             else flash_attention_reference)
        with pytest.raises(ValueError):
            f(q, k, v, **kw)

    kv8 = jnp.zeros((1, 6, 2, 64), jnp.int8)
    scale = jnp.ones((1, 6, 2), jnp.float32)

    # case -> (k, v, k_scale, v_scale, a pattern the message must contain)
    SCALE_CASES = {
        "scales_for_float_kv": ("f32", "f32", "f32", "f32", "k_scale / v_scale are given"),
        "int8_without_scales": ("int8", "int8", None, None, "k_scale and v_scale are required"),
        "fp8_without_scales": ("fp8", "fp8", None, None, "k_scale and v_scale are required"),
        "k_scale_only": ("int8", "int8", "f32", None, "k_scale and v_scale must be given"),
        "v_scale_only": ("int8", "int8", None, "f32", "k_scale and v_scale must be given"),
        "k_scale_shape": ("int8", "int8", "shape", "f32", r"k_scale must have the shape"),
        "v_scale_shape": ("int8", "int8", "f32", "shape", r"v_scale must have the shape"),
        "k_scale_dtype": ("int8", "int8", "int32", "f32", "k_scale dtype must be floating"),
        "v_scale_dtype": ("fp8", "fp8", "f32", "int8", "v_scale dtype must be floating"),
        "mixed_codes": ("int8", "fp8", "f32", "f32", "both hold int8 or both"),
        "codes_and_float": ("f32", "int8", "f32", "f32", "both hold int8 or both"),
    }

    @pytest.mark.parametrize("fn", ["kernel", "reference"])
    @pytest.mark.parametrize("case", list(SCALE_CASES))
    def test_invalid_scales_raise(self, fn, case):
        k_kind, v_kind, ks_kind, vs_kind, pattern = self.SCALE_CASES[case]
        kv = {"f32": self.kv, "int8": self.kv8, "fp8": self.kv8.astype(jnp.float8_e4m3fn)}
        scales = {None: None, "f32": self.scale, "shape": self.scale[..., None],
                  "int32": self.scale.astype(jnp.int32), "int8": self.scale.astype(jnp.int8)}
        f = (functools.partial(flash_attention, interpret=True) if fn == "kernel"
             else flash_attention_reference)
        with pytest.raises(ValueError, match=pattern):
            f(self.q, kv[k_kind], kv[v_kind], k_scale=scales[ks_kind], v_scale=scales[vs_kind])

    def test_bad_block_size_raises(self):
        with pytest.raises(ValueError):
            flash_attention(self.q, self.kv, self.kv, interpret=True, block_q=0)


def test_block_size_table():
    assert {"cpu", "gpu"} <= set(BLOCK_SIZES)
    small = default_block_sizes("gpu", 128, 5, 3000)
    assert (small.block_q, small.block_k) == (16, BLOCK_SIZES["gpu"]["default"].block_k)
    big = default_block_sizes("gpu", 256, 4096, 4096)
    assert (big.block_q, big.block_k) == (BLOCK_SIZES["gpu"][256].block_q,
                                         BLOCK_SIZES["gpu"][256].block_k)
    assert default_block_sizes("tpu", 64, 1000, 1000) == default_block_sizes("cpu", 64, 1000,
                                                                                1000)


def test_keys_past_kv_length_may_hold_nan():
    """Slots at or past kv_lengths are ignored even when they hold NaN (a fresh cache page)."""
    rng = np.random.default_rng(11)
    B, T, S, N, K, H = 2, 5, 37, 4, 2, 64
    q = jnp.asarray(rng.standard_normal((B, T, N, H), np.float32))
    k = rng.standard_normal((B, S, K, H)).astype(np.float32)
    v = rng.standard_normal((B, S, K, H)).astype(np.float32)
    lengths = np.array([20, 33], np.int32)
    for b, n in enumerate(lengths):
        k[b, n:] = np.nan
        v[b, n:] = np.nan
    kw = dict(q_offset=jnp.asarray(lengths - T), kv_lengths=jnp.asarray(lengths))
    out = flash_attention(q, jnp.asarray(k), jnp.asarray(v), interpret=True, block_q=16,
                          block_k=16, **kw)
    clean = [jnp.asarray(np.nan_to_num(x)) for x in (k, v)]
    want = flash_attention_reference(q, *clean, **kw)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind,max_bound,mean_bound", [
    # Measured on this case (seed 12; float outputs: max |out| 2.1, rms 0.38):
    #   int8  max abs error 1.74e-2, mean abs error 2.2e-3
    #   fp8   max abs error 9.0e-2,  mean abs error 8.9e-3 (3 mantissa bits: coarser)
    # (seeds 0-3 give int8 1.5-2.1e-2, fp8 8.7e-2-1.06e-1 max). The bounds are ~3x the measured.
    ("int8", 0.05, 0.0065),
    ("fp8", 0.27, 0.027),
])
def test_quantization_error_bound(kind, max_bound, mean_bound):
    """Kernel on int8 / fp8 K/V quantized per (token, kv head) vs float attention on the original
    float32 K/V: the error stays under a stated bound (and is not zero, so the codes are used)."""
    B, T, S, N, K, H = 2, 37, 45, 4, 2, 64
    q, k, v = make_qkv(12, B, T, S, N, K, H, jnp.float32)
    (kc, ks), (vc, vs) = quantize(k, kind), quantize(v, kind)
    kw = dict(q_offset=i32([8, 0]), kv_lengths=i32([45, 30]), sliding_window=24)
    out = flash_attention(q, kc, vc, k_scale=ks, v_scale=vs, interpret=True, block_q=16,
                          block_k=16, **kw)
    want = np.asarray(reference(q, k, v, **kw), np.float64)
    err = np.abs(np.asarray(out, np.float64) - want)
    assert 0 < err.max() <= max_bound, f"{kind}: max abs error {err.max():.3g} > {max_bound}"
    assert err.mean() <= mean_bound, f"{kind}: mean abs error {err.mean():.3g} > {mean_bound}"
