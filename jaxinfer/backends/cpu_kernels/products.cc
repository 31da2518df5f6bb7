// jaxinfer's CPU kernels: the bf16 products (docs/cpu_kernels.md). For one row of activations
// (batch-1 decode) each weight row is read once, in memory order, converted to float32 in
// registers and accumulated with FMAs: faster than XLA:CPU's one-row bf16 dot.

#include "common.h"

namespace {

// Rows of the weights asked for into L2 ahead of the one being read: faster than the
// hardware's own prefetching alone; into L1, the requests held up the loads.
constexpr int64_t kAheadRows = 4;

// acc[0:n1-n0] = sum over k < K of x[k] * w[k, n0:n1], row by row in memory order; acc (at
// most kPanel floats) stays in L1.
void rows_times_scalars(const uint16_t* x, const uint16_t* w, int64_t K, int64_t N, int64_t n0,
                        int64_t n1, float* acc) {
  const int64_t width = n1 - n0;
  std::memset(acc, 0, sizeof(float) * width);
  const int64_t full = width / 32 * 32;
  for (int64_t k = 0; k < K; ++k) {
    const __m512 xv = _mm512_set1_ps(bf16_to_f32(x[k]));
    const uint16_t* row = w + k * N + n0;
    if (k + kAheadRows < K) prefetch_l2(row + kAheadRows * N, width * 2);  // the row kAheadRows on
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
// The bf16 products of w [K, N] sum k in blocks of kBlockK (even), in order, and add the
// blocks' sums in order: a one-row product can then share whole rows between threads.
constexpr int64_t kBlockK = 64;

#ifdef __AVX512BF16__
// With AVX512-BF16 every product, whatever its row count, sums each output as rows_strip and
// head_block do (pairs of k through vdpbf16ps, in order): a row's result does not depend on
// the rows beside it (docs/architecture.md, "Batch invariance"). Defined below.
ffi::Error PairsRowTimesMatrix(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                               ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y);
ffi::Error PairsMatrixTimesRow(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                               ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y);
#endif

// y[N] = x[K] @ w[K, N], bf16 in, float32 out: the threads share column panels (at most
// kPanel columns), each summed over k in order whatever the thread count.
ffi::Error RowTimesMatrix(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                          ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto dims = w.dimensions();
  if (dims.size() != 2 || x.element_count() != dims[0] || y->element_count() != dims[1])
    return ffi::Error::InvalidArgument("row_times_matrix: x [K], w [K, N] and y [N] expected");
#ifdef __AVX512BF16__
  return PairsRowTimesMatrix(pool, x, w, y);
#endif
  const int64_t K = dims[0], N = dims[1];
  const auto* xp = reinterpret_cast<const uint16_t*>(x.typed_data());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.typed_data());
  float* yp = y->typed_data();
  const int64_t helpers = helper_count(pool);
  const int64_t strips = (N + 15) / 16;
  const int64_t per = std::clamp<int64_t>((strips + helpers) / (helpers + 1), 1, kPanel / 16);
  parallel_chunks(pool, (strips + per - 1) / per, helpers, [=](int64_t c) {
    const int64_t n0 = c * per * 16, n1 = std::min(N, n0 + per * 16);
    rows_times_scalars(xp, wp, K, N, n0, n1, yp + n0);
  });
  return ffi::Error::Success();
}

// y[N] = w[N, K] @ x[K] (a tied embedding as the output head), bf16 in, float32 out. Four rows
// at a time in memory order, the four 2 * kAheadRows on asked for; the threads share blocks
// of kRowBlock rows.
constexpr int64_t kRowBlock = 256;

ffi::Error MatrixTimesRow(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                          ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto dims = w.dimensions();
  if (dims.size() != 2 || x.element_count() != dims[1] || y->element_count() != dims[0])
    return ffi::Error::InvalidArgument("matrix_times_row: x [K], w [N, K] and y [N] expected");
#ifdef __AVX512BF16__
  return PairsMatrixTimesRow(pool, x, w, y);
#endif
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


// f(std::integral_constant<int, rb>) for the largest rb in {8, 4, 2, 1} that is <= rows.
template <typename F>
inline int64_t with_rows(int64_t rows, F f) {
  if (rows >= 8) { f(std::integral_constant<int, 8>()); return 8; }
  if (rows >= 4) { f(std::integral_constant<int, 4>()); return 4; }
  if (rows >= 2) { f(std::integral_constant<int, 2>()); return 2; }
  f(std::integral_constant<int, 1>());
  return 1;
}

// ---------------------------------------------------------------------------------------------
// float32 products (float32 weights and activations), any number of rows: every output summed
// over k in order with one FMA each, the same in the one-row, many-row and transposed forms'
// own orders whatever the row count (batch invariance at float32; XLA:CPU's dot sums a row
// differently alone than among many).

// y[(m0 + r) * ldy + j] = x[m0 + r] @ w[:, n0 + j] for r < RB, j < width <= 32, k in order.
template <int RB>
__attribute__((always_inline)) inline void rows_strip_f32(const float* x, const float* w,
                                                         int64_t K, int64_t N, int64_t m0,
                                                         int64_t n0, int64_t width, float* y,
                                                         int64_t ldy) {
  const __mmask16 m_first = width >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << width) - 1u);
  const __mmask16 m_second =
      width >= 32 ? __mmask16(0xFFFF) : width > 16 ? __mmask16((1u << (width - 16)) - 1u) : 0;
  __m512 lo[RB], hi[RB];
  for (int r = 0; r < RB; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const float* xr = x + m0 * K;
  for (int64_t k = 0; k < K; ++k) {
    const float* row = w + k * N + n0;
    const __m512 a = _mm512_maskz_loadu_ps(m_first, row);
    const __m512 b = _mm512_maskz_loadu_ps(m_second, row + 16);
    for (int r = 0; r < RB; ++r) {
      const __m512 xv = _mm512_set1_ps(xr[r * K + k]);
      lo[r] = _mm512_fmadd_ps(xv, a, lo[r]);
      hi[r] = _mm512_fmadd_ps(xv, b, hi[r]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    float* out = y + (m0 + r) * ldy;
    _mm512_mask_storeu_ps(out, m_first, lo[r]);
    _mm512_mask_storeu_ps(out + 16, m_second, hi[r]);
  }
}

// y[n0:n1] = x[K] @ w[K, n0:n1] for one row, each output as rows_strip_f32 sums it: the weight
// rows read in memory order, the panel's sums in L1.
void row_f32(const float* x, const float* w, int64_t K, int64_t N, int64_t n0, int64_t n1,
             float* y) {
  const int64_t width = n1 - n0;
  alignas(64) float acc[kPanel];
  std::memset(acc, 0, sizeof(float) * width);
  for (int64_t k = 0; k < K; ++k) {
    const float* row = w + k * N + n0;
    if (k + kAheadRows < K) prefetch_l2(row + kAheadRows * N, width * 4);
    const __m512 xv = _mm512_set1_ps(x[k]);
    for (int64_t n = 0; n < width; n += 16) {
      const int64_t m = std::min<int64_t>(16, width - n);
      const __mmask16 mask = __mmask16((1u << m) - 1u);
      _mm512_mask_storeu_ps(acc + n, mask,
                            _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(mask, row + n),
                                            _mm512_maskz_loadu_ps(mask, acc + n)));
    }
  }
  std::memcpy(y + n0, acc, sizeof(float) * width);
}

// y[m, n] = w[n] . x[m] for MR rows of x from m0 (all valid) and 16 rows of w from n0 (clamped
// past N, not stored): 16 lanes of FMAs over k in order, the lanes added by lane_sums16, the
// same sums for any MR.
template <int MR>
inline void head_block_f32(const float* x, const float* w, int64_t K, int64_t M, int64_t N,
                           int64_t m0, int64_t n0, float* y) {
  for (int mi = 0; mi < MR; ++mi) {
    const float* xr = x + std::min(m0 + mi, M - 1) * K;
    __m512 a[16];
    for (int g = 0; g < 4; ++g) {
      const float* wr[4];
      for (int i = 0; i < 4; ++i) wr[i] = w + std::min(n0 + 4 * g + i, N - 1) * K;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1u);
        const __m512 xv = _mm512_maskz_loadu_ps(mask, xr + k);
        a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, wr[0] + k), xv, a0);
        a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, wr[1] + k), xv, a1);
        a2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, wr[2] + k), xv, a2);
        a3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, wr[3] + k), xv, a3);
      }
      a[4 * g] = a0;
      a[4 * g + 1] = a1;
      a[4 * g + 2] = a2;
      a[4 * g + 3] = a3;
    }
    alignas(64) float s[16];
    _mm512_store_ps(s, lane_sums16(a));
    std::memcpy(y + (m0 + mi) * N + n0, s, sizeof(float) * std::min<int64_t>(16, N - n0));
  }
}

// y = x @ w for float32 x [K] or [M, K] and w [K, N] (transposed == 0) or [N, K] (1).
ffi::Error ProductF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> y, int64_t transposed) {
  const auto wd = w.dimensions(), xd = x.dimensions();
  if (wd.size() != 2 || (xd.size() != 1 && xd.size() != 2))
    return ffi::Error::InvalidArgument("product_f32: x [K] or [M, K] and a 2-D w expected");
  const int64_t K = xd[xd.size() - 1], M = xd.size() == 2 ? xd[0] : 1;
  const int64_t N = transposed ? wd[0] : wd[1];
  if ((transposed ? wd[1] : wd[0]) != K || y->element_count() != M * N)
    return ffi::Error::InvalidArgument("product_f32: inconsistent shapes");
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t helpers = helper_count(pool);
  if (transposed) {
    const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
    parallel_chunks(pool, blocks, helpers, [=](int64_t c) {
      const int64_t r1 = std::min(N, (c + 1) * kRowBlock);
      for (int64_t n0 = c * kRowBlock; n0 < r1; n0 += 16)
        for (int64_t m0 = 0; m0 < M;) {
          if (M - m0 >= 4) {
            head_block_f32<4>(xp, wp, K, M, N, m0, n0, yp);
            m0 += 4;
          } else {
            head_block_f32<1>(xp, wp, K, M, N, m0, n0, yp);
            m0 += 1;
          }
        }
    });
    return ffi::Error::Success();
  }
  if (M == 1) {
    const int64_t strips = (N + 15) / 16;
    const int64_t per = std::clamp<int64_t>((strips + helpers) / (helpers + 1), 1, kPanel / 16);
    const int64_t panels = (strips + per - 1) / per;
    parallel_chunks(pool, panels, helpers, [=](int64_t c) {
      const int64_t n0 = c * per * 16;
      row_f32(xp, wp, K, N, n0, std::min(N, n0 + per * 16), yp);
    });
    return ffi::Error::Success();
  }
  parallel_chunks(pool, (N + 31) / 32, helpers, [=](int64_t c) {
    const int64_t n0 = c * 32, width = std::min<int64_t>(32, N - n0);
    for (int64_t m0 = 0; m0 < M;)
      m0 += with_rows(M - m0, [&](auto rb) {
        rows_strip_f32<decltype(rb)::value>(xp, wp, K, N, m0, n0, width, yp + n0, N);
      });
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// bf16 products for a few rows of activations (a decode step of several rows, a verification).
// XLA:CPU's library repacks the whole weight matrix on every such call; these read the weights
// as they lie, with AVX512-BF16's `vdpbf16ps` (pairs of bf16 products added into float32).

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

// y[(m0 + r) * ldy + j] = x[m0 + r] @ w[:, n0 + j] for r < RB, j < width <= 32: the strip's
// rows are read in pairs (k, k+1) and interleaved in registers into vdpbf16ps's pair layout;
// the RB rows' sums stay in registers. An odd K's last row is paired with zeros. Always
// inlined: called out of line, its sums went through memory.
template <int RB>
__attribute__((always_inline)) inline void rows_strip(const uint16_t* x, const uint16_t* w,
                                                     int64_t K, int64_t N, int64_t m0, int64_t n0,
                                                     int64_t width, float* y, int64_t ldy) {
  const __mmask32 cols = width >= 32 ? ~__mmask32(0) : __mmask32((1ull << width) - 1);
  const __mmask16 m_first = width >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << width) - 1u);
  const __mmask16 m_second =
      width >= 32 ? __mmask16(0xFFFF) : width > 16 ? __mmask16((1u << (width - 16)) - 1u) : 0;
  __m512 lo[RB], hi[RB];
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
  // Blocks of kBlockK k, each summed from zero, added to the output in order.
  for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
    const int64_t k1 = std::min(K, k0 + kBlockK);
    for (int r = 0; r < RB; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    int64_t k = k0;
    for (; k + 2 <= k1; k += 2) step(w + k * N + n0, w + (k + 1) * N + n0, xr + k, true);
    if (k < k1) step(w + k * N + n0, nullptr, xr + k, false);
    for (int r = 0; r < RB; ++r) {
      __m512 first, second;
      unscramble(lo[r], hi[r], &first, &second);
      float* out = y + (m0 + r) * ldy;
      if (k0 > 0) {
        first = _mm512_add_ps(_mm512_maskz_loadu_ps(m_first, out), first);
        second = _mm512_add_ps(_mm512_maskz_loadu_ps(m_second, out + 16), second);
      }
      _mm512_mask_storeu_ps(out, m_first, first);
      _mm512_mask_storeu_ps(out + 16, m_second, second);
    }
  }
}



// y[0:n1 - n0] = x[k0:k1] @ w[k0:k1, n0:n1] (n0 a multiple of 32), each output as rows_strip<1>
// sums one block: the weights read row pair by row pair in memory order, the sums of every
// 32-column strip kept in vdpbf16ps's layout in L1 until the end.
void row_pairs(const uint16_t* x, const uint16_t* w, int64_t k0, int64_t k1, int64_t N,
               int64_t n0, int64_t n1, float* y) {
  const int64_t strips = (n1 - n0 + 31) / 32;
  alignas(64) float acc[kPanel];  // per strip: lo[16], hi[16]
  std::memset(acc, 0, sizeof(float) * strips * 32);
  auto pass = [&](const uint16_t* row, const uint16_t* next, uint32_t xx, bool ahead) {
    if (ahead) {  // the pair kAheadRows pairs on
      prefetch_l2(row + kAheadRows * 2 * N, (n1 - n0) * 2);
      prefetch_l2(row + (kAheadRows * 2 + 1) * N, (n1 - n0) * 2);
    }
    const __m512bh xv = (__m512bh)_mm512_set1_epi32(int32_t(xx));
    for (int64_t s = 0; s < strips; ++s) {
      const int64_t width = std::min<int64_t>(32, n1 - n0 - 32 * s);
      const __mmask32 cols = width >= 32 ? ~__mmask32(0) : __mmask32((1ull << width) - 1);
      const __m512i a = _mm512_maskz_loadu_epi16(cols, row + 32 * s);
      const __m512i b = next ? _mm512_maskz_loadu_epi16(cols, next + 32 * s)
                             : _mm512_setzero_si512();
      float* lo = acc + 32 * s;
      _mm512_store_ps(lo, _mm512_dpbf16_ps(_mm512_load_ps(lo),
                                           (__m512bh)_mm512_unpacklo_epi16(a, b), xv));
      _mm512_store_ps(lo + 16, _mm512_dpbf16_ps(_mm512_load_ps(lo + 16),
                                                (__m512bh)_mm512_unpackhi_epi16(a, b), xv));
    }
  };
  int64_t k = k0;
  for (; k + 2 <= k1; k += 2) {
    uint32_t xx;
    std::memcpy(&xx, x + k, sizeof xx);
    pass(w + k * N + n0, w + (k + 1) * N + n0, xx, k + 2 * kAheadRows + 2 <= k1);
  }
  if (k < k1) pass(w + k * N + n0, nullptr, x[k], false);
  for (int64_t s = 0; s < strips; ++s) {
    const int64_t width = std::min<int64_t>(32, n1 - n0 - 32 * s);
    __m512 first, second;
    unscramble(_mm512_load_ps(acc + 32 * s), _mm512_load_ps(acc + 32 * s + 16), &first, &second);
    const __mmask16 m_first = width >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << width) - 1u);
    const __mmask16 m_second =
        width >= 32 ? __mmask16(0xFFFF) : width > 16 ? __mmask16((1u << (width - 16)) - 1u) : 0;
    _mm512_mask_storeu_ps(y + 32 * s, m_first, first);
    _mm512_mask_storeu_ps(y + 32 * s + 16, m_second, second);
  }
}

// y[N] = x[K] @ w[K, N] in kBlockK blocks: each thread takes a run of consecutive blocks (and a
// column panel), streaming whole rows, and the blocks' sums are added in order afterwards, so
// each output is summed as rows_strip sums it whatever the thread count.
void pairs_row(ffi::ThreadPool& pool, const uint16_t* xp, const uint16_t* wp, int64_t K,
               int64_t N, float* yp) {
  const int64_t blocks = (K + kBlockK - 1) / kBlockK, panels = (N + kPanel - 1) / kPanel;
  const int64_t helpers = helper_count(pool);
  const int64_t runs = std::min(blocks, helpers + 1), per = (blocks + runs - 1) / runs;
  // The caller's scratch, kept between calls (the helpers only write into it while it waits).
  thread_local std::vector<float> part;
  if (part.size() < size_t(blocks * N)) part.resize(blocks * N);
  float* pp = part.data();
  parallel_chunks(pool, runs * panels, helpers, [=](int64_t c) {
    const int64_t n0 = (c % panels) * kPanel, n1 = std::min(N, n0 + kPanel);
    for (int64_t b = (c / panels) * per; b < std::min(blocks, (c / panels + 1) * per); ++b)
      row_pairs(xp, wp, b * kBlockK, std::min(K, (b + 1) * kBlockK), N, n0, n1, pp + b * N + n0);
  });
  std::memcpy(yp, pp, sizeof(float) * N);
  for (int64_t b = 1; b < blocks; ++b)
    for (int64_t n = 0; n < N; n += 16) {
      const __mmask16 mask = N - n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (N - n)) - 1u);
      _mm512_mask_storeu_ps(yp + n, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, yp + n),
                                                        _mm512_maskz_loadu_ps(mask, pp + b * N + n)));
    }
}

ffi::Error PairsRowTimesMatrix(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                               ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto dims = w.dimensions();
  pairs_row(pool, reinterpret_cast<const uint16_t*>(x.typed_data()),
            reinterpret_cast<const uint16_t*>(w.typed_data()), dims[0], dims[1],
            y->typed_data());
  return ffi::Error::Success();
}

// y[n0 .. n0 + 15] = w[n] . x for one row x (rows past N clamped, not stored): each output as
// head_block sums it (32 k at a time through vdpbf16ps, lanes by lane_sums16). Four rows of w
// are read together, in memory order, the four 2 * kAheadRows on asked for.
inline void head_rows16(const uint16_t* x, const uint16_t* w, int64_t K, int64_t N, int64_t n0,
                        float* y) {
  __m512 a[16];
  for (int g = 0; g < 4; ++g) {
    const uint16_t* wr[4];
    for (int i = 0; i < 4; ++i) wr[i] = w + std::min(n0 + 4 * g + i, N - 1) * K;
    if (n0 + 4 * g + 2 * kAheadRows + 4 <= N) prefetch_l2(wr[0] + 2 * kAheadRows * K, 4 * K * 2);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(wr[0] + k), xv);
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(wr[1] + k), xv);
      a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(wr[2] + k), xv);
      a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(wr[3] + k), xv);
    }
    if (k < K) {
      const __mmask32 mask = __mmask32((1ull << (K - k)) - 1);
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + k);
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[0] + k), xv);
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[1] + k), xv);
      a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[2] + k), xv);
      a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[3] + k), xv);
    }
    a[4 * g] = a0;
    a[4 * g + 1] = a1;
    a[4 * g + 2] = a2;
    a[4 * g + 3] = a3;
  }
  alignas(64) float s[16];
  _mm512_store_ps(s, lane_sums16(a));
  std::memcpy(y + n0, s, sizeof(float) * std::min<int64_t>(16, N - n0));
}

ffi::Error PairsMatrixTimesRow(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                               ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto dims = w.dimensions();
  const int64_t N = dims[0], K = dims[1];
  const auto* xp = reinterpret_cast<const uint16_t*>(x.typed_data());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.typed_data());
  float* yp = y->typed_data();
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  parallel_chunks(pool, blocks, helper_count(pool), [=](int64_t c) {
    const int64_t r1 = std::min(N, (c + 1) * kRowBlock);
    for (int64_t n0 = c * kRowBlock; n0 < r1; n0 += 16) head_rows16(xp, wp, K, N, n0, yp);
  });
  return ffi::Error::Success();
}

// y[M, N] = x[M, K] @ w[K, N], bf16 in, float32 out. The threads share strips of 32 columns,
// each over every row of w, block by block of activation rows (the strip comes from memory
// once, then from cache). Each output is summed over k in order, as XLA's dot does.
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
        rows_strip<decltype(rb)::value>(xp, wp, K, N, m0, n0, width, yp + n0, N);
      });
  });
  return ffi::Error::Success();
}

// 16 floats as bf16 bits, rounded to nearest even; a NaN stays a quiet NaN.
inline __m256i to_bf16_16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16),
                                 _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(rounded);
}

// h[M, F] = act(x @ w_gate) * (x @ w_up), bf16 in and out (the MLP's hidden activations): the
// products as rows_times_matrix computes them, the gate applied to each strip while its sums are
// in L1 instead of in a separate elementwise pass. act is silu (activation 0) or GELU's tanh
// form (1), both g / (1 + exp(-z)): z = g for silu, z = 2 sqrt(2 / pi) (g + 0.044715 g^3) for
// GELU, since 0.5 (1 + tanh(y)) = 1 / (1 + exp(-2y)).
constexpr int64_t kGatedRows = 64;  // rows whose sums of a strip stay in L1

template <int Act>
inline __m512 gate16(__m512 g) {
  if constexpr (Act == 0) return g;
  const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
  return _mm512_mul_ps(_mm512_set1_ps(1.5957691216057308f),  // 2 sqrt(2 / pi)
                       _mm512_fmadd_ps(g3, _mm512_set1_ps(0.044715f), g));
}

// h[m, j] = act(g[m, j]) * u[m, j] as bf16 for j < width (g, u float32 rows of ld floats).
template <int Act>
inline void apply_gate(const float* g, const float* u, int64_t rows, int64_t ld, int64_t width,
                       uint16_t* h, int64_t ldh) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t j = 0; j < width; j += 16) {
      const __mmask16 mask = width - j >= 16 ? __mmask16(0xFFFF)
                                             : __mmask16((1u << (width - j)) - 1u);
      const __m512 gv = _mm512_maskz_loadu_ps(mask, g + m * ld + j);
      // exp(-z), -z held to [-104, 200] (max and min return their second operand when either
      // is NaN, so a NaN passes): exp(-inf) is 0 and exp(inf) is inf.
      const __m512 minus_z = _mm512_sub_ps(_mm512_setzero_ps(), gate16<Act>(gv));
      const __m512 e = exp16_in_range(_mm512_min_ps(
          _mm512_set1_ps(200.0f), _mm512_max_ps(_mm512_set1_ps(-104.0f), minus_z)));
      const __m512 v = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)),
                                     _mm512_maskz_loadu_ps(mask, u + m * ld + j));
      _mm256_mask_storeu_epi16(h + m * ldh + j, mask, to_bf16_16(v));
    }
}

template <int Act>
void gated_strips(ffi::ThreadPool& pool, const uint16_t* xp, const uint16_t* gp,
                  const uint16_t* up, uint16_t* hp, int64_t M, int64_t K, int64_t F) {
  const int64_t helpers = helper_count(pool);
  if (M == 1) {
    // One row: both products as pairs_row computes them (whole rows streamed), then the gate.
    thread_local std::vector<float> gu;
    if (gu.size() < size_t(2 * F)) gu.resize(2 * F);
    pairs_row(pool, xp, gp, K, F, gu.data());
    pairs_row(pool, xp, up, K, F, gu.data() + F);
    apply_gate<Act>(gu.data(), gu.data() + F, 1, 0, F, hp, 0);
    return;
  }
  parallel_chunks(pool, (F + 31) / 32, helpers, [=](int64_t c) {
    const int64_t n0 = c * 32, width = std::min<int64_t>(32, F - n0);
    alignas(64) float g[kGatedRows * 32], u[kGatedRows * 32];
    // Row blocks of kGatedRows, each one's sums in L1 while the gate is applied.
    for (int64_t b0 = 0; b0 < M; b0 += kGatedRows) {
      const int64_t rows = std::min(kGatedRows, M - b0);
      const uint16_t* xb = xp + b0 * K;
      for (int64_t m0 = 0; m0 < rows;)
        m0 += with_rows(rows - m0, [&](auto rb) {
          rows_strip<decltype(rb)::value>(xb, gp, K, F, m0, n0, width, g, 32);
        });
      for (int64_t m0 = 0; m0 < rows;)
        m0 += with_rows(rows - m0, [&](auto rb) {
          rows_strip<decltype(rb)::value>(xb, up, K, F, m0, n0, width, u, 32);
        });
      apply_gate<Act>(g, u, rows, 32, width, hp + b0 * F + n0, F);
    }
  });
}

ffi::Error GatedRowsTimesMatrices(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                                  ffi::Buffer<ffi::BF16> w_gate, ffi::Buffer<ffi::BF16> w_up,
                                  ffi::ResultBuffer<ffi::BF16> h, int64_t activation) {
  const auto gd = w_gate.dimensions(), ud = w_up.dimensions(), xd = x.dimensions();
  if (gd.size() != 2 || ud.size() != 2 || xd.size() != 2 || gd[0] != ud[0] ||
      gd[1] != ud[1] || xd[1] != gd[0] ||
      h->element_count() != xd[0] * gd[1])
    return ffi::Error::InvalidArgument(
        "gated_rows_times_matrices: x [M, K], w_gate and w_up [K, F], h [M, F] expected");
  if (activation != 0 && activation != 1)
    return ffi::Error::InvalidArgument(
        "gated_rows_times_matrices: activation must be 0 (silu) or 1 (gelu, tanh form)");
  const int64_t M = xd[0], K = gd[0], F = gd[1];
  const auto* xp = reinterpret_cast<const uint16_t*>(x.typed_data());
  const auto* gp = reinterpret_cast<const uint16_t*>(w_gate.typed_data());
  const auto* up = reinterpret_cast<const uint16_t*>(w_up.typed_data());
  auto* hp = reinterpret_cast<uint16_t*>(h->typed_data());
  if (activation == 0) gated_strips<0>(pool, xp, gp, up, hp, M, K, F);
  else gated_strips<1>(pool, xp, gp, up, hp, M, K, F);
  return ffi::Error::Success();
}

// y[m, n] = w[n] . x[m] for 4 rows of x and 4 rows of w (indices clamped to the last row; only
// the valid ones stored): both rows are contiguous in k, so a 32-element load of each is
// already in vdpbf16ps's pair layout. The 16 sums are named registers (an array of them went
// through memory every iteration).
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

// y[M, N] = x[M, K] @ w[N, K]^T (the tied head), bf16 in, float32 out. The threads share
// blocks of kRowBlock rows of w.
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
      if (n0 + 2 * kAheadRows + 4 <= N)  // as matrix_times_row
        prefetch_l2(wp + (n0 + 2 * kAheadRows) * K, 4 * K * 2);
      for (int64_t m0 = 0; m0 < M; m0 += 4) head_block(xp, wp, K, M, N, m0, n0, yp);
    }
  });
  return ffi::Error::Success();
}

#else  // no AVX512-BF16: jaxinfer/backends/cpu_kernels/__init__.py never calls these

ffi::Error RowsTimesMatrix(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::BF16>,
                           ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error::Internal("rows_times_matrix: built without AVX512-BF16");
}

ffi::Error MatrixTimesRows(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::BF16>,
                           ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error::Internal("matrix_times_rows: built without AVX512-BF16");
}

ffi::Error GatedRowsTimesMatrices(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::BF16>,
                                  ffi::Buffer<ffi::BF16>, ffi::ResultBuffer<ffi::BF16>, int64_t) {
  return ffi::Error::Internal("gated_rows_times_matrices: built without AVX512-BF16");
}

#endif  // __AVX512BF16__

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

JAXINFER_PRODUCT_HANDLER(jaxinfer_rows_times_matrix, RowsTimesMatrix)

JAXINFER_PRODUCT_HANDLER(jaxinfer_matrix_times_rows, MatrixTimesRows)

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_product_f32, ProductF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("transposed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_gated_rows_times_matrices, GatedRowsTimesMatrices,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<int64_t>("activation"));
