// Softmax pieces shared by the attention kernels (decode_attention.cpp, prefill_attention.cpp)
// and the greedy argmax: portable loops the compiler vectorizes (exp from glibc's vector math
// library, which -ffast-math allows).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "convert.h"

// The largest of x[0, n) as float32.
template <typename T>
inline float max_of(const T* x, int64_t n) {
  float mx = std::numeric_limits<float>::lowest();
  // Written as a select: the vectoriser left a std::max reduction scalar (one vmaxss after
  // another, most of exp_sum_'s time at context 200).
#pragma omp simd reduction(max : mx)
  for (int64_t t = 0; t < n; ++t) mx = to_f(x[t]) > mx ? to_f(x[t]) : mx;
  return mx;
}

// In place: s = exp(s - max(s)); returns the sum (softmax's denominator).
inline float exp_sum_(float* s, int64_t n) {
  const float mx = max_of(s, n);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  return sum;
}

// In place: s = softmax(s).
inline void softmax_(float* s, int64_t n) {
  const float inv = 1.f / exp_sum_(s, n);
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) s[t] *= inv;
}
