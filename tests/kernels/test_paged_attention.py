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
  compile nothing.

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
], ids=["bf16-gqa3", "f32-window-softcap"])
def test_body_lowers_through_triton(dtype, N, K, H, page_size, pages_per_block, options):
    """The body lowers through Pallas' Triton backend (a CUDA export needs no GPU); the PTX
    compile itself is left to the gpu-marked tests."""
    from jax import export
    f = jax.jit(lambda *a: paged_attention(*a, pages_per_block=pages_per_block, q_rows=16,
                                           **options))
    args = (jax.ShapeDtypeStruct((4, N, H), dtype),
            *[jax.ShapeDtypeStruct((64, page_size, K, H), dtype)] * 2,
            jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4, 9), jnp.int32))
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


def _good():
    q = jnp.zeros((2, 4, 64), jnp.float32)
    pages = jnp.zeros((5, 4, 2, 64), jnp.float32)
    return dict(q=q, k_pages=pages, v_pages=pages, lengths=jnp.zeros((2,), jnp.int32),
                block_tables=jnp.zeros((2, 3), jnp.int32))


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
}


@pytest.mark.parametrize("fn", ["kernel", "reference"])
@pytest.mark.parametrize("bad", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_invalid_inputs_raise(fn, bad):
    args = {**_good(), **BAD_INPUTS[bad]}
    call = (lambda **a: paged_attention(**a, interpret=True)) if fn == "kernel" \
        else paged_attention_reference
    with pytest.raises(ValueError):
        call(**args)


def test_valid_edge_inputs_do_not_raise():
    """Zero pages in the table, one page in the pool, a float16 pool: valid, not errors."""
    args = _good()
    paged_attention(**{**args, "block_tables": jnp.zeros((2, 0), jnp.int32)}, interpret=True)
    paged_attention(**{**args, "k_pages": jnp.zeros((1, 4, 2, 64), jnp.float16),
                       "v_pages": jnp.zeros((1, 4, 2, 64), jnp.float16)}, interpret=True)
