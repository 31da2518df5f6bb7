"""Paged attention for decode (pallas_kernels.paged_attention) against independent references.

- the Pallas kernel (interpret mode on CPU; compiled on GPU behind the gpu marker) == the pure-jnp
  reference == a float64 numpy implementation that gathers each sequence's visible keys page by
  page, over dtypes, GQA ratios N/K of 1, 3 and 8, head dims, page sizes, pages_per_block, ragged
  lengths at page boundaries (0, 1, page-1, page, page+1, long) in one batch, sliding windows
  smaller and larger than a page, and softcap;
- pages are scattered in the pool in random order; every page no sequence owns, the stale tail of
  each last page and the pages named by unused block-table entries hold NaN, and the remaining
  unused entries are out-of-range ids, so any read the contract forbids shows up as NaN;
- masked reads cannot show in the output, so the kernel body also runs eagerly on recording refs:
  it reads only block-table slots below ceil(length / page_size) and at or after the first page of
  the window, and exactly the pages of its row that touch the window;
- the body lowers through Pallas' Triton backend (a CUDA export, no GPU needed);
- invalid ranks, dtypes, N % K != 0 and head dims raise ValueError; new lengths and block tables
  compile nothing;
- quantized pages (int8 / float8_e4m3fn codes, per-(slot, kv head) float32 scales): kernel ==
  reference on the same codes + scales (the float tolerance below) == numpy on the dequantized
  pool, with NaN scales in every slot the contract forbids reading; the error against float
  attention on the unquantized pool stays under a stated bound; the scales are gathered through
  exactly the K/V pages; missing, extra or misshapen scales raise ValueError.

Tolerances (absolute, outputs of order 1): float32 1e-5, float16 5e-3, bfloat16 2e-2.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import (paged_attention, paged_attention_kernel,
                                            paged_attention_reference)

TOL = {jnp.float32: 1e-5, jnp.float16: 5e-3, jnp.bfloat16: 2e-2}
OUT_OF_RANGE = (2**31 - 1, -(2**31), -1)     # plus P and P + 1000, added per case


def make_inputs(seed, lengths, *, N, K, H, page_size, max_pages, dtype, spare_pages=3,
                q_scale=1.0):
    """Random q and a shuffled page pool holding `lengths` tokens per row; NaN everywhere else."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int32)
    used = -(-lengths // page_size)
    assert used.max() <= max_pages
    P = int(used.sum()) + spare_pages
    perm = rng.permutation(P)
    spare = perm[used.sum():]
    garbage = np.array([*OUT_OF_RANGE, P, P + 1000, *spare], np.int64)
    k = np.full((P, page_size, K, H), np.nan, np.float32)
    v = np.full((P, page_size, K, H), np.nan, np.float32)
    block_tables = np.empty((len(lengths), max_pages), np.int64)
    start = 0
    for b, (length, n_pages) in enumerate(zip(lengths, used)):
        ids = perm[start:start + n_pages]
        start += n_pages
        block_tables[b, :n_pages] = ids
        block_tables[b, n_pages:] = rng.choice(garbage, size=max_pages - n_pages)
        for j, page in enumerate(ids):
            filled = min(page_size, int(length) - j * page_size)
            k[page, :filled] = rng.standard_normal((filled, K, H))
            v[page, :filled] = rng.standard_normal((filled, K, H))
    q = rng.standard_normal((len(lengths), N, H)) * q_scale
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(lengths), jnp.asarray(block_tables.astype(np.int32)))


def naive_paged_attention(q, k_pages, v_pages, lengths, block_tables, *, sliding_window=None,
                          softcap=None, sm_scale=None):
    """float64 numpy: gather the visible keys of each row slot by slot, softmax per head."""
    q, k_pages, v_pages = (np.asarray(x).astype(np.float64) for x in (q, k_pages, v_pages))
    lengths, block_tables = np.asarray(lengths), np.asarray(block_tables)
    B, N, H = q.shape
    page_size, K = k_pages.shape[1], k_pages.shape[2]
    scale = sm_scale if sm_scale is not None else 1.0 / np.sqrt(H)
    out = np.zeros((B, N, H))
    for b in range(B):
        length = int(lengths[b])
        first = 0 if sliding_window is None else max(0, length - sliding_window)
        slots = np.arange(first, length)
        if not len(slots):
            continue
        pages, offsets = block_tables[b, slots // page_size], slots % page_size
        keys, values = k_pages[pages, offsets], v_pages[pages, offsets]      # [S, K, H]
        for n in range(N):
            logits = keys[:, n // (N // K)] @ q[b, n] * scale
            if softcap is not None:
                logits = softcap * np.tanh(logits / softcap)
            w = np.exp(logits - logits.max())
            out[b, n] = (w / w.sum()) @ values[:, n // (N // K)]
    return out


def quantize(x, kind):
    """Symmetric per-(slot, head) quantization of a float pool [..., H] -> (codes [..., H],
    float32 scales [...]). int8: scale = amax / 127, codes = clip(round(x / scale), -127, 127);
    fp8: scale = amax / 448 (the largest finite float8_e4m3fn), codes = (x / scale) as fp8.
    A slot holding NaN (stale, or a page no sequence owns) gets a NaN scale (and NaN fp8 codes),
    so reading it still shows up as NaN."""
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float32)
    with np.errstate(invalid="ignore"):
        scale = np.abs(x).max(axis=-1) / (127.0 if kind == "int8" else 448.0)
        y = x / np.where(scale > 0, scale, 1.0)[..., None]
        if kind == "int8":
            codes = jnp.asarray(np.clip(np.round(np.nan_to_num(y)), -127, 127).astype(np.int8))
        else:
            codes = jnp.asarray(y).astype(jnp.float8_e4m3fn)
    return codes, jnp.asarray(scale, jnp.float32)


def dequantize(codes, scale):
    return jnp.asarray(codes).astype(jnp.float32) * jnp.asarray(scale)[..., None]


def boundary_lengths(page_size, long_pages):
    return [0, 1, page_size - 1, page_size, page_size + 1, long_pages * page_size - 3]


def assert_close(actual, expected, dtype, what):
    actual = np.asarray(actual.astype(jnp.float32) if hasattr(actual, "astype") else actual)
    assert np.isfinite(actual).all(), f"{what}: non-finite output (a forbidden read?)"
    err = np.max(np.abs(actual.astype(np.float64) - np.asarray(expected, np.float64)))
    assert err <= TOL[dtype], f"{what}: max abs error {err:.3g} > {TOL[dtype]}"


# (dtype, N, K, H, page_size, pages_per_block); None = the backend's block-size table.
CASES = [
    (jnp.float32, 4, 4, 64, 4, 1),
    (jnp.float32, 6, 2, 128, 16, 2),
    (jnp.float32, 8, 1, 64, 16, 1),
    (jnp.float32, 3, 1, 64, 4, 4),
    (jnp.float32, 16, 2, 128, 4, None),
    (jnp.bfloat16, 4, 4, 128, 4, 2),
    (jnp.bfloat16, 6, 2, 64, 16, 1),
    (jnp.bfloat16, 16, 2, 128, 4, 4),
    (jnp.float16, 9, 3, 64, 16, None),
]
CASE_IDS = [f"{jnp.dtype(d).name}-N{n}K{k}-H{h}-page{p}-ppb{b}" for d, n, k, h, p, b in CASES]


class PagedAttentionSweep:
    """Kernel vs reference vs numpy; subclasses choose interpret mode and the shapes."""

    interpret = True
    long_pages = 6      # pages of the longest row
    extra_rows = 0      # random-length rows added to the boundary rows

    def lengths(self, page_size, seed):
        rng = np.random.default_rng(seed)
        extra = rng.integers(0, self.long_pages * page_size, size=self.extra_rows)
        return boundary_lengths(page_size, self.long_pages) + list(extra)

    def check(self, case, seed, **options):
        dtype, N, K, H, page_size, pages_per_block = case
        inputs = make_inputs(seed, self.lengths(page_size, seed), N=N, K=K, H=H,
                             page_size=page_size, max_pages=self.long_pages + 2, dtype=dtype,
                             q_scale=options.pop("q_scale", 1.0))
        out = paged_attention(*inputs, interpret=self.interpret, pages_per_block=pages_per_block,
                              **options)
        ref = paged_attention_reference(*inputs, **options)
        assert out.shape == inputs[0].shape and out.dtype == dtype
        assert_close(out, ref.astype(jnp.float32), dtype, "kernel vs reference")
        assert_close(out, naive_paged_attention(*inputs, **options), dtype, "kernel vs numpy")
        assert np.all(np.asarray(out[0]) == 0), "a row of length 0 must give zeros"

    @pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
    def test_full_attention(self, case):
        self.check(case, seed=1)

    @pytest.mark.parametrize("window", ["below_page", "above_page"])
    @pytest.mark.parametrize("case", CASES[:2] + CASES[5:7], ids=CASE_IDS[:2] + CASE_IDS[5:7])
    def test_sliding_window(self, case, window):
        page_size = case[4]
        w = page_size // 2 + 1 if window == "below_page" else 2 * page_size + 3
        self.check(case, seed=2, sliding_window=w)

    @pytest.mark.parametrize("case", [CASES[1], CASES[7]], ids=[CASE_IDS[1], CASE_IDS[7]])
    def test_softcap_window_and_scale(self, case):
        self.check(case, seed=3, softcap=2.0, sliding_window=case[4] + 1, sm_scale=0.2,
                   q_scale=3.0)

    @pytest.mark.parametrize("case", [CASES[2], CASES[5]], ids=[CASE_IDS[2], CASE_IDS[5]])
    def test_softcap(self, case):
        self.check(case, seed=4, softcap=1.5, q_scale=3.0)

    @pytest.mark.parametrize("kind", ["int8", "fp8"])
    @pytest.mark.parametrize("case,options", [
        (CASES[1], {}), (CASES[3], {"sliding_window": 5}), (CASES[6], {"softcap": 2.0})],
        ids=[CASE_IDS[1], CASE_IDS[3] + "-window5", CASE_IDS[6] + "-softcap"])
    def test_quantized_pages(self, case, options, kind):
        """int8 / fp8 codes + scales: kernel == reference on the same == numpy on the
        dequantized pool (ragged lengths, shuffled pages, GQA 1 / 3 / 3)."""
        dtype, N, K, H, page_size, pages_per_block = case
        q, k, v, lengths, block_tables = make_inputs(
            11, self.lengths(page_size, 11), N=N, K=K, H=H, page_size=page_size,
            max_pages=self.long_pages + 2, dtype=jnp.float32)
        q = q.astype(dtype)
        (kc, ks), (vc, vs) = quantize(k, kind), quantize(v, kind)
        out = paged_attention(q, kc, vc, lengths, block_tables, interpret=self.interpret,
                              pages_per_block=pages_per_block, k_scale=ks, v_scale=vs, **options)
        assert out.shape == q.shape and out.dtype == dtype
        ref = paged_attention_reference(q, kc, vc, lengths, block_tables, k_scale=ks, v_scale=vs,
                                        **options)
        assert_close(out, ref.astype(jnp.float32), dtype, f"{kind} kernel vs reference")
        assert_close(ref, naive_paged_attention(q, dequantize(kc, ks), dequantize(vc, vs),
                                                lengths, block_tables, **options),
                     dtype, f"{kind} reference vs numpy on the dequantized pool")
        assert np.all(np.asarray(out[0]) == 0), "a row of length 0 must give zeros"

    def test_all_rows_empty(self):
        q, k, v, lengths, block_tables = make_inputs(5, [0, 0, 0], N=4, K=2, H=64, page_size=4,
                                                     max_pages=3, dtype=jnp.float32)
        out = paged_attention(q, k, v, lengths, block_tables, interpret=self.interpret)
        np.testing.assert_array_equal(np.asarray(out), 0.0)


class TestPagedAttentionInterpret(PagedAttentionSweep):
    interpret = True


@pytest.mark.slow
class TestPagedAttentionInterpretLong(PagedAttentionSweep):
    interpret = True
    long_pages = 24
    extra_rows = 4


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
class TestPagedAttentionGPU(PagedAttentionSweep):
    interpret = False
    long_pages = 80
    extra_rows = 26


# The reference against numpy alone, where it is cheap to sweep wider.
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("N,K", [(2, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 1}, {"sliding_window": 7},
                                     {"softcap": 1.0, "sm_scale": 0.3}],
                         ids=["full", "window1", "window7", "softcap"])
def test_reference_matches_numpy(dtype, N, K, page_size, options):
    inputs = make_inputs(6, boundary_lengths(page_size, 4) + [2 * page_size], N=N, K=K, H=32,
                         page_size=page_size, max_pages=5, dtype=dtype, q_scale=2.0)
    ref = paged_attention_reference(*inputs, **options)
    assert_close(ref, naive_paged_attention(*inputs, **options), dtype, "reference vs numpy")


def test_q_rows_padding_and_mixed_dtypes():
    """A query block padded past the group (G=3 -> 8 rows), f32 queries over bf16 pages."""
    q, k, v, lengths, block_tables = make_inputs(7, boundary_lengths(4, 3), N=6, K=2, H=64,
                                                 page_size=4, max_pages=4, dtype=jnp.bfloat16)
    q = q.astype(jnp.float32)
    out = paged_attention(q, k, v, lengths, block_tables, interpret=True, q_rows=8,
                          pages_per_block=2)
    assert out.dtype == jnp.float32
    assert_close(out, paged_attention_reference(q, k, v, lengths, block_tables), jnp.bfloat16,
                 "kernel vs reference")


def test_new_lengths_and_tables_compile_nothing(compile_recorder):
    a = make_inputs(8, [5, 9], N=4, K=2, H=64, page_size=4, max_pages=4, dtype=jnp.float32)
    b = make_inputs(9, [13, 2], N=4, K=2, H=64, page_size=4, max_pages=4, dtype=jnp.float32)
    assert all(x.shape == y.shape for x, y in zip(a, b))
    paged_attention(*a, interpret=True).block_until_ready()
    with compile_recorder() as rec:
        out = paged_attention(*b, interpret=True)
    assert not rec.logs and not rec.events, rec.logs
    assert_close(out, naive_paged_attention(*b), jnp.float32, "kernel vs numpy")


@pytest.mark.parametrize("dtype,N,K,H,page_size,pages_per_block,options", [
    (jnp.bfloat16, 9, 3, 64, 16, 8, {}),
    (jnp.float32, 8, 8, 128, 4, 4, {"sliding_window": 5, "softcap": 2.0}),
    (jnp.bfloat16, 8, 2, 128, 16, 4, {"pages_dtype": jnp.int8}),
    (jnp.float32, 9, 3, 64, 4, 4, {"pages_dtype": jnp.float8_e4m3fn, "sliding_window": 5}),
], ids=["bf16-gqa3", "f32-window-softcap", "bf16-int8-pages", "f32-fp8-pages-window"])
def test_body_lowers_through_triton(dtype, N, K, H, page_size, pages_per_block, options):
    """The body lowers through Pallas' Triton backend (a CUDA export needs no GPU); the PTX
    compile itself is left to the gpu-marked tests. pages_dtype int8 / fp8: quantized pages with
    [P, page_size, K] float32 scales."""
    from jax import export
    options = dict(options)
    pages_dtype = options.pop("pages_dtype", dtype)
    args = (jax.ShapeDtypeStruct((4, N, H), dtype),
            *[jax.ShapeDtypeStruct((64, page_size, K, H), pages_dtype)] * 2,
            jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4, 9), jnp.int32))
    if pages_dtype == dtype:
        f = jax.jit(lambda *a: paged_attention(*a, pages_per_block=pages_per_block, q_rows=16,
                                               **options))
    else:
        args += (jax.ShapeDtypeStruct((64, page_size, K), jnp.float32),) * 2
        f = jax.jit(lambda *a: paged_attention(*a[:5], pages_per_block=pages_per_block,
                                               q_rows=16, k_scale=a[5], v_scale=a[6],
                                               **options))
    triton_call = "__gpu$xla.gpu.triton"
    exported = export.export(f, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call(triton_call)])(*args)
    assert triton_call in exported.mlir_module()


class RecordingRef:
    """A numpy-backed stand-in for a kernel ref that logs the indices of every read."""

    def __init__(self, array, log=None):
        self.array, self.log = np.array(array), log
        self.shape, self.dtype = self.array.shape, self.array.dtype

    def __getitem__(self, idx):
        idx = idx if idx is Ellipsis else np.asarray(idx)
        if self.log is not None:
            self.log.append(idx)
        return jnp.asarray(self.array[idx])       # numpy raises on an out-of-range id

    def __setitem__(self, idx, value):
        self.array[idx] = np.asarray(value)


@pytest.mark.parametrize("pages_per_block", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 3, 9], ids=["full", "window3", "window9"])
def test_reads_only_pages_in_the_window(pages_per_block, window):
    """Runs the kernel body eagerly on recording refs, one (row, kv head) program at a time: the
    block-table slots it reads lie in [first window page, ceil(length / page_size)), the pages it
    reads are exactly the row's pages touching the window, and with one page per step each is
    read once per kv head. (Masked reads cannot show in the output, so they are logged here.)"""
    page_size, N, K, H = 4, 6, 2, 32
    G = N // K
    q, k, v, lengths, block_tables = make_inputs(
        10, boundary_lengths(page_size, 5), N=N, K=K, H=H, page_size=page_size, max_pages=7,
        dtype=jnp.float32)
    q_np, k_np, v_np = np.asarray(q), np.asarray(k), np.asarray(v)
    lengths_np, tables_np = np.asarray(lengths), np.asarray(block_tables)
    expected = naive_paged_attention(q, k, v, lengths, block_tables, sliding_window=window)
    for b, length in enumerate(lengths_np):
        end = -(-int(length) // page_size)
        first = 0 if window is None else max(0, int(length) - window) // page_size
        owned = set(tables_np[b, first:end].tolist())
        for h in range(K):
            slot_log, k_log, v_log = [], [], []
            out = RecordingRef(np.zeros((G, H), np.float32))
            with jax.disable_jit():
                paged_attention_kernel(
                    RecordingRef(lengths_np[b:b + 1]), RecordingRef(tables_np[b], slot_log),
                    RecordingRef(q_np[b, h * G:(h + 1) * G]),
                    RecordingRef(k_np[:, :, h], k_log), RecordingRef(v_np[:, :, h], v_log), out,
                    page_size=page_size, pages_per_block=pages_per_block, sm_scale=H ** -0.5,
                    softcap=None, sliding_window=window)
            slots = np.concatenate([np.ravel(i) for i in slot_log]) if slot_log else []
            assert all(first <= s < end for s in slots), (b, length, slots)
            for log in (k_log, v_log):
                read = np.concatenate([np.ravel(i) for i in log]).tolist() if log else []
                assert set(read) == owned, (b, length, read, owned)
                if pages_per_block == 1:
                    assert len(read) == len(owned), (b, length, read)
            np.testing.assert_allclose(out.array, expected[b, h * G:(h + 1) * G], atol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_reads_scales_of_the_same_pages(kind):
    """The body on recording refs with quantized pages: the scale reads name exactly the pages of
    the K/V reads, step by step, and the output matches numpy on the dequantized pool."""
    page_size, N, K, H, pages_per_block, window = 4, 6, 2, 32, 2, 9
    G = N // K
    q, k, v, lengths, block_tables = make_inputs(
        12, boundary_lengths(page_size, 5), N=N, K=K, H=H, page_size=page_size, max_pages=7,
        dtype=jnp.float32)
    (kc, ks), (vc, vs) = quantize(k, kind), quantize(v, kind)
    expected = naive_paged_attention(q, dequantize(kc, ks), dequantize(vc, vs), lengths,
                                     block_tables, sliding_window=window)
    for b, length in enumerate(np.asarray(lengths)):
        for h in range(K):
            logs = {name: [] for name in ("k", "v", "ks", "vs")}
            out = RecordingRef(np.zeros((G, H), np.float32))
            with jax.disable_jit():
                paged_attention_kernel(
                    RecordingRef(np.asarray(lengths)[b:b + 1]),
                    RecordingRef(np.asarray(block_tables)[b]),
                    RecordingRef(np.asarray(q)[b, h * G:(h + 1) * G]),
                    RecordingRef(np.asarray(kc)[:, :, h], logs["k"]),
                    RecordingRef(np.asarray(vc)[:, :, h], logs["v"]),
                    RecordingRef(np.asarray(ks)[:, :, h], logs["ks"]),
                    RecordingRef(np.asarray(vs)[:, :, h], logs["vs"]), out,
                    page_size=page_size, pages_per_block=pages_per_block, sm_scale=H ** -0.5,
                    softcap=None, sliding_window=window)
            reads = {name: [np.ravel(i).tolist() for i in log] for name, log in logs.items()}
            assert reads["ks"] == reads["k"] and reads["vs"] == reads["v"], (b, length, reads)
            assert bool(reads["k"]) == (length > 0)
            np.testing.assert_allclose(out.array, expected[b, h * G:(h + 1) * G], atol=1e-5)


@pytest.mark.parametrize("kind,max_bound,mean_bound", [
    # Measured on this case (seed 13; float outputs: max |out| 2.9, rms 0.48):
    #   int8  max abs error 1.15e-2, mean abs error 2.05e-3
    #   fp8   max abs error 9.96e-2, mean abs error 7.6e-3 (3 mantissa bits: coarser)
    # (seeds 0-2 give int8 1.2-1.7e-2, fp8 8.7e-2-1.10e-1 max). The bounds are ~3x the measured.
    ("int8", 0.035, 0.006),
    ("fp8", 0.30, 0.023),
])
def test_quantization_error_bound(kind, max_bound, mean_bound):
    """Kernel on int8 / fp8 pages quantized per (slot, kv head) vs float attention on the original
    float32 pool: the error stays under a stated bound (and is not zero)."""
    q, k, v, lengths, block_tables = make_inputs(
        13, boundary_lengths(16, 6) + [40, 77], N=8, K=2, H=64, page_size=16, max_pages=8,
        dtype=jnp.float32)
    (kc, ks), (vc, vs) = quantize(k, kind), quantize(v, kind)
    out = paged_attention(q, kc, vc, lengths, block_tables, interpret=True, pages_per_block=2,
                          k_scale=ks, v_scale=vs)
    want = naive_paged_attention(q, k, v, lengths, block_tables)
    err = np.abs(np.asarray(out, np.float64) - want)
    assert 0 < err.max() <= max_bound, f"{kind}: max abs error {err.max():.3g} > {max_bound}"
    assert err.mean() <= mean_bound, f"{kind}: mean abs error {err.mean():.3g} > {mean_bound}"


def _good():
    q = jnp.zeros((2, 4, 64), jnp.float32)
    pages = jnp.zeros((5, 4, 2, 64), jnp.float32)
    return dict(q=q, k_pages=pages, v_pages=pages, lengths=jnp.zeros((2,), jnp.int32),
                block_tables=jnp.zeros((2, 3), jnp.int32))


_PAGES8 = jnp.zeros((5, 4, 2, 64), jnp.int8)
_PAGES_FP8 = jnp.zeros((5, 4, 2, 64), jnp.float8_e4m3fn)
_SCALE = jnp.ones((5, 4, 2), jnp.float32)

BAD_INPUTS = {
    "q_rank": dict(q=jnp.zeros((2, 4, 1, 64))),
    "pages_rank": dict(k_pages=jnp.zeros((5, 4, 128)), v_pages=jnp.zeros((5, 4, 128))),
    "lengths_rank": dict(lengths=jnp.zeros((2, 1), jnp.int32)),
    "block_tables_rank": dict(block_tables=jnp.zeros((6,), jnp.int32)),
    "q_dtype": dict(q=jnp.zeros((2, 4, 64), jnp.int32)),
    "pages_dtype": dict(v_pages=jnp.zeros((5, 4, 2, 64), jnp.int8)),
    "lengths_dtype": dict(lengths=jnp.zeros((2,), jnp.float32)),
    "block_tables_dtype": dict(block_tables=jnp.zeros((2, 3), jnp.int16)),
    "heads_not_multiple": dict(q=jnp.zeros((2, 3, 64))),
    "head_dim_48": dict(q=jnp.zeros((2, 4, 48)), k_pages=jnp.zeros((5, 4, 2, 48)),
                        v_pages=jnp.zeros((5, 4, 2, 48))),
    "head_dim_mismatch": dict(q=jnp.zeros((2, 4, 128))),
    "window_0": dict(sliding_window=0),
    "softcap_0": dict(softcap=0.0),
    # quantized pages: scales given together, exactly for int8 / fp8 pages, shaped
    # [P, page_size, K], floating
    "scales_for_float_pages": dict(k_scale=_SCALE, v_scale=_SCALE),
    "int8_pages_without_scales": dict(k_pages=_PAGES8, v_pages=_PAGES8),
    "fp8_pages_without_scales": dict(k_pages=_PAGES_FP8, v_pages=_PAGES_FP8),
    "k_scale_only": dict(k_pages=_PAGES8, v_pages=_PAGES8, k_scale=_SCALE),
    "v_scale_only": dict(k_pages=_PAGES8, v_pages=_PAGES8, v_scale=_SCALE),
    "scale_shape": dict(k_pages=_PAGES8, v_pages=_PAGES8, k_scale=_SCALE[:, :, :1],
                        v_scale=_SCALE[:, :, :1]),
    "scale_shape_with_head_dim": dict(k_pages=_PAGES8, v_pages=_PAGES8, k_scale=_SCALE,
                                      v_scale=_SCALE[..., None]),
    "scale_dtype": dict(k_pages=_PAGES_FP8, v_pages=_PAGES_FP8, k_scale=_SCALE.astype(jnp.int32),
                        v_scale=_SCALE.astype(jnp.int32)),
    "mixed_codes": dict(k_pages=_PAGES8, v_pages=_PAGES_FP8, k_scale=_SCALE, v_scale=_SCALE),
}
SCALE_ERRORS = {   # the message names the value
    "scales_for_float_pages": "k_scale / v_scale are given", "k_scale_only": "given together",
    "int8_pages_without_scales": "k_scale and v_scale are required",
    "fp8_pages_without_scales": "k_scale and v_scale are required",
    "v_scale_only": "given together", "scale_shape": "k_scale must have the shape",
    "scale_shape_with_head_dim": "v_scale must have the shape",
    "scale_dtype": "k_scale dtype must be floating", "mixed_codes": "both hold int8 or both",
}


@pytest.mark.parametrize("fn", ["kernel", "reference"])
@pytest.mark.parametrize("bad", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_invalid_inputs_raise(fn, bad):
    args = {**_good(), **BAD_INPUTS[bad]}
    call = (lambda **a: paged_attention(**a, interpret=True)) if fn == "kernel" \
        else paged_attention_reference
    with pytest.raises(ValueError, match=SCALE_ERRORS.get(bad)):
        call(**args)


def test_edge_inputs_follow_the_contract():
    """Valid edge inputs, not errors, with the outputs the contract promises:
    - zero pages in the block table (rows of length 0): a query that sees no key gets a zero
      row, exactly, though the pool holds only NaN;
    - a pool of one page that both rows' tables name (a shared prefix), the rest of each table
      out-of-range ids: the float64 gather, within float32's tolerance;
    - a float16 pool under float32 queries: the output is float32, within float16's tolerance
      of float64 on the pool's values (the probabilities meet the values in the pool's
      dtype, in the kernel as in the reference)."""
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
    nan_pool = jnp.full((5, 4, 2, 64), jnp.nan, jnp.float32)
    for fn in (lambda **a: paged_attention(**a, interpret=True), paged_attention_reference):
        out = fn(q=q, k_pages=nan_pool, v_pages=nan_pool, lengths=jnp.zeros((2,), jnp.int32),
                 block_tables=jnp.zeros((2, 0), jnp.int32))
        assert out.shape == q.shape and out.dtype == q.dtype
        np.testing.assert_array_equal(np.asarray(out), np.zeros(q.shape, np.float32))

    lengths = jnp.asarray([3, 4], jnp.int32)
    tables = jnp.asarray([[0, 2**31 - 1, -1], [0, 1, 1000]], jnp.int32)
    for dtype in (jnp.float32, jnp.float16):
        k = jnp.asarray(rng.standard_normal((1, 4, 2, 64)), dtype)
        v = jnp.asarray(rng.standard_normal((1, 4, 2, 64)), dtype)
        want = naive_paged_attention(q, k, v, lengths, tables)
        for fn in (lambda **a: paged_attention(**a, interpret=True), paged_attention_reference):
            out = fn(q=q, k_pages=k, v_pages=v, lengths=lengths, block_tables=tables)
            assert out.shape == q.shape and out.dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(out), want, atol=TOL[dtype], rtol=0)
