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

// acc[0:n1-n0] = sum over k in [k0, k1) of x[k] * w[k, n0:n1]: row by row, each row's segment
// read in memory order; acc (at most kPanel floats) stays in L1.
void rows_times_scalars(const uint16_t* x, const uint16_t* w, int64_t N, int64_t k0,
                        int64_t k1, int64_t n0, int64_t n1, float* acc) {
  const int64_t width = n1 - n0;
  std::memset(acc, 0, sizeof(float) * width);
  const int64_t full = width / 32 * 32;
  for (int64_t k = k0; k < k1; ++k) {
    const __m512 xv = _mm512_set1_ps(bf16_to_f32(x[k]));
    const uint16_t* row = w + k * N + n0;
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
// the output head), float32 y. Four rows at a time, each read in memory order; the rows are
// shared among the threads in blocks of kRowBlock.
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

constexpr int kMaxG = 16;

// One (tile, kv head): G queries q [G, 16 * HB] over the keys at positions [start, end] of a
// row whose logical page j is table[j % M]; out [G, 16 * HB].
template <typename T, int HB>
void attend_one(const float* q, int64_t G, const T* k_layer, const T* v_layer, int64_t kv_heads,
                int64_t kh, const int32_t* table, int64_t M, int64_t Z, int64_t start,
                int64_t end, float softcap, float* out) {
  constexpr int64_t H = 16 * HB;
  __m512 qv[kMaxG][HB], acc[kMaxG][HB];
  float m[kMaxG], l[kMaxG];
  for (int64_t g = 0; g < G; ++g) {
    for (int b = 0; b < HB; ++b) {
      qv[g][b] = _mm512_loadu_ps(q + g * H + 16 * b);
      acc[g][b] = _mm512_setzero_ps();
    }
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }
  const int64_t stride = kv_heads * H;  // between consecutive slots of the pool
  alignas(64) float scores[kMaxG][16];
  for (int64_t pos = start; pos <= end;) {
    const int64_t page = table[(pos / Z) % M];
    const int64_t z0 = pos % Z;
    const int64_t count = std::min<int64_t>({16, Z - z0, end - pos + 1});
    const int64_t slot0 = page * Z + z0;
    const T* kp = k_layer + slot0 * stride + kh * H;
    const T* vp = v_layer + slot0 * stride + kh * H;
    for (int64_t j = 0; j < count; ++j) {
      __m512 kk[HB];
      for (int b = 0; b < HB; ++b) kk[b] = load_key16<T>(kp + j * stride + 16 * b);
      for (int64_t g = 0; g < G; ++g) {
        __m512 d = _mm512_mul_ps(qv[g][0], kk[0]);
        for (int b = 1; b < HB; ++b) d = _mm512_fmadd_ps(qv[g][b], kk[b], d);
        scores[g][j] = _mm512_reduce_add_ps(d);
      }
    }
    const __mmask16 live = __mmask16((1u << count) - 1u);
    alignas(64) float probs[kMaxG][16];
    for (int64_t g = 0; g < G; ++g) {
      __m512 s = _mm512_maskz_loadu_ps(live, scores[g]);
      if (softcap > 0.0f) s = softcap16(s, softcap);
      const float m_new = std::max(m[g], _mm512_mask_reduce_max_ps(live, s));
      const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
      const float corr = std::exp(m[g] - m_new);  // 0 on the first group (m = -inf)
      l[g] = l[g] * corr + _mm512_reduce_add_ps(p);
      m[g] = m_new;
      _mm512_store_ps(probs[g], p);
      const __m512 c = _mm512_set1_ps(corr);
      for (int b = 0; b < HB; ++b) acc[g][b] = _mm512_mul_ps(acc[g][b], c);
    }
    for (int64_t j = 0; j < count; ++j) {
      __m512 vv[HB];
      for (int b = 0; b < HB; ++b) vv[b] = load_key16<T>(vp + j * stride + 16 * b);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(probs[g][j]);
        for (int b = 0; b < HB; ++b) acc[g][b] = _mm512_fmadd_ps(p, vv[b], acc[g][b]);
      }
    }
    pos += count;
  }
  for (int64_t g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(l[g] > 0.0f ? 1.0f / l[g] : 0.0f);
    for (int b = 0; b < HB; ++b) _mm512_storeu_ps(out + g * H + 16 * b, _mm512_mul_ps(acc[g][b], inv));
  }
}

template <typename T, int HB>
void attend_all(ffi::ThreadPool& pool, const float* q, const T* k, const T* v, int64_t layer,
                int64_t slots, int64_t Nt, int64_t K, int64_t G, const int32_t* table,
                int64_t M, const int32_t* pos, int64_t Z, int64_t window, float softcap,
                float* out) {
  constexpr int64_t H = 16 * HB;
  const T* k_layer = k + layer * slots * K * H;
  const T* v_layer = v + layer * slots * K * H;
  parallel_chunks(pool, Nt * K, helper_count(pool), [=](int64_t c) {
    const int64_t t = c / K, kh = c % K;
    const int64_t end = pos[t];
    float* o = out + (t * K + kh) * G * H;
    if (end < 0) {
      std::memset(o, 0, sizeof(float) * G * H);
      return;
    }
    const int64_t start = window > 0 ? std::max<int64_t>(0, end - window + 1) : 0;
    attend_one<T, HB>(q + (t * K + kh) * G * H, G, k_layer, v_layer, K, kh, table + t * M, M, Z,
                      start, end, softcap, o);
  });
}

// q [Nt, K, G, H] float32 (scaled); k, v [L, slots, K, H] (bf16 bits as u16, or float32);
// layer [] s32; table [Nt, M] s32, the tile's row's pages; pos [Nt] s32, the query's position
// (-1: an empty tile, whose output is zeros). out [Nt, K, G, H] float32.
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                           ffi::AnyBuffer v, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> pos,
                           ffi::ResultBuffer<ffi::F32> out, int64_t page_size, int64_t window,
                           float softcap) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = table.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("decode_attention: q [Nt, K, G, H], k/v [L, S, K, H], "
                                       "table [Nt, M] expected");
  const int64_t Nt = qd[0], K = qd[1], G = qd[2], H = qd[3];
  const int64_t L = kd[0], slots = kd[1], M = td[1];
  if (kd[2] != K || kd[3] != H || td[0] != Nt || pos.element_count() != Nt || G > kMaxG ||
      k.element_type() != v.element_type() || page_size <= 0 || slots % page_size != 0)
    return ffi::Error::InvalidArgument("decode_attention: inconsistent shapes");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("decode_attention: layer out of range");
  const int32_t* tp = table.typed_data();
  const int32_t* pp = pos.typed_data();
  float* op = out->typed_data();
  const bool bits = k.element_type() == ffi::DataType::U16;
  if (!bits && k.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("decode_attention: k/v must be u16 (bf16 bits) or f32");
#define JAXINFER_ATTEND(HB)                                                                    \
  case HB:                                                                                     \
    if (bits)                                                                                  \
      attend_all<uint16_t, HB>(pool, q.typed_data(), static_cast<const uint16_t*>(k.untyped_data()), \
                               static_cast<const uint16_t*>(v.untyped_data()), l, slots, Nt, K, G, \
                               tp, M, pp, page_size, window, softcap, op);                     \
    else                                                                                       \
      attend_all<float, HB>(pool, q.typed_data(), static_cast<const float*>(k.untyped_data()), \
                            static_cast<const float*>(v.untyped_data()), l, slots, Nt, K, G, tp, \
                            M, pp, page_size, window, softcap, op);                            \
    return ffi::Error::Success();
  switch (H % 16 == 0 ? H / 16 : 0) {
    JAXINFER_ATTEND(2)
    JAXINFER_ATTEND(4)
    JAXINFER_ATTEND(8)
    JAXINFER_ATTEND(16)
    default:
      break;
  }
#undef JAXINFER_ATTEND
  return ffi::Error::InvalidArgument("decode_attention: head_dim must be 32, 64, 128 or 256");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_row_times_matrix, RowTimesMatrix,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_matrix_times_row, MatrixTimesRow,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_decode_attention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("page_size")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("softcap"));
