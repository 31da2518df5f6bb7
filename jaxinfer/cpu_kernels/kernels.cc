// jaxinfer's CPU kernels: XLA FFI handlers for XLA:CPU, built on the machine that runs them
// (jaxinfer/cpu_kernels/__init__.py compiles this file with -march=native and registers the
// handlers). See docs/cpu_kernels.md for the contract of each handler.
//
// bf16 matrix-vector products for one row of activations (batch-1 decode). XLA:CPU's one-row
// bf16 dots stream the weights at 10-15 GB/s on the development machine, where a loop that
// reads each weight row once, in memory order, converts it to float32 in registers and
// accumulates with FMAs streams at 16-19 GB/s on one core.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "jaxinfer's CPU kernels need AVX-512 (F, BW, VL)"
#endif

namespace ffi = xla::ffi;

namespace {

struct Chunks {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
};

// Runs body(c) for every c in [0, total) on the calling thread and on up to `helpers` tasks
// of XLA's intra-op thread pool. Chunks are claimed from a counter: a task that starts after
// every chunk is claimed returns at once, and the caller waits only for claimed chunks, so a
// pool busy with other work never holds the caller up (nor deadlocks it).
template <typename Body>
void parallel_chunks(ffi::ThreadPool& pool, int64_t total, int64_t helpers, Body body) {
  if (total <= 1 || helpers <= 0) {
    for (int64_t c = 0; c < total; ++c) body(c);
    return;
  }
  auto state = std::make_shared<Chunks>();
  state->total = total;
  auto work = [state, body]() {
    for (;;) {
      int64_t c = state->next.fetch_add(1, std::memory_order_relaxed);
      if (c >= state->total) return;
      body(c);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 0; h < std::min(helpers, total - 1); ++h) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  while (state->done.load(std::memory_order_acquire) < total) _mm_pause();
}

int64_t helper_count(ffi::ThreadPool& pool) {
  return std::max<int64_t>(0, pool.num_threads() - 1);
}

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// 16 bf16 values (the first `n` of them; the rest read as zero) as float32.
inline __m512 load16(const uint16_t* p, int64_t n = 16) {
  __m256i v = n >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                      : _mm256_maskz_loadu_epi16(__mmask16((1u << n) - 1u), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// Rows of the weights asked for ahead of the one being read, into L2: the hardware's own
// prefetching left the one-row products at 15-21 GB/s, and with these requests a jitted chain of
// SmolLM2's 30 layers and head streamed at 21-26 GB/s (alternating runs in one process; the
// machine's jnp.sum reads about 29 GB/s). Into L1, the requests held up the loads.
constexpr int64_t kAheadRows = 4;

// Asks for bytes [p, p + bytes) into L2, a cache line at a time. Written as inline assembly:
// GCC counts a function whose only effect is _mm_prefetch as one without effects and drops
// calls to it that it has not inlined (it did so to a helper that called this).
inline void prefetch_l2(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    asm volatile("prefetcht1 %0" : : "m"(*(static_cast<const char*>(p) + off)));
}

// acc[0:n1-n0] = sum over k in [k0, k1) of x[k] * w[k, n0:n1]: row by row, each row's segment
// read in memory order, the row kAheadRows on asked for; acc (at most kPanel floats) stays in
// L1.
void rows_times_scalars(const uint16_t* x, const uint16_t* w, int64_t N, int64_t k0,
                        int64_t k1, int64_t n0, int64_t n1, float* acc) {
  const int64_t width = n1 - n0;
  std::memset(acc, 0, sizeof(float) * width);
  const int64_t full = width / 32 * 32;
  for (int64_t k = k0; k < k1; ++k) {
    const __m512 xv = _mm512_set1_ps(bf16_to_f32(x[k]));
    const uint16_t* row = w + k * N + n0;
    if (k + kAheadRows < k1) prefetch_l2(row + kAheadRows * N, width * 2);  // the row kAheadRows on
    int64_t n = 0;
    for (; n < full; n += 32) {
      _mm512_storeu_ps(acc + n, _mm512_fmadd_ps(xv, load16(row + n), _mm512_loadu_ps(acc + n)));
      _mm512_storeu_ps(acc + n + 16,
                       _mm512_fmadd_ps(xv, load16(row + n + 16), _mm512_loadu_ps(acc + n + 16)));
    }
    for (; n < width; n += 16) {
      const int64_t m = std::min<int64_t>(16, width - n);
      const __mmask16 mask = __mmask16((1u << m) - 1u);
      _mm512_mask_storeu_ps(acc + n, mask,
                            _mm512_fmadd_ps(xv, load16(row + n, m), _mm512_maskz_loadu_ps(mask, acc + n)));
    }
  }
}

constexpr int64_t kPanel = 2048;  // columns whose float32 sums fit in L1 (8 KiB)

// y[N] = x[K] @ w[K, N] for bf16 x and w, float32 y. Up to kPanel columns, the rows are split
// between the threads (each streams its rows whole) and the partial sums added; wider
// matrices go in column panels of kPanel, each over every row.
ffi::Error RowTimesMatrix(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                          ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto dims = w.dimensions();
  if (dims.size() != 2 || x.element_count() != dims[0] || y->element_count() != dims[1])
    return ffi::Error::InvalidArgument("row_times_matrix: x [K], w [K, N] and y [N] expected");
  const int64_t K = dims[0], N = dims[1];
  const auto* xp = reinterpret_cast<const uint16_t*>(x.typed_data());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.typed_data());
  float* yp = y->typed_data();
  const int64_t helpers = helper_count(pool);
  if (N > kPanel) {
    const int64_t panels = (N + kPanel - 1) / kPanel;
    parallel_chunks(pool, panels, helpers, [=](int64_t c) {
      const int64_t n0 = c * kPanel, n1 = std::min(N, n0 + kPanel);
      rows_times_scalars(xp, wp, N, 0, K, n0, n1, yp + n0);
    });
    return ffi::Error::Success();
  }
  const int64_t parts = std::max<int64_t>(1, std::min(helpers + 1, K / 64));
  const int64_t rows = (K + parts - 1) / parts;
  std::vector<float> partial((parts - 1) * N);
  float* pp = partial.data();
  parallel_chunks(pool, parts, helpers, [=](int64_t c) {
    rows_times_scalars(xp, wp, N, c * rows, std::min(K, (c + 1) * rows), 0, N,
                       c == 0 ? yp : pp + (c - 1) * N);
  });
  for (int64_t c = 1; c < parts; ++c) {
    const float* src = pp + (c - 1) * N;
    for (int64_t n = 0; n < N; ++n) yp[n] += src[n];
  }
  return ffi::Error::Success();
}

// y[N] = w[N, K] @ x[K] for bf16 x and w (w's rows are the outputs: a tied embedding used as
// the output head), float32 y. Four rows at a time, each read in memory order, the four rows
// 2 * kAheadRows on asked for (SmolLM2's head streamed at 22 GB/s with the requests, 15
// without); the rows are shared among the threads in blocks of kRowBlock.
constexpr int64_t kRowBlock = 256;

ffi::Error MatrixTimesRow(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                          ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto dims = w.dimensions();
  if (dims.size() != 2 || x.element_count() != dims[1] || y->element_count() != dims[0])
    return ffi::Error::InvalidArgument("matrix_times_row: x [K], w [N, K] and y [N] expected");
  const int64_t N = dims[0], K = dims[1];
  const auto* xp = reinterpret_cast<const uint16_t*>(x.typed_data());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.typed_data());
  float* yp = y->typed_data();
  const int64_t padded = (K + 15) / 16 * 16;
  std::vector<float> xf(padded, 0.0f);
  for (int64_t k = 0; k < K; ++k) xf[k] = bf16_to_f32(xp[k]);
  const float* xq = xf.data();
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  parallel_chunks(pool, blocks, helper_count(pool), [=](int64_t c) {
    const int64_t r0 = c * kRowBlock, r1 = std::min(N, r0 + kRowBlock);
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) {
      const uint16_t* row = wp + r * K;
      if (r + 2 * kAheadRows + 4 <= N)  // the four rows 2 * kAheadRows on
        prefetch_l2(row + 2 * kAheadRows * K, 4 * K * 2);
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t k = 0; k < K; k += 16) {
        const int64_t m = std::min<int64_t>(16, K - k);
        const __m512 xv = _mm512_loadu_ps(xq + k);
        a0 = _mm512_fmadd_ps(load16(row + k, m), xv, a0);
        a1 = _mm512_fmadd_ps(load16(row + K + k, m), xv, a1);
        a2 = _mm512_fmadd_ps(load16(row + 2 * K + k, m), xv, a2);
        a3 = _mm512_fmadd_ps(load16(row + 3 * K + k, m), xv, a3);
      }
      yp[r] = _mm512_reduce_add_ps(a0);
      yp[r + 1] = _mm512_reduce_add_ps(a1);
      yp[r + 2] = _mm512_reduce_add_ps(a2);
      yp[r + 3] = _mm512_reduce_add_ps(a3);
    }
    for (; r < r1; ++r) {
      const uint16_t* row = wp + r * K;
      __m512 a = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16)
        a = _mm512_fmadd_ps(load16(row + k, std::min<int64_t>(16, K - k)), _mm512_loadu_ps(xq + k), a);
      yp[r] = _mm512_reduce_add_ps(a);
    }
  });
  return ffi::Error::Success();
}


// ---------------------------------------------------------------------------------------------
// bf16 products for a few rows of activations (a decode step of several rows, a speculative
// verification). XLA:CPU hands such dots to a library that repacks the whole weight matrix into
// its own layout on every call, which took longer than the products themselves in a 16-row
// decode step of SmolLM2 (a `perf` profile of the step). These read the weights as they lie,
// with AVX512-BF16's `vdpbf16ps` (pairs of bf16 products added into float32), as XLA's library
// does. Without AVX512-BF16 they are not built, and jaxinfer leaves such dots to XLA.

// The lane sums of v[0..15]: r[j] = sum of v[j]'s 16 lanes (a transposing tree of shuffles).
inline __m512 lane_sums16(const __m512* v) {
  __m512 s1[8];
  for (int j = 0; j < 8; ++j)
    s1[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                          _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  __m512 s2[4];
  for (int j = 0; j < 4; ++j)
    s2[j] = _mm512_add_ps(_mm512_shuffle_ps(s1[2 * j], s1[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(s1[2 * j], s1[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 s3[2];
  for (int j = 0; j < 2; ++j)
    s3[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * j], s2[2 * j + 1], 0x44),
                          _mm512_shuffle_f32x4(s2[2 * j], s2[2 * j + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], 0x88),
                       _mm512_shuffle_f32x4(s3[0], s3[1], 0xDD));
}

#ifdef __AVX512BF16__

// The columns of a 32-column strip of w as two vdpbf16ps operands hold them: lane i of `lo`
// is column c_lo[i] and of `hi` column c_hi[i] (unpack works within 128-bit lanes). Returns
// columns 0..15 and 16..31 in order.
inline void unscramble(__m512 lo, __m512 hi, __m512* first, __m512* second) {
  const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30,
                                       31);
  *first = _mm512_permutex2var_ps(lo, i0, hi);
  *second = _mm512_permutex2var_ps(lo, i1, hi);
}

// y[m0 + r, n0:n0+width] = x[m0 + r] @ w[:, n0:n0+width] for r < RB, width <= 32: the strip's
// rows are read in pairs (k, k+1) and interleaved in registers into vdpbf16ps's pair layout;
// the RB rows' sums stay in registers. An odd K's last row is paired with zeros.
template <int RB>
void rows_strip(const uint16_t* x, const uint16_t* w, int64_t K, int64_t N, int64_t m0,
                int64_t n0, int64_t width, float* y) {
  const __mmask32 cols = width >= 32 ? ~__mmask32(0) : __mmask32((1ull << width) - 1);
  __m512 lo[RB], hi[RB];
  for (int r = 0; r < RB; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const uint16_t* xr = x + m0 * K;
  auto step = [&](const uint16_t* row, const uint16_t* next, const uint16_t* xk, bool pair) {
    const __m512i a = _mm512_maskz_loadu_epi16(cols, row);
    const __m512i b = pair ? _mm512_maskz_loadu_epi16(cols, next) : _mm512_setzero_si512();
    const __m512bh pl = (__m512bh)_mm512_unpacklo_epi16(a, b);
    const __m512bh ph = (__m512bh)_mm512_unpackhi_epi16(a, b);
    for (int r = 0; r < RB; ++r) {
      uint32_t xx = xk[r * K];  // x[k] in the low half, x[k + 1] (or 0) in the high half
      if (pair) std::memcpy(&xx, xk + r * K, sizeof xx);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(int32_t(xx));
      lo[r] = _mm512_dpbf16_ps(lo[r], pl, xv);
      hi[r] = _mm512_dpbf16_ps(hi[r], ph, xv);
    }
  };
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) step(w + k * N + n0, w + (k + 1) * N + n0, xr + k, true);
  if (k < K) step(w + k * N + n0, nullptr, xr + k, false);
  const __mmask16 m_first = width >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << width) - 1u);
  const __mmask16 m_second =
      width >= 32 ? __mmask16(0xFFFF) : width > 16 ? __mmask16((1u << (width - 16)) - 1u) : 0;
  for (int r = 0; r < RB; ++r) {
    __m512 first, second;
    unscramble(lo[r], hi[r], &first, &second);
    float* out = y + (m0 + r) * N + n0;
    _mm512_mask_storeu_ps(out, m_first, first);
    _mm512_mask_storeu_ps(out + 16, m_second, second);
  }
}

// f(std::integral_constant<int, rb>) for the largest rb in {8, 4, 2, 1} that is <= rows.
template <typename F>
inline int64_t with_rows(int64_t rows, F f) {
  if (rows >= 8) { f(std::integral_constant<int, 8>()); return 8; }
  if (rows >= 4) { f(std::integral_constant<int, 4>()); return 4; }
  if (rows >= 2) { f(std::integral_constant<int, 2>()); return 2; }
  f(std::integral_constant<int, 1>());
  return 1;
}

// y[M, N] = x[M, K] @ w[K, N] for bf16 x and w, float32 y. The threads share strips of 32
// columns, each over every row of w and block by block of activation rows: the strip is read
// from memory for the first block and from cache for the rest (reading the weights a block of
// rows at a time for every strip was slower: 22 against 20 ms for SmolLM2's 30 layers at 16
// rows). Each output is summed over k in order, as XLA's dot does (it equalled XLA's dot bit for
// bit with jaxlib 0.10.2 on the development machine: an observation, not a contract).
ffi::Error RowsTimesMatrix(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                           ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions(), xd = x.dimensions();
  if (wd.size() != 2 || xd.size() != 2 || xd[1] != wd[0] ||
      y->element_count() != xd[0] * wd[1])
    return ffi::Error::InvalidArgument("rows_times_matrix: x [M, K], w [K, N], y [M, N] expected");
  const int64_t M = xd[0], K = wd[0], N = wd[1];
  const auto* xp = reinterpret_cast<const uint16_t*>(x.typed_data());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.typed_data());
  float* yp = y->typed_data();
  parallel_chunks(pool, (N + 31) / 32, helper_count(pool), [=](int64_t c) {
    const int64_t n0 = c * 32, width = std::min<int64_t>(32, N - n0);
    for (int64_t m0 = 0; m0 < M;)
      m0 += with_rows(M - m0, [&](auto rb) {
        rows_strip<decltype(rb)::value>(xp, wp, K, N, m0, n0, width, yp);
      });
  });
  return ffi::Error::Success();
}

// y[m, n] = w[n] . x[m] for 4 rows of x and 4 rows of w (indices clamped to the last row; only
// the valid ones stored): both rows are contiguous in k, so a 32-element load of each is
// already in vdpbf16ps's pair layout; each product's 16 lanes are summed at the end. The 16
// sums are named registers (an array of them was written back to memory every iteration).
inline void head_block(const uint16_t* x, const uint16_t* w, int64_t K, int64_t M, int64_t N,
                       int64_t m0, int64_t n0, float* y) {
  const uint16_t* xr[4];
  const uint16_t* wr[4];
  for (int i = 0; i < 4; ++i) {
    xr[i] = x + std::min(m0 + i, M - 1) * K;
    wr[i] = w + std::min(n0 + i, N - 1) * K;
  }
  __m512 a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15;
  a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = a10 = a11 = a12 = a13 = a14 = a15 =
      _mm512_setzero_ps();
  auto step = [&](__mmask32 mask, int64_t k) {
    __m512bh wv[4], xv[4];
    for (int i = 0; i < 4; ++i) {
      wv[i] = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[i] + k);
      xv[i] = (__m512bh)_mm512_maskz_loadu_epi16(mask, xr[i] + k);
    }
#define JAXINFER_DOT4(a, b, c, d, mi)        \
    a = _mm512_dpbf16_ps(a, wv[0], xv[mi]);  \
    b = _mm512_dpbf16_ps(b, wv[1], xv[mi]);  \
    c = _mm512_dpbf16_ps(c, wv[2], xv[mi]);  \
    d = _mm512_dpbf16_ps(d, wv[3], xv[mi]);
    JAXINFER_DOT4(a0, a1, a2, a3, 0)
    JAXINFER_DOT4(a4, a5, a6, a7, 1)
    JAXINFER_DOT4(a8, a9, a10, a11, 2)
    JAXINFER_DOT4(a12, a13, a14, a15, 3)
#undef JAXINFER_DOT4
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step(~__mmask32(0), k);
  if (k < K) step(__mmask32((1ull << (K - k)) - 1), k);
  const __m512 v[16] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15};
  alignas(64) float s[16];  // s[mi * 4 + ni]
  _mm512_store_ps(s, lane_sums16(v));
  const int64_t nn = std::min<int64_t>(4, N - n0);
  for (int64_t mi = 0; mi < std::min<int64_t>(4, M - m0); ++mi)
    std::memcpy(y + (m0 + mi) * N + n0, s + mi * 4, sizeof(float) * nn);
}

// y[M, N] = x[M, K] @ w[N, K]^T for bf16 x and w (w's rows are the outputs: a tied embedding
// used as the output head), float32 y. The threads share blocks of kRowBlock rows of w.
ffi::Error MatrixTimesRows(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                           ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions(), xd = x.dimensions();
  if (wd.size() != 2 || xd.size() != 2 || xd[1] != wd[1] ||
      y->element_count() != xd[0] * wd[0])
    return ffi::Error::InvalidArgument("matrix_times_rows: x [M, K], w [N, K], y [M, N] expected");
  const int64_t M = xd[0], N = wd[0], K = wd[1];
  const auto* xp = reinterpret_cast<const uint16_t*>(x.typed_data());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.typed_data());
  float* yp = y->typed_data();
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  parallel_chunks(pool, blocks, helper_count(pool), [=](int64_t c) {
    const int64_t r1 = std::min(N, (c + 1) * kRowBlock);
    for (int64_t n0 = c * kRowBlock; n0 < r1; n0 += 4) {
      if (n0 + 2 * kAheadRows + 4 <= N)  // as matrix_times_row: 3.4 against 5.2 ms at 16 rows
        prefetch_l2(wp + (n0 + 2 * kAheadRows) * K, 4 * K * 2);
      for (int64_t m0 = 0; m0 < M; m0 += 4) head_block(xp, wp, K, M, N, m0, n0, yp);
    }
  });
  return ffi::Error::Success();
}

#else  // no AVX512-BF16: jaxinfer/cpu_kernels/__init__.py never calls these

ffi::Error RowsTimesMatrix(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::BF16>,
                           ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error::Internal("rows_times_matrix: built without AVX512-BF16");
}

ffi::Error MatrixTimesRows(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::BF16>,
                           ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error::Internal("matrix_times_rows: built without AVX512-BF16");
}

#endif  // __AVX512BF16__


// ---------------------------------------------------------------------------------------------
// Decode attention over a paged KV pool: one query per tile (a decoding row), every kv head's G
// queries against the row's keys up to the query's position (and within a sliding window), in
// float32 with an online softmax over groups of up to 16 keys of one page.

// exp(x) for float32 x (x <= 0 here: scores minus their running maximum); below -87 it is 0.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2 in two steps (Cody-Waite), |r| <= ln2 / 2.
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  // e^r by its Taylor series to r^7 (relative error below 1e-8 for |r| <= 0.347).
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, n));
}

// softcap * tanh(s / softcap), tanh(y) = sign(y) (1 - e) / (1 + e) with e = exp(-2 |y|).
inline __m512 softcap16(__m512 s, float softcap) {
  const __m512 y = _mm512_mul_ps(s, _mm512_set1_ps(1.0f / softcap));
  const __m512 a = _mm512_abs_ps(y);
  const __m512 e = exp16(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)));
  const __m512 one = _mm512_set1_ps(1.0f);
  __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  t = _mm512_mask_sub_ps(t, _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ),
                         _mm512_setzero_ps(), t);
  return _mm512_mul_ps(t, _mm512_set1_ps(softcap));
}

template <typename T>
inline __m512 load_key16(const T* p);
template <>
inline __m512 load_key16<uint16_t>(const uint16_t* p) { return load16(p); }
template <>
inline __m512 load_key16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load_key16<int8_t>(const int8_t* p) {  // int8 codes, their scale applied later
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// A float8 e4m3fn code (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities,
// S.1111.111 is NaN), as the pool holds it.
struct E4M3 {
  uint8_t bits;
};

// 16 e4m3fn codes as float32, exactly (their scale applied later). The code's sign moved to
// bit 31 and its exponent and mantissa into float32's fields (one shift of the sign-extended
// byte and a mask), then 120 added to the exponent: that is a normal code's value. A subnormal
// code (exponent 0) is m * 2^-9 = (1 + m/8) * 2^-6 - 2^-6 (its sign on both), computed by
// rebiasing by 121 and subtracting the value with its mantissa cleared (exact); NaN codes give
// NaN. Neither is in most groups of 16, which then skip both.
template <>
inline __m512 load_key16<E4M3>(const E4M3* p) {
  const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i x = _mm512_add_epi32(
      _mm512_and_si512(_mm512_slli_epi32(b, 20), _mm512_set1_epi32(int32_t(0x87F00000u))),
      _mm512_set1_epi32(120 << 23));
  const __mmask16 sub = _mm512_testn_epi32_mask(b, _mm512_set1_epi32(0x78));
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7F)),
                                                _mm512_set1_epi32(0x7F));
  __m512 v = _mm512_castsi512_ps(x);
  if (__builtin_expect((sub | nan) != 0, 0)) {
    const __m512i up = _mm512_add_epi32(x, _mm512_set1_epi32(1 << 23));
    const __m512i lead = _mm512_and_si512(up, _mm512_set1_epi32(int32_t(0xFF800000u)));
    v = _mm512_mask_sub_ps(v, sub, _mm512_castsi512_ps(up), _mm512_castsi512_ps(lead));
    v = _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(NAN));
  }
  return v;
}


// r[j] = the sum of the 16 lanes of v[j] for j < n (r[j] = 0 beyond): a transposing tree of
// shuffles and adds, 45 instructions for 16 vectors where one horizontal sum each takes 128.
inline __m512 sum_each16(const float (*v)[16], int64_t n) {
  __m512 x[16];
  for (int j = 0; j < 16; ++j) x[j] = j < n ? _mm512_load_ps(v[j]) : _mm512_setzero_ps();
  return lane_sums16(x);
}


// Keys from position pos on that one group takes: up to 16, within pos's page, up to end.
inline int64_t group_size(int64_t pos, int64_t end, int64_t Z) {
  return std::min<int64_t>({16, Z - pos % Z, end - pos + 1});
}


// A key or value row of H = 16 * HB elements as HB vectors of float32. bf16 rows are read 32
// elements at a time and split into their even and odd elements, a shift and a mask where
// widening them in order takes four conversions: vector 2c holds elements 32c + 2i and vector
// 2c + 1 elements 32c + 2i + 1 (i < 16). attend_row lays the queries out alike (kSplit) and
// puts the sums back in order at the end.
template <typename T>
constexpr bool kSplit = std::is_same_v<T, uint16_t>;

template <typename T, int HB>
inline void load_row(const T* p, __m512* out) {
  if constexpr (kSplit<T>) {
    const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
    for (int c = 0; c < HB / 2; ++c) {
      const __m512i w = _mm512_loadu_si512(p + 32 * c);
      out[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
      out[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, high));
    }
  } else {
    for (int b = 0; b < HB; ++b) out[b] = load_key16<T>(p + 16 * b);
  }
}

// partial[g][j] = q[g] * k[j] lane by lane (its lanes summed later), for GB queries of one kv
// head (kept in registers) and the group's count keys k[j] = kp + j * stride.
template <typename T, int HB, int GB>
inline void qk_block(const float* q, const T* kp, int64_t stride, int64_t count,
                     float (*partial)[16][16]) {
  __m512 qv[GB][HB];
  for (int g = 0; g < GB; ++g)
    for (int b = 0; b < HB; ++b) qv[g][b] = _mm512_loadu_ps(q + g * 16 * HB + 16 * b);
  for (int64_t j = 0; j < count; ++j) {
    __m512 kk[HB];
    load_row<T, HB>(kp + j * stride, kk);
    for (int g = 0; g < GB; ++g) {
      __m512 d = _mm512_mul_ps(qv[g][0], kk[0]);
      for (int b = 1; b < HB; ++b) d = _mm512_fmadd_ps(qv[g][b], kk[b], d);
      _mm512_store_ps(partial[g][j], d);
    }
  }
}

// acc[g] += sum_j probs[g][j] * v[j] for GB queries of one kv head (acc kept in registers).
template <typename T, int HB, int GB>
inline void pv_block(const float (*probs)[16], const T* vp, int64_t stride, int64_t count,
                     float (*acc)[16 * HB]) {
  __m512 a[GB][HB];
  for (int g = 0; g < GB; ++g)
    for (int b = 0; b < HB; ++b) a[g][b] = _mm512_load_ps(acc[g] + 16 * b);
  for (int64_t j = 0; j < count; ++j) {
    __m512 vv[HB];
    load_row<T, HB>(vp + j * stride, vv);
    for (int g = 0; g < GB; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g][j]);
      for (int b = 0; b < HB; ++b) a[g][b] = _mm512_fmadd_ps(p, vv[b], a[g][b]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int b = 0; b < HB; ++b) _mm512_store_ps(acc[g] + 16 * b, a[g][b]);
}

// Queries of one kv head taken together (their products kept in registers): four, or two at
// 256 head dims.
template <int HB>
constexpr int64_t kGroupStep = HB >= 16 ? 2 : 4;

// f(std::integral_constant<int, gb>) for gb in 1..kGroupStep<HB>.
template <int HB, typename F>
inline void with_group(int64_t gb, F f) {
  switch (gb) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: if constexpr (kGroupStep<HB> >= 3) f(std::integral_constant<int, 3>()); break;
    case 4: if constexpr (kGroupStep<HB> >= 4) f(std::integral_constant<int, 4>()); break;
  }
}

constexpr int kMaxHeads = 64;  // kv heads x G queries of one row

// Groups whose scores are taken together before their values are summed: one online-softmax
// step (one maximum, one correction) per chunk instead of per group. With the walk below,
// 30 layers of SmolLM2's 16-row decode attention took 3.2-3.5 ms against 4.6 ms (groups one
// at a time, each group's keys then values, the next group asked for), alternating in one
// process; 8 and 16 groups a chunk, and 1 to 3 items ahead, were alike.
constexpr int64_t kChunkGroups = 8;
// Whether the pool holds codes with scales (int8 or float8), and the groups whose value scales
// are kept: the chunk's for codes, none otherwise.
template <typename T>
constexpr bool kScaled = std::is_same_v<T, int8_t> || std::is_same_v<T, E4M3>;
template <typename T>
constexpr int64_t kScaledChunkGroups = kScaled<T> ? kChunkGroups : 1;

// A row's keys from start to end in the order attend_row reads them: chunks of up to
// kChunkGroups groups, each chunk's key groups and then its value groups (items).
struct Walk {
  const int32_t* table;
  int64_t M, Z, end;
  int64_t ng = 0, item = 0;  // the chunk's groups, the item within the chunk (0 .. 2 ng)
  int64_t gpos[kChunkGroups + 1], gslot[kChunkGroups], gcount[kChunkGroups];

  Walk(const int32_t* table, int64_t M, int64_t Z, int64_t end, int64_t start)
      : table(table), M(M), Z(Z), end(end) {
    chunk(start);
  }
  void chunk(int64_t pos) {
    ng = item = 0;
    gpos[0] = pos;
    while (ng < kChunkGroups && gpos[ng] <= end) {
      gcount[ng] = group_size(gpos[ng], end, Z);
      gslot[ng] = table[(gpos[ng] / Z) % M] * Z + gpos[ng] % Z;
      gpos[ng + 1] = gpos[ng] + gcount[ng];
      ++ng;
    }
  }
  bool done() const { return ng == 0; }
  bool values() const { return item >= ng; }
  int64_t group() const { return item % ng; }
  void advance() {
    if (ng > 0 && ++item == 2 * ng) chunk(gpos[ng]);
  }
};

// Asks for kv head kh's share of the walk's current group (its keys or values) into L2, and
// with kv head 0 the group's scales where the pool has them.
template <typename T>
inline void ask(const Walk& w, const T* k_layer, const T* v_layer, const float* ks_layer,
                const float* vs_layer, int64_t stride, int64_t K, int64_t kh) {
  if (w.done()) return;
  const int64_t g = w.group();
  if (kScaled<T> && kh == 0)
    prefetch_l2((w.values() ? vs_layer : ks_layer) + w.gslot[g] * K,
                w.gcount[g] * K * int64_t(sizeof(float)));
  const int64_t bytes = w.gcount[g] * stride * int64_t(sizeof(T));
  const int64_t share = (bytes / K + 63) / 64 * 64;
  const char* base = reinterpret_cast<const char*>((w.values() ? v_layer : k_layer) +
                                                   w.gslot[g] * stride);
  prefetch_l2(base + kh * share, std::min(bytes, (kh + 1) * share) - kh * share);
}

// Items a walk asks for ahead of the one being read.
constexpr int64_t kAheadItems = 2;

// One row's query heads, NH = K * G of them (q [K, G, 16 * HB]), over the keys at positions
// [start, end] of a row whose logical page j is table[j % M]; out [K, G, 16 * HB]. The keys
// go in chunks of up to kChunkGroups groups of up to 16 keys of one page: the chunk's scores
// group by group, one online-softmax step for the whole chunk, then its values group by group.
// A group is read slot by slot, every kv head of a slot together (a slot's keys are contiguous
// in the pool), so the reads run in memory order within a page; a second walk asks for the
// groups kAheadItems on.
template <typename T, int HB>
void attend_row(const float* q, float scale, int64_t K, int64_t G, const T* k_layer,
                const T* v_layer, const float* ks_layer, const float* vs_layer,
                const int32_t* table, int64_t M, int64_t Z, int64_t start, int64_t end,
                float softcap, float* out) {
  constexpr int64_t H = 16 * HB;
  const int64_t NH = K * G;
  const int64_t stride = K * H;  // between consecutive slots of the pool
  alignas(64) float acc[kMaxHeads][H];
  float m[kMaxHeads], l[kMaxHeads];
  for (int64_t n = 0; n < NH; ++n) {
    std::memset(acc[n], 0, sizeof acc[n]);
    m[n] = -INFINITY;
    l[n] = 0.0f;
  }
  // The queries times scale (one float32 multiply each), in load_row's order where it splits
  // the keys.
  alignas(64) float q_scaled[kMaxHeads][H];
  const __m512 by = _mm512_set1_ps(scale);
  const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
  for (int64_t n = 0; n < NH; ++n)
    for (int64_t c = 0; c < H; c += 32) {
      const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(q + n * H + c), by);
      const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(q + n * H + c + 16), by);
      if constexpr (kSplit<T>) {
        _mm512_store_ps(q_scaled[n] + c, _mm512_permutex2var_ps(lo, evens, hi));
        _mm512_store_ps(q_scaled[n] + c + 16, _mm512_permutex2var_ps(lo, odds, hi));
      } else {
        _mm512_store_ps(q_scaled[n] + c, lo);
        _mm512_store_ps(q_scaled[n] + c + 16, hi);
      }
    }
  q = q_scaled[0];
  alignas(64) float partial[kMaxHeads][16][16];
  // A chunk's scores, then its probabilities: [group][head][key], NH heads a group.
  alignas(64) float probs_all[kChunkGroups * kMaxHeads][16];
  auto probs = [&](int64_t g) { return probs_all + g * NH; };
  // A quantized pool's scales of a group's keys, and of the chunk's values, kv head by kv head
  // (0 past a group's keys): a score is q . codes times its key's scale, and a value's scale
  // goes into its probability.
  alignas(64) float k_scales[kMaxHeads][16];
  alignas(64) float v_scales_all[kScaledChunkGroups<T> * kMaxHeads][16];
  auto v_scales = [&](int64_t g) { return v_scales_all + g * K; };
  constexpr bool scaled = kScaled<T>;  // ks_layer and vs_layer are set for codes
  // The second walk, kAheadItems groups on, asks for what the first reads next into L2, a kv
  // head's share with each kv head's products.
  Walk walk(table, M, Z, end, start), ahead = walk;
  // For each kv head: its share of what comes next asked for, then block(kh, g0, gb) for its
  // queries, kGroupStep<HB> at a time.
  auto each_kv_head = [&](auto block) {
    for (int64_t kh = 0; kh < K; ++kh) {
      ask(ahead, k_layer, v_layer, ks_layer, vs_layer, stride, K, kh);
      for (int64_t g0 = 0; g0 < G; g0 += kGroupStep<HB>)
        with_group<HB>(std::min<int64_t>(kGroupStep<HB>, G - g0),
                       [&](auto gb) { block(kh, g0, gb); });
    }
  };
  for (int64_t i = 0; i < kAheadItems; ++i) {
    for (int64_t kh = 0; kh < K; ++kh) ask(ahead, k_layer, v_layer, ks_layer, vs_layer, stride, K, kh);
    ahead.advance();
  }
  while (!walk.done()) {
    const int64_t ng = walk.ng;
    for (int64_t g = 0; g < ng; ++g, walk.advance(), ahead.advance()) {
      const int64_t count = walk.gcount[g], slot0 = walk.gslot[g];
      if constexpr (scaled) {
        for (int64_t kh = 0; kh < K; ++kh)
          for (int64_t j = 0; j < 16; ++j) {
            k_scales[kh][j] = j < count ? ks_layer[(slot0 + j) * K + kh] : 0.0f;
            v_scales(g)[kh][j] = j < count ? vs_layer[(slot0 + j) * K + kh] : 0.0f;
          }
      }
      each_kv_head([&](int64_t kh, int64_t g0, auto gb) {
        qk_block<T, HB, decltype(gb)::value>(q + (kh * G + g0) * H,
                                             k_layer + slot0 * stride + kh * H, stride, count,
                                             partial + kh * G + g0);
      });
      const __mmask16 live = __mmask16((1u << count) - 1u);
      for (int64_t n = 0; n < NH; ++n) {
        __m512 s = sum_each16(partial[n], count);
        if constexpr (scaled) s = _mm512_mul_ps(s, _mm512_load_ps(k_scales[n / G]));
        if (softcap > 0.0f) s = softcap16(s, softcap);
        _mm512_store_ps(probs(g)[n], _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, s));
      }
    }
    // The chunk's softmax, one online step for all its groups.
    for (int64_t n = 0; n < NH; ++n) {
      __m512 top = _mm512_load_ps(probs(0)[n]);
      for (int64_t g = 1; g < ng; ++g) top = _mm512_max_ps(top, _mm512_load_ps(probs(g)[n]));
      const float m_new = std::max(m[n], _mm512_reduce_max_ps(top));
      const __m512 shift = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t g = 0; g < ng; ++g) {
        const __m512 p = exp16(_mm512_sub_ps(_mm512_load_ps(probs(g)[n]), shift));  // 0 at -inf
        sum = _mm512_add_ps(sum, p);
        if constexpr (scaled)
          _mm512_store_ps(probs(g)[n], _mm512_mul_ps(p, _mm512_load_ps(v_scales(g)[n / G])));
        else
          _mm512_store_ps(probs(g)[n], p);
      }
      const float corr = std::exp(m[n] - m_new);  // 0 on the first chunk (m = -inf)
      l[n] = l[n] * corr + _mm512_reduce_add_ps(sum);
      m[n] = m_new;
      if (corr != 1.0f) {
        const __m512 c = _mm512_set1_ps(corr);
        for (int b = 0; b < HB; ++b)
          _mm512_store_ps(acc[n] + 16 * b, _mm512_mul_ps(_mm512_load_ps(acc[n] + 16 * b), c));
      }
    }
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t count = walk.gcount[g], slot0 = walk.gslot[g];
      each_kv_head([&](int64_t kh, int64_t g0, auto gb) {
        pv_block<T, HB, decltype(gb)::value>(probs(g) + kh * G + g0,
                                             v_layer + slot0 * stride + kh * H, stride, count,
                                             acc + kh * G + g0);
      });
      walk.advance();
      ahead.advance();
    }
  }
  const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  for (int64_t n = 0; n < NH; ++n) {
    const __m512 inv = _mm512_set1_ps(l[n] > 0.0f ? 1.0f / l[n] : 0.0f);
    if constexpr (kSplit<T>) {  // vectors b, b + 1: elements 16b + 2i and 16b + 2i + 1
      for (int b = 0; b < HB; b += 2) {
        const __m512 even = _mm512_mul_ps(_mm512_load_ps(acc[n] + 16 * b), inv);
        const __m512 odd = _mm512_mul_ps(_mm512_load_ps(acc[n] + 16 * (b + 1)), inv);
        _mm512_storeu_ps(out + n * H + 16 * b, _mm512_permutex2var_ps(even, first, odd));
        _mm512_storeu_ps(out + n * H + 16 * (b + 1), _mm512_permutex2var_ps(even, second, odd));
      }
    } else {
      for (int b = 0; b < HB; ++b)
        _mm512_storeu_ps(out + n * H + 16 * b, _mm512_mul_ps(_mm512_load_ps(acc[n] + 16 * b), inv));
    }
  }
}

template <typename T, int HB>
void attend_all(ffi::ThreadPool& pool, const float* q, int64_t T_, float scale, const T* k,
                const T* v, const float* ks, const float* vs, int64_t layer, int64_t slots,
                int64_t Nt, int64_t K, int64_t G, const int32_t* tables, int64_t B, int64_t M,
                const int32_t* token, const int32_t* row, const int32_t* pos, int64_t Z,
                int64_t window, float softcap, float* out) {
  constexpr int64_t H = 16 * HB;
  const int64_t per_token = K * G * H;
  const T* k_layer = k + layer * slots * K * H;
  const T* v_layer = v + layer * slots * K * H;
  const float* ks_layer = ks ? ks + layer * slots * K : nullptr;
  const float* vs_layer = vs ? vs + layer * slots * K : nullptr;
  // Tokens that no tile names keep zeros.
  std::memset(out, 0, sizeof(float) * T_ * per_token);
  parallel_chunks(pool, Nt, helper_count(pool), [=](int64_t t) {
    const int64_t end = pos[t], tok = token[t], r = row[t];
    if (end < 0 || tok < 0 || tok >= T_ || r < 0 || r >= B) return;
    const int64_t start = window > 0 ? std::max<int64_t>(0, end - window + 1) : 0;
    attend_row<T, HB>(q + tok * per_token, scale, K, G, k_layer, v_layer, ks_layer, vs_layer,
                      tables + r * M, M, Z, start, end, softcap, out + tok * per_token);
  });
}

// The pools as the attention reads them: k and v's elements (in place) and their common
// element type and dimensions.
struct Pools {
  const void* k;
  const void* v;
  ffi::DataType type;
  ffi::AnyBuffer::Dimensions dims;
};

ffi::Error attend_pools(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, const Pools& kv,
                        ffi::Buffer<ffi::F32>& k_scale, ffi::Buffer<ffi::F32>& v_scale,
                        ffi::Buffer<ffi::S32>& layer, ffi::Buffer<ffi::S32>& tables,
                        ffi::Buffer<ffi::S32>& token, ffi::Buffer<ffi::S32>& row,
                        ffi::Buffer<ffi::S32>& pos, ffi::ResultBuffer<ffi::F32>& out,
                        int64_t page_size, int64_t window, float softcap, float scale) {
  const auto qd = q.dimensions(), kd = kv.dims, td = tables.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("decode_attention: q [T, K, G, H], k/v [L, S, K, H], "
                                       "tables [B, M] expected");
  const int64_t T_ = qd[0], K = qd[1], G = qd[2], H = qd[3];
  const int64_t L = kd[0], slots = kd[1], B = td[0], M = td[1], Nt = pos.element_count();
  if (kd[2] != K || kd[3] != H || token.element_count() != Nt || row.element_count() != Nt ||
      out->element_count() != q.element_count() || K * G > kMaxHeads || page_size <= 0 ||
      slots % page_size != 0)
    return ffi::Error::InvalidArgument("decode_attention: inconsistent shapes");
  const auto type = kv.type;
  const bool codes = type == ffi::DataType::S8 || type == ffi::DataType::F8E4M3FN ||
                     type == ffi::DataType::U8;
  if (type != ffi::DataType::U16 && type != ffi::DataType::F32 && !codes)
    return ffi::Error::InvalidArgument("decode_attention: k/v must be u16 (bf16 bits), f32, "
                                       "s8 (int8 codes), f8e4m3fn or u8 (float8 e4m3fn codes, "
                                       "or their bits)");
  const int64_t scales = codes ? L * slots * K : 0;
  if (k_scale.element_count() != scales || v_scale.element_count() != scales)
    return ffi::Error::InvalidArgument("decode_attention: k/v scales [L, S, K] go with int8 "
                                       "or float8 codes, and only with them");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("decode_attention: layer out of range");
  float* op = out->typed_data();
  const float* ks = codes ? k_scale.typed_data() : nullptr;
  const float* vs = codes ? v_scale.typed_data() : nullptr;
  auto attend = [&](auto hb) -> ffi::Error {
    constexpr int HB = decltype(hb)::value;
    auto run = [&](auto* kp) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
      attend_all<T, HB>(pool, q.typed_data(), T_, scale, kp,
                        static_cast<const T*>(kv.v), ks, vs, l, slots, Nt, K, G,
                        tables.typed_data(), B, M, token.typed_data(), row.typed_data(),
                        pos.typed_data(), page_size, window, softcap, op);
    };
    if (type == ffi::DataType::U16) run(static_cast<const uint16_t*>(kv.k));
    else if (type == ffi::DataType::F32) run(static_cast<const float*>(kv.k));
    else if (type == ffi::DataType::S8) run(static_cast<const int8_t*>(kv.k));
    else run(static_cast<const E4M3*>(kv.k));
    return ffi::Error::Success();
  };
  switch (H % 16 == 0 ? H / 16 : 0) {
    case 2: return attend(std::integral_constant<int, 2>());
    case 4: return attend(std::integral_constant<int, 4>());
    case 8: return attend(std::integral_constant<int, 8>());
    case 16: return attend(std::integral_constant<int, 16>());
    default: break;
  }
  return ffi::Error::InvalidArgument("decode_attention: head_dim must be 32, 64, 128 or 256");
}

// q [T, K, G, H] float32, the step's queries (unscaled: each is multiplied by `scale` first);
// k, v [L, slots, K, H] (bf16 bits as u16, float32, int8 codes, or float8 e4m3fn codes as
// f8e4m3fn or as their bits in u8); k_scale, v_scale [L, slots, K] float32 for codes (value =
// code * scale), empty otherwise; layer [] s32;
// tables [B, M] s32, each row's pages; token, row, pos [Nt] s32: tile t is the query of token
// token[t] (T or more: none), of row row[t] (B or more: none), at position pos[t] (-1: none).
// out [T, K, G, H] float32: each tile's attention at its token, zeros for tokens no tile names.
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                           ffi::AnyBuffer v, ffi::Buffer<ffi::F32> k_scale,
                           ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> token,
                           ffi::Buffer<ffi::S32> row, ffi::Buffer<ffi::S32> pos,
                           ffi::ResultBuffer<ffi::F32> out, int64_t page_size, int64_t window,
                           float softcap, float scale) {
  if (k.element_type() != v.element_type() || k.element_count() != v.element_count())
    return ffi::Error::InvalidArgument("decode_attention: k and v pools differ");
  return attend_pools(pool, q, Pools{k.untyped_data(), v.untyped_data(), k.element_type(),
                                     k.dimensions()},
                      k_scale, v_scale, layer, tables, token, row, pos, out, page_size, window,
                      softcap, scale);
}

// One float32 value as bf16 bits, rounded to nearest even (NaN stays a quiet NaN).
inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// decode_attention after writing the step's new keys and values: k_new, v_new [T, K, H]
// float32 go into layer `layer`'s slots[t] of the pools (bf16 bits, rounded to nearest even,
// or float32; a slot outside the pool is dropped), which are the outputs k_out, v_out, the
// same buffers as k, v (aliased); then the attention reads them as decode_attention does.
ffi::Error DecodeAttentionWriting(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                  ffi::AnyBuffer k, ffi::AnyBuffer v,
                                  ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                                  ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::F32> k_scale,
                                  ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> layer,
                                  ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> token,
                                  ffi::Buffer<ffi::S32> row, ffi::Buffer<ffi::S32> pos,
                                  ffi::ResultBuffer<ffi::F32> out,
                                  ffi::Result<ffi::AnyBuffer> k_out,
                                  ffi::Result<ffi::AnyBuffer> v_out, int64_t page_size,
                                  int64_t window, float softcap, float scale) {
  const auto type = k.element_type();
  const auto kd = k.dimensions();
  if ((type != ffi::DataType::U16 && type != ffi::DataType::F32) || kd.size() != 4 ||
      v.element_type() != type || k_out->element_type() != type ||
      v_out->element_type() != type || v.element_count() != k.element_count() ||
      k_out->element_count() != k.element_count() ||
      v_out->element_count() != k.element_count())
    return ffi::Error::InvalidArgument("decode_attention_writing: k, v and their outputs must "
                                       "be alike, [L, S, K, H] u16 (bf16 bits) or f32");
  const int64_t L = kd[0], S = kd[1], KH = kd[2] * kd[3], T_ = slots.element_count();
  if (k_new.element_count() != T_ * KH || v_new.element_count() != T_ * KH)
    return ffi::Error::InvalidArgument("decode_attention_writing: k_new, v_new [T, K, H] and "
                                       "slots [T] expected");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L)
    return ffi::Error::InvalidArgument("decode_attention: layer out of range");
  const size_t bytes = k.size_bytes();
  // Aliased, the outputs are the inputs' buffers; should XLA ever hand others, copy first.
  if (k_out->untyped_data() != k.untyped_data())
    std::memcpy(k_out->untyped_data(), k.untyped_data(), bytes);
  if (v_out->untyped_data() != v.untyped_data())
    std::memcpy(v_out->untyped_data(), v.untyped_data(), bytes);
  const int32_t* sp = slots.typed_data();
  auto write = [&](void* pool_data, const float* src) {
    for (int64_t t = 0; t < T_; ++t) {
      const int64_t s = sp[t];
      if (s < 0 || s >= S) continue;
      const float* x = src + t * KH;
      const int64_t at = (l * S + s) * KH;
      if (type == ffi::DataType::F32) {
        std::memcpy(static_cast<float*>(pool_data) + at, x, sizeof(float) * KH);
      } else {
        uint16_t* y = static_cast<uint16_t*>(pool_data) + at;
        for (int64_t i = 0; i < KH; ++i) y[i] = f32_to_bf16_bits(x[i]);
      }
    }
  };
  write(k_out->untyped_data(), k_new.typed_data());
  write(v_out->untyped_data(), v_new.typed_data());
  return attend_pools(pool, q, Pools{k_out->untyped_data(), v_out->untyped_data(), type, kd},
                      k_scale, v_scale, layer, tables, token, row, pos, out, page_size, window,
                      softcap, scale);
}

}  // namespace

// The products: bf16 x and w in, float32 y out, on XLA's intra-op thread pool.
#define JAXINFER_PRODUCT_HANDLER(symbol, fn)                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, fn,                                   \
                                ffi::Ffi::Bind()                              \
                                    .Ctx<ffi::ThreadPool>()                   \
                                    .Arg<ffi::Buffer<ffi::BF16>>()            \
                                    .Arg<ffi::Buffer<ffi::BF16>>()            \
                                    .Ret<ffi::Buffer<ffi::F32>>());

JAXINFER_PRODUCT_HANDLER(jaxinfer_row_times_matrix, RowTimesMatrix)

JAXINFER_PRODUCT_HANDLER(jaxinfer_matrix_times_row, MatrixTimesRow)

// The attention handlers' operands after the queries, pools and new keys (k_scale, v_scale,
// layer, tables, token, row, pos), and their attributes.
#define JAXINFER_ATTENTION_READS                                                       \
  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::S32>>() \
      .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()                         \
      .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
#define JAXINFER_ATTENTION_ATTRS                                        \
  .Attr<int64_t>("page_size").Attr<int64_t>("window").Attr<float>("softcap") \
      .Attr<float>("scale")

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_decode_attention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  JAXINFER_ATTENTION_READS
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  JAXINFER_ATTENTION_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_decode_attention_writing, DecodeAttentionWriting,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  JAXINFER_ATTENTION_READS
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  JAXINFER_ATTENTION_ATTRS);

JAXINFER_PRODUCT_HANDLER(jaxinfer_rows_times_matrix, RowsTimesMatrix)

JAXINFER_PRODUCT_HANDLER(jaxinfer_matrix_times_rows, MatrixTimesRows)
