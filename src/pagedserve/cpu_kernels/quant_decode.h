// Tiles of packed codes (quant_layout.h) decoded to weights, per kernel level:
// - decode_tile_f32(w, nt, g, out): float32 out[32 inputs][16 columns] (AVX2 and up);
// - decode_tile_bf16(w, nt, g, out): bfloat16 in a B tile's pair layout, out[16 rows][32 lanes]
//   (AVX-512 BF16, for AMX);
// - decode_tile_f32(w, nt, g, out, ldw): float32 at out[input * ldw + column] (portable).
#pragma once

#include <algorithm>

#include "isa.h"
#include "quant_layout.h"
#include "vec.h"

// Rows [0, R) handed to fn<R>(...) for R = 1..4: the few-rows kernels' unrolled row counts.
#define PAGEDSERVE_ROWS_1_TO_4(rows, fn, ...)        \
  switch (rows) {                                    \
    case 1: fn<1>(__VA_ARGS__); break;               \
    case 2: fn<2>(__VA_ARGS__); break;               \
    case 3: fn<3>(__VA_ARGS__); break;               \
    default: fn<4>(__VA_ARGS__);                     \
  }

#ifdef PAGEDSERVE_AVX2

inline __m256 load8_half(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// v >> n for n >= 0, v << -n otherwise (n is a constant once loops unroll).
inline __m256i shift_right(__m256i v, int n) {
  return n >= 0 ? _mm256_srli_epi32(v, n) : _mm256_slli_epi32(v, -n);
}

// The codes of input 8q + t of one tile's 8 columns [8h, 8h + 8), one per 32-bit lane: lane c
// of a quad's 32 bytes at h * 32 holds column 8h + c's inputs 8q..8q + 7 at bits
// 16 (t % 2) + 4 (t / 2) (quant_layout.h), and a K type's high bits the same way.
template <typename F>
inline __m256i codes8(const uint8_t* tile, int q, int h, int t) {
  const int shift = 16 * (t % 2) + 4 * (t / 2);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + q * 64 + h * 32));
  __m256i c = _mm256_and_si256(_mm256_srli_epi32(v, shift), _mm256_set1_epi32(0xF));
  if constexpr (F::kHighBits > 0) {
    const int p = F::kQuadsPerHigh;
    const __m256i hv = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(tile + 256 + q / p * 64 + h * 32));
    const int at = shift + F::kHighBits * (q % p);  // the high bits' position, to bit 4
    const __m256i high = _mm256_and_si256(shift_right(hv, at - 4),
                                          _mm256_set1_epi32(((1 << F::kHighBits) - 1) << 4));
    c = _mm256_or_si256(c, high);
  }
  return c;
}

// The scales and offsets of columns [8h, 8h + 8) for half `half` of group g's inputs.
template <int Bits>
inline void scales8(const BlockFormat<Bits>& w, int64_t nt, int64_t g, int /*half*/, int h,
                    __m256& d, __m256& m) {
  d = load8_half(w.scale(nt, g) + h * 8);
  m = w.offsets ? load8_half(w.offset(nt, g) + h * 8) : _mm256_setzero_ps();
}

template <int Bits>
inline void scales8(const KFormat<Bits>& w, int64_t nt, int64_t g, int half, int h, __m256& d,
                    __m256& m) {
  const float* s = w.super(nt, g) + h * 8;
  const uint8_t* u = w.sub(nt, g) + h * 8;
  const auto bytes = [](const uint8_t* p) {
    return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  };
  if constexpr (Bits == 6) {
    d = _mm256_mul_ps(_mm256_loadu_ps(s),
                      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes(u + half * 16))));
    m = _mm256_mul_ps(d, _mm256_set1_ps(-32.f));
  } else {
    d = _mm256_mul_ps(_mm256_loadu_ps(s), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes(u))));
    m = _mm256_mul_ps(_mm256_loadu_ps(s + 16),
                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes(u + 16))));
    m = _mm256_sub_ps(_mm256_setzero_ps(), m);
  }
}

// Four-bit codes (block Q4 and every K type): one tile -> out[32 inputs][16 columns].
template <typename F>
inline void decode_tile_f32(const F& w, int64_t nt, int64_t g, float* out) {
  const uint8_t* codes = w.tile(nt, g);
  for (int h = 0; h < 2; ++h) {
    for (int q = 0; q < 4; ++q) {  // inputs [8q, 8q + 8): half q / 2 of the group
      __m256 d, m;
      scales8(w, nt, g, q / 2, h, d, m);
      for (int t = 0; t < 8; ++t) {
        const __m256 f = _mm256_cvtepi32_ps(codes8<F>(codes, q, h, t));
        _mm256_store_ps(out + (8 * q + t) * 16 + h * 8, _mm256_fmadd_ps(f, d, m));
      }
    }
  }
}

// Eight-bit codes.
inline void decode_tile_f32(const BlockFormat<8>& w, int64_t nt, int64_t g, float* out) {
  const uint8_t* codes = w.tile(nt, g);
  // Row r's (column, pair) bytes -> the 8 columns' bytes for input 2r, then for 2r + 1.
  const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int h = 0; h < 2; ++h) {
    __m256 d, m;
    scales8(w, nt, g, 0, h, d, m);
    for (int r = 0; r < 16; ++r) {
      const __m128i v = _mm_shuffle_epi8(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + r * 32 + h * 16)), split);
      const __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
      const __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
      _mm256_store_ps(out + (2 * r) * 16 + h * 8, _mm256_fmadd_ps(f0, d, m));
      _mm256_store_ps(out + (2 * r + 1) * 16 + h * 8, _mm256_fmadd_ps(f1, d, m));
    }
  }
}

#endif  // PAGEDSERVE_AVX2

#ifdef PAGEDSERVE_AVX512

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

// The scales d and offsets m of the 16 columns, one lane a column, for half `half` of group
// g's inputs (the halves differ for Q6_K only).
template <int Bits>
inline void scales16(const BlockFormat<Bits>& w, int64_t nt, int64_t g, int /*half*/,
                     __m512& d, __m512& m) {
  d = load_columns(w.scale(nt, g));
  m = w.offsets != nullptr ? load_columns(w.offset(nt, g)) : _mm512_setzero_ps();
}

template <int Bits>
inline void scales16(const KFormat<Bits>& w, int64_t nt, int64_t g, int half, __m512& d,
                     __m512& m) {
  const float* s = w.super(nt, g);
  const uint8_t* u = w.sub(nt, g);
  const auto bytes = [](const uint8_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  };
  if constexpr (Bits == 6) {
    d = _mm512_mul_ps(_mm512_loadu_ps(s),
                      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes(u + half * 16))));
    m = _mm512_mul_ps(d, _mm512_set1_ps(-32.f));
  } else {
    d = _mm512_mul_ps(_mm512_loadu_ps(s), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes(u))));
    m = _mm512_mul_ps(_mm512_loadu_ps(s + 16),
                      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes(u + 16))));
    m = _mm512_sub_ps(_mm512_setzero_ps(), m);
  }
}

#endif  // PAGEDSERVE_AVX512

#ifdef PAGEDSERVE_AVX512_BF16

// 16 columns' values, each repeated for the two lanes of its pair: lanes 0-15 cover columns
// 0-7 (lo), lanes 16-31 columns 8-15 (hi).
inline void pair_lanes(__m512 v, __m512& lo, __m512& hi) {
  const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  lo = _mm512_permutexvar_ps(lo_idx, v);
  hi = _mm512_permutexvar_ps(_mm512_add_epi32(lo_idx, _mm512_set1_epi32(8)), v);
}

inline __m512i shift_right(__m512i v, int n) {
  return n >= 0 ? _mm512_srli_epi32(v, n) : _mm512_slli_epi32(v, -n);
}

// A B-bit code c becomes the float32 1 + c / 2^B by shifts and ORs into the mantissa of 1.0
// (no int-to-float conversion): weight = (1 + c / 2^B) * 2^B d + (m - 2^B d). `low`: the
// nibbles (32-bit lanes of zero-extended 16-bit words), nibble i; `high`: a K type's high
// bits, at bit `at` of each lane.
template <int B>
inline __m512 code_plus_one(__m512i low, int i, __m512i high, int at) {
  constexpr int kAndOr = 0xEA;  // ternary logic: (a & b) | c
  const __m512i one = _mm512_set1_epi32(0x3F800000);
  __m512i v = _mm512_ternarylogic_epi32(shift_right(low, 4 * i - (23 - B)),
                                        _mm512_set1_epi32(0xF << (23 - B)), one, kAndOr);
  if constexpr (B > 4) {
    v = _mm512_ternarylogic_epi32(shift_right(high, at - (27 - B)),
                                  _mm512_set1_epi32(((1 << (B - 4)) - 1) << (27 - B)), v, kAndOr);
  }
  return _mm512_castsi512_ps(v);
}

// Rows [r0, r0 + 4 * quads) of a tile from the nibble quads at `codes` (and high quads at
// `high`), scaled by (s_lo, s_hi) (o_lo, o_hi), to bfloat16 pairs at out.
template <int B, int P>
inline void emit_quads(const uint8_t* codes, const uint8_t* high, int q0, int quads, __m512 s_lo,
                       __m512 s_hi, __m512 o_lo, __m512 o_hi, uint16_t* out) {
  constexpr float kSpan = 1 << B;
  s_lo = _mm512_mul_ps(s_lo, _mm512_set1_ps(kSpan));
  s_hi = _mm512_mul_ps(s_hi, _mm512_set1_ps(kSpan));
  o_lo = _mm512_sub_ps(o_lo, s_lo);
  o_hi = _mm512_sub_ps(o_hi, s_hi);
  for (int q = q0; q < q0 + quads; ++q) {
    const __m512i words = _mm512_loadu_si512(codes + q * 64);
    const __m512i v0 = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(words));
    const __m512i v1 = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(words, 1));
    __m512i h0 = v0, h1 = v1;  // unused for four-bit codes
    if constexpr (B > 4) {
      const __m512i hw = _mm512_loadu_si512(high + q / P * 64);
      h0 = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(hw));
      h1 = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hw, 1));
    }
    for (int i = 0; i < 4; ++i) {
      const int at = 4 * i + (B - 4) * (q % P);
      const __m512 lo = _mm512_fmadd_ps(code_plus_one<B>(v0, i, h0, at), s_lo, o_lo);
      const __m512 hi = _mm512_fmadd_ps(code_plus_one<B>(v1, i, h1, at), s_hi, o_hi);
      _mm512_storeu_si512(out + (4 * q + i) * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// The scales and offsets of the 16 columns for half `half` of group g's inputs, each repeated
// for the two lanes of its pair (pair_lanes).
template <typename F>
inline void scales_paired(const F& w, int64_t nt, int64_t g, int half, __m512 (&d)[2],
                          __m512 (&m)[2]) {
  __m512 dv, mv;
  scales16(w, nt, g, half, dv, mv);
  pair_lanes(dv, d[0], d[1]);
  pair_lanes(mv, m[0], m[1]);
}

// Four-bit codes (block Q4 and every K type): one tile -> 16 rows of 32 bfloat16 (1 KB).
template <typename F>
inline void decode_tile_bf16(const F& w, int64_t nt, int64_t g, uint16_t* out) {
  const uint8_t* codes = w.tile(nt, g);
  prefetch_ahead(codes, F::kTileBytes);
  constexpr int kParts = F::kHalvesDiffer ? 2 : 1;  // scalings per group
  for (int part = 0; part < kParts; ++part) {
    __m512 d[2], m[2];
    scales_paired(w, nt, g, part, d, m);
    emit_quads<F::kHighBits + 4, F::kQuadsPerHigh>(
        codes, codes + 256, 4 / kParts * part, 4 / kParts, d[0], d[1], m[0], m[1], out);
  }
}

// Eight-bit codes.
inline void decode_tile_bf16(const BlockFormat<8>& w, int64_t nt, int64_t g, uint16_t* out) {
  const uint8_t* codes = w.tile(nt, g);
  prefetch_ahead(codes, BlockFormat<8>::kTileBytes);
  __m512 d[2], m[2];
  scales_paired(w, nt, g, 0, d, m);
  for (int r = 0; r < 16; ++r) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + r * 32));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
    _mm512_storeu_si512(out + r * 32, (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, d[1], m[1]),
                                                                   _mm512_fmadd_ps(lo, d[0], m[0])));
  }
}

#endif  // PAGEDSERVE_AVX512_BF16

// Portable: one tile -> float32 weights at out[input * ldw + column], 4 columns a vector: a
// 32-bit lane of a code row is one column's input pair (its halves; quant_layout.h).
template <typename F>
inline void decode_tile_f32(const F& w, int64_t nt, int64_t g, float* out, int64_t ldw) {
  float d[2][kTileCols], m[2][kTileCols];
  w.group_scales(nt, g, d, m);
  F32x4 dv[2][4], mv[2][4];  // [half of the group's inputs][4 columns]
  std::memcpy(dv, d, sizeof dv);
  std::memcpy(mv, m, sizeof mv);
  const uint8_t* t = w.tile(nt, g);
  for (int r = 0; r < kTileRows; ++r) {
    const int h = r / 8, q = r / 4, nibble = r % 4;  // inputs 2r, 2r + 1 lie in half h
    for (int v = 0; v < 4; ++v) {
      I32x4 pair[2];  // the codes of inputs 2r and 2r + 1
      if constexpr (F::kBits == 8) {
        I8x8 bytes;
        std::memcpy(&bytes, t + r * 32 + v * 8, sizeof bytes);
        const I32x4 wide = reinterpret_cast<I32x4>(__builtin_convertvector(bytes, I16x8));
        pair[0] = low_halves(wide);
        pair[1] = high_halves(wide);
      } else {
        I32x4 words;  // nibble `nibble` of each 16-bit word of quad q
        std::memcpy(&words, t + q * 64 + v * 16, sizeof words);
        for (int p = 0; p < 2; ++p) pair[p] = (words >> (16 * p + 4 * nibble)) & 0xF;
        if constexpr (F::kHighBits > 0) {  // quad q's high bits: high quad q / P, at bit B(q % P)
          constexpr int kP = F::kQuadsPerHigh, kMask = (1 << F::kHighBits) - 1;
          I32x4 high;
          std::memcpy(&high, t + 256 + q / kP * 64 + v * 16, sizeof high);
          const int at = 4 * nibble + F::kHighBits * (q % kP);
          for (int p = 0; p < 2; ++p) pair[p] |= ((high >> (16 * p + at)) & kMask) << 4;
        }
      }
      for (int p = 0; p < 2; ++p) {
        const F32x4 f = __builtin_convertvector(pair[p], F32x4) * dv[h][v] + mv[h][v];
        std::memcpy(out + (2 * r + p) * ldw + 4 * v, &f, sizeof f);
      }
    }
  }
}
