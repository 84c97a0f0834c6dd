// y = x W^T for bfloat16 rows with Intel AMX: each thread decodes a strip of 32 output columns
// into bfloat16 tiles (in the pair layout TDPBF16PS reads, so no shuffles; quant_decode.h) and
// multiplies every 32-row block of the activations by it. Products accumulate in float32.
#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>
#include <type_traits>

#include "amx.h"
#include "quant_decode.h"
#include "quant_kernels.h"

#ifdef PAGEDSERVE_AMX

namespace {

// Accumulator tile `c` (16x16 float32, at `acc`) -> rows [m0, m0 + rows) of y (bf16 or
// float32), columns [n0, n0 + 16), plus the bias.
template <typename O>
inline void store_tile(const float* acc, O* y, int64_t ldy, int64_t m0, int64_t rows, int64_t n0,
                       const float* bias) {
  const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(acc + r * 16), b);
    if constexpr (std::is_same_v<O, float>) {
      _mm512_storeu_ps(y + (m0 + r) * ldy + n0, v);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + r) * ldy + n0),
                          (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// Sums 0-3 plus the bias to y: rows [m0, m0 + min(rows, 32)), columns [n0, n0 + 32).
template <typename O>
inline void store_sums(O* y, int64_t ldy, int64_t m0, int64_t rows, int64_t n0,
                       const float* bias) {
  alignas(64) float acc[16 * 16];
  const int64_t rows0 = std::min<int64_t>(kTileRows, rows);
  _tile_stored(0, acc, 64);
  store_tile(acc, y, ldy, m0, rows0, n0, bias);
  _tile_stored(1, acc, 64);
  store_tile(acc, y, ldy, m0, rows0, n0 + kTileCols, bias);
  if (rows > kTileRows) {
    const int64_t rows1 = std::min<int64_t>(kTileRows, rows - kTileRows);
    _tile_stored(2, acc, 64);
    store_tile(acc, y, ldy, m0 + kTileRows, rows1, n0, bias);
    _tile_stored(3, acc, 64);
    store_tile(acc, y, ldy, m0 + kTileRows, rows1, n0 + kTileCols, bias);
  }
}

// One group's products into sums 0-3: activation rows [0, 16) at a0 (and [16, 32) at a1 when
// `two`) times the group's two decoded weight tiles.
inline void multiply_group(const uint16_t* w0, const uint16_t* w1, const char* a0, const char* a1,
                           int64_t lda, bool two) {
  _tile_loadd(6, w0, 64);
  _tile_loadd(7, w1, 64);
  _tile_loadd(4, a0, lda);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  if (two) {
    _tile_loadd(5, a1, lda);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// amx_linear for steps of at most 32 rows (decode): each group's two weight tiles are used
// by every row as soon as they are decoded, in L1, instead of a run of strips decoded to L2
// first (all packed linears of a batch-32 step of the default model: 11.1-15.0 -> 9.9-12.0 ms).
template <typename F, typename O>
void amx_linear_one_pass(const RowBlocks& x, int64_t m, int64_t k, const F& wt, const float* bias,
                         O* y, int64_t n) {
  const int64_t groups = k / kGroup;
  const int64_t lda = k * 2;
  const bool two = m > kTileRows;
  const char* a0 = x.at(0);
  const char* a1 = x.at(kTileRows);
  at::parallel_for(0, n / (2 * kTileCols), 1, [&](int64_t begin, int64_t end) {
    _tile_loadconfig(&tile_config());  // tmm0-3: sums; tmm4-5: activations; tmm6-7: weights
    alignas(64) uint16_t w[2][2][512];  // [buffer, alternating by group][column tile]
    for (int64_t strip = begin; strip < end; ++strip) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t g = 0; g < groups; ++g) {
        uint16_t(*wg)[512] = w[g & 1];
        for (int t = 0; t < 2; ++t) {
          decode_tile_bf16(wt, strip * 2 + t, g, wg[t]);
        }
        multiply_group(wg[0], wg[1], a0 + g * 64, a1 + g * 64, lda, two);
      }
      store_sums(y, n, 0, m, strip * 2 * kTileCols, bias);
    }
    _tile_release();
  });
}

}  // namespace

template <typename F, typename O>
void amx_linear(const RowBlocks& x, int64_t m, int64_t k, const F& wt, const float* bias, O* y,
                int64_t n) {
  if (m <= 2 * kTileRows) {
    amx_linear_one_pass(x, m, k, wt, bias, y, n);
    return;
  }
  const int64_t groups = k / kGroup;
  const int64_t padded_m = (m + kTileRows - 1) / kTileRows * kTileRows;
  const int64_t strips = n / (2 * kTileCols);
  const int64_t lda = k * 2;  // bytes per activation row
  // A thread decodes a run of strips that fits in L2 (~256 KB of bf16 tiles), then streams
  // the activations past them once: for long steps (prefill) the activations, not the weights,
  // are the big operand, and reading them once per strip ran at a third of the AMX rate.
  const int64_t strip_bytes = groups * 2 * 512 * sizeof(uint16_t);
  const int64_t run_len = std::max<int64_t>(1, (256 << 10) / strip_bytes);
  at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
    _tile_loadconfig(&tile_config());  // tmm0-3: sums; tmm4-5: activations; tmm6-7: weights
    // Not value-initialised: zeroing up to 256 KB per call cost more than the products.
    std::unique_ptr<uint16_t[]> w(new uint16_t[std::min(run_len, end - begin) * groups * 1024]);
    for (int64_t run = begin; run < end; run += run_len) {
      const int64_t run_end = std::min(end, run + run_len);
      for (int64_t strip = run; strip < run_end; ++strip) {
        uint16_t* ws = w.get() + (strip - run) * groups * 1024;
        for (int t = 0; t < 2; ++t) {
          const int64_t nt = strip * 2 + t;
          for (int64_t g = 0; g < groups; ++g) decode_tile_bf16(wt, nt, g, ws + (g * 2 + t) * 512);
        }
      }
      for (int64_t m0 = 0; m0 < padded_m; m0 += 2 * kTileRows) {
        const bool two = m0 + kTileRows < padded_m;
        const char* a0 = x.at(m0);
        const char* a1 = x.at(m0 + kTileRows);
        for (int64_t strip = run; strip < run_end; ++strip) {
          const uint16_t* ws = w.get() + (strip - run) * groups * 1024;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t g = 0; g < groups; ++g) {
            const uint16_t* wg = ws + g * 1024;
            multiply_group(wg, wg + 512, a0 + g * 64, a1 + g * 64, lda, two);
          }
          store_sums(y, n, m0, m - m0, strip * 2 * kTileCols, bias);
        }
      }
    }
    _tile_release();
  });
}

#define INSTANTIATE(F)                                                                    \
  template void amx_linear<F, at::BFloat16>(const RowBlocks&, int64_t, int64_t, const F&,    \
                                            const float*, at::BFloat16*, int64_t);           \
  template void amx_linear<F, float>(const RowBlocks&, int64_t, int64_t, const F&,           \
                                     const float*, float*, int64_t);
PAGEDSERVE_FOR_EACH_FORMAT(INSTANTIATE)

#endif  // PAGEDSERVE_AMX
