// Matrix products straight from GGUF's block-quantized weights (Q4_0/Q4_1 and Q8_0). A step's
// linears are bound by reading weights: at four or eight bits per weight they read 2-4x fewer
// bytes than bfloat16.
// - Steps of a few rows (kGemvMaxRows) take dot products on AVX-512: four-bit codes become the
//   bfloat16 numbers 128 + code by one OR (exact), vdpbf16ps sums them against the activations,
//   and each group's sum is scaled once: sum(x * (code * d + m)) = d * (sum(x * (128 + code))
//   - 128 * sum(x)) + m * sum(x).
// - Bigger steps use Intel AMX: each thread decodes a strip of 32 output columns into bfloat16
//   tiles (in the pair layout TDPBF16PS reads, so no shuffles) and multiplies every 32-row
//   block of the activations by it. Products accumulate in float32 either way.
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

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "amx.h"

#ifdef PAGEDSERVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kGroup = 32;     // input values per quantization group (one B tile's K)
constexpr int64_t kTileCols = 16;  // output columns per tile
constexpr int64_t kTileRows = 16;  // activation rows per A tile
// Steps of at most this many rows take the AVX-512 dot-product path, bigger ones AMX.
constexpr int64_t kGemvMaxRows = 4;

#ifdef PAGEDSERVE_AMX

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
  TORCH_CHECK(amx_available(), "quant_linear needs AMX (amx_bf16) on this CPU");
  check_packed(codes, scales, offsets, bits);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "quant_linear: x bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0) * kTileCols;
  TORCH_CHECK(k == codes.size(1) * kGroup, "quant_linear: x has ", k, " columns, weights ",
              codes.size(1) * kGroup);
  TORCH_CHECK(n % (2 * kTileCols) == 0, "quant_linear: output size must be a multiple of 32");
  TORCH_CHECK(bits == 4 || !offsets.has_value(), "quant_linear: 8-bit codes take no offsets");
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  auto y = at::empty({m, n}, x.options());
  if (m == 0) return y;
#ifdef PAGEDSERVE_AMX
  const auto* off = offsets.has_value() ? offsets->data_ptr<at::Half>() : nullptr;
  const float* b = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  const auto* cp = codes.data_ptr<uint8_t>();
  const auto* sp = scales.data_ptr<at::Half>();
  auto* yp = y.data_ptr<at::BFloat16>();
  if (m <= kGemvMaxRows) {
    gemv_linear(x.contiguous(), cp, sp, off, b, yp, n, bits);
    return y;
  }
  const at::Tensor a = x.contiguous();
  const at::BFloat16* xp = a.data_ptr<at::BFloat16>();
  const int64_t full = m / kTileRows * kTileRows;
  // Plain memory, not a tensor: a step's ~120 calls paid ~1 ms for at::zeros and copy_.
  thread_local std::vector<at::BFloat16> tail;
  if (full < m) {
    tail.assign(kTileRows * k, at::BFloat16(0.f));
    std::memcpy(tail.data(), xp + full * k, (m - full) * k * sizeof(at::BFloat16));
  }
  const auto fn = bits == 4 ? amx_linear<4> : amx_linear<8>;
  fn(RowBlocks{xp, tail.data(), full, k}, m, k, cp, sp, off, b, yp, n);
#endif
  return y;
}

at::Tensor quant_rows(const at::Tensor& ids, const at::Tensor& codes, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& offsets, int64_t bits) {
  check_packed(codes, scales, offsets, bits);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "quant_rows: ids int64 [M]");
  const int64_t m = ids.size(0), groups = codes.size(1), k = groups * kGroup;
  const int64_t n = codes.size(0) * kTileCols, tile_bytes = codes.size(2);
  auto out = at::empty({m, k}, ids.options().dtype(at::kBFloat16));
  const int64_t* idp = ids.data_ptr<int64_t>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* op = offsets.has_value() ? offsets->data_ptr<at::Half>() : nullptr;
  at::BFloat16* yp = out.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < m; ++i) {
    const int64_t row = idp[i];
    TORCH_CHECK(row >= 0 && row < n, "quant_rows: id ", row, " out of range");
    const int64_t nt = row / kTileCols, col = row % kTileCols;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t tile = nt * groups + g;
      const float s = sp[tile * 16 + col], o = op != nullptr ? float(op[tile * 16 + col]) : 0.f;
      const uint8_t* c = cp + tile * tile_bytes;
      for (int64_t j = 0; j < kGroup; ++j) {
        const int64_t r = j / 2, lane = 2 * col + j % 2;
        float code;
        if (bits == 4) {
          uint16_t word;
          std::memcpy(&word, c + r / 4 * 64 + 2 * lane, sizeof word);
          code = (word >> (4 * (r % 4))) & 0xF;
        } else {
          code = static_cast<int8_t>(c[r * 32 + lane]);
        }
        yp[i * k + g * kGroup + j] = at::BFloat16(code * s + o);
      }
    }
  }
  return out;
}
