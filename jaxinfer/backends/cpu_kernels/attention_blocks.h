// jaxinfer's CPU kernels: the decode attention's building blocks (attention.cc): exp and
// softcap, keys and values of every pool type as float32, a group's key and value products.

#pragma once

#include "common.h"

namespace {

// exp(x) for float32 x (x <= 0 here: scores minus their running maximum); below -87 it is 0.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  return _mm512_maskz_mov_ps(~tiny, exp16_in_range(_mm512_max_ps(x, lo)));
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

// 16 e4m3fn codes known to be normal as float32: sign, exponent and mantissa moved into
// float32's fields (a shift of the sign-extended byte and a mask), the exponent rebiased by 120.
inline __m512 load_normal_e4m3(const E4M3* p) {
  const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_castsi512_ps(_mm512_add_epi32(
      _mm512_and_si512(_mm512_slli_epi32(b, 20), _mm512_set1_epi32(int32_t(0x87F00000u))),
      _mm512_set1_epi32(120 << 23)));
}

// 16 e4m3fn codes as float32, exactly (their scale applied later). A subnormal code is m * 2^-9
// = (1 + m/8) * 2^-6 - 2^-6 (rebiased by 121, minus the value with its mantissa cleared); NaN
// codes give NaN. Most groups of 16 have neither and skip both fixups.
template <>
inline __m512 load_key16<E4M3>(const E4M3* p) {
  const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i x = _mm512_castps_si512(load_normal_e4m3(p));
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

// r[j] = the sum of the 16 lanes of v[j] for j < n (0 beyond), by lane_sums16's tree (fewer
// instructions than a horizontal sum each).
inline __m512 sum_each16(const float (*v)[16], int64_t n) {
  __m512 x[16];
  for (int j = 0; j < 16; ++j) x[j] = j < n ? _mm512_load_ps(v[j]) : _mm512_setzero_ps();
  return lane_sums16(x);
}

// Keys from position pos on that one group takes: up to 16, within pos's page, up to end.
inline int64_t group_size(int64_t pos, int64_t end, int64_t Z) {
  return std::min<int64_t>({16, Z - pos % Z, end - pos + 1});
}

// A key or value row of H = 16 * HB elements as HB float32 vectors. bf16 rows are split into
// even and odd elements (a shift and a mask, where widening in order takes four conversions):
// vector 2c holds elements 32c + 2i, vector 2c + 1 elements 32c + 2i + 1. attend_row lays the
// queries out alike (kSplit) and puts the sums back in order at the end.
template <typename T>
constexpr bool kSplit = std::is_same_v<T, uint16_t>;

template <typename T, int HB>
inline void load_row(const T* p, __m512* out) {
  if constexpr (std::is_same_v<T, E4M3>) {
    // 64 codes at a time: a chunk without subnormal, zero or NaN codes skips load_key16's checks.
    for (int c = 0; c < HB; c += 4) {
      const int n = std::min(4, HB - c);
      const __mmask64 bytes = n == 4 ? ~__mmask64(0) : (__mmask64(1) << (16 * n)) - 1;
      const __m512i raw = _mm512_maskz_loadu_epi8(bytes, p + 16 * c);
      const __mmask64 special =
          (_mm512_testn_epi8_mask(raw, _mm512_set1_epi8(0x78)) |
           _mm512_cmpeq_epi8_mask(_mm512_and_si512(raw, _mm512_set1_epi8(0x7F)),
                                  _mm512_set1_epi8(0x7F))) & bytes;
      if (__builtin_expect(special == 0, 1)) {
        for (int i = 0; i < n; ++i) out[c + i] = load_normal_e4m3(p + 16 * (c + i));
      } else {
        for (int i = 0; i < n; ++i) out[c + i] = load_key16<E4M3>(p + 16 * (c + i));
      }
    }
  } else if constexpr (kSplit<T>) {
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

}  // namespace
