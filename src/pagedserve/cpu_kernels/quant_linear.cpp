// Matrix products straight from GGUF's block-quantized weights (Q4_0/Q4_1 and Q8_0), at every
// kernel level. A step's linears are bound by reading weights: at four or eight bits per
// weight they read 2-4x fewer bytes than bfloat16 (4-7x fewer than float32).
//
// bfloat16 activations where the level computes bfloat16 (AVX-512 BF16, AMX):
// - Steps of a few rows (kGemvMaxRows) take dot products on AVX-512: four-bit codes become the
//   bfloat16 numbers 128 + code by one OR (exact), vdpbf16ps sums them against the activations,
//   and each group's sum is scaled once: sum(x * (code * d + m)) = d * (sum(x * (128 + code))
//   - 128 * sum(x)) + m * sum(x).
// - Bigger steps use Intel AMX: each thread decodes a strip of 32 output columns into bfloat16
//   tiles (in the pair layout TDPBF16PS reads, so no shuffles) and multiplies every 32-row
//   block of the activations by it. Products accumulate in float32 either way.
// float32 activations, and bfloat16 ones elsewhere (computed in float32, rounded once):
// - AVX2 and up, steps of a few rows (kDotMaxRows): float32 dot products over the codes,
//   scaled once per group: sum(x * (c * d + m)) = d * sum(x * c) + m * sum(x). (llama.cpp's
//   int8 products over activations quantized per group ran 1.5-2x faster here, but their
//   rounding, ~0.4% of each product, is not float32's: greedy parity with float32 references
//   would not hold.)
// - AVX2 and up, bigger steps: a thread decodes one tile (16 columns x 32 inputs) to float32 in
//   L1 and multiplies every row by it, six rows at a time in registers.
// - The portable level (generic C++ the compiler vectorizes): float32 dot products over the
//   codes for a few rows; for more, a strip of columns decoded to float32 for torch's matmul.
//
// The packed layout (built once at load, models/quant_weight.py): for output-column tile nt
// (16 columns) and input group g (32 values), one "tile" of codes whose row r and lane L hold
// the weight at column nt*16 + L/2, input g*32 + 2r + L%2 (the pair layout of a bfloat16 B
// tile). Eight-bit codes are stored lane by lane (32 bytes a row). Four-bit codes come in
// groups of four rows: 16-bit word j of group q holds lane j of rows 4q..4q+3 in its four
// nibbles, lowest first. Scales and offsets are float16 [tiles, groups, 16];
// weight = code * scale + offset.
#include "quant_linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "amx.h"

#ifdef PAGEDSERVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

// Whether this build computes bfloat16 products natively (avx512 on Zen 4, amx).
#if defined(PAGEDSERVE_AVX512) && defined(__AVX512BF16__)
#define PAGEDSERVE_AVX512_BF16 1
#endif

namespace {

constexpr int64_t kGroup = 32;     // input values per quantization group (one B tile's K)
constexpr int64_t kTileCols = 16;  // output columns per tile
constexpr int64_t kTileRows = 16;  // activation rows per A tile
// Steps of at most this many rows take the AVX-512 bf16 dot-product path, bigger ones AMX.
constexpr int64_t kGemvMaxRows = 4;
// float32 steps of at most this many rows take dot products, bigger ones decoded tiles.
constexpr int64_t kDotMaxRows = 8;

// The code at row r, lane `lane` of a tile (layout above).
template <int Bits>
inline int code_at(const uint8_t* tile, int r, int lane) {
  if constexpr (Bits == 4) {
    uint16_t word;
    std::memcpy(&word, tile + r / 4 * 64 + 2 * lane, sizeof word);
    return (word >> (4 * (r % 4))) & 0xF;
  } else {
    return static_cast<int8_t>(tile[r * 32 + lane]);
  }
}

// y[0, count) = v + bias, rounded to y's type.
template <typename T>
inline void store_out(T* y, const float* v, const float* bias, int64_t count) {
  for (int64_t c = 0; c < count; ++c) y[c] = static_cast<T>(v[c] + (bias ? bias[c] : 0.f));
}

#ifdef PAGEDSERVE_AVX512_BF16
// Codes stream through once per step; without prefetching, a thread waits on memory for a
// third of the time (decode step at batch 1, reference CPU). 4 KB ahead is 8-16 groups.
constexpr int64_t kPrefetchAhead = 4096;
inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchAhead + line), _MM_HINT_T0);
  }
}

// A tile's 16 float16 scales (or offsets) as float32, one lane a column.
inline __m512 load_columns(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The same, each repeated for the two lanes of its pair: lanes 0-15 cover columns 0-7 (lo),
// lanes 16-31 columns 8-15 (hi).
inline void pair_lanes(const at::Half* p, __m512& lo, __m512& hi) {
  const __m512 v = load_columns(p);
  const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  lo = _mm512_permutexvar_ps(lo_idx, v);
  hi = _mm512_permutexvar_ps(_mm512_add_epi32(lo_idx, _mm512_set1_epi32(8)), v);
}

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
    pair_lanes(scale + g * 16, d_lo, d_hi);
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

template <int R>
void gemv_rows(const at::BFloat16* x, const float* xf, const float* xsum, int64_t k,
               const uint8_t* codes, const at::Half* scales, const at::Half* offsets,
               const float* bias, at::BFloat16* y, int64_t n, int bits) {
  const int64_t groups = k / kGroup, tile_bytes = kTileRows * kGroup * bits / 8;
  at::parallel_for(0, n / kTileCols, 1, [&](int64_t begin, int64_t end) {
    __m512 out[R];
    for (int64_t nt = begin; nt < end; ++nt) {
      const int64_t tile = nt * groups;
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
  });
}

// y = x W^T for a few rows, in chunks of up to kGemvMaxRows.
void gemv_linear(const at::Tensor& x, const uint8_t* codes, const at::Half* scales,
                 const at::Half* offsets, const float* bias, at::BFloat16* y, int64_t n,
                 int bits) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup;
  const auto* xp = x.data_ptr<at::BFloat16>();
  // x in float32 (eight-bit path) and its sum over each group (four-bit path's offsets).
  std::vector<float> xf(m * k), xsum(m * groups, 0.f);
  for (int64_t i = 0; i < m * k; ++i) {
    xf[i] = static_cast<float>(xp[i]);
    xsum[i / kGroup] += xf[i];
  }
  const float* xfp = xf.data();
  const float* sp = xsum.data();
  for (int64_t i0 = 0; i0 < m; i0 += kGemvMaxRows) {
    const int64_t rows = std::min(kGemvMaxRows, m - i0);
    const auto fn = rows == 1 ? gemv_rows<1>
                    : rows == 2 ? gemv_rows<2>
                    : rows == 3 ? gemv_rows<3>
                                : gemv_rows<4>;
    fn(xp + i0 * k, xfp + i0 * k, sp + i0 * groups, k, codes, scales, offsets, bias, y + i0 * n,
       n, bits);
  }
}


#endif  // PAGEDSERVE_AVX512_BF16

#ifdef PAGEDSERVE_AMX

// One tile of codes -> 16 rows of 32 bfloat16 (1 KB) at `out`.
template <int Bits>
inline void decode_tile(const uint8_t* codes, const at::Half* scale, const at::Half* offset,
                        uint16_t* out) {
  prefetch_ahead(codes, Bits * 64);
  __m512 s_lo, s_hi, o_lo = _mm512_setzero_ps(), o_hi = _mm512_setzero_ps();
  pair_lanes(scale, s_lo, s_hi);
  if (offset != nullptr) pair_lanes(offset, o_lo, o_hi);
  const auto emit = [&](int r, __m512 lo, __m512 hi) {
    lo = _mm512_fmadd_ps(lo, s_lo, o_lo);
    hi = _mm512_fmadd_ps(hi, s_hi, o_hi);
    _mm512_storeu_si512(out + r * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  };
  if constexpr (Bits == 4) {
    // A code c becomes the float32 1 + c/16 by one shift and one OR into the mantissa of 1.0
    // (no int-to-float conversion): weight = (1 + c/16) * 16 scale + (offset - 16 scale).
    const __m512 sixteen = _mm512_set1_ps(16.f);
    s_lo = _mm512_mul_ps(s_lo, sixteen);
    s_hi = _mm512_mul_ps(s_hi, sixteen);
    o_lo = _mm512_sub_ps(o_lo, s_lo);
    o_hi = _mm512_sub_ps(o_hi, s_hi);
    const __m512i mantissa = _mm512_set1_epi32(0xF << 19), one = _mm512_set1_epi32(0x3F800000);
    constexpr int kAndOr = 0xEA;  // ternary logic: (a & b) | c
    const auto code_plus_one = [&](__m512i v, int i) {
      return _mm512_castsi512_ps(
          _mm512_ternarylogic_epi32(_mm512_slli_epi32(v, 19 - 4 * i), mantissa, one, kAndOr));
    };
    for (int q = 0; q < 4; ++q) {
      const __m512i words = _mm512_loadu_si512(codes + q * 64);
      const __m512i v0 = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(words));
      const __m512i v1 = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(words, 1));
      for (int i = 0; i < 4; ++i) emit(4 * q + i, code_plus_one(v0, i), code_plus_one(v1, i));
    }
  } else {
    for (int r = 0; r < 16; ++r) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + r * 32));
      emit(r, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v))),
           _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1))));
    }
  }
}

// Accumulator tile `c` (16x16 float32, at `acc`) -> rows [m0, m0 + rows) of y, columns
// [n0, n0 + 16), plus the bias.
inline void store_tile(const float* acc, at::BFloat16* y, int64_t ldy, int64_t m0, int64_t rows,
                       int64_t n0, const float* bias) {
  const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(acc + r * 16), b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + r) * ldy + n0),
                        (__m256i)_mm512_cvtneps_pbh(v));
  }
}

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

// Sums 0-3 plus the bias to y: rows [m0, m0 + min(rows, 32)), columns [n0, n0 + 32).
inline void store_sums(at::BFloat16* y, int64_t ldy, int64_t m0, int64_t rows, int64_t n0,
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
template <int Bits>
void amx_linear_one_pass(const RowBlocks& x, int64_t m, int64_t k, const uint8_t* codes,
                         const at::Half* scales, const at::Half* offsets, const float* bias,
                         at::BFloat16* y, int64_t n) {
  const int64_t groups = k / kGroup;
  const int64_t tile_bytes = kTileRows * kGroup * Bits / 8;
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
          const int64_t tile = (strip * 2 + t) * groups + g;
          decode_tile<Bits>(codes + tile * tile_bytes, scales + tile * 16,
                            offsets != nullptr ? offsets + tile * 16 : nullptr, wg[t]);
        }
        multiply_group(wg[0], wg[1], a0 + g * 64, a1 + g * 64, lda, two);
      }
      store_sums(y, n, 0, m, strip * 2 * kTileCols, bias);
    }
    _tile_release();
  });
}

template <int Bits>
void amx_linear(const RowBlocks& x, int64_t m, int64_t k, const uint8_t* codes,
                const at::Half* scales, const at::Half* offsets, const float* bias,
                at::BFloat16* y, int64_t n) {
  if (m <= 2 * kTileRows) {
    amx_linear_one_pass<Bits>(x, m, k, codes, scales, offsets, bias, y, n);
    return;
  }
  const int64_t groups = k / kGroup;
  const int64_t tile_bytes = kTileRows * kGroup * Bits / 8;
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
          for (int64_t g = 0; g < groups; ++g) {
            const int64_t tile = nt * groups + g;
            decode_tile<Bits>(codes + tile * tile_bytes, scales + tile * 16,
                              offsets != nullptr ? offsets + tile * 16 : nullptr,
                              ws + (g * 2 + t) * 512);
          }
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

#endif  // PAGEDSERVE_AMX

#ifdef PAGEDSERVE_AVX2

inline __m256 load8_half(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Rows [0, R) of x (float32, row stride k) times one tile column, float32 FMAs over the
// codes: per group, a = sum(x * c) in float32 (A accumulators a row and half, so that enough
// FMAs are in flight), then out += d * a + m * sum(x). out: [R][16] in memory.
template <int R, int A>
inline void dot_q4(const float* x, int64_t k, const float* xsum, const uint8_t* codes,
                   const at::Half* scale, const at::Half* offset, float* out) {
  const int64_t groups = k / kGroup;
  const __m256i low = _mm256_set1_epi32(0xF);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = codes + g * 256;
    __m256 acc[R][2][A];
    for (auto& row : acc) {
      for (auto& half : row) {
        for (auto& a : half) a = _mm256_setzero_ps();
      }
    }
    for (int q = 0; q < 4; ++q) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + q * 64));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + q * 64 + 32));
      for (int t = 0; t < 8; ++t) {  // column c's input 8q + t: bits 16 (t % 2) + 4 (t / 2)
        const int shift = 16 * (t % 2) + 4 * (t / 2);
        const __m256i c0 = _mm256_and_si256(_mm256_srli_epi32(v0, shift), low);
        const __m256i c1 = _mm256_and_si256(_mm256_srli_epi32(v1, shift), low);
        const __m256 f0 = _mm256_cvtepi32_ps(c0), f1 = _mm256_cvtepi32_ps(c1);
        for (int i = 0; i < R; ++i) {
          const __m256 xb = _mm256_broadcast_ss(x + i * k + g * kGroup + 8 * q + t);
          acc[i][0][t % A] = _mm256_fmadd_ps(f0, xb, acc[i][0][t % A]);
          acc[i][1][t % A] = _mm256_fmadd_ps(f1, xb, acc[i][1][t % A]);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = load8_half(scale + g * 16 + h * 8);
      const __m256 m = offset ? load8_half(offset + g * 16 + h * 8) : _mm256_setzero_ps();
      for (int i = 0; i < R; ++i) {
        __m256 s = acc[i][h][0];
        for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[i][h][a]);
        __m256 o = _mm256_loadu_ps(out + i * 16 + h * 8);
        o = _mm256_fmadd_ps(s, d, o);
        o = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[i * groups + g]), o);
        _mm256_storeu_ps(out + i * 16 + h * 8, o);
      }
    }
  }
}

// The same for eight-bit codes: a tile row's 32 bytes are (column, pair) int8s, widened to
// float32 4 columns at a time and multiplied by the activation pair (2r, 2r + 1); each
// column's two lanes are added at the end. out: [R][16] in memory.
template <int R>
inline void dot_q8(const float* x, int64_t k, const uint8_t* codes, const at::Half* scale,
                   float* out) {
  const int64_t groups = k / kGroup;
  __m256 sums[R][4];  // (column, pair) lanes: columns 4j..4j+3
  for (auto& row : sums) {
    for (auto& v : row) v = _mm256_setzero_ps();
  }
  const __m256i pairs_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  const __m256i pairs_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = codes + g * 512;
    __m256 acc[R][4];
    for (auto& row : acc) {
      for (auto& v : row) v = _mm256_setzero_ps();
    }
    for (int r = 0; r < 16; ++r) {
      __m256 w[4];
      for (int j = 0; j < 4; ++j) {
        w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + r * 32 + 8 * j))));
      }
      for (int i = 0; i < R; ++i) {
        double pair;  // x[2r], x[2r + 1], repeated in every lane pair
        std::memcpy(&pair, x + i * k + g * kGroup + 2 * r, sizeof pair);
        const __m256 xp = _mm256_castpd_ps(_mm256_set1_pd(pair));
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_fmadd_ps(w[j], xp, acc[i][j]);
      }
    }
    const __m256 d0 = load8_half(scale + g * 16), d1 = load8_half(scale + g * 16 + 8);
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

template <int R>
inline void dot_rows(const float* x, int64_t k, const float* xsum, const uint8_t* codes,
                     const at::Half* scale, const at::Half* offset, int bits, float* out) {
  constexpr int A = R == 1 ? 4 : R == 2 ? 2 : 1;  // 8 chains of FMAs (two of latency 4 each)
  if (bits == 4) {
    dot_q4<R, A>(x, k, xsum, codes, scale, offset, out);
  } else {
    dot_q8<R>(x, k, codes, scale, out);
  }
}

// y = x W^T for a few rows: threads split the column tiles, each tile multiplied by up to four
// rows at a time.
template <typename T>
void few_rows_linear(const float* x, int64_t m, int64_t k, const uint8_t* codes,
                     const at::Half* scales, const at::Half* offsets, const float* bias, T* y,
                     int64_t n, int bits) {
  constexpr int kChunk = 4;
  const int64_t groups = k / kGroup, tile_bytes = kTileRows * kGroup * bits / 8;
  std::vector<float> xsum(m * groups, 0.f);
  for (int64_t i = 0; i < m * k; ++i) xsum[i / kGroup] += x[i];
  at::parallel_for(0, n / kTileCols, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float out[kChunk * kTileCols];
    for (int64_t nt = begin; nt < end; ++nt) {
      const uint8_t* c = codes + nt * groups * tile_bytes;
      const at::Half* s = scales + nt * groups * 16;
      const at::Half* o = offsets ? offsets + nt * groups * 16 : nullptr;
      for (int64_t i0 = 0; i0 < m; i0 += kChunk) {
        const int64_t rows = std::min<int64_t>(kChunk, m - i0);
        std::fill(out, out + kChunk * kTileCols, 0.f);
        const auto fn = rows == 1   ? dot_rows<1>
                        : rows == 2 ? dot_rows<2>
                        : rows == 3 ? dot_rows<3>
                                    : dot_rows<4>;
        fn(x + i0 * k, k, xsum.data() + i0 * groups, c, s, o, bits, out);
        for (int64_t i = 0; i < rows; ++i) {
          store_out(y + (i0 + i) * n + nt * kTileCols, out + i * kTileCols,
                    bias ? bias + nt * kTileCols : nullptr, kTileCols);
        }
      }
    }
  });
}

// One tile of codes -> float32 weights w[32 inputs][16 columns].
template <int Bits>
inline void decode_tile_f32(const uint8_t* codes, const at::Half* scale, const at::Half* offset,
                            float* w) {
  for (int h = 0; h < 2; ++h) {
    const __m256 d = load8_half(scale + h * 8);
    const __m256 m = offset ? load8_half(offset + h * 8) : _mm256_setzero_ps();
    if constexpr (Bits == 4) {
      const __m256i low = _mm256_set1_epi32(0xF);
      for (int q = 0; q < 4; ++q) {  // column c's input 8q + t: bits 16 (t % 2) + 4 (t / 2)
        const __m256i v =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + q * 64 + h * 32));
        for (int t = 0; t < 8; ++t) {
          const int shift = 16 * (t % 2) + 4 * (t / 2);
          const __m256 f = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, shift), low));
          _mm256_store_ps(w + (8 * q + t) * 16 + h * 8, _mm256_fmadd_ps(f, d, m));
        }
      }
    } else {
      // Row r's (column, pair) bytes -> the 8 columns' bytes for input 2r, then for 2r + 1.
      const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
      for (int r = 0; r < 16; ++r) {
        const __m128i v = _mm_shuffle_epi8(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + r * 32 + h * 16)), split);
        const __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
        const __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
        _mm256_store_ps(w + (2 * r) * 16 + h * 8, _mm256_fmadd_ps(f0, d, m));
        _mm256_store_ps(w + (2 * r + 1) * 16 + h * 8, _mm256_fmadd_ps(f1, d, m));
      }
    }
  }
}

// acc[R][16] += rows [0, R) of x (row stride ldx) times one decoded tile w[32][16].
template <int R>
inline void multiply_tile(const float* w, const float* x, int64_t ldx, float* acc) {
  __m256 a[R][2];
  for (int i = 0; i < R; ++i) {
    a[i][0] = _mm256_loadu_ps(acc + i * 16);
    a[i][1] = _mm256_loadu_ps(acc + i * 16 + 8);
  }
  for (int j = 0; j < kGroup; ++j) {
    const __m256 w0 = _mm256_load_ps(w + j * 16), w1 = _mm256_load_ps(w + j * 16 + 8);
    for (int i = 0; i < R; ++i) {
      const __m256 xb = _mm256_broadcast_ss(x + i * ldx + j);
      a[i][0] = _mm256_fmadd_ps(w0, xb, a[i][0]);
      a[i][1] = _mm256_fmadd_ps(w1, xb, a[i][1]);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(acc + i * 16, a[i][0]);
    _mm256_storeu_ps(acc + i * 16 + 8, a[i][1]);
  }
}

// y = x W^T for many rows: a thread decodes each tile of its columns once per chunk of rows
// and multiplies the chunk's rows by it, six at a time (12 accumulators in registers).
template <typename T, int Bits>
void many_rows_linear(const float* x, int64_t m, int64_t k, const uint8_t* codes,
                      const at::Half* scales, const at::Half* offsets, const float* bias, T* y,
                      int64_t n) {
  constexpr int kBlock = 6;
  constexpr int64_t kChunkRows = 64;  // sums of a chunk: 4 KB, in L1 beside the tile
  const int64_t groups = k / kGroup, tile_bytes = kTileRows * kGroup * Bits / 8;
  at::parallel_for(0, n / kTileCols, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float w[kGroup * kTileCols];
    alignas(32) float acc[kChunkRows * kTileCols];
    for (int64_t nt = begin; nt < end; ++nt) {
      for (int64_t m0 = 0; m0 < m; m0 += kChunkRows) {
        const int64_t rows = std::min(kChunkRows, m - m0);
        std::fill(acc, acc + rows * kTileCols, 0.f);
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t tile = nt * groups + g;
          decode_tile_f32<Bits>(codes + tile * tile_bytes, scales + tile * 16,
                                offsets ? offsets + tile * 16 : nullptr, w);
          const float* xg = x + m0 * k + g * kGroup;
          for (int64_t i0 = 0; i0 < rows; i0 += kBlock) {
            switch (std::min<int64_t>(kBlock, rows - i0)) {
              case 1: multiply_tile<1>(w, xg + i0 * k, k, acc + i0 * 16); break;
              case 2: multiply_tile<2>(w, xg + i0 * k, k, acc + i0 * 16); break;
              case 3: multiply_tile<3>(w, xg + i0 * k, k, acc + i0 * 16); break;
              case 4: multiply_tile<4>(w, xg + i0 * k, k, acc + i0 * 16); break;
              case 5: multiply_tile<5>(w, xg + i0 * k, k, acc + i0 * 16); break;
              default: multiply_tile<6>(w, xg + i0 * k, k, acc + i0 * 16);
            }
          }
        }
        for (int64_t i = 0; i < rows; ++i) {
          store_out(y + (m0 + i) * n + nt * kTileCols, acc + i * kTileCols,
                    bias ? bias + nt * kTileCols : nullptr, kTileCols);
        }
      }
    }
  });
}

#else  // portable C++

// Rows [0, R) of x times one tile column: out[i][c] = the sums of row i, column c, in float32
// over the codes and scaled once per group: sum(x * (c * d + m)) = d * sum(x * c) + m * sum(x).
// Loops run over the 16 columns (lanes 2c + p of a tile row, for input 2r + p), which the
// compiler vectorizes.
template <int Bits, int R>
void dot_tile(const float* x, int64_t k, const float* xsum, const uint8_t* codes,
              const at::Half* scale, const at::Half* offset, float (*out)[kTileCols]) {
  const int64_t groups = k / kGroup, tile_bytes = kTileRows * kGroup * Bits / 8;
  for (int i = 0; i < R; ++i) std::fill(out[i], out[i] + kTileCols, 0.f);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* t = codes + g * tile_bytes;
    float acc[R][kTileCols] = {};
    for (int r = 0; r < 16; ++r) {
      for (int p = 0; p < 2; ++p) {
        float w[kTileCols];
#pragma omp simd
        for (int c = 0; c < kTileCols; ++c) w[c] = float(code_at<Bits>(t, r, 2 * c + p));
        for (int i = 0; i < R; ++i) {
          const float xv = x[i * k + g * kGroup + 2 * r + p];
#pragma omp simd
          for (int c = 0; c < kTileCols; ++c) acc[i][c] += w[c] * xv;
        }
      }
    }
    for (int i = 0; i < R; ++i) {
      const float xs = xsum[i * groups + g];
#pragma omp simd
      for (int c = 0; c < kTileCols; ++c) {
        const float m = offset ? float(offset[g * 16 + c]) : 0.f;
        out[i][c] += float(scale[g * 16 + c]) * acc[i][c] + m * xs;
      }
    }
  }
}

template <int R>
void dot_rows(const float* x, int64_t k, const float* xsum, const uint8_t* codes,
              const at::Half* scale, const at::Half* offset, int bits, float (*out)[kTileCols]) {
  if (bits == 4) {
    dot_tile<4, R>(x, k, xsum, codes, scale, offset, out);
  } else {
    dot_tile<8, R>(x, k, xsum, codes, scale, offset, out);
  }
}

template <typename T>
void few_rows_linear(const float* x, int64_t m, int64_t k, const uint8_t* codes,
                     const at::Half* scales, const at::Half* offsets, const float* bias, T* y,
                     int64_t n, int bits) {
  constexpr int kChunk = 4;
  const int64_t groups = k / kGroup, tile_bytes = kTileRows * kGroup * bits / 8;
  std::vector<float> xsum(m * groups, 0.f);
  for (int64_t i = 0; i < m * k; ++i) xsum[i / kGroup] += x[i];
  at::parallel_for(0, n / kTileCols, 1, [&](int64_t begin, int64_t end) {
    float out[kChunk][kTileCols];
    for (int64_t nt = begin; nt < end; ++nt) {
      const uint8_t* c = codes + nt * groups * tile_bytes;
      const at::Half* s = scales + nt * groups * 16;
      const at::Half* o = offsets ? offsets + nt * groups * 16 : nullptr;
      for (int64_t i0 = 0; i0 < m; i0 += kChunk) {
        const int64_t rows = std::min<int64_t>(kChunk, m - i0);
        const auto fn = rows == 1   ? dot_rows<1>
                        : rows == 2 ? dot_rows<2>
                        : rows == 3 ? dot_rows<3>
                                    : dot_rows<4>;
        fn(x + i0 * k, k, xsum.data() + i0 * groups, c, s, o, bits, out);
        for (int64_t i = 0; i < rows; ++i) {
          store_out(y + (i0 + i) * n + nt * kTileCols, out[i],
                    bias ? bias + nt * kTileCols : nullptr, kTileCols);
        }
      }
    }
  });
}

// One tile -> float32 weights at w[input * ldw + column].
template <int Bits>
inline void decode_tile_f32(const uint8_t* t, const at::Half* scale, const at::Half* offset,
                            float* w, int64_t ldw) {
  float d[kTileCols], m[kTileCols];
  for (int c = 0; c < kTileCols; ++c) {
    d[c] = scale[c];
    m[c] = offset ? float(offset[c]) : 0.f;
  }
  for (int r = 0; r < 16; ++r) {
    float lane[32];
#pragma omp simd
    for (int j = 0; j < 32; ++j) lane[j] = static_cast<float>(code_at<Bits>(t, r, j));
    for (int p = 0; p < 2; ++p) {
#pragma omp simd
      for (int c = 0; c < kTileCols; ++c) w[(2 * r + p) * ldw + c] = lane[2 * c + p] * d[c] + m[c];
    }
  }
}

// y = x W^T for many rows: strips of columns decoded to float32 (in parallel), each multiplied
// by torch's matmul, which beats any portable loop at this size.
template <typename T, int Bits>
void many_rows_linear(const float* x, int64_t m, int64_t k, const uint8_t* codes,
                      const at::Half* scales, const at::Half* offsets, const float* bias, T* y,
                      int64_t n) {
  constexpr int64_t kStripCols = 256;
  const int64_t groups = k / kGroup, tile_bytes = kTileRows * kGroup * Bits / 8;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor xt = at::from_blob(const_cast<float*>(x), {m, k}, f32);
  const at::Tensor w = at::empty({k, std::min(kStripCols, n)}, f32);
  for (int64_t n0 = 0; n0 < n; n0 += kStripCols) {
    const int64_t cols = std::min(kStripCols, n - n0);
    float* wp = w.data_ptr<float>();
    at::parallel_for(n0 / kTileCols, (n0 + cols) / kTileCols, 1, [&](int64_t begin, int64_t end) {
      for (int64_t nt = begin; nt < end; ++nt) {
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t tile = nt * groups + g;
          decode_tile_f32<Bits>(codes + tile * tile_bytes, scales + tile * 16,
                                offsets ? offsets + tile * 16 : nullptr,
                                wp + g * kGroup * w.size(1) + (nt * kTileCols - n0), w.size(1));
        }
      }
    });
    const at::Tensor o = at::mm(xt, w.narrow(1, 0, cols));
    for (int64_t i = 0; i < m; ++i) {
      store_out(y + i * n + n0, o.data_ptr<float>() + i * cols, bias ? bias + n0 : nullptr, cols);
    }
  }
}

#endif  // PAGEDSERVE_AVX2

// y = x W^T in float32 products, rounded to T.
template <typename T>
void float_linear(const float* x, int64_t m, int64_t k, const uint8_t* codes,
                  const at::Half* scales, const at::Half* offsets, const float* bias, T* y,
                  int64_t n, int bits) {
  if (m <= kDotMaxRows) {
    few_rows_linear<T>(x, m, k, codes, scales, offsets, bias, y, n, bits);
  } else if (bits == 4) {
    many_rows_linear<T, 4>(x, m, k, codes, scales, offsets, bias, y, n);
  } else {
    many_rows_linear<T, 8>(x, m, k, codes, scales, offsets, bias, y, n);
  }
}

void check_packed(const at::Tensor& codes, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& offsets, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "quantized weights: 4 or 8 bits");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.is_contiguous(),
              "quantized weights: codes must be contiguous uint8 [tiles, groups, bytes]");
  TORCH_CHECK(codes.size(2) == kTileRows * kGroup * bits / 8, "quantized weights: tile size");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({codes.size(0), codes.size(1), kTileCols}),
              "quantized weights: scales must be float16 [tiles, groups, 16]");
  if (offsets.has_value()) {
    TORCH_CHECK(offsets->sizes() == scales.sizes() && offsets->scalar_type() == at::kHalf &&
                    offsets->is_contiguous(),
                "quantized weights: offsets must match the scales");
  }
}

}  // namespace

bool amx_available() {
#ifdef PAGEDSERVE_AMX
  // Linux hands AMX's tile state to a process only on request (once, for all its threads).
  constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  static const bool ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  return ok;
#else
  return false;
#endif
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& offsets,
                        const c10::optional<at::Tensor>& bias, int64_t bits) {
  check_packed(codes, scales, offsets, bits);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || x.scalar_type() == at::kFloat) && x.dim() == 2,
              "quant_linear: x float32 or bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0) * kTileCols;
  TORCH_CHECK(k == codes.size(1) * kGroup, "quant_linear: x has ", k, " columns, weights ",
              codes.size(1) * kGroup);
  TORCH_CHECK(n % (2 * kTileCols) == 0, "quant_linear: output size must be a multiple of 32");
  TORCH_CHECK(bits == 4 || !offsets.has_value(), "quant_linear: 8-bit codes take no offsets");
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  auto y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const auto* off = offsets.has_value() ? offsets->data_ptr<at::Half>() : nullptr;
  const float* b = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  const auto* cp = codes.data_ptr<uint8_t>();
  const auto* sp = scales.data_ptr<at::Half>();
  const at::Tensor a = x.contiguous();
#ifdef PAGEDSERVE_AVX512_BF16
  if (bf16 && m <= kGemvMaxRows) {
    gemv_linear(a, cp, sp, off, b, y.data_ptr<at::BFloat16>(), n, bits);
    return y;
  }
#endif
#ifdef PAGEDSERVE_AMX
  if (bf16 && amx_available()) {
    const at::BFloat16* xp = a.data_ptr<at::BFloat16>();
    const int64_t full = m / kTileRows * kTileRows;
    // Plain memory, not a tensor: a step's ~120 calls paid ~1 ms for at::zeros and copy_.
    thread_local std::vector<at::BFloat16> tail;
    if (full < m) {
      tail.assign(kTileRows * k, at::BFloat16(0.f));
      std::memcpy(tail.data(), xp + full * k, (m - full) * k * sizeof(at::BFloat16));
    }
    const auto fn = bits == 4 ? amx_linear<4> : amx_linear<8>;
    fn(RowBlocks{xp, tail.data(), full, k}, m, k, cp, sp, off, b, y.data_ptr<at::BFloat16>(), n);
    return y;
  }
#endif
  if (!bf16) {
    float_linear(a.data_ptr<float>(), m, k, cp, sp, off, b, y.data_ptr<float>(), n, bits);
    return y;
  }
  thread_local std::vector<float> xf;  // plain memory, as above
  xf.resize(m * k);
  const at::BFloat16* xp = a.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < m * k; ++i) xf[i] = static_cast<float>(xp[i]);
  float_linear(xf.data(), m, k, cp, sp, off, b, y.data_ptr<at::BFloat16>(), n, bits);
  return y;
}

at::Tensor quant_rows(const at::Tensor& ids, const at::Tensor& codes, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& offsets, int64_t bits,
                      at::ScalarType dtype) {
  check_packed(codes, scales, offsets, bits);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "quant_rows: ids int64 [M]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quant_rows: float32 or bf16 rows");
  const int64_t m = ids.size(0), groups = codes.size(1), k = groups * kGroup;
  const int64_t n = codes.size(0) * kTileCols, tile_bytes = codes.size(2);
  auto out = at::empty({m, k}, ids.options().dtype(dtype));
  const int64_t* idp = ids.data_ptr<int64_t>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* op = offsets.has_value() ? offsets->data_ptr<at::Half>() : nullptr;
  const auto lookup = [&](auto* yp) {
    for (int64_t i = 0; i < m; ++i) {
      const int64_t row = idp[i];
      TORCH_CHECK(row >= 0 && row < n, "quant_rows: id ", row, " out of range");
      const int64_t nt = row / kTileCols, col = row % kTileCols;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t tile = nt * groups + g;
        const float s = sp[tile * 16 + col], o = op ? float(op[tile * 16 + col]) : 0.f;
        const uint8_t* c = cp + tile * tile_bytes;
        for (int j = 0; j < kGroup; ++j) {
          const int lane = 2 * col + j % 2;
          const float code = bits == 4 ? code_at<4>(c, j / 2, lane) : code_at<8>(c, j / 2, lane);
          using T = std::remove_pointer_t<decltype(yp)>;
          yp[i * k + g * kGroup + j] = static_cast<T>(code * s + o);
        }
      }
    }
  };
  if (dtype == at::kFloat) {
    lookup(out.data_ptr<float>());
  } else {
    lookup(out.data_ptr<at::BFloat16>());
  }
  return out;
}
