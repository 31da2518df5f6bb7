// jaxinfer's CPU kernels: the argmax of each row of a step's logits (see common.h and
// docs/cpu_kernels.md).

#include "common.h"

namespace {

// Lanes of the running maximum a row keeps: four vectors of 16, so that consecutive blocks do
// not wait on each other's comparison.
constexpr int kArgmaxVectors = 4;

// The index of x[0..V)'s maximum, as jnp.argmax gives it: the first index of the largest value,
// the first NaN where there is one, 0 where every value is -inf. Each lane keeps the first
// index of the largest value it has seen (only a strictly greater value replaces it, and a
// lane sees its indices in increasing order); the row's answer is the smallest index among the
// lanes holding the largest value.
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
  // Vector j takes blocks j, j + N, ... of 16 values (in the tail, whichever vector is next).
  // A lane that has seen only -inf keeps -inf at index INT32_MAX; where every lane has, the
  // row is all -inf (NaN aside) and its answer is 0.
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

// x [..., V] float32 -> out [...] int32: each row's argmax (argmax_row). Rows are shared
// among the threads.
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_argmax, Argmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
