// jaxinfer's CPU kernels: what the products (products.cc), the decode attention (attention.cc)
// and the argmax and sort (sampling.cc) share. jaxinfer/backends/cpu_kernels/__init__.py builds
// them with -march=native into one library; docs/cpu_kernels.md has each handler's contract.

#pragma once

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

// Runs body(c) for every c in [0, total) on the calling thread and up to `helpers` tasks of
// XLA's intra-op pool. Chunks are claimed from a counter and the caller waits only for claimed
// ones, so a busy pool never holds the caller up (nor deadlocks it).
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

// exp(x) for float32 x held to [-104, 200] by the caller (NaN passes): x = n ln2 + r with n an
// integer and |r| <= ln2 / 2 (ln2 in two parts, Cody-Waite, the first exact in 15 bits), e^r by
// its Taylor series to r^7 (relative error below 1e-8 for |r| <= 0.347), scaled by 2^n with
// vscalefps, which gives inf above about 88.7 and 0 or a denormal below about -87.3.
inline __m512 exp16_in_range(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Asks for bytes [p, p + bytes) into L2, a line at a time. Inline assembly: GCC dropped
// out-of-line calls to a helper whose only effect was _mm_prefetch.
inline void prefetch_l2(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    asm volatile("prefetcht1 %0" : : "m"(*(static_cast<const char*>(p) + off)));
}

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

}  // namespace
