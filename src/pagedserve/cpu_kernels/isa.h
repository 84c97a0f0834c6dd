// The kernel level this build targets (cpu_kernels/isa.py passes the level's -m flags), from
// the compiler's feature macros: each source holds the code of every level behind these.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDSERVE_AVX2 1
#endif
#if defined(PAGEDSERVE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512DQ__)
#define PAGEDSERVE_AVX512 1
#endif
#if defined(PAGEDSERVE_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__AVX512BF16__)
#define PAGEDSERVE_AMX 1
#endif

// Whether this build computes bfloat16 products natively (avx512 on Zen 4, amx).
#if defined(PAGEDSERVE_AVX512) && defined(__AVX512BF16__)
#define PAGEDSERVE_AVX512_BF16 1
#endif

#if defined(PAGEDSERVE_AVX2)
#include <immintrin.h>
#endif

// "amx", "avx512", "avx2" or "generic": what this build was compiled for.
inline const char* kernel_level_name() {
#if defined(PAGEDSERVE_AMX)
  return "amx";
#elif defined(PAGEDSERVE_AVX512)
  return "avx512";
#elif defined(PAGEDSERVE_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}
