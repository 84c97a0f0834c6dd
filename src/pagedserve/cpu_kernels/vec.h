// A float32 vector of the level's native width, through GCC's and Clang's vector extension
// (any architecture): register-blocked loops written with it keep their accumulators in
// registers, which plain loops over arrays did not (the compiler spilled them every step).
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
