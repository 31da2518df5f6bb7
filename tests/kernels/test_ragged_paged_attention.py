"""Ragged paged attention (pallas_kernels.ragged_paged_attention) against independent references.

- the Pallas kernel (interpret mode on CPU; compiled on GPU behind the gpu marker) == the pure-jnp
  reference == a float64 numpy implementation that loops over rows and their queries and gathers
  each query's visible keys slot by slot, over dtypes, GQA ratios N/K of 1, 3 and 8, head dims
  32 / 64 / 128 / 256, page sizes 4 and 16, pages_per_block and block_q, sliding windows smaller
  and larger than a page, softcap and sm_scale;
- every batch is mixed: decode rows (one query) at lengths 1, page, page + 1, prefill chunks of
  5 and 13 queries starting at non-zero positions (one ending on a page boundary), a whole prompt
  from position 0, a row with keys and no queries, an empty row; the rows sit in the flat token
  array in random order with unowned gap tokens between some of them and padding tokens at the
  end, and the empty rows' query_start points into another row's range; unowned tokens must come
  back exactly zero;
- pages are scattered in the pool in random order; every page no row owns, the stale tail of each
  last page and the pages named by unused block-table entries hold NaN, and the remaining unused
  entries are out-of-range ids, so any read the contract forbids shows up as NaN;
- masked reads cannot show in the output, so the kernel body also runs eagerly on recording refs:
  each work item reads only block-table slots from the first page of its first query's window up
  to the page of its last query, and exactly the row's pages there;
- the work list covers every owned token exactly once and never needs more items than its static
  bound;
- the body lowers through Pallas' Triton backend (a CUDA export, no GPU needed);
- invalid ranks, dtypes, shapes, N % K != 0 and head dims raise ValueError; new lengths, block
  tables, query starts and query counts of the same shapes compile nothing;
- quantized pages (int8 / float8_e4m3fn codes, per-(slot, kv head) float32 scales): kernel ==
  reference on the same codes + scales (the float tolerance below) == numpy on the dequantized
  pool, with NaN scales in every slot the contract forbids reading; the error against float
  attention on the unquantized pool stays under a stated bound; the scales are gathered through
  exactly the K/V pages.

Tolerances (absolute, outputs of order 1): float32 1e-5, float16 5e-3, bfloat16 2e-2.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                   ragged_paged_attention_kernel,
                                                   ragged_paged_attention_reference)
from pallas_kernels.ragged_paged_attention import kernel as kernel_module
from pallas_kernels.ragged_paged_attention.kernel import num_work_items, work_items

TOL = {jnp.float32: 1e-5, jnp.float16: 5e-3, jnp.bfloat16: 2e-2}
OUT_OF_RANGE = (2**31 - 1, -(2**31), -1)     # plus P and P + 1000, added per case


def make_batch(seed, rows, *, N, K, H, page_size, max_pages, dtype, spare_pages=3, pad_tokens=3,
               gaps=True, num_tokens=None, q_scale=1.0):
    """A flat ragged batch for rows [(kv_length, num_queries)]: the rows' query ranges in random
    order, with a random gap (0 or 1 unowned tokens) before each if `gaps`, then pad_tokens
    unowned tokens (or as many as make num_tokens in all); a row with no queries gets a random
    query_start, often inside another row's range. Random q (the unowned tokens too) and a
    shuffled page pool holding each row's keys; NaN everywhere else.
    Returns (q, k_pages, v_pages, kv_lengths, block_tables, query_start, num_queries)."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray([r[0] for r in rows], np.int32)
    counts = np.asarray([r[1] for r in rows], np.int32)
    assert (counts <= lengths).all()
    used = -(-lengths // page_size)
    assert used.max() <= max_pages
    P = int(used.sum()) + spare_pages
    perm = rng.permutation(P)
    spare = perm[used.sum():]
    garbage = np.array([*OUT_OF_RANGE, P, P + 1000, *spare], np.int64)
    k = np.full((P, page_size, K, H), np.nan, np.float32)
    v = np.full((P, page_size, K, H), np.nan, np.float32)
    block_tables = np.empty((len(rows), max_pages), np.int64)
    start = 0
    for r, (length, n_pages) in enumerate(zip(lengths, used)):
        ids = perm[start:start + n_pages]
        start += n_pages
        block_tables[r, :n_pages] = ids
        block_tables[r, n_pages:] = rng.choice(garbage, size=max_pages - n_pages)
        for j, page in enumerate(ids):
            filled = min(page_size, int(length) - j * page_size)
            k[page, :filled] = rng.standard_normal((filled, K, H))
            v[page, :filled] = rng.standard_normal((filled, K, H))
    query_start = np.zeros(len(rows), np.int32)
    cursor = 0
    for r in rng.permutation(len(rows)):
        if counts[r]:
            cursor += int(rng.integers(0, 2)) if gaps else 0
            query_start[r] = cursor
            cursor += int(counts[r])
    T = cursor + pad_tokens if num_tokens is None else num_tokens
    assert T >= cursor
    for r in np.flatnonzero(counts == 0):
        query_start[r] = rng.integers(0, T + 1)
    q = rng.standard_normal((T, N, H)) * q_scale
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(lengths), jnp.asarray(block_tables.astype(np.int32)),
            jnp.asarray(query_start), jnp.asarray(counts))


def owned_tokens(query_start, num_queries, T):
    owned = np.zeros(T, bool)
    for start, count in zip(np.asarray(query_start), np.asarray(num_queries)):
        owned[start:start + count] = True
    return owned


def naive_ragged_attention(q, k_pages, v_pages, kv_lengths, block_tables, query_start,
                           num_queries, *, sliding_window=None, softcap=None, sm_scale=None):
    """float64 numpy: for each row and each of its queries, gather the visible keys slot by
    slot and softmax per head."""
    q, k_pages, v_pages = (np.asarray(jnp.asarray(x, jnp.float32), np.float64)
                           for x in (q, k_pages, v_pages))
    lengths, block_tables = np.asarray(kv_lengths), np.asarray(block_tables)
    query_start, num_queries = np.asarray(query_start), np.asarray(num_queries)
    T, N, H = q.shape
    page_size, K = k_pages.shape[1], k_pages.shape[2]
    scale = sm_scale if sm_scale is not None else 1.0 / np.sqrt(H)
    out = np.zeros((T, N, H))
    for r in range(len(lengths)):
        length, count = int(lengths[r]), int(num_queries[r])
        for i in range(count):
            t = int(query_start[r]) + i
            pos = length - count + i
            first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            slots = np.arange(first, pos + 1)
            pages, offsets = block_tables[r, slots // page_size], slots % page_size
            keys, values = k_pages[pages, offsets], v_pages[pages, offsets]   # [S, K, H]
            for n in range(N):
                logits = keys[:, n // (N // K)] @ q[t, n] * scale
                if softcap is not None:
                    logits = softcap * np.tanh(logits / softcap)
                w = np.exp(logits - logits.max())
                out[t, n] = (w / w.sum()) @ values[:, n // (N // K)]
    return out


def quantize(x, kind):
    """Symmetric per-(slot, head) quantization of a float pool [..., H] -> (codes [..., H],
    float32 scales [...]). int8: scale = amax / 127, codes = clip(round(x / scale), -127, 127);
    fp8: scale = amax / 448 (the largest finite float8_e4m3fn), codes = (x / scale) as fp8.
    A slot holding NaN (stale, or a page no row owns) gets a NaN scale (and NaN fp8 codes), so
    reading it still shows up as NaN."""
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


def mixed_rows(page_size, long_pages):
    """(kv_length, num_queries) rows of a mixed batch, lengths at and around page boundaries
    (long_pages * page_size must be at least 17)."""
    Z = page_size
    assert long_pages * Z >= 17
    return [
        (0, 0),                        # an empty row
        (3 * Z, 0),                    # keys, no queries this step
        (1, 1),                        # decode of a first token
        (Z, 1),                        # decode, length on a page boundary
        (Z + 1, 1),                    # decode, one key into a new page
        (Z * max(2, -(-6 // Z)), 5),   # a chunk of 5 ending on a page boundary
        (long_pages * Z - 3, 13),      # a chunk of 13 starting mid-row
        (12, 12),                      # a whole prompt from position 0
    ]


def assert_close(actual, expected, dtype, what):
    actual = np.asarray(actual.astype(jnp.float32) if hasattr(actual, "astype") else actual)
    assert np.isfinite(actual).all(), f"{what}: non-finite output (a forbidden read?)"
    err = np.max(np.abs(actual.astype(np.float64) - np.asarray(expected, np.float64)))
    assert err <= TOL[dtype], f"{what}: max abs error {err:.3g} > {TOL[dtype]}"


# (dtype, N, K, H, page_size, pages_per_block, block_q); None = the backend's block-size table.
CASES = [
    (jnp.float32, 2, 2, 64, 4, 1, 4),
    (jnp.float32, 6, 2, 128, 16, 2, None),
    (jnp.float32, 8, 1, 64, 16, 1, 2),
    (jnp.bfloat16, 2, 2, 128, 4, 2, 8),
    (jnp.bfloat16, 6, 2, 64, 16, 1, 4),
    (jnp.bfloat16, 8, 1, 128, 4, 4, None),
    (jnp.float32, 4, 2, 32, 4, 2, 4),
    (jnp.float32, 2, 1, 256, 16, None, 8),
    (jnp.float16, 6, 2, 64, 4, None, 2),
]
CASE_IDS = [f"{jnp.dtype(d).name}-N{n}K{k}-H{h}-page{p}-ppb{b}-bq{q}"
            for d, n, k, h, p, b, q in CASES]


def cases(default, slow=()):
    """pytest params of CASES[i]: `default` ones always, `slow` ones marked slow. Interpret mode
    costs about two seconds of compilation a case, so the default run keeps a subset that, over
    the class's tests, still has float32 and bfloat16, GQA ratios 1, 2, 3 and 8, every head dim,
    page sizes 4 and 16 and several block sizes; the slow run (and the gpu class) takes them
    all, float16 included."""
    return ([pytest.param(CASES[i], id=CASE_IDS[i]) for i in default]
            + [pytest.param(CASES[i], id=CASE_IDS[i], marks=pytest.mark.slow) for i in slow])


class RaggedPagedAttentionSweep:
    """Kernel vs reference vs numpy; subclasses choose interpret mode and the shapes."""

    interpret = True
    long_pages = 6      # pages of the longest row
    extra_rows = 0      # random rows (decode or chunks of up to 40 queries) added to mixed_rows

    def rows(self, page_size, seed):
        rng = np.random.default_rng(seed)
        rows = mixed_rows(page_size, self.long_pages)
        for _ in range(self.extra_rows):
            length = int(rng.integers(1, self.long_pages * page_size + 1))
            count = 1 if rng.random() < 0.5 else int(rng.integers(1, min(40, length) + 1))
            rows.append((length, count))
        return rows

    def check(self, case, seed, **options):
        dtype, N, K, H, page_size, pages_per_block, block_q = case
        inputs = make_batch(seed, self.rows(page_size, seed), N=N, K=K, H=H, page_size=page_size,
                            max_pages=self.long_pages + 2, dtype=dtype,
                            q_scale=options.pop("q_scale", 1.0))
        out = ragged_paged_attention(*inputs, interpret=self.interpret,
                                     pages_per_block=pages_per_block, block_q=block_q, **options)
        ref = ragged_paged_attention_reference(*inputs, **options)
        assert out.shape == inputs[0].shape and out.dtype == dtype
        assert_close(out, ref.astype(jnp.float32), dtype, "kernel vs reference")
        assert_close(out, naive_ragged_attention(*inputs, **options), dtype, "kernel vs numpy")
        unowned = ~owned_tokens(inputs[5], inputs[6], inputs[0].shape[0])
        assert unowned.sum() >= 3
        assert np.all(np.asarray(out)[unowned] == 0), "tokens no row owns must give zeros"

    @pytest.mark.parametrize("case", cases([0, 5, 6, 7], [1, 2, 3, 4, 8]))
    def test_mixed_batch(self, case):
        self.check(case, seed=1)

    @pytest.mark.parametrize("case,window", [
        pytest.param(CASES[i], window, id=f"{CASE_IDS[i]}-{window}",
                     marks=() if (i, window) in ((1, "below_page"), (4, "above_page"))
                     else pytest.mark.slow)
        for i in (0, 1, 3, 4) for window in ("below_page", "above_page")])
    def test_sliding_window(self, case, window):
        page_size = case[4]
        w = page_size // 2 + 1 if window == "below_page" else 2 * page_size + 3
        self.check(case, seed=2, sliding_window=w)

    @pytest.mark.parametrize("case", cases([5], [1]))
    def test_softcap_window_and_scale(self, case):
        self.check(case, seed=3, softcap=2.0, sliding_window=case[4] + 1, sm_scale=0.2,
                   q_scale=3.0)

    @pytest.mark.parametrize("case", cases([], [2, 3]))
    def test_softcap(self, case):
        """Softcap alone (the default run has it with a window and sm_scale above)."""
        self.check(case, seed=4, softcap=1.5, q_scale=3.0)

    @pytest.mark.parametrize("kind,case,options", [
        pytest.param("int8", CASES[1], {}, id="int8-" + CASE_IDS[1]),
        pytest.param("fp8", CASES[6], {"sliding_window": 5}, id="fp8-" + CASE_IDS[6] + "-window5"),
        *[pytest.param(kind, case, options, id=f"{kind}-{name}", marks=pytest.mark.slow)
          for kind, case, options, name in [
              ("fp8", CASES[1], {}, CASE_IDS[1]),
              ("int8", CASES[6], {"sliding_window": 5}, CASE_IDS[6] + "-window5"),
              ("int8", CASES[4], {"softcap": 2.0}, CASE_IDS[4] + "-softcap"),
              ("fp8", CASES[4], {"softcap": 2.0}, CASE_IDS[4] + "-softcap")]]])
    def test_quantized_pages(self, kind, case, options):
        """int8 / fp8 codes + scales: kernel == reference on the same == numpy on the
        dequantized pool (mixed batch, shuffled pages, GQA 3 / 2 / 3)."""
        dtype, N, K, H, page_size, pages_per_block, block_q = case
        q, k, v, *meta = make_batch(11, self.rows(page_size, 11), N=N, K=K, H=H,
                                    page_size=page_size, max_pages=self.long_pages + 2,
                                    dtype=jnp.float32)
        q = q.astype(dtype)
        (kc, ks), (vc, vs) = quantize(k, kind), quantize(v, kind)
        out = ragged_paged_attention(q, kc, vc, *meta, interpret=self.interpret,
                                     pages_per_block=pages_per_block, block_q=block_q,
                                     k_scale=ks, v_scale=vs, **options)
        assert out.shape == q.shape and out.dtype == dtype
        ref = ragged_paged_attention_reference(q, kc, vc, *meta, k_scale=ks, v_scale=vs,
                                               **options)
        assert_close(out, ref.astype(jnp.float32), dtype, f"{kind} kernel vs reference")
        assert_close(ref, naive_ragged_attention(q, dequantize(kc, ks), dequantize(vc, vs), *meta,
                                                 **options),
                     dtype, f"{kind} reference vs numpy on the dequantized pool")
        unowned = ~owned_tokens(meta[2], meta[3], q.shape[0])
        assert np.all(np.asarray(out)[unowned] == 0), "tokens no row owns must give zeros"

    def test_no_token_owned(self):
        """Every row has num_queries 0 (one with keys, one without): all zeros."""
        inputs = make_batch(5, [(0, 0), (9, 0), (3, 0)], N=4, K=2, H=64, page_size=4,
                            max_pages=3, dtype=jnp.float32)
        out = ragged_paged_attention(*inputs, interpret=self.interpret)
        np.testing.assert_array_equal(np.asarray(out), 0.0)

    def test_one_row_owns_every_token(self):
        """A single prefill chunk filling the flat batch, split over several query blocks."""
        inputs = make_batch(6, [(3 * 16 + 5, 21)], N=4, K=2, H=64, page_size=16, max_pages=4,
                            dtype=jnp.float32, pad_tokens=0, gaps=False)
        assert inputs[0].shape[0] == 21 and int(inputs[5][0]) == 0
        out = ragged_paged_attention(*inputs, interpret=self.interpret, block_q=4,
                                     sliding_window=19)
        assert_close(out, naive_ragged_attention(*inputs, sliding_window=19), jnp.float32,
                     "kernel vs numpy")

    @pytest.mark.parametrize("window,pages_per_block,block_q", [(3, 1, 4), (9, 2, 8)])
    def test_ring_buffer_wraps(self, window, pages_per_block, block_q):
        """wraps=True over a ring of window + (most queries of a row) - 1 slots per row, whose
        longer rows have gone round it: the output equals numpy over the same keys laid out
        without wrapping."""
        Z = 4
        rows = mixed_rows(Z, 12) + [(40, 1), (37, 6)]
        inputs = make_batch(11, rows, N=6, K=2, H=32, page_size=Z, max_pages=12,
                            dtype=jnp.float32)
        ring_pages = -(-(window + max(n for _, n in rows) - 1) // Z)
        ring = ring_batch(inputs, ring_pages, seed=12)
        assert max(length for length, _ in rows) > ring_pages * Z + Z
        out = ragged_paged_attention(*ring, sliding_window=window, wraps=True,
                                     interpret=self.interpret, pages_per_block=pages_per_block,
                                     block_q=block_q)
        assert_close(out, naive_ragged_attention(*inputs, sliding_window=window), jnp.float32,
                     "ring kernel vs numpy without wrapping")


def ring_batch(inputs, ring_pages, seed):
    """The batch `inputs` (make_batch's) with each row's keys in a ring of ring_pages pages
    (position p in page tables[r, (p // Z) % ring_pages], written in position order, so later
    positions overwrite earlier ones), the rows' pages shuffled in a pool whose other slots hold
    NaN."""
    q, k, v, lengths, tables, query_start, num_queries = inputs
    k, v, tables, lengths = (np.asarray(x) for x in (k, v, tables, lengths))
    Z, R = k.shape[1], len(lengths)
    rng = np.random.default_rng(seed)
    P = R * ring_pages + 2
    ring_tables = rng.permutation(P)[:R * ring_pages].reshape(R, ring_pages)
    ring_k = np.full((P,) + k.shape[1:], np.nan, np.float32)
    ring_v = np.full((P,) + v.shape[1:], np.nan, np.float32)
    for r, length in enumerate(lengths):
        for p in range(int(length)):
            src = tables[r, p // Z], p % Z
            dst = ring_tables[r, (p // Z) % ring_pages], p % Z
            ring_k[dst], ring_v[dst] = k[src], v[src]
    return (q, jnp.asarray(ring_k), jnp.asarray(ring_v), jnp.asarray(lengths),
            jnp.asarray(ring_tables.astype(np.int32)), query_start, num_queries)


class TestRaggedPagedAttentionInterpret(RaggedPagedAttentionSweep):
    interpret = True


@pytest.mark.slow
class TestRaggedPagedAttentionInterpretLong(RaggedPagedAttentionSweep):
    interpret = True
    long_pages = 12
    extra_rows = 5


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
class TestRaggedPagedAttentionGPU(RaggedPagedAttentionSweep):
    interpret = False
    long_pages = 40
    extra_rows = 24


# The reference against numpy alone, where it is cheaper to sweep wider (about half a second a
# case): the default run takes one options set and dtype per (GQA ratio, page size), every
# options set and dtype among them; the slow run takes the whole product.
REFERENCE_OPTIONS = {"full": {}, "window1": {"sliding_window": 1},
                     "window7": {"sliding_window": 7}, "softcap": {"softcap": 1.0, "sm_scale": 0.3}}
REFERENCE_SWEEP = [
    pytest.param(dtype, N, K, page_size, options,
                 id=f"{jnp.dtype(dtype).name}-N{N}K{K}-page{page_size}-{name}",
                 marks=() if (a, d) == ((b + c) % 2, (b + c) % 4) else pytest.mark.slow)
    for a, dtype in enumerate([jnp.float32, jnp.bfloat16])
    for b, (N, K) in enumerate([(2, 2), (6, 2), (8, 1)])
    for c, page_size in enumerate([1, 4, 16])
    for d, (name, options) in enumerate(REFERENCE_OPTIONS.items())]


@pytest.mark.parametrize("dtype,N,K,page_size,options", REFERENCE_SWEEP)
def test_reference_matches_numpy(dtype, N, K, page_size, options):
    long_pages = max(4, -(-17 // page_size))
    rows = mixed_rows(page_size, long_pages) + [(2 * page_size + 7, 7)]
    inputs = make_batch(6, rows, N=N, K=K, H=32, page_size=page_size,
                        max_pages=max(long_pages, 12 // page_size, 2 + -(-7 // page_size)) + 2,
                        dtype=dtype, q_scale=2.0)
    ref = ragged_paged_attention_reference(*inputs, **options)
    assert_close(ref, naive_ragged_attention(*inputs, **options), dtype, "reference vs numpy")


@pytest.mark.parametrize("block_q", [1, 3, 8])
def test_work_items_cover_each_owned_token_once(block_q):
    """Over random batches (row order, gaps, empty rows, chunks longer than a block): the valid
    queries of the work items are exactly the owned tokens, each once, at the right positions,
    within the static bound; idle items have no valid query."""
    rng = np.random.default_rng(block_q)
    R, T = 8, 8 * 24 + 8 + 2           # fixed shapes: one compile
    schedule = jax.jit(work_items, static_argnames=("num_tokens", "block_q"))
    for trial in range(20):
        counts = [0 if rng.random() < 0.2 else int(rng.integers(1, 25)) for _ in range(R)]
        rows = [(n + int(rng.integers(0, 30)), n) for n in counts]
        _, _, _, lengths, _, starts, counts = make_batch(
            trial, rows, N=2, K=1, H=32, page_size=64, max_pages=1, dtype=jnp.float32,
            gaps=rng.random() < 0.5, num_tokens=T)
        rows_w, table = schedule(lengths, starts, counts, num_tokens=T, block_q=block_q)
        rows_w, table = np.asarray(rows_w), np.asarray(table)
        assert table.shape == (num_work_items(T, R, block_q), 4)
        seen = np.zeros(T, int)
        for r, (length, token, position, valid) in zip(rows_w, table):
            assert 0 <= valid <= block_q
            if not valid:
                continue
            assert length == lengths[r]
            seen[token:token + valid] += 1
            first = token - int(starts[r])
            assert position == int(lengths[r]) - int(counts[r]) + first
            assert first % block_q == 0 and first + valid <= counts[r]
        np.testing.assert_array_equal(seen, owned_tokens(starts, counts, T).astype(int))


def test_padded_group_and_mixed_dtypes():
    """G = 3 query heads per kv head (a query block pads them to 4 rows per token), f32 queries
    over bf16 pages, block_q 3 (not a power of two: allowed in interpret mode)."""
    q, *rest = make_batch(7, mixed_rows(4, 5), N=6, K=2, H=64, page_size=4, max_pages=7,
                          dtype=jnp.bfloat16)
    q = q.astype(jnp.float32)
    out = ragged_paged_attention(q, *rest, interpret=True, block_q=3, pages_per_block=2)
    assert out.dtype == jnp.float32
    assert_close(out, ragged_paged_attention_reference(q, *rest), jnp.bfloat16,
                 "kernel vs reference")


def test_new_lengths_tables_and_query_ranges_compile_nothing(compile_recorder):
    a = make_batch(8, [(5, 2), (9, 1), (4, 4), (0, 0)], N=4, K=2, H=64, page_size=4,
                   max_pages=4, dtype=jnp.float32, num_tokens=12)
    b = make_batch(9, [(13, 1), (2, 2), (0, 0), (3, 3)], N=4, K=2, H=64, page_size=4,
                   max_pages=4, dtype=jnp.float32, num_tokens=12)
    assert all(x.shape == y.shape for x, y in zip(a, b))
    ragged_paged_attention(*a, interpret=True).block_until_ready()
    with compile_recorder() as rec:
        out = ragged_paged_attention(*b, interpret=True)
    assert not rec.logs and not rec.events, rec.logs
    assert_close(out, naive_ragged_attention(*b), jnp.float32, "kernel vs numpy")


@pytest.mark.parametrize("dtype,N,K,H,page_size,pages_per_block,block_q,options", [
    (jnp.bfloat16, 9, 3, 64, 16, 8, 4, {}),
    (jnp.float32, 8, 8, 128, 4, 4, 16, {"sliding_window": 5, "softcap": 2.0}),
    (jnp.bfloat16, 4, 1, 256, 16, 4, 8, {"sliding_window": 5, "wraps": True}),
    (jnp.bfloat16, 8, 2, 128, 16, 4, 4, {"pages_dtype": jnp.int8}),
    (jnp.float32, 2, 1, 256, 16, 1, 16, {"pages_dtype": jnp.float8_e4m3fn,
                                         "sliding_window": 5}),
    (jnp.float16, 16, 2, 32, 16, None, None, {}),
], ids=["bf16-gqa3", "f32-window-softcap", "bf16-ring-window-h256", "bf16-int8-pages",
        "f32-fp8-pages-window-h256",
        "f16-default-blocks"])
def test_body_lowers_through_triton(dtype, N, K, H, page_size, pages_per_block, block_q,
                                    options):
    """The body lowers through Pallas' Triton backend (a CUDA export needs no GPU); the PTX
    compile itself is left to the gpu-marked tests. pages_dtype int8 / fp8: quantized pages with
    [P, Z, K] float32 scales. T = 37 tokens, 5 rows, 9 block-table slots."""
    from jax import export
    options = dict(options)
    pages_dtype = options.pop("pages_dtype", dtype)
    i32 = jax.ShapeDtypeStruct((5,), jnp.int32)
    args = (jax.ShapeDtypeStruct((37, N, H), dtype),
            *[jax.ShapeDtypeStruct((64, page_size, K, H), pages_dtype)] * 2,
            i32, jax.ShapeDtypeStruct((5, 9), jnp.int32), i32, i32)
    blocks = dict(pages_per_block=pages_per_block, block_q=block_q)
    if pages_dtype == dtype:
        f = jax.jit(lambda *a: ragged_paged_attention(*a, **blocks, **options))
    else:
        args += (jax.ShapeDtypeStruct((64, page_size, K), jnp.float32),) * 2
        f = jax.jit(lambda *a: ragged_paged_attention(*a[:7], k_scale=a[7], v_scale=a[8],
                                                      **blocks, **options))
    triton_call = "__gpu$xla.gpu.triton"
    exported = export.export(f, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call(triton_call)])(*args)
    assert triton_call in exported.mlir_module()


class RecordingRef:
    """A numpy-backed stand-in for a kernel ref that logs the indices of every read (pl.ds
    slices become Python slices)."""

    def __init__(self, array, log=None):
        self.array, self.log = np.array(array), log
        self.shape, self.dtype = self.array.shape, self.array.dtype

    @staticmethod
    def _index(idx):
        if isinstance(idx, tuple):
            return tuple(RecordingRef._index(i) for i in idx)
        if isinstance(idx, pl.Slice):
            return slice(int(idx.start), int(idx.start) + idx.size)
        return idx if isinstance(idx, (slice, type(Ellipsis), int)) else np.asarray(idx)

    def __getitem__(self, idx):
        idx = self._index(idx)
        if self.log is not None:
            self.log.append(idx)
        return jnp.asarray(self.array[idx])       # numpy raises on an out-of-range id


def _record_stores(monkeypatch):
    """Replaces the kernel's masked store with a numpy one on RecordingRef outputs."""
    def store(o_ref, start, value, mask):
        rows = slice(int(start), int(start) + value.shape[0])
        o_ref.array[rows] = np.where(np.asarray(mask)[:, None], np.asarray(value),
                                     o_ref.array[rows])
    monkeypatch.setattr(kernel_module, "_store_rows", store)


def run_body_eagerly(inputs, *, block_q, pages_per_block, window, scales=None, logs=None):
    """Runs the kernel body once per (work item, kv head) on recording refs, as the grid would.
    Returns the [T, N, H] output and, per (item, head), the logs of `logs` names
    ("slots", "k", "v", "k_scale", "v_scale")."""
    q, k, v, lengths, tables, starts, counts = (np.asarray(x) for x in inputs)
    T, N, H = q.shape
    Z, K = k.shape[1], k.shape[2]
    G = N // K
    Gp = 1 << (G - 1).bit_length()
    qg = np.zeros((K, T + block_q, Gp, H), np.float32)
    qg[:, :T, :G] = q.reshape(T, K, G, H).transpose(1, 0, 2, 3)
    qg = qg.reshape(K, -1, H)
    rows, table = work_items(jnp.asarray(lengths), jnp.asarray(starts), jnp.asarray(counts),
                             num_tokens=T, block_q=block_q)
    out = np.zeros((K, (T + block_q) * Gp, H), np.float32)
    records = []
    for row, item in zip(np.asarray(rows), np.asarray(table)):
        for h in range(K):
            log = {name: [] for name in ("slots", "k", "v", "k_scale", "v_scale")}
            refs = [RecordingRef(k[:, :, h], log["k"]), RecordingRef(v[:, :, h], log["v"])]
            if scales is not None:
                refs += [RecordingRef(np.asarray(scales[0])[:, :, h], log["k_scale"]),
                         RecordingRef(np.asarray(scales[1])[:, :, h], log["v_scale"])]
            o_ref = RecordingRef(out[h])
            with jax.disable_jit():
                ragged_paged_attention_kernel(
                    RecordingRef(item), RecordingRef(tables[row], log["slots"]),
                    RecordingRef(qg[h]), *refs, o_ref, page_size=Z,
                    pages_per_block=pages_per_block, block_q=block_q, group_rows=Gp,
                    sm_scale=H ** -0.5, softcap=None, sliding_window=window)
            out[h] = o_ref.array
            records.append((row, item, {name: [np.ravel(i).tolist() for i in entries]
                                        for name, entries in log.items()}))
    out = out.reshape(K, T + block_q, Gp, H)[:, :T, :G].transpose(1, 0, 2, 3).reshape(T, N, H)
    return out, records


@pytest.mark.parametrize("pages_per_block", [1, 2])
@pytest.mark.parametrize("window", [None, 3, 9], ids=["full", "window3", "window9"])
def test_reads_only_pages_in_the_window(pages_per_block, window, monkeypatch):
    """Runs the kernel body eagerly on recording refs, one (work item, kv head) program at a
    time: the block-table slots an item reads lie in [first page of its first query's window,
    page of its last query], the pages it reads are exactly the row's pages there, and with one
    page per step each is read once. (Masked reads cannot show in the output, so they are logged
    here.) The output of the body run matches numpy."""
    _record_stores(monkeypatch)
    page_size, block_q = 4, 4
    inputs = make_batch(10, mixed_rows(page_size, 5), N=6, K=2, H=32, page_size=page_size,
                        max_pages=7, dtype=jnp.float32)
    out, records = run_body_eagerly(inputs, block_q=block_q, pages_per_block=pages_per_block,
                                    window=window)
    tables = np.asarray(inputs[4])
    for row, (length, token, position, valid), log in records:
        if not valid:
            assert not any(log.values()), (row, log)
            continue
        end = -(-(position + valid) // page_size)
        first = 0 if window is None else max(0, position - window + 1) // page_size
        owned = set(tables[row, first:end].tolist())
        slots = [s for read in log["slots"] for s in read]
        assert slots and all(first <= s < end for s in slots), (row, position, valid, slots)
        for name in ("k", "v"):
            read = [p for pages in log[name] for p in pages]
            assert set(read) == owned, (row, position, valid, read, owned)
            if pages_per_block == 1:
                assert len(read) == len(owned), (row, read)
    np.testing.assert_allclose(out, naive_ragged_attention(*inputs, sliding_window=window),
                               atol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_reads_scales_of_the_same_pages(kind, monkeypatch):
    """The body on recording refs with quantized pages: the scale reads name exactly the pages of
    the K/V reads, step by step, and the output matches numpy on the dequantized pool."""
    _record_stores(monkeypatch)
    page_size, window = 4, 9
    q, k, v, *meta = make_batch(12, mixed_rows(page_size, 5), N=6, K=2, H=32,
                                page_size=page_size, max_pages=7, dtype=jnp.float32)
    (kc, ks), (vc, vs) = quantize(k, kind), quantize(v, kind)
    out, records = run_body_eagerly((q, kc, vc, *meta), block_q=4, pages_per_block=2,
                                    window=window, scales=(ks, vs))
    for row, item, log in records:
        assert log["k_scale"] == log["k"] and log["v_scale"] == log["v"], (row, log)
        assert bool(log["k"]) == (item[3] > 0)
    np.testing.assert_allclose(out, naive_ragged_attention(
        q, dequantize(kc, ks), dequantize(vc, vs), *meta, sliding_window=window), atol=1e-5)


@pytest.mark.parametrize("kind,max_bound,mean_bound", [
    # Measured on this case (seed 13; float outputs of the owned tokens: max |out| 3.2, rms 0.42):
    #   int8  max abs error 2.10e-2, mean abs error 2.23e-3
    #   fp8   max abs error 1.04e-1, mean abs error 8.9e-3 (3 mantissa bits: coarser)
    # (seeds 0-2 give int8 1.9-2.1e-2, fp8 1.03e-1-1.38e-1 max). The bounds are ~3x the measured.
    ("int8", 0.06, 0.007),
    ("fp8", 0.35, 0.027),
])
def test_quantization_error_bound(kind, max_bound, mean_bound):
    """Kernel on int8 / fp8 pages quantized per (slot, kv head) vs float attention on the original
    float32 pool (mixed batch): the error stays under a stated bound (and is not zero)."""
    q, k, v, *meta = make_batch(13, mixed_rows(16, 4) + [(40, 40), (77, 9)], N=8, K=2, H=64,
                                page_size=16, max_pages=6, dtype=jnp.float32)
    (kc, ks), (vc, vs) = quantize(k, kind), quantize(v, kind)
    out = ragged_paged_attention(q, kc, vc, *meta, interpret=True, pages_per_block=2,
                                 k_scale=ks, v_scale=vs)
    want = naive_ragged_attention(q, k, v, *meta)
    owned = owned_tokens(meta[2], meta[3], q.shape[0])
    err = np.abs(np.asarray(out, np.float64) - want)[owned]
    assert 0 < err.max() <= max_bound, f"{kind}: max abs error {err.max():.3g} > {max_bound}"
    assert err.mean() <= mean_bound, f"{kind}: mean abs error {err.mean():.3g} > {mean_bound}"


def _good():
    pages = jnp.zeros((5, 4, 2, 64), jnp.float32)
    rows = jnp.zeros((2,), jnp.int32)
    return dict(q=jnp.zeros((6, 4, 64), jnp.float32), k_pages=pages, v_pages=pages,
                kv_lengths=rows, block_tables=jnp.zeros((2, 3), jnp.int32), query_start=rows,
                num_queries=rows)


_PAGES8 = jnp.zeros((5, 4, 2, 64), jnp.int8)
_PAGES_FP8 = jnp.zeros((5, 4, 2, 64), jnp.float8_e4m3fn)
_SCALE = jnp.ones((5, 4, 2), jnp.float32)

BAD_INPUTS = {
    "q_rank": dict(q=jnp.zeros((1, 6, 4, 64))),
    "pages_rank": dict(k_pages=jnp.zeros((5, 4, 128)), v_pages=jnp.zeros((5, 4, 128))),
    "kv_lengths_rank": dict(kv_lengths=jnp.zeros((2, 1), jnp.int32)),
    "block_tables_rank": dict(block_tables=jnp.zeros((6,), jnp.int32)),
    "query_start_rank": dict(query_start=jnp.zeros((), jnp.int32)),
    "num_queries_rank": dict(num_queries=jnp.zeros((2, 1), jnp.int32)),
    "q_dtype": dict(q=jnp.zeros((6, 4, 64), jnp.int32)),
    "pages_dtype": dict(v_pages=jnp.zeros((5, 4, 2, 64), jnp.int8)),
    "kv_lengths_dtype": dict(kv_lengths=jnp.zeros((2,), jnp.float32)),
    "block_tables_dtype": dict(block_tables=jnp.zeros((2, 3), jnp.int16)),
    "query_start_dtype": dict(query_start=jnp.zeros((2,), jnp.uint32)),
    "num_queries_dtype": dict(num_queries=jnp.zeros((2,), jnp.float32)),
    "rows_mismatch": dict(num_queries=jnp.zeros((3,), jnp.int32)),
    "pages_shapes_differ": dict(v_pages=jnp.zeros((5, 8, 2, 64), jnp.float32)),
    "heads_not_multiple": dict(q=jnp.zeros((6, 3, 64))),
    "head_dim_48": dict(q=jnp.zeros((6, 4, 48)), k_pages=jnp.zeros((5, 4, 2, 48)),
                        v_pages=jnp.zeros((5, 4, 2, 48))),
    "head_dim_mismatch": dict(q=jnp.zeros((6, 4, 128))),
    "window_0": dict(sliding_window=0),
    "softcap_0": dict(softcap=0.0),
    # quantized pages: scales given together, exactly for int8 / fp8 pages, shaped [P, Z, K],
    # floating
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
ERRORS = {   # the message names the value
    "scales_for_float_pages": "k_scale / v_scale are given", "k_scale_only": "given together",
    "int8_pages_without_scales": "k_scale and v_scale are required",
    "fp8_pages_without_scales": "k_scale and v_scale are required",
    "v_scale_only": "given together", "scale_shape": "k_scale must have the shape",
    "scale_shape_with_head_dim": "v_scale must have the shape",
    "scale_dtype": "k_scale dtype must be floating", "mixed_codes": "both hold int8 or both",
    "rows_mismatch": "num_queries", "query_start_dtype": "query_start has dtype uint32",
}


@pytest.mark.parametrize("fn", ["kernel", "reference"])
@pytest.mark.parametrize("bad", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_invalid_inputs_raise(fn, bad):
    args = {**_good(), **BAD_INPUTS[bad]}
    call = (lambda **a: ragged_paged_attention(**a, interpret=True)) if fn == "kernel" \
        else ragged_paged_attention_reference
    with pytest.raises(ValueError, match=ERRORS.get(bad)):
        call(**args)


def test_valid_edge_inputs_do_not_raise():
    """Zero pages in the table, zero rows, zero tokens, one page in the pool, a float16 pool:
    valid, not errors (all zeros: no row owns a token)."""
    args = _good()
    no_rows = jnp.zeros((0,), jnp.int32)
    for edge in (dict(block_tables=jnp.zeros((2, 0), jnp.int32)),
                 dict(block_tables=jnp.zeros((0, 3), jnp.int32), kv_lengths=no_rows,
                      query_start=no_rows, num_queries=no_rows),
                 dict(q=jnp.zeros((0, 4, 64), jnp.float32)),
                 dict(k_pages=jnp.zeros((1, 4, 2, 64), jnp.float16),
                      v_pages=jnp.zeros((1, 4, 2, 64), jnp.float16))):
        out = ragged_paged_attention(**{**args, **edge}, interpret=True)
        assert out.shape == (args | edge)["q"].shape
        np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_gpu_key_block_fits_shared_memory():
    """The GPU table's target of keys per loop step (docs/gpu.md: 128, the fastest measured on an
    H200) is lowered so that a key block holds at most 64 KiB: float32 with head dim 256 (128 KiB
    at 128 keys overflowed shared memory there) takes 64 keys. An explicit pages_per_block is
    kept; the CPU table has no cap."""
    from pallas_kernels.ragged_paged_attention import block_sizes as bs

    def keys(backend, page, key_bytes, requested=None):
        return page * bs.pages_per_block_for(backend, page, 1000, requested, key_bytes=key_bytes)

    gpu = bs.BLOCK_SIZES["gpu"]
    for H, itemsize, expected in ((128, 2, 128), (128, 4, 128), (256, 2, 128), (256, 4, 64),
                                  (64, 4, 128)):
        got = keys("gpu", 16, H * itemsize)
        assert got == expected, (H, itemsize, got)
        assert got * H * itemsize <= gpu.max_kv_block_bytes
    assert keys("gpu", 16, 256 * 4, requested=8) == 128           # asked for: not capped
    assert keys("gpu", 4, 256 * 4) == 64
    assert keys("cpu", 16, 256 * 4) == bs.BLOCK_SIZES["cpu"].kv_tokens_per_block
    assert bs.pages_per_block_for("gpu", 16, 3, key_bytes=256) == 4   # at most the table width
