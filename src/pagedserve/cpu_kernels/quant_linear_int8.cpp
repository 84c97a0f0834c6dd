// y = x W^T over four-bit block codes (Q4_0/Q4_1) in integer products, as llama.cpp computes
// its quantized matmuls: each row of x is quantized per group of 32 inputs to int8 codes a and
// a float32 scale s (s = max |x| / 127), and
// sum(x * (c * d + m)) ~ d * s * sum(a * c) + m * sum(x), with sum(x) exact.
// The integer sums take one instruction per 4 products a lane:
// - AVX-512 VNNI (vpdpbusd, 64 products an instruction): 16 columns a register, a pass of
//   kPassRows rows kept in registers over a whole column tile;
// - AVX2 (vpmaddubsw, vpmaddwd): 8 columns a register; a group's 8 registers of codes are
//   shared by every row of the chunk.
// Codes are unsigned (0..15) and the activations signed, as both instructions take them. The
// activations' rounding (~0.4% of the largest in a group) is of bfloat16's order: this path
// serves bfloat16 activations, never float32 ones, whose products stay exact float32.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_decode.h"
#include "quant_kernels.h"

#ifdef PAGEDSERVE_AVX2

namespace {

constexpr int64_t kChunkRows = 64;  // rows of x a sweep over the tiles reads (int8: 96 KB)

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// One group of 32 inputs -> 32 int8 codes, its scale and exact sum. The codes of each 8
// inputs are stored in the order a nibble quad's 32-bit lane holds a column's codes
// (quant_layout.h): inputs 0, 4, 1, 5 in its low nibbles, 2, 6, 3, 7 in its high ones.
template <typename T>
inline void quantize_group(const T* x, int8_t* codes, float* scale, float* sum) {
  __m256 v[4];
  for (int j = 0; j < 4; ++j) v[j] = load8(x + 8 * j);
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 total = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
  __m256 amax = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
  amax = _mm256_max_ps(amax, _mm256_max_ps(_mm256_andnot_ps(sign, v[2]),
                                           _mm256_andnot_ps(sign, v[3])));
  const float top = reduce_max(amax);
  *sum = reduce_add(total);
  *scale = top / 127.f;
  const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256i c[4];
  for (int j = 0; j < 4; ++j) {
    c[j] = _mm256_cvtps_epi32(_mm256_permutevar8x32_ps(_mm256_mul_ps(v[j], inv), order));
  }
  // packs work within 128-bit lanes: the 32-bit groups come out as block 0..3's first four,
  // then their last four; the same permutation puts each block's two together.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                           _mm256_packs_epi32(c[2], c[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes),
                      _mm256_permutevar8x32_epi32(bytes, order));
}

// Rows of x quantized per group (thread-local buffers: ~120 calls a step).
struct QuantizedRows {
  const int8_t* codes;  // [m, k]
  const float* scale;   // [m, groups]
  const float* sum;     // [m, groups]
};

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t m, int64_t k) {
  thread_local std::vector<int8_t> codes;
  thread_local std::vector<float> scale, sum;
  const int64_t groups = k / kGroup;
  codes.resize(m * k);
  scale.resize(m * groups);
  sum.resize(m * groups);
  // The pool's threads see their own thread_local vectors: hand them this thread's memory.
  const QuantizedRows q{codes.data(), scale.data(), sum.data()};
  at::parallel_for(0, m * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      quantize_group(x + i * kGroup, const_cast<int8_t*>(q.codes) + i * kGroup,
                     const_cast<float*>(q.scale) + i, const_cast<float*>(q.sum) + i);
    }
  });
  return q;
}

template <typename T>
inline void store16(T* y, const float* v, const float* bias) {
  store_out(y, v, bias, kTileCols);
}

#if defined(PAGEDSERVE_AVX512) && defined(__AVX512VNNI__)

constexpr int64_t kPassRows = 8;  // R int and R float accumulators: 2R of the 32 registers

// Rows [0, R) of the quantized x times column tile nt: out[i] = row i's 16 columns.
template <int R>
inline void tile_rows(const QuantizedRows& x, int64_t k, const BlockFormat<4>& w, int64_t nt,
                      __m512* out) {
  const int64_t groups = k / kGroup;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int i = 0; i < R; ++i) out[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = w.tile(nt, g);
    prefetch_ahead(c, 256);
    __m512i acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_si512();
    for (int q = 0; q < 4; ++q) {
      const __m512i v = _mm512_loadu_si512(c + q * 64);
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int i = 0; i < R; ++i) {
        int32_t a[2];
        std::memcpy(a, x.codes + i * k + g * kGroup + 8 * q, sizeof a);
        acc[i] = _mm512_dpbusd_epi32(acc[i], lo, _mm512_set1_epi32(a[0]));
        acc[i] = _mm512_dpbusd_epi32(acc[i], hi, _mm512_set1_epi32(a[1]));
      }
    }
    const __m512 d = load_columns(w.scale(nt, g));
    const __m512 m = w.offsets ? load_columns(w.offset(nt, g)) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i) {
      const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(x.scale[i * groups + g]));
      out[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), ds, out[i]);
      out[i] = _mm512_fmadd_ps(_mm512_set1_ps(x.sum[i * groups + g]), m, out[i]);
    }
  }
}

template <int R, typename T>
void tile_rows_to(const QuantizedRows& x, int64_t k, const BlockFormat<4>& w, int64_t nt,
                  const float* bias, T* y, int64_t n) {
  __m512 out[R];
  tile_rows<R>(x, k, w, nt, out);
  alignas(64) float v[kTileCols];
  for (int i = 0; i < R; ++i) {
    _mm512_store_ps(v, out[i]);
    store16(y + i * n + nt * kTileCols, v, bias ? bias + nt * kTileCols : nullptr);
  }
}

// A chunk's rows through column tiles [begin, end), kPassRows at a time.
template <typename T>
void chunk_tiles(const QuantizedRows& x, int64_t rows, int64_t k, const BlockFormat<4>& w,
                 const float* bias, T* y, int64_t n, int64_t begin, int64_t end) {
  using Fn = void (*)(const QuantizedRows&, int64_t, const BlockFormat<4>&, int64_t,
                      const float*, T*, int64_t);
  static constexpr Fn kRows[kPassRows] = {tile_rows_to<1, T>, tile_rows_to<2, T>,
                                          tile_rows_to<3, T>, tile_rows_to<4, T>,
                                          tile_rows_to<5, T>, tile_rows_to<6, T>,
                                          tile_rows_to<7, T>, tile_rows_to<8, T>};
  const int64_t groups = k / kGroup;
  for (int64_t nt = begin; nt < end; ++nt) {
    for (int64_t i0 = 0; i0 < rows; i0 += kPassRows) {
      const QuantizedRows xi{x.codes + i0 * k, x.scale + i0 * groups, x.sum + i0 * groups};
      kRows[std::min(kPassRows, rows - i0) - 1](xi, k, w, nt, bias, y + i0 * n, n);
    }
  }
}

#else  // AVX2: vpmaddubsw

// The chunk's rows through column tiles [begin, end): per group, the tile's codes as 16
// registers of bytes (two halves of 8 columns, four quads, low and high nibbles), then every
// row's sums over them; the row sums of a tile stay in L1 (acc).
template <typename T>
void chunk_tiles(const QuantizedRows& x, int64_t rows, int64_t k, const BlockFormat<4>& w,
                 const float* bias, T* y, int64_t n, int64_t begin, int64_t end) {
  const int64_t groups = k / kGroup;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) float acc[kChunkRows * kTileCols];
  for (int64_t nt = begin; nt < end; ++nt) {
    std::fill(acc, acc + rows * kTileCols, 0.f);
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* c = w.tile(nt, g);
      for (int h = 0; h < 2; ++h) {
        __m256i code[8];  // quad q's low nibbles at 2q, high at 2q + 1
        for (int q = 0; q < 4; ++q) {
          const __m256i v =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + q * 64 + h * 32));
          code[2 * q] = _mm256_and_si256(v, low);
          code[2 * q + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        __m256 d, m;
        scales8(w, nt, g, 0, h, d, m);
        for (int64_t i = 0; i < rows; ++i) {
          const int8_t* a = x.codes + i * k + g * kGroup;
          // 16-bit sums of 8 products pairs: at most 8 * 2 * 15 * 127 = 30,480, no overflow.
          __m256i s = _mm256_setzero_si256();
          for (int j = 0; j < 8; ++j) {
            int32_t pick;
            std::memcpy(&pick, a + 4 * j, sizeof pick);
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(code[j], _mm256_set1_epi32(pick)));
          }
          const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));
          float* o = acc + i * kTileCols + h * 8;
          __m256 r = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(x.scale[i * groups + g])),
                                     _mm256_load_ps(o));
          r = _mm256_fmadd_ps(_mm256_set1_ps(x.sum[i * groups + g]), m, r);
          _mm256_store_ps(o, r);
        }
      }
    }
    for (int64_t i = 0; i < rows; ++i) {
      store16(y + i * n + nt * kTileCols, acc + i * kTileCols,
              bias ? bias + nt * kTileCols : nullptr);
    }
  }
}

#endif

}  // namespace

template <typename T>
void int8_linear(const T* x, int64_t m, int64_t k, const BlockFormat<4>& w, const float* bias,
                 T* y, int64_t n) {
  const QuantizedRows q = quantize_rows(x, m, k);
  const int64_t groups = k / kGroup;
  for (int64_t m0 = 0; m0 < m; m0 += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, m - m0);
    const QuantizedRows chunk{q.codes + m0 * k, q.scale + m0 * groups, q.sum + m0 * groups};
    at::parallel_for(0, n / kTileCols, 1, [&](int64_t begin, int64_t end) {
      chunk_tiles(chunk, rows, k, w, bias, y + m0 * n, n, begin, end);
    });
  }
}

template void int8_linear<float>(const float*, int64_t, int64_t, const BlockFormat<4>&,
                                 const float*, float*, int64_t);
template void int8_linear<at::BFloat16>(const at::BFloat16*, int64_t, int64_t,
                                        const BlockFormat<4>&, const float*, at::BFloat16*,
                                        int64_t);

#endif  // PAGEDSERVE_AVX2
