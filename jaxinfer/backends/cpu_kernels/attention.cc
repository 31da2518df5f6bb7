// jaxinfer's CPU kernels: decode attention over the paged KV pool (docs/cpu_kernels.md). One
// query per tile (a decoding row), every kv head's G queries against the row's keys up to its
// position (within a sliding window), in float32 with an online softmax over groups of up to
// 16 keys of one page.

#include "common.h"
#include "attention_blocks.h"

namespace {

// Groups whose scores are taken together before their values: one online-softmax step per
// chunk instead of per group, which was faster (docs/cpu_kernels.md).
constexpr int64_t kChunkGroups = 8;
// Whether the pool holds codes with scales (int8 or float8), and the groups whose value scales
// are kept.
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

// One row's NH = K * G query heads (q [K, G, 16 * HB]) over the keys at positions [start, end]
// of a row whose logical page j is table[j % M]; out [K, G, 16 * HB]. Chunk by chunk: the
// scores group by group, one online-softmax step, then the values group by group. A group is
// read slot by slot, every kv head together, in memory order; a second walk asks for the
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
  // The queries times scale, in load_row's order where it splits the keys.
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
  // A quantized pool's key scales of a group and value scales of the chunk (0 past the keys):
  // a score is q . codes times its key's scale; a value's scale goes into its probability.
  alignas(64) float k_scales[kMaxHeads][16];
  alignas(64) float v_scales_all[kScaledChunkGroups<T> * kMaxHeads][16];
  auto v_scales = [&](int64_t g) { return v_scales_all + g * K; };
  constexpr bool scaled = kScaled<T>;  // ks_layer and vs_layer are set for codes
  // The second walk, kAheadItems groups on, asks for what the first reads next into L2.
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

// Whether every pool page that positions [start, end] of a row read, table[(p / Z) % M], is
// one of the pool's `pages`: at most M entries, checked before any key is read.
inline bool pages_in_pool(const int32_t* table, int64_t M, int64_t Z, int64_t start,
                          int64_t end, int64_t pages) {
  if (M <= 0) return false;
  const int64_t first = start / Z, count = std::min(end / Z - first + 1, M);
  for (int64_t j = first; j < first + count; ++j)
    if (table[j % M] < 0 || table[j % M] >= pages) return false;
  return true;
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
  // A tile's first key: the window's first position, or 0.
  auto first_key = [=](int64_t end) {
    return window > 0 ? std::max<int64_t>(0, end - window + 1) : int64_t(0);
  };
  // Tiles longest first, so that the threads finish close together.
  std::vector<int32_t> order(Nt);
  for (int64_t t = 0; t < Nt; ++t) order[t] = int32_t(t);
  auto keys = [=](int64_t t) { return pos[t] < 0 ? int64_t(0) : pos[t] + 1 - first_key(pos[t]); };
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return keys(a) > keys(b); });
  const int32_t* op = order.data();
  parallel_chunks(pool, Nt, helper_count(pool), [=](int64_t c) {
    const int64_t t = op[c];
    const int64_t end = pos[t], tok = token[t], r = row[t];
    if (end < 0 || tok < 0 || tok >= T_ || r < 0 || r >= B) return;
    const int64_t start = first_key(end);
    // A page id outside the pool (a corrupt table): the tile's output is NaN, so the fault shows.
    if (!pages_in_pool(tables + r * M, M, Z, start, end, slots / Z)) {
      std::fill_n(out + tok * per_token, per_token, NAN);
      return;
    }
    attend_row<T, HB>(q + tok * per_token, scale, K, G, k_layer, v_layer, ks_layer, vs_layer,
                      tables + r * M, M, Z, start, end, softcap, out + tok * per_token);
  });
}

// The pools as the attention reads them (in place), with their element type and dimensions.
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

// q [T, K, G, H] float32 unscaled; k, v [L, slots, K, H] (bf16 bits as u16, float32, int8 or
// float8 e4m3fn codes, the latter possibly as u8 bits); k_scale, v_scale [L, slots, K] float32
// for codes, empty otherwise; layer [] s32; tables [B, M] s32; token, row, pos [Nt] s32 (tile t:
// token[t]'s query, of row row[t], at position pos[t]; out of range or -1: none).
// out [T, K, G, H] float32: zeros at tokens of no tile, NaN for a tile on a page outside the pool.
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

// decode_attention after writing k_new, v_new [T, K, H] float32 at layer `layer`'s slots of the
// pools (bf16 bits rounded to nearest even, or float32; slots outside dropped); k_out, v_out
// alias k, v.
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
