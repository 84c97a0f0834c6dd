// Element conversions shared by the kernels: math is in float32 and results are rounded once
// to the tensor's dtype (to nearest even, as torch does). bfloat16 goes by bit shifts, which
// the compiler vectorizes at every level.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "isa.h"

inline float to_f(float x) { return x; }
inline float to_f(int8_t x) { return static_cast<float>(x); }
// float16 in bit operations the compiler vectorizes at every level (c10's conversion went
// value by value: float16 KV pages read 1.6x slower than float32 ones at the generic level).
// Exponent and mantissa moved into float32's fields and scaled by 2^112 (subnormals come out
// normalized); infinities and NaNs get float32's top exponent.
inline float to_f(at::Half x) {
  const uint32_t em = x.x & 0x7FFFu;
  float f;
  const uint32_t shifted = em << 13;
  std::memcpy(&f, &shifted, sizeof f);
  f *= 0x1p112f;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits |= (em >= 0x7C00u ? 0x7F800000u : 0u) | (static_cast<uint32_t>(x.x & 0x8000u) << 16);
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_f(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline T from_f(float v);
template <>
inline float from_f<float>(float v) { return v; }
template <>
inline at::Half from_f<at::Half>(float v) { return static_cast<at::Half>(v); }
template <>
inline at::BFloat16 from_f<at::BFloat16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest even
  return at::BFloat16(static_cast<uint16_t>(bits >> 16), at::BFloat16::from_bits());
}

// int8 KV pages: the row of one (token, KV head) is its D codes, then the float32 scale that
// multiplies them (the row's largest magnitude / 127) in the row's last 4 bytes, so that a row
// is read in one place. kRowExtra<C>: the elements a row of a C cache holds beyond D.
template <typename C>
inline constexpr int64_t kRowExtra = std::is_same_v<C, int8_t> ? 4 : 0;

// The scale of a cache row of head size d (1 for float pages).
template <typename C>
inline float row_scale(const C* row, int64_t d) {
  if constexpr (std::is_same_v<C, int8_t>) {
    float s;
    std::memcpy(&s, row + d, sizeof s);
    return s;
  } else {
    return 1.f;
  }
}

// The head size of a KV cache [pages, page_size, Hk, D (+ 4 for int8)].
inline int64_t cache_head_dim(const at::Tensor& cache) {
  return cache.size(3) - (cache.scalar_type() == at::kChar ? 4 : 0);
}

#ifdef PAGEDSERVE_AVX2
// 8 values as float32 (bfloat16: its bits shifted into the high half; float16: F16C).
inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_f32(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8_f32(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8_f32(const int8_t* p) {  // the codes alone: the caller applies the scale
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// Calls fn(T{}) with T the C++ type of `dtype` (float, bfloat16 or half). A plain switch, not
// AT_DISPATCH: the loop bodies carry `#pragma omp simd`, which a macro argument cannot hold.
template <typename Fn>
void dispatch(at::ScalarType dtype, const char* name, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(at::BFloat16{}); break;
    case at::kHalf: fn(at::Half{}); break;
    default: TORCH_CHECK(false, name, ": unsupported dtype ", dtype);
  }
}

// Calls fn(T{}, C{}) with T the C++ type of the activations' dtype and C that of the KV
// cache's: the same dtype, float32 activations over 16-bit pages (llama.cpp's default: half
// the cache's bytes at float32 math), or int8 pages (int8_t) under any activations.
template <typename Fn>
void dispatch_kv(at::ScalarType dtype, at::ScalarType cache_dtype, const char* name, Fn&& fn) {
  if (cache_dtype == dtype) {
    dispatch(dtype, name, [&](auto tag) { fn(tag, tag); });
  } else if (dtype == at::kFloat && cache_dtype == at::kHalf) {
    fn(float{}, at::Half{});
  } else if (dtype == at::kFloat && cache_dtype == at::kBFloat16) {
    fn(float{}, at::BFloat16{});
  } else if (cache_dtype == at::kChar) {
    dispatch(dtype, name, [&](auto tag) { fn(tag, int8_t{}); });
  } else {
    TORCH_CHECK(false, name, ": a ", cache_dtype, " KV cache under ", dtype, " activations");
  }
}
