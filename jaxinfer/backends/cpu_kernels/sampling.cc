// jaxinfer's CPU kernels: the argmax of each row of a step's logits, and the descending sort
// and top-k of top-k and top-p filtering (see docs/cpu_kernels.md).

#include "common.h"

namespace {

// Running maxima a row keeps: four vectors, so consecutive blocks do not wait on each other.
constexpr int kArgmaxVectors = 4;

// jnp.argmax of x[0..V): the first index of the largest value, the first NaN, or 0 for all
// -inf. Each lane keeps the first index of the largest value it saw (only a greater one
// replaces it); the answer is the smallest index among the lanes holding the largest value.
int32_t argmax_row(const float* x, int64_t V) {
  constexpr int N = kArgmaxVectors;
  const __m512 lowest = _mm512_set1_ps(-INFINITY);
  const __m512i none = _mm512_set1_epi32(INT32_MAX);  // a lane that has seen nothing above -inf
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 best[N];
  __m512i best_i[N];
  for (int j = 0; j < N; ++j) {
    best[j] = lowest;
    best_i[j] = none;
  }
  __mmask16 nan = 0;
  // Vector j takes blocks j, j + N, ... of 16 values. A lane that saw only -inf keeps index
  // INT32_MAX; where every lane did, the answer is 0.
  auto take = [&](int j, int64_t i, __mmask16 live) {
    const __m512 v = _mm512_mask_loadu_ps(lowest, live, x + i);
    const __m512i idx = _mm512_add_epi32(lanes, _mm512_set1_epi32(int32_t(i)));
    const __mmask16 better = _mm512_mask_cmp_ps_mask(live, v, best[j], _CMP_GT_OQ);
    best[j] = _mm512_mask_mov_ps(best[j], better, v);
    best_i[j] = _mm512_mask_mov_epi32(best_i[j], better, idx);
    nan |= _mm512_mask_cmp_ps_mask(live, v, v, _CMP_UNORD_Q);
  };
  int64_t i = 0;
  for (; i + 16 * N <= V; i += 16 * N)
    for (int j = 0; j < N; ++j) take(j, i + 16 * j, __mmask16(0xFFFF));
  for (int j = 0; i < V; i += 16, ++j)
    take(j, i, V - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (V - i)) - 1u));
  if (nan) {
    for (int64_t i = 0; i < V; ++i)
      if (std::isnan(x[i])) return int32_t(i);
  }
  __m512 top = best[0];
  for (int j = 1; j < N; ++j) top = _mm512_max_ps(top, best[j]);
  const float largest = _mm512_reduce_max_ps(top);
  if (largest == -INFINITY) return 0;
  const __m512 m = _mm512_set1_ps(largest);
  int32_t first = INT32_MAX;
  for (int j = 0; j < N; ++j)
    first = std::min(first, _mm512_mask_reduce_min_epi32(
                                _mm512_cmp_ps_mask(best[j], m, _CMP_EQ_OQ), best_i[j]));
  return first;
}

// x [..., V] float32 -> out [...] int32, each row's argmax_row, rows shared among the threads.
ffi::Error Argmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                  ffi::ResultBuffer<ffi::S32> out) {
  const auto dims = x.dimensions();
  if (dims.size() < 1 || dims.back() < 1 || dims.back() > INT32_MAX - 16 ||
      out->element_count() * dims.back() != x.element_count())
    return ffi::Error::InvalidArgument("argmax: x [..., V] with V >= 1 and out [...] expected");
  const int64_t V = dims.back(), R = out->element_count();
  const float* xp = x.typed_data();
  int32_t* op = out->typed_data();
  parallel_chunks(pool, R, helper_count(pool),
                  [=](int64_t r) { op[r] = argmax_row(xp + r * V, V); });
  return ffi::Error::Success();
}

// A float's sort key, ascending as the values descend: -x's bits made monotone as unsigned
// integers, -0.0 taken as 0.0, every NaN the largest key (last, as jnp.argsort puts it).
inline uint32_t descending_key(float x) {
  if (std::isnan(x)) return UINT32_MAX;
  const float y = x == 0.0f ? 0.0f : -x;
  uint32_t u;
  std::memcpy(&u, &y, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Radix digits of the keys: three passes of 11 bits.
constexpr int kDigitBits = 11;
constexpr int kPasses = 3;

// items[0..n) stably sorted by their keys (the high 32 bits): an LSD radix sort that skips a
// pass whose digit every item shares. spare holds n entries; returns the buffer holding the
// result.
uint64_t* radix_sort(uint64_t* items, uint64_t* spare, int64_t n) {
  constexpr int64_t kBuckets = int64_t(1) << kDigitBits;
  std::vector<int64_t> count(kBuckets);
  for (int pass = 0; pass < kPasses; ++pass) {
    const int shift = 32 + pass * kDigitBits;
    auto digit = [shift](uint64_t item) { return (item >> shift) & (kBuckets - 1); };
    std::fill(count.begin(), count.end(), 0);
    for (int64_t i = 0; i < n; ++i) ++count[digit(items[i])];
    if (count[digit(items[0])] == n) continue;  // one digit throughout
    int64_t total = 0;
    for (auto& c : count) {
      const int64_t m = c;
      c = total;
      total += m;
    }
    for (int64_t i = 0; i < n; ++i) spare[count[digit(items[i])]++] = items[i];
    std::swap(items, spare);
  }
  return items;
}

// An item is (key << 32) | index: the index moves with its key, ties stay in index order.
inline uint64_t item(uint32_t key, int64_t i) { return (uint64_t(key) << 32) | uint64_t(i); }

// order[0..V) = the indices of x[0..V) by descending value, equal values (and NaNs, last) in
// index order; sorted[i] = x[order[i]]. items and spare hold V entries each.
void sort_row(const float* x, int64_t V, float* sorted, int32_t* order, uint64_t* items,
              uint64_t* spare) {
  for (int64_t i = 0; i < V; ++i) items[i] = item(descending_key(x[i]), i);
  const uint64_t* done = radix_sort(items, spare, V);
  for (int64_t i = 0; i < V; ++i) {
    order[i] = int32_t(done[i] & 0xFFFFFFFFu);
    sorted[i] = x[order[i]];
  }
}

constexpr int kTopBits = 11;

// descending_key of 16 floats at once.
inline __m512i descending_keys16(__m512 x) {
  const __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_EQ_OQ);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i u = _mm512_castps_si512(
      _mm512_maskz_sub_ps(__mmask16(~zero), _mm512_setzero_ps(), x));  // -x, and 0 for +-0
  const __m512i sign = _mm512_set1_epi32(int32_t(0x80000000u));
  const __mmask16 negative = _mm512_test_epi32_mask(u, sign);
  __m512i key = _mm512_mask_xor_epi32(_mm512_or_si512(u, sign), negative, u,
                                      _mm512_set1_epi32(-1));
  return _mm512_mask_mov_epi32(key, nan, _mm512_set1_epi32(-1));
}

// The first k of sort_row's order and values: one pass keys the row and counts the keys' top 11
// bits; only the items in the buckets up to the one completing k are gathered and sorted. keys
// holds V entries, items and spare up to V.
void top_row(const float* x, int64_t V, int64_t k, float* top, int32_t* order, uint32_t* keys,
             uint64_t* items, uint64_t* spare) {
  constexpr int64_t kBuckets = int64_t(1) << kTopBits;
  constexpr int kShift = 32 - kTopBits;
  // Four histograms, so consecutive keys of one bucket do not wait on each other's increment.
  std::vector<int32_t> counts(4 * kBuckets, 0);
  int64_t i = 0;
  for (; i + 16 <= V; i += 16)
    _mm512_storeu_si512(keys + i, descending_keys16(_mm512_loadu_ps(x + i)));
  for (; i < V; ++i) keys[i] = descending_key(x[i]);
  i = 0;
  for (; i + 4 <= V; i += 4)
    for (int j = 0; j < 4; ++j) ++counts[j * kBuckets + (keys[i + j] >> kShift)];
  for (; i < V; ++i) ++counts[keys[i] >> kShift];
  uint32_t last = 0;  // the bucket that completes k (1 <= k <= V, so there is one)
  for (int64_t below = 0;; ++last) {
    const int64_t c = counts[last] + counts[kBuckets + last] + counts[2 * kBuckets + last] +
                      counts[3 * kBuckets + last];
    if (below + c >= k) break;
    below += c;
  }
  // The keys in buckets up to `last`, in index order.
  const __m512i bound = _mm512_set1_epi32(int32_t(((last + 1ull) << kShift) - 1u));
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) int32_t picked[16];
  int64_t n = 0;
  for (i = 0; i < V; i += 16) {
    const __mmask16 live = V - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (V - i)) - 1u);
    const __mmask16 in = _mm512_mask_cmple_epu32_mask(
        live, _mm512_maskz_loadu_epi32(live, keys + i), bound);
    if (!in) continue;
    _mm512_mask_compressstoreu_epi32(picked, in,
                                     _mm512_add_epi32(lanes, _mm512_set1_epi32(int32_t(i))));
    for (int j = 0, m = __builtin_popcount(in); j < m; ++j)
      items[n++] = item(keys[picked[j]], picked[j]);
  }
  const uint64_t* done = radix_sort(items, spare, n);
  for (i = 0; i < k; ++i) {
    order[i] = int32_t(done[i] & 0xFFFFFFFFu);
    top[i] = x[order[i]];
  }
}

// x [..., V] float32 -> (sorted [..., V] float32, order [..., V] int32): each row's sort_row.
ffi::Error SortDescending(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::ResultBuffer<ffi::F32> sorted, ffi::ResultBuffer<ffi::S32> order) {
  const auto dims = x.dimensions();
  if (dims.size() < 1 || dims.back() < 1 || dims.back() > INT32_MAX ||
      sorted->element_count() != x.element_count() || order->element_count() != x.element_count())
    return ffi::Error::InvalidArgument(
        "sort_descending: x [..., V] with V >= 1, sorted and order like x expected");
  const int64_t V = dims.back(), R = x.element_count() / V;
  const float* xp = x.typed_data();
  float* sp = sorted->typed_data();
  int32_t* op = order->typed_data();
  parallel_chunks(pool, R, helper_count(pool), [=](int64_t r) {
    std::vector<uint64_t> items(V), spare(V);
    sort_row(xp + r * V, V, sp + r * V, op + r * V, items.data(), spare.data());
  });
  return ffi::Error::Success();
}

// x [..., V] float32 -> (top [..., k] float32, order [..., k] int32): each row's top_row.
ffi::Error TopDescending(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                         ffi::ResultBuffer<ffi::F32> top, ffi::ResultBuffer<ffi::S32> order) {
  const auto dims = x.dimensions(), tdims = top->dimensions();
  if (dims.size() < 1 || dims.back() < 1 || dims.back() > INT32_MAX ||
      tdims.size() != dims.size() || tdims.back() < 1 || tdims.back() > dims.back() ||
      top->element_count() / tdims.back() != x.element_count() / dims.back() ||
      order->element_count() != top->element_count())
    return ffi::Error::InvalidArgument(
        "top_descending: x [..., V], top and order [..., k] with 1 <= k <= V expected");
  const int64_t V = dims.back(), k = tdims.back(), R = x.element_count() / V;
  const float* xp = x.typed_data();
  float* tp = top->typed_data();
  int32_t* op = order->typed_data();
  parallel_chunks(pool, R, helper_count(pool), [=](int64_t r) {
    std::vector<uint32_t> keys(V);
    std::vector<uint64_t> items(V), spare(V);
    top_row(xp + r * V, V, k, tp + r * k, op + r * k, keys.data(), items.data(), spare.data());
  });
  return ffi::Error::Success();
}

// out[r] = the sum of row r of x [R, D] (of its squares with `squares`), in one order that
// depends on D alone: 16 lanes, lane j taking elements j, j + 16, ... in order (one add, or one
// FMA for a square, each), then the lanes added by a fixed tree. Rows never share a sum, so a
// row's result is the same whatever the rows beside it, and zeros appended to a row leave it
// unchanged (the norms' and the sampler's sums: batch invariance, docs/architecture.md).
template <bool Squares>
inline float row_sum(const float* x, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < D; k += 16) {
    const __mmask16 mask = D - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (D - k)) - 1u);
    const __m512 v = _mm512_maskz_loadu_ps(mask, x + k);
    acc = Squares ? _mm512_fmadd_ps(v, v, acc) : _mm512_add_ps(acc, v);
  }
  alignas(64) float lane[16];
  _mm512_store_ps(lane, acc);
  float quad[4];
  for (int q = 0; q < 4; ++q)
    quad[q] = (lane[4 * q] + lane[4 * q + 2]) + (lane[4 * q + 1] + lane[4 * q + 3]);
  return (quad[0] + quad[2]) + (quad[1] + quad[3]);
}

ffi::Error RowSums(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out,
                   int64_t squares) {
  const auto dims = x.dimensions();
  if (dims.size() < 1 || out->element_count() * dims.back() != x.element_count())
    return ffi::Error::InvalidArgument("row_sums: x [..., D] and out [...] expected");
  const int64_t D = dims.back(), R = out->element_count();
  const float* xp = x.typed_data();
  float* op = out->typed_data();
  // Chunks of rows worth about 64 KiB each between the threads.
  const int64_t per = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(D, 1));
  parallel_chunks(pool, (R + per - 1) / per, helper_count(pool), [=](int64_t c) {
    for (int64_t r = c * per; r < std::min(R, (c + 1) * per); ++r)
      op[r] = squares ? row_sum<true>(xp + r * D, D) : row_sum<false>(xp + r * D, D);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_sort_descending, SortDescending,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_argmax, Argmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_top_descending, TopDescending,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_row_sums, RowSums,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("squares"));
