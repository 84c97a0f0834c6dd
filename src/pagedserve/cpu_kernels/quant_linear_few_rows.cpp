// y = x W^T for a few float32 rows (decode steps) over packed codes: dot products in float32
// over the codes, scaled once per group (or half group, Q6_K):
// sum(x * (c * d + m)) = d * sum(x * c) + m * sum(x). (The default, int8 products, is
// quant_linear_int8.cpp's; these keep float32's rounding, for --dtype float32 and K types.)
// AVX2 and up only: the portable kernels multiply decoded strips at every row count
// (quant_linear_tiles.cpp), faster than portable dot products even at one row.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "claims.h"
#include "quant_decode.h"
#include "quant_kernels.h"

#ifdef PAGEDSERVE_AVX2

namespace {

// Rows [0, R) of x (row stride k) times column tile nt, four-bit codes and every K type:
// a = sum(x * c) per scaling (A accumulators a row and half, so that enough FMAs are in
// flight), then out += d * a + m * sum(x). out: [R][16] in memory.
template <int R, typename F>
inline void dot_nibbles(const F& w, int64_t nt, const float* x, int64_t k, const float* xsum,
                        float* out) {
  constexpr int A = R == 1 ? 4 : R == 2 ? 2 : 1;  // 8 chains of FMAs (two of latency 4 each)
  constexpr int kParts = F::kHalvesDiffer ? 2 : 1;  // scalings per group
  const int64_t groups = k / kGroup, halves = k / kHalf;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = w.tile(nt, g);
    for (int part = 0; part < kParts; ++part) {
      __m256 acc[R][2][A];
      for (auto& row : acc) {
        for (auto& half : row) {
          for (auto& a : half) a = _mm256_setzero_ps();
        }
      }
      for (int q = 4 / kParts * part; q < 4 / kParts * (part + 1); ++q) {
        for (int t = 0; t < 8; ++t) {  // input 8q + t
          const __m256 f0 = _mm256_cvtepi32_ps(codes8<F>(c, q, 0, t));
          const __m256 f1 = _mm256_cvtepi32_ps(codes8<F>(c, q, 1, t));
          for (int i = 0; i < R; ++i) {
            const __m256 xb = _mm256_broadcast_ss(x + i * k + g * kGroup + 8 * q + t);
            acc[i][0][t % A] = _mm256_fmadd_ps(f0, xb, acc[i][0][t % A]);
            acc[i][1][t % A] = _mm256_fmadd_ps(f1, xb, acc[i][1][t % A]);
          }
        }
      }
      for (int h = 0; h < 2; ++h) {
        __m256 d, m;
        scales8(w, nt, g, part, h, d, m);
        for (int i = 0; i < R; ++i) {
          const float* xs = xsum + i * halves + 2 * g;
          __m256 s = acc[i][h][0];
          for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[i][h][a]);
          __m256 o = _mm256_loadu_ps(out + i * 16 + h * 8);
          o = _mm256_fmadd_ps(s, d, o);
          o = _mm256_fmadd_ps(m, _mm256_set1_ps(kParts == 2 ? xs[part] : xs[0] + xs[1]), o);
          _mm256_storeu_ps(out + i * 16 + h * 8, o);
        }
      }
    }
  }
}

template <int R>
inline void dot_rows(const BlockFormat<4>& w, int64_t nt, const float* x, int64_t k,
                     const float* xsum, float* out) {
  dot_nibbles<R>(w, nt, x, k, xsum, out);
}

template <int R, int Bits>
inline void dot_rows(const KFormat<Bits>& w, int64_t nt, const float* x, int64_t k,
                     const float* xsum, float* out) {
  dot_nibbles<R>(w, nt, x, k, xsum, out);
}

// Eight-bit codes: a tile row's 32 bytes are (column, pair) int8s, widened to float32 4
// columns at a time and multiplied by the activation pair (2r, 2r + 1); each column's two lanes
// are added at the end.
template <int R>
inline void dot_rows(const BlockFormat<8>& w, int64_t nt, const float* x, int64_t k,
                     const float* /*xsum*/, float* out) {
  const int64_t groups = k / kGroup;
  __m256 sums[R][4];  // (column, pair) lanes: columns 4j..4j+3
  for (auto& row : sums) {
    for (auto& v : row) v = _mm256_setzero_ps();
  }
  const __m256i pairs_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  const __m256i pairs_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = w.tile(nt, g);
    __m256 acc[R][4];
    for (auto& row : acc) {
      for (auto& v : row) v = _mm256_setzero_ps();
    }
    for (int r = 0; r < 16; ++r) {
      __m256 wv[4];
      for (int j = 0; j < 4; ++j) {
        wv[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + r * 32 + 8 * j))));
      }
      for (int i = 0; i < R; ++i) {
        double pair;  // x[2r], x[2r + 1], repeated in every lane pair
        std::memcpy(&pair, x + i * k + g * kGroup + 2 * r, sizeof pair);
        const __m256 xp = _mm256_castpd_ps(_mm256_set1_pd(pair));
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_fmadd_ps(wv[j], xp, acc[i][j]);
      }
    }
    const at::Half* scale = w.scale(nt, g);
    const __m256 d0 = load8_half(scale), d1 = load8_half(scale + 8);
    const __m256 d[4] = {
        _mm256_permutevar8x32_ps(d0, pairs_lo), _mm256_permutevar8x32_ps(d0, pairs_hi),
        _mm256_permutevar8x32_ps(d1, pairs_lo), _mm256_permutevar8x32_ps(d1, pairs_hi)};
    for (int i = 0; i < R; ++i) {
      for (int j = 0; j < 4; ++j) sums[i][j] = _mm256_fmadd_ps(acc[i][j], d[j], sums[i][j]);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int h = 0; h < 2; ++h) {  // hadd: (c0, c1, c4, c5 | c2, c3, c6, c7) -> in order
      const __m256 s = _mm256_hadd_ps(sums[i][2 * h], sums[i][2 * h + 1]);
      const __m256 v = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(s), 0xD8));
      float* o = out + i * 16 + h * 8;
      _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), v));
    }
  }
}

}  // namespace

// Threads claim the column tiles; each tile is multiplied by up to four rows at a time.
template <typename T, typename F>
void few_rows_linear(const float* x, int64_t m, int64_t k, const F& w, const float* bias, T* y,
                     int64_t n) {
  constexpr int kChunk = 4;
  const int64_t halves = k / kHalf;
  std::vector<float> xsum(m * halves, 0.f);  // x's sum over each half group (the offsets')
  for (int64_t i = 0; i < m * k; ++i) xsum[i / kHalf] += x[i];
  parallel_tiles(n / kTileCols, [&](int64_t begin, int64_t end) {
    alignas(32) float out[kChunk * kTileCols];
    for (int64_t nt = begin; nt < end; ++nt) {
      for (int64_t i0 = 0; i0 < m; i0 += kChunk) {
        const int64_t rows = std::min<int64_t>(kChunk, m - i0);
        std::fill(out, out + kChunk * kTileCols, 0.f);
        PAGEDSERVE_ROWS_1_TO_4(rows, dot_rows, w, nt, x + i0 * k, k,
                               xsum.data() + i0 * halves, out);
        for (int64_t i = 0; i < rows; ++i) {
          store_out(y + (i0 + i) * n + nt * kTileCols, out + i * kTileCols,
                    bias ? bias + nt * kTileCols : nullptr, kTileCols);
        }
      }
    }
  });
}

#define INSTANTIATE(F)                                                                    \
  template void few_rows_linear<float, F>(const float*, int64_t, int64_t, const F&,       \
                                          const float*, float*, int64_t);                 \
  template void few_rows_linear<at::BFloat16, F>(const float*, int64_t, int64_t, const F&, \
                                                 const float*, at::BFloat16*, int64_t);
PAGEDSERVE_FOR_EACH_FORMAT(INSTANTIATE)

#endif  // PAGEDSERVE_AVX2
