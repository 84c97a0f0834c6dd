// y = x W^T for bfloat16 rows over block-type codes (Q4_0/Q4_1, Q8_0) where the level computes
// bfloat16: any number of rows at the avx512 level (AVX-512 BF16 without AMX), a few in AMX
// builds (whose tiles pay off for more):
// - four-bit codes become the bfloat16 numbers 128 + code by one OR (exact), vdpbf16ps sums
//   them against the activations, and each group's sum is scaled once:
//   sum(x * (code * d + m)) = d * (sum(x * (128 + code)) - 128 * sum(x)) + m * sum(x);
// - eight-bit codes are widened to float32 and multiplied by x in float32.
// Products accumulate in float32 either way.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "quant_decode.h"
#include "quant_kernels.h"

#ifdef PAGEDSERVE_AVX512_BF16

namespace {

// Rows [0, R) of x times one column tile, four-bit codes: out[i] = 16 columns of row i.
template <int R>
inline void gemv_q4_tile(const at::BFloat16* x, int64_t k, const float* xsum, const uint8_t* codes,
                         const at::Half* scale, const at::Half* offset, __m512* out) {
  const int64_t groups = k / kGroup;
  const __m512i nibble = _mm512_set1_epi16(0xF), bf16_128 = _mm512_set1_epi16(0x4300);
  constexpr int kAndOr = 0xEA;  // ternary logic: (a & b) | c
  for (int i = 0; i < R; ++i) out[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    const uint8_t* c = codes + g * 256;
    prefetch_ahead(c, 256);
    for (int q = 0; q < 4; ++q) {
      const __m512i words = _mm512_loadu_si512(c + q * 64);
      for (int j = 0; j < 4; ++j) {  // row 4q + j: the bfloat16 numbers 128 + code
        const auto row = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4 * j),
                                                             nibble, bf16_128, kAndOr);
        for (int i = 0; i < R; ++i) {
          int32_t pair;  // x[2r], x[2r+1] of the group, r = 4q + j
          std::memcpy(&pair, x + i * k + g * kGroup + 2 * (4 * q + j), sizeof pair);
          acc[i] = _mm512_dpbf16_ps(acc[i], row, (__m512bh)_mm512_set1_epi32(pair));
        }
      }
    }
    const __m512 d = load_columns(scale + g * 16);
    const __m512 m = offset != nullptr ? load_columns(offset + g * 16) : _mm512_setzero_ps();
    const __m512 m_shift = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), d, m);  // m - 128 d
    for (int i = 0; i < R; ++i) {
      out[i] = _mm512_fmadd_ps(acc[i], d, out[i]);
      out[i] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[i * groups + g]), m_shift, out[i]);
    }
  }
}

// The same for eight-bit codes without offsets, in float32 (xf: x as float32).
template <int R>
inline void gemv_q8_tile(const float* xf, int64_t k, const uint8_t* codes, const at::Half* scale,
                         __m512* out) {
  const int64_t groups = k / kGroup;
  __m512 lo_sum[R], hi_sum[R];
  for (int i = 0; i < R; ++i) lo_sum[i] = hi_sum[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 lo_acc[R], hi_acc[R];
    for (int i = 0; i < R; ++i) lo_acc[i] = hi_acc[i] = _mm512_setzero_ps();
    const uint8_t* c = codes + g * 512;
    prefetch_ahead(c, 512);
    for (int r = 0; r < 16; ++r) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + r * 32));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
      for (int i = 0; i < R; ++i) {
        double pair;  // x[2r], x[2r+1] of the group, repeated in every lane pair
        std::memcpy(&pair, xf + i * k + g * kGroup + 2 * r, sizeof pair);
        const __m512 xp = _mm512_castpd_ps(_mm512_set1_pd(pair));
        lo_acc[i] = _mm512_fmadd_ps(lo, xp, lo_acc[i]);
        hi_acc[i] = _mm512_fmadd_ps(hi, xp, hi_acc[i]);
      }
    }
    __m512 d_lo, d_hi;
    pair_lanes(load_columns(scale + g * 16), d_lo, d_hi);
    for (int i = 0; i < R; ++i) {
      lo_sum[i] = _mm512_fmadd_ps(lo_acc[i], d_lo, lo_sum[i]);
      hi_sum[i] = _mm512_fmadd_ps(hi_acc[i], d_hi, hi_sum[i]);
    }
  }
  // Lanes hold (column, pair) sums: add each column's two lanes.
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int i = 0; i < R; ++i) {
    out[i] = _mm512_add_ps(_mm512_permutex2var_ps(lo_sum[i], even, hi_sum[i]),
                           _mm512_permutex2var_ps(lo_sum[i], odd, hi_sum[i]));
  }
}

// Rows a pass over one tile: R accumulators and R sums in registers (2R of the 32 zmm).
constexpr int64_t kPassRows = 8;
// Rows of x a sweep over the tiles reads: 64 rows of 1,536 bfloat16 inputs are 192 KB.
constexpr int64_t kChunkRows = 64;

// Rows [0, R) of one column tile nt into y (row stride n), bias added, rounded to bfloat16.
template <int R>
void tile_rows(const at::BFloat16* x, const float* xf, const float* xsum, int64_t k,
               const uint8_t* codes, const at::Half* scales, const at::Half* offsets,
               const float* bias, at::BFloat16* y, int64_t n, int bits, int64_t nt) {
  const int64_t groups = k / kGroup, tile_bytes = kTileRows * kGroup * bits / 8;
  const int64_t tile = nt * groups;
  __m512 out[R];
  if (bits == 4) {
    gemv_q4_tile<R>(x, k, xsum, codes + tile * tile_bytes, scales + tile * 16,
                    offsets != nullptr ? offsets + tile * 16 : nullptr, out);
  } else {
    gemv_q8_tile<R>(xf, k, codes + tile * tile_bytes, scales + tile * 16, out);
  }
  const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + nt * 16) : _mm512_setzero_ps();
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * n + nt * 16),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(out[i], b)));
  }
}

using TileRows = void (*)(const at::BFloat16*, const float*, const float*, int64_t,
                          const uint8_t*, const at::Half*, const at::Half*, const float*,
                          at::BFloat16*, int64_t, int, int64_t);
constexpr TileRows kTileRowsFor[kPassRows] = {tile_rows<1>, tile_rows<2>, tile_rows<3>,
                                              tile_rows<4>, tile_rows<5>, tile_rows<6>,
                                              tile_rows<7>, tile_rows<8>};

}  // namespace

// y = x W^T for any number of rows, in chunks of kChunkRows (x's chunk stays in L2): a thread
// takes whole column tiles and runs every row of the chunk through one before the next
// (kPassRows at a time), so a tile's codes are read once a chunk and then from L1.
void gemv_bf16_linear(const at::Tensor& x, const uint8_t* codes, const at::Half* scales,
                      const at::Half* offsets, const float* bias, at::BFloat16* y, int64_t n,
                      int bits) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup;
  const auto* xp = x.data_ptr<at::BFloat16>();
  // x in float32 (eight-bit path) or its sum over each group (four-bit path's offsets).
  thread_local std::vector<float> xf, xsum;  // plain memory: ~120 calls a step
  if (bits == 8) {
    xf.resize(m * k);
    for (int64_t i = 0; i < m * k; ++i) xf[i] = static_cast<float>(xp[i]);
  } else {
    xsum.assign(m * groups, 0.f);
    for (int64_t i = 0; i < m * k; ++i) xsum[i / kGroup] += static_cast<float>(xp[i]);
  }
  const float* xfp = xf.data();
  const float* sp = xsum.data();
  // One parallel region, each thread's column tiles through every chunk (as int8_linear).
  at::parallel_for(0, n / kTileCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m; m0 += kChunkRows) {
      const int64_t chunk_end = std::min(m, m0 + kChunkRows);
      for (int64_t nt = begin; nt < end; ++nt) {
        for (int64_t i0 = m0; i0 < chunk_end; i0 += kPassRows) {
          const int64_t rows = std::min(kPassRows, chunk_end - i0);
          kTileRowsFor[rows - 1](xp + i0 * k, bits == 8 ? xfp + i0 * k : nullptr,
                                 bits == 8 ? nullptr : sp + i0 * groups, k, codes, scales,
                                 offsets, bias, y + i0 * n, n, bits, nt);
        }
      }
    }
  });
}

#endif  // PAGEDSERVE_AVX512_BF16
