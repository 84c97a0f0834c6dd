// The quant_linear kernels' entry points shared across their files: y = x W^T over a packed W
// (quant_layout.h) by the regime of the step's size. quant_linear.cpp chooses among them.
#pragma once

#include <ATen/core/Tensor.h>

#include "isa.h"
#include "quant_layout.h"

// float32 x [m, K] (row stride k), products in float32, y rounded to T:
#ifdef PAGEDSERVE_AVX2
// few rows (m <= kDotMaxRows): dot products over the codes (quant_linear_few_rows.cpp);
template <typename T, typename F>
void few_rows_linear(const float* x, int64_t m, int64_t k, const F& w, const float* bias, T* y,
                     int64_t n);
#endif
// more, and every row count in the portable kernels: decoded tiles (quant_linear_tiles.cpp).
template <typename T, typename F>
void many_rows_linear(const float* x, int64_t m, int64_t k, const F& w, const float* bias, T* y,
                      int64_t n);

// The integer products' instructions: AVX-512 VNNI's vpdpbusd, else from AVX2 on vpmaddubsw
// (quant_linear_int8.cpp; portable ones below AVX2).
#if defined(PAGEDSERVE_AVX512) && defined(__AVX512VNNI__)
#define PAGEDSERVE_VNNI 1
#elif defined(PAGEDSERVE_AVX2)
#define PAGEDSERVE_MADDUBS 1
#if defined(__AVXVNNI__)
#define PAGEDSERVE_AVX_VNNI 1  // the same loops with AVX-VNNI's 256-bit vpdpbusd
#endif
#endif
// Rows the integer products take: every count from AVX2 on; the portable ones up to 4 (beyond
// that torch's matmul over decoded strips, many_rows_linear, is as fast or faster).
#ifdef PAGEDSERVE_AVX2
constexpr int64_t kInt8MaxRows = INT64_MAX;
#else
constexpr int64_t kInt8MaxRows = 4;
#endif
// Eight-bit codes through AVX2's sign flips (no VNNI of either width: each costs an instruction
// a product) take them from 2 rows on (1.3-2.7x the float32 dot products at 2-8 rows of the
// Q8_0 lm_head, on Zen 3); one row is bound by reading the codes either way. With AVX-VNNI's
// shifted activations one row gains too (the lm_head 1.30-1.34x, Sapphire Rapids capped to
// avx2).
#if defined(PAGEDSERVE_MADDUBS) && !defined(PAGEDSERVE_AVX_VNNI)
constexpr int64_t kInt8EightBitMinRows = 2;
#else
constexpr int64_t kInt8EightBitMinRows = 1;
#endif
template <typename T, typename F>
void int8_linear(const T* x, int64_t m, int64_t k, const F& w, const float* bias, T* y,
                 int64_t n);

#ifdef PAGEDSERVE_AVX512_BF16
// bf16 x, block types: AVX-512 BF16 dot products (quant_linear_gemv_bf16.cpp).
void gemv_bf16_linear(const at::Tensor& x, const uint8_t* codes, const at::Half* scales,
                      const at::Half* offsets, const float* bias, at::BFloat16* y, int64_t n,
                      int bits);
#endif

#ifdef PAGEDSERVE_AMX
// The activations as A tiles read them, 16 whole rows at a time: blocks of x, and the last
// partial block (if any) from a zero-padded copy.
struct RowBlocks {
  const at::BFloat16* x;
  const at::BFloat16* tail;  // 16 rows: x's rows from `full` on, then zeros
  int64_t full;              // rows of x in whole blocks
  int64_t k;
  const char* at(int64_t m0) const {
    return reinterpret_cast<const char*>(m0 < full ? x + m0 * k : tail);
  }
};

// bf16 x, any number of rows: AMX tiles (quant_linear_amx.cpp); y bf16 or float32 (O).
template <typename F, typename O>
void amx_linear(const RowBlocks& x, int64_t m, int64_t k, const F& w, const float* bias, O* y,
                int64_t n);
#endif
