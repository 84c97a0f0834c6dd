// Vectors through GCC's and Clang's vector extension (any architecture): a float32 vector of
// the level's native width, and the 128-bit vectors (SSE2's and NEON's baseline width) of the
// portable quantized kernels. Register-blocked loops written with them keep their
// accumulators in registers, which plain loops over arrays did not (the compiler spilled them
// every step).
#pragma once

#include <cstdint>
#include <cstring>

#include "isa.h"

#if defined(PAGEDSERVE_AVX512)
constexpr int64_t kLanes = 16;
#elif defined(PAGEDSERVE_AVX2)
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 4;  // SSE2, NEON
#endif

typedef float VecF __attribute__((vector_size(kLanes * sizeof(float))));

inline VecF load_vec(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store_vec(float* p, VecF v) { std::memcpy(p, &v, sizeof v); }

typedef int8_t I8x8 __attribute__((vector_size(8)));
typedef int16_t I16x8 __attribute__((vector_size(16)));
typedef uint16_t U16x8 __attribute__((vector_size(16)));
typedef int32_t I32x4 __attribute__((vector_size(16)));
typedef float F32x4 __attribute__((vector_size(16)));

// The low and the high 16-bit half of each 32-bit lane, sign-extended: of a packed tile row's
// lane pairs (column c's inputs 2r and 2r + 1, quant_layout.h), the first input's and the
// second's.
inline I32x4 low_halves(I32x4 v) { return (v << 16) >> 16; }
inline I32x4 high_halves(I32x4 v) { return v >> 16; }
