// y = x W^T over block codes (Q4_0/Q4_1, Q8_0) and K codes (Q4_K, Q5_K, Q6_K) in integer
// products, as llama.cpp computes its quantized matmuls: each row of x
// is quantized per group of 32 inputs to int8 codes a and a float32 scale s (s = max |x| / 127),
// and per group sum(x * (c * d + m)) ~ d * s * sum(a * c) + m * sum(x), with sum(x) exact (for
// Q6_K, whose group halves have their own d and m, per half).
// The integer sums by level:
// - AVX-512 VNNI (vpdpbusd, 64 products an instruction): 16 columns a register, a pass of
//   kPassRows rows kept in registers over a whole column tile. vpdpbusd multiplies unsigned
//   by signed bytes: codes of 4 to 6 bits are unsigned and a signed; eight-bit codes are
//   signed, so a + 128 is, and 128 * sum(c) comes off each group's sum.
// - AVX2 (vpmaddubsw, vpmaddwd): 8 columns a register; a group's 8 registers of codes (K
//   types' high bits ORed in) are shared by every row of the chunk; products are summed in 16
//   bits as far as the code width allows (sum16_products) before vpmaddwd widens them. Each 4
//   inputs of a row are broadcast from memory (pick4). Eight copies of them stored at
//   quantization, read by plain loads, had made a chunk's activations 8x the bytes, read from
//   L2 at every tile: the broadcasts measured 1.0-1.15x faster on AMD Zen 3 (where an earlier
//   form of them had cost 15-20% on AMD Zen 1, whose 256-bit ops are two). Eight-bit codes are
//   signed: |c| times a with c's sign (vpsignb), each product pair widened at once; from
//   kInt8EightBitMinRows rows on (quant_kernels.h).
// - AVX-VNNI (the avx2 build where the CPU has it: Intel from Alder Lake and Sapphire Rapids
//   on, AMD Zen 5): AVX2's loops, its 256-bit vpdpbusd taking each product quad to 32 bits in
//   one instruction (in place of vpmaddubsw, the 16-bit sums and vpmaddwd); eight-bit codes
//   against a + 128, as with AVX-512 VNNI.
// - Portable (the generic level: SSE2, NEON, ...): 16-bit products in GCC's and Clang's
//   vector extension, a tile row's 32 lanes (16 columns x an input pair) against the row's
//   activation pair repeated; both lanes of a column are added once per run of rows. Four-bit
//   codes sum a group's 16 rows in 16 bits (at most 16 * 15 * 127), K types' 5- and 6-bit ones
//   8 and 4 rows, eight-bit ones two rows (2 * 128 * 127) before widening. Against float32
//   products over the decoded codes: fewer and narrower instructions per weight (SSE2 has no
//   FMA).
// The activations' rounding (~0.4% of the largest in a group) is of bfloat16's order; a
// float32 model asked for by name keeps float32 products (engine.py).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "claims.h"
#include "convert.h"
#include "quant_decode.h"
#include "quant_kernels.h"
#include "vec.h"

namespace {

// Rows of x a sweep over the tiles reads (int8: 96 KB at k = 1536); 32 and 128 measured no
// faster on AMD Zen 3.
constexpr int64_t kChunkRows = 64;

// Products of a Bits-wide unsigned code and an int8 activation (|a| <= 127) that a 16-bit sum
// holds: 16 for 4 bits (30,480), 8 for 5, 4 for 6.
constexpr int sum16_products(int bits) {
  int n = 1;
  while (2 * n * ((1 << bits) - 1) * 127 <= 32767) n *= 2;
  return n;
}

// Whether eight-bit activation codes are stored as a + 128, vpdpbusd's unsigned operand.
#if defined(PAGEDSERVE_VNNI) || defined(PAGEDSERVE_AVX_VNNI)
constexpr bool kShiftedEightBit = true;
#else
constexpr bool kShiftedEightBit = false;
#endif

#ifdef PAGEDSERVE_AVX2

using ActCode = uint8_t;  // the byte operand of vpmaddubsw / vpdpbusd

// Inputs 4j..4j + 3 of a row's group (its codes p) in every 32-bit lane: vpbroadcastd from
// memory, an op of the load pipes alone.
inline __m256i pick4(const uint8_t* p, int j) {
  int32_t v;
  std::memcpy(&v, p + 4 * j, sizeof v);
  return _mm256_set1_epi32(v);
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

// One group of 32 inputs -> 32 int8 codes, its scale and exact sum. Four-bit codes' order
// (kNibbleOrder): the codes of each 8 inputs in the order a nibble quad's 32-bit lane holds a
// column's codes (quant_layout.h), inputs 0, 4, 1, 5 in its low nibbles, 2, 6, 3, 7 in its high
// ones. Eight-bit codes': inputs in order, a + 128 (unsigned) for vpdpbusd, a for vpsignb.
// The sum is the group's, or with kHalfSums its two halves' (inputs 0-15, 16-31).
template <bool kNibbleOrder, bool kHalfSums, typename T>
inline void quantize_group(const T* x, uint8_t* codes, float* scale, float* sum) {
  __m256 v[4];
  for (int j = 0; j < 4; ++j) v[j] = load8_f32(x + 8 * j);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 halves[2] = {_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])};
  __m256 amax = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
  amax = _mm256_max_ps(amax, _mm256_max_ps(_mm256_andnot_ps(sign, v[2]),
                                           _mm256_andnot_ps(sign, v[3])));
  const float top = reduce_max(amax);
  if constexpr (kHalfSums) {
    sum[0] = reduce_add(halves[0]);
    sum[1] = reduce_add(halves[1]);
  } else {
    *sum = reduce_add(_mm256_add_ps(halves[0], halves[1]));
  }
  *scale = top / 127.f;
  const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256i c[4];
  for (int j = 0; j < 4; ++j) {
    __m256 scaled = _mm256_mul_ps(v[j], inv);
    if constexpr (kNibbleOrder) scaled = _mm256_permutevar8x32_ps(scaled, order);
    c[j] = _mm256_cvtps_epi32(scaled);
  }
  // packs work within 128-bit lanes: the 32-bit groups come out as block 0..3's first four,
  // then their last four; the same permutation puts each block's two together.
  __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])), order);
  if constexpr (kShiftedEightBit && !kNibbleOrder) {
    bytes = _mm256_xor_si256(bytes, _mm256_set1_epi8(-128));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), bytes);
}

#else  // portable

using ActCode = int16_t;  // int8 values, widened once here rather than at every product

// One group of 32 inputs -> 32 codes in input order (every code width), its scale and sum
// (or, kHalfSums, its halves' sums).
template <bool /*kNibbleOrder*/, bool kHalfSums, typename T>
inline void quantize_group(const T* x, ActCode* codes, float* scale, float* sum) {
  float v[kGroup];
  float top = 0.f, halves[2] = {0.f, 0.f};
  for (int j = 0; j < kGroup; ++j) {
    v[j] = to_f(x[j]);
    top = std::max(top, std::fabs(v[j]));
    halves[j / kHalf] += v[j];
  }
  if constexpr (kHalfSums) {
    sum[0] = halves[0];
    sum[1] = halves[1];
  } else {
    *sum = halves[0] + halves[1];
  }
  *scale = top / 127.f;
  const float inv = top > 0.f ? 127.f / top : 0.f;
  for (int j = 0; j < kGroup; ++j) codes[j] = static_cast<ActCode>(std::lrint(v[j] * inv));
}

#endif

// Rows of x quantized per group: row i's codes of group g at codes + i * stride + g * kGroup.
struct QuantizedRows {
  ActCode* codes;      // written by quantize_rows only
  const float* scale;  // [m, groups]
  const float* sum;    // [m, groups, parts]
  int64_t stride;      // codes from a row to the next: k
  int64_t parts;       // sums a group: 1, or 2 (its halves' sums, kHalfSums)

  ActCode* pick(int64_t i, int64_t g) const { return codes + i * stride + g * kGroup; }
  // Rows from i on.
  QuantizedRows rows_from(int64_t i, int64_t k) const {
    const int64_t groups = k / kGroup;
    return {codes + i * stride, scale + i * groups, sum + i * groups * parts, stride, parts};
  }
};

// x's rows quantized.
template <bool kNibbleOrder, bool kHalfSums, typename T>
QuantizedRows quantize_rows(const T* x, int64_t m, int64_t k) {
  thread_local std::vector<ActCode> codes_buf;  // plain memory: ~120 calls a step
  thread_local std::vector<float> scale_buf, sum_buf;
  constexpr int64_t kLine = 64 / sizeof(ActCode);  // codes a cache line
  constexpr int64_t kParts = kHalfSums ? 2 : 1;
  const int64_t groups = k / kGroup;
  codes_buf.resize(m * k + kLine);
  scale_buf.resize(m * groups);
  sum_buf.resize(m * groups * kParts);
  // The pool's threads would see their own thread_local vectors: they get this one's memory.
  ActCode* codes = codes_buf.data();
  codes += (kLine - reinterpret_cast<uintptr_t>(codes) / sizeof(ActCode) % kLine) % kLine;
  float* scale = scale_buf.data();
  float* sum = sum_buf.data();
  const QuantizedRows q{codes, scale, sum, k, kParts};
  at::parallel_for(0, m * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      quantize_group<kNibbleOrder, kHalfSums>(x + i * kGroup, codes + i * kGroup, scale + i,
                                              sum + i * kParts);
    }
  });
  return q;
}

#ifdef PAGEDSERVE_VNNI

constexpr int64_t kPassRows = 8;  // R int and R float accumulators: 2R of the 32 registers

// Rows [0, R) of the quantized x times column tile nt: out[i] = row i's 16 columns. Codes of
// 4 to 6 bits (block Q4 and the K types): a 32-bit lane of a nibble quad holds 8 inputs of a
// column, whose low nibbles and high ones are two registers of 4 codes a lane (the activations'
// kNibbleOrder), a K type's high bits ORed in at bit 4. A Q6_K group's halves (quads 0-1 and
// 2-3) are scaled each by its own d.
template <int R, typename F>
inline void tile_rows(const QuantizedRows& x, int64_t k, const F& w, int64_t nt, __m512* out) {
  constexpr int kParts = F::kHalvesDiffer ? 2 : 1;
  constexpr int kQuads = 4 / kParts;  // nibble quads a part
  const int64_t groups = k / kGroup;
  const __m512i low = _mm512_set1_epi8(0x0F);
  bool offsets = true;  // K types' m: their mins, or Q6_K's -32 d
  if constexpr (!F::kKType) offsets = w.offsets != nullptr;
  for (int i = 0; i < R; ++i) out[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = w.tile(nt, g);
    prefetch_ahead(c, F::kTileBytes);
    for (int part = 0; part < kParts; ++part) {
      __m512i acc[R];
      for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_si512();
      for (int q = part * kQuads; q < (part + 1) * kQuads; ++q) {
        const __m512i v = _mm512_loadu_si512(c + q * 64);
        __m512i lo = _mm512_and_si512(v, low);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if constexpr (F::kHighBits > 0) {
          // Quad q's high bits: high quad q / P, at bit `at` of its code's nibble
          // (quant_layout.h), shifted within 16-bit words to bit 4 of each byte; bits shifted
          // into the word's other byte fall outside the mask.
          constexpr int kP = F::kQuadsPerHigh;
          constexpr int kAndOr = 0xEA;  // ternary logic: (a & b) | c
          const int at = F::kHighBits * (q % kP);
          const __m512i mask = _mm512_set1_epi8(static_cast<char>(((1 << F::kHighBits) - 1) << 4));
          const __m512i hv = _mm512_loadu_si512(c + 256 + q / kP * 64);
          lo = _mm512_ternarylogic_epi32(_mm512_slli_epi16(hv, 4 - at), mask, lo, kAndOr);
          hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(hv, at), mask, hi, kAndOr);
        }
        for (int i = 0; i < R; ++i) {
          // Two 4-byte loads, each broadcast from memory (a load port): one 8-byte load came
          // out as a shift and a broadcast from a general register, on the port vpdpbusd
          // needs.
          const ActCode* a = x.pick(i, g) + 8 * q;
          acc[i] = _mm512_dpbusd_epi32(acc[i], lo, _mm512_broadcastd_epi32(_mm_loadu_si32(a)));
          acc[i] =
              _mm512_dpbusd_epi32(acc[i], hi, _mm512_broadcastd_epi32(_mm_loadu_si32(a + 4)));
        }
      }
      __m512 d, m;
      scales16(w, nt, g, part, d, m);
      for (int i = 0; i < R; ++i) {
        const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(x.scale[i * groups + g]));
        out[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), ds, out[i]);
        if (offsets) {
          const float sum = x.sum[(i * groups + g) * kParts + part];  // kParts == x.parts
          out[i] = _mm512_fmadd_ps(_mm512_set1_ps(sum), m, out[i]);
        }
      }
    }
  }
}

// The same for eight-bit codes: a tile's rows 2s and 2s + 1 (one 64-byte load) hold inputs
// 4s..4s + 3 of every column; one word permutation gathers each column's four into its lane.
template <int R>
inline void tile_rows(const QuantizedRows& x, int64_t k, const BlockFormat<8>& w, int64_t nt,
                      __m512* out) {
  const int64_t groups = k / kGroup;
  alignas(64) static constexpr int16_t kColumnWords[32] = {
      0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i columns = _mm512_load_si512(kColumnWords);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int i = 0; i < R; ++i) out[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = w.tile(nt, g);
    prefetch_ahead(c, 512);
    __m512i acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_si512();
    __m512i code_sum = _mm512_setzero_si512();
    for (int s = 0; s < 8; ++s) {
      const __m512i v = _mm512_permutexvar_epi16(columns, _mm512_loadu_si512(c + s * 64));
      code_sum = _mm512_dpbusd_epi32(code_sum, ones, v);
      for (int i = 0; i < R; ++i) {
        int32_t a;
        std::memcpy(&a, x.pick(i, g) + 4 * s, sizeof a);
        acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32(a), v);
      }
    }
    const __m512i shift = _mm512_slli_epi32(code_sum, 7);  // 128 * sum(c)
    const __m512 d = load_columns(w.scale(nt, g));
    for (int i = 0; i < R; ++i) {
      const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(x.scale[i * groups + g]));
      out[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i], shift)), ds, out[i]);
    }
  }
}

template <int R, typename F, typename T>
void tile_rows_to(const QuantizedRows& x, int64_t k, const F& w, int64_t nt, const float* bias,
                  T* y, int64_t n) {
  __m512 out[R];
  tile_rows<R>(x, k, w, nt, out);
  alignas(64) float v[kTileCols];
  for (int i = 0; i < R; ++i) {
    _mm512_store_ps(v, out[i]);
    store_out(y + i * n + nt * kTileCols, v, bias ? bias + nt * kTileCols : nullptr, kTileCols);
  }
}

// A chunk's rows through column tiles [begin, end), kPassRows at a time.
template <typename F, typename T>
void chunk_tiles(const QuantizedRows& x, int64_t rows, int64_t k, const F& w, const float* bias,
                 T* y, int64_t n, int64_t begin, int64_t end) {
  using Fn = void (*)(const QuantizedRows&, int64_t, const F&, int64_t, const float*, T*,
                      int64_t);
  static constexpr Fn kRows[kPassRows] = {
      tile_rows_to<1, F, T>, tile_rows_to<2, F, T>, tile_rows_to<3, F, T>,
      tile_rows_to<4, F, T>, tile_rows_to<5, F, T>, tile_rows_to<6, F, T>,
      tile_rows_to<7, F, T>, tile_rows_to<8, F, T>};
  for (int64_t nt = begin; nt < end; ++nt) {
    for (int64_t i0 = 0; i0 < rows; i0 += kPassRows) {
      kRows[std::min(kPassRows, rows - i0) - 1](x.rows_from(i0, k), k, w, nt, bias, y + i0 * n,
                                                n);
    }
  }
}

#elif defined(PAGEDSERVE_MADDUBS)

// A group's codes for one half tile (8 columns) as 8 registers of bytes: quad q's low nibbles at
// 2q, its high ones at 2q + 1, and a K type's high bits at bit 4 up of each byte.
template <typename F>
inline void half_tile_codes(const uint8_t* c, int h, __m256i (&code)[8]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int q = 0; q < 4; ++q) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + q * 64 + h * 32));
    code[2 * q] = _mm256_and_si256(v, low);
    code[2 * q + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    if constexpr (F::kHighBits > 0) {
      // Quad q's high bits: high quad q / P, at bit `at` of the nibble of its code's
      // (quant_layout.h). Shifted within 16-bit words to bit 4 of each byte; bits shifted
      // across into the word's other byte fall outside the mask.
      constexpr int kP = F::kQuadsPerHigh;
      const int at = F::kHighBits * (q % kP);
      const __m256i mask = _mm256_set1_epi8(static_cast<char>(((1 << F::kHighBits) - 1) << 4));
      const __m256i hv = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(c + 256 + q / kP * 64 + h * 32));
      code[2 * q] =
          _mm256_or_si256(code[2 * q], _mm256_and_si256(_mm256_slli_epi16(hv, 4 - at), mask));
      code[2 * q + 1] =
          _mm256_or_si256(code[2 * q + 1], _mm256_and_si256(_mm256_srli_epi16(hv, at), mask));
    }
  }
}

// The offsets' term of R rows' tile sums o, sum over group parts p of sum(x)[p] * m[p], after
// the products rather than in their loop (where m took a register, spilled, and sum(x) a
// broadcast: 1.1x slower in a standalone copy). R rows at a time keep 2R chains of FMAs in
// flight: one row's two had waited on each FMA's latency, ~13% of this kernel's samples.
template <int R>
inline void add_offsets(float* o, const float* sums, int64_t parts, const float* m) {
  __m256 r[R][2];
  for (int i = 0; i < R; ++i) {
    r[i][0] = _mm256_load_ps(o + i * kTileCols);
    r[i][1] = _mm256_load_ps(o + i * kTileCols + 8);
  }
  for (int64_t p = 0; p < parts; ++p) {
    const __m256 m0 = _mm256_loadu_ps(m + p * kTileCols);
    const __m256 m1 = _mm256_loadu_ps(m + p * kTileCols + 8);
    for (int i = 0; i < R; ++i) {
      const __m256 sum = _mm256_set1_ps(sums[i * parts + p]);
      r[i][0] = _mm256_fmadd_ps(sum, m0, r[i][0]);
      r[i][1] = _mm256_fmadd_ps(sum, m1, r[i][1]);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm256_store_ps(o + i * kTileCols, r[i][0]);
    _mm256_store_ps(o + i * kTileCols + 8, r[i][1]);
  }
}

// The chunk's rows through column tiles [begin, end) for codes of 4 to 6 bits (Q4_0/Q4_1 and
// the K types): per group and half tile (8 columns), its codes as 8 registers (shared by every
// row), then every row's sums over them; the row sums of a tile stay in L1 (acc). A Q6_K
// group's halves (registers 0-3 and 4-7: quads 0-1 and 2-3) take their own scales and sums.
template <typename T, typename F>
void chunk_tiles(const QuantizedRows& x, int64_t rows, int64_t k, const F& w,
                 const float* bias, T* y, int64_t n, int64_t begin, int64_t end) {
  constexpr int kSum = sum16_products(F::kBits) / 2;  // vpmaddubsw lanes (2 products each)
  constexpr int kParts = F::kHalvesDiffer ? 2 : 1;
  constexpr int kWide = 8 / kSum / kParts;  // 16-bit sums widened for each part
  const int64_t groups = k / kGroup;
  bool offsets = true;  // K types' m: their mins, or Q6_K's -32 d
  if constexpr (!F::kKType) offsets = w.offsets != nullptr;
  alignas(32) float acc[kChunkRows * kTileCols];
  thread_local std::vector<float> offset_buf;
  offset_buf.resize(groups * kParts * kTileCols);
  float* tile_offsets = offset_buf.data();  // [groups, parts, 16]: the tile's offsets m
  for (int64_t nt = begin; nt < end; ++nt) {
    std::fill(acc, acc + rows * kTileCols, 0.f);
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* c = w.tile(nt, g);
      for (int h = 0; h < 2; ++h) {
        __m256i code[8];
        half_tile_codes<F>(c, h, code);
        __m256 d[kParts];
        for (int part = 0; part < kParts; ++part) {
          __m256 m;
          scales8(w, nt, g, part, h, d[part], m);
          _mm256_storeu_ps(tile_offsets + (g * kParts + part) * kTileCols + h * 8, m);
        }
        for (int64_t i = 0; i < rows; ++i) {
          const uint8_t* a = x.pick(i, g);
          const auto product = [&](int j) { return _mm256_maddubs_epi16(code[j], pick4(a, j)); };
          float* o = acc + i * kTileCols + h * 8;
          __m256 r = _mm256_load_ps(o);
          const __m256 s = _mm256_set1_ps(x.scale[i * groups + g]);
          for (int part = 0; part < kParts; ++part) {
            __m256i dot;
#ifdef PAGEDSERVE_AVX_VNNI
            // vpdpbusd: a product quad summed into 32 bits in one instruction, in two chains.
            constexpr int kJ = 8 / kParts;
            __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
            for (int j = part * kJ; j < (part + 1) * kJ; j += 2) {
              even = _mm256_dpbusd_avx_epi32(even, code[j], pick4(a, j));
              odd = _mm256_dpbusd_avx_epi32(odd, code[j + 1], pick4(a, j + 1));
            }
            dot = _mm256_add_epi32(even, odd);
#else
            const __m256i ones = _mm256_set1_epi16(1);
            for (int run = 0; run < kWide; ++run) {
              // A run's kSum products summed in 16 bits a pair at a time as they come: a tree
              // over all 8 kept 16 registers live with the codes, and its spills made a
              // standalone copy of this loop 1.3x slower on AMD Zen 3.
              const int j0 = (part * kWide + run) * kSum;
              __m256i sum16 = _mm256_add_epi16(product(j0), product(j0 + 1));
              for (int j = j0 + 2; j < j0 + kSum; j += 2) {
                sum16 = _mm256_add_epi16(sum16, _mm256_add_epi16(product(j), product(j + 1)));
                // Kept in this order (GCC had regrouped the additions, 8 products live, and
                // reloaded d and vpmaddwd's ones from the stack every row: 12 loads a row, 10
                // with this; the FP load pipes bound the loop).
                asm("" : "+x"(sum16));
              }
              const __m256i wide = _mm256_madd_epi16(sum16, ones);
              dot = run ? _mm256_add_epi32(dot, wide) : wide;
            }
#endif
            r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d[part], s), r);
          }
          _mm256_store_ps(o, r);
        }
      }
    }
    if (offsets) {
      const int64_t parts = groups * kParts;  // a row's sums (kParts == x.parts)
      for (int64_t i0 = 0; i0 < rows; i0 += 4) {
        PAGEDSERVE_ROWS_1_TO_4(std::min<int64_t>(4, rows - i0), add_offsets,
                               acc + i0 * kTileCols, x.sum + i0 * parts, parts, tile_offsets);
      }
    }
    for (int64_t i = 0; i < rows; ++i) {
      store_out(y + i * n + nt * kTileCols, acc + i * kTileCols,
                bias ? bias + nt * kTileCols : nullptr, kTileCols);
    }
  }
}

// Eight-bit codes. A tile's code rows 2s and 2s + 1 hold inputs 4s..4s + 3 of every column as
// 16-bit pairs; interleaved by words they put each column's four in one 32-bit lane, columns
// 0-3 and 8-11 in one register (h = 0), 4-7 and 12-15 in the other (h = 1): acc keeps that
// order until the store. Per row, group and h: with AVX-VNNI 8 vpdpbusd of a + 128 (unsigned)
// by the codes, 128 * sum(c) taken off once for all rows, as in the AVX-512 VNNI kernel;
// without it 8 sign flips, 8 vpmaddubsw of |c| by a with c's sign (a pair at most
// 2 * 128 * 127, so no 16-bit sums) and 8 vpmaddwd.
template <typename T>
void chunk_tiles(const QuantizedRows& x, int64_t rows, int64_t k, const BlockFormat<8>& w,
                 const float* bias, T* y, int64_t n, int64_t begin, int64_t end) {
  const int64_t groups = k / kGroup;
  alignas(32) float acc[kChunkRows * kTileCols];
#ifndef PAGEDSERVE_AVX_VNNI
  alignas(32) int8_t signs[8][32];  // the codes, vpsignb's memory operand (registers are few)
#endif
  for (int64_t nt = begin; nt < end; ++nt) {
    std::fill(acc, acc + rows * kTileCols, 0.f);
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* c = w.tile(nt, g);
      const at::Half* scale = w.scale(nt, g);
      for (int h = 0; h < 2; ++h) {
        __m256i code[8];  // with AVX-VNNI the codes, else |code| (vpmaddubsw's unsigned side)
#ifdef PAGEDSERVE_AVX_VNNI
        __m256i code_sum = _mm256_setzero_si256();
#endif
        for (int s = 0; s < 8; ++s) {
          const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * s));
          const __m256i r1 =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * s + 32));
          const __m256i v = h ? _mm256_unpackhi_epi16(r0, r1) : _mm256_unpacklo_epi16(r0, r1);
#ifdef PAGEDSERVE_AVX_VNNI
          code[s] = v;
          code_sum = _mm256_dpbusd_avx_epi32(code_sum, _mm256_set1_epi8(1), v);
#else
          _mm256_store_si256(reinterpret_cast<__m256i*>(signs[s]), v);
          code[s] = _mm256_abs_epi8(v);
#endif
        }
        const __m128i halves = _mm_unpacklo_epi64(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scale + 4 * h)),
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scale + 8 + 4 * h)));
        const __m256 d = _mm256_cvtph_ps(halves);
#ifdef PAGEDSERVE_AVX_VNNI
        const __m256i shift = _mm256_slli_epi32(code_sum, 7);  // 128 * sum(c)
#endif
        for (int64_t i = 0; i < rows; ++i) {
          const uint8_t* a = x.pick(i, g);
#ifdef PAGEDSERVE_AVX_VNNI
          __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
          for (int s = 0; s < 8; s += 2) {
            even = _mm256_dpbusd_avx_epi32(even, pick4(a, s), code[s]);
            odd = _mm256_dpbusd_avx_epi32(odd, pick4(a, s + 1), code[s + 1]);
          }
          const __m256i dot = _mm256_sub_epi32(_mm256_add_epi32(even, odd), shift);
#else
          const __m256i ones = _mm256_set1_epi16(1);
          const auto product = [&](int s) {  // 4 inputs x 8 columns, summed per column
            const __m256i sign = _mm256_load_si256(reinterpret_cast<const __m256i*>(signs[s]));
            const __m256i signed_a = _mm256_sign_epi8(pick4(a, s), sign);
            return _mm256_madd_epi16(_mm256_maddubs_epi16(code[s], signed_a), ones);
          };
          // Summed in pairs as they come: the 8 codes' registers leave few for products.
          __m256i dot = _mm256_add_epi32(product(0), product(1));
          for (int s = 2; s < 8; s += 2) {
            dot = _mm256_add_epi32(dot, _mm256_add_epi32(product(s), product(s + 1)));
          }
#endif
          const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(x.scale[i * groups + g]));
          float* o = acc + i * kTileCols + h * 8;
          _mm256_store_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), ds, _mm256_load_ps(o)));
        }
      }
    }
    for (int64_t i = 0; i < rows; ++i) {
      const float* o = acc + i * kTileCols;
      alignas(32) float v[kTileCols];  // columns back in order
      std::memcpy(v, o, 4 * sizeof(float));
      std::memcpy(v + 8, o + 4, 4 * sizeof(float));
      std::memcpy(v + 4, o + 8, 4 * sizeof(float));
      std::memcpy(v + 12, o + 12, 4 * sizeof(float));
      store_out(y + i * n + nt * kTileCols, v, bias ? bias + nt * kTileCols : nullptr,
                kTileCols);
    }
  }
}

#else  // portable

// vec.h's 128-bit vectors: a tile row's 32 lanes (16 columns x an input pair) are kVecs of
// them, 4 columns each. (At 256 bits GCC assembled broadcasts in memory without AVX.)
constexpr int kVecs = 4;

// Row r's activation pair (inputs 2r, 2r + 1 of a group) in every pair of 16-bit lanes.
inline I16x8 pair_lanes(const ActCode* a, int r) {
  int32_t p;
  std::memcpy(&p, a + 2 * r, sizeof p);
  return reinterpret_cast<I16x8>(I32x4{p, p, p, p});
}

// Per column (4 of them), its two lanes' sums added.
inline I32x4 column_sums(I16x8 v) {
  const I32x4 w = reinterpret_cast<I32x4>(v);
  return low_halves(w) + high_halves(w);
}

// A group's integer sums, codes of 4 to 6 bits (block Q4 and the K types):
// acc[i][part][v] = row i's, for columns [4v, 4v + 4) and the part of the group's inputs (its
// halves where their scales differ: Q6_K).
template <int R, typename F>
inline void group_sums(const F& w, int64_t nt, int64_t g, const ActCode* a, int64_t stride,
                       I32x4 (&acc)[R][F::kHalvesDiffer ? 2 : 1][kVecs]) {
  constexpr int kRun = std::min<int>(sum16_products(F::kBits), kTileRows);  // rows a 16-bit sum
  const uint8_t* c = w.tile(nt, g);
  I16x8 sums[R][kVecs] = {};
  for (int q = 0; q < 4; ++q) {
    U16x8 words[kVecs], high[kVecs];
    std::memcpy(words, c + q * 64, sizeof words);
    if constexpr (F::kHighBits > 0) {  // quad q's high bits: high quad q / P (quant_layout.h)
      std::memcpy(high, c + 256 + q / F::kQuadsPerHigh * 64, sizeof high);
    }
    for (int n = 0; n < 4; ++n) {  // code row r = 4q + n: nibble n of every word
      const int r = 4 * q + n;
      I16x8 codes[kVecs];
      for (int v = 0; v < kVecs; ++v) {
        U16x8 code = (words[v] >> (4 * n)) & 0xF;
        if constexpr (F::kHighBits > 0) {
          const int at = 4 * n + F::kHighBits * (q % F::kQuadsPerHigh);
          code |= ((high[v] >> at) & ((1 << F::kHighBits) - 1)) << 4;
        }
        codes[v] = reinterpret_cast<I16x8>(code);
      }
      for (int i = 0; i < R; ++i) {
        const I16x8 pair = pair_lanes(a + i * stride, r);
        for (int v = 0; v < kVecs; ++v) sums[i][v] += codes[v] * pair;
      }
      if ((r + 1) % kRun == 0) {  // a run's end: widen (rows 0-7 are inputs 0-15, half 0)
        const int part = F::kHalvesDiffer ? r / 8 : 0;
        const bool first = r + 1 - kRun == part * 8;  // the part's first run sets acc
        for (int i = 0; i < R; ++i) {
          for (int v = 0; v < kVecs; ++v) {
            const I32x4 run = column_sums(sums[i][v]);
            acc[i][part][v] = first ? run : acc[i][part][v] + run;
            sums[i][v] = I16x8{};
          }
        }
      }
    }
  }
}

// Eight-bit codes: two rows' products summed in 16 bits, then widened.
template <int R>
inline void group_sums(const BlockFormat<8>& w, int64_t nt, int64_t g, const ActCode* a,
                       int64_t stride, I32x4 (&acc)[R][1][kVecs]) {
  const uint8_t* c = w.tile(nt, g);
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < kVecs; ++v) acc[i][0][v] = I32x4{};
  }
  for (int r = 0; r < kTileRows; r += 2) {
    I16x8 codes[2][kVecs];  // [row r or r + 1][vector]
    for (int s = 0; s < 2; ++s) {
      for (int v = 0; v < kVecs; ++v) {
        I8x8 bytes;
        std::memcpy(&bytes, c + (r + s) * 32 + v * 8, sizeof bytes);
        codes[s][v] = __builtin_convertvector(bytes, I16x8);
      }
    }
    for (int i = 0; i < R; ++i) {
      const I16x8 p0 = pair_lanes(a + i * stride, r), p1 = pair_lanes(a + i * stride, r + 1);
      for (int v = 0; v < kVecs; ++v) {
        acc[i][0][v] += column_sums(codes[0][v] * p0 + codes[1][v] * p1);
      }
    }
  }
}

// Rows [0, R) of the quantized x times column tile nt, rounded into y (row stride n).
template <int R, typename F, typename T>
inline void tile_rows(const QuantizedRows& x, int64_t k, const F& w, int64_t nt,
                      const float* bias, T* y, int64_t n) {
  constexpr int kParts = F::kHalvesDiffer ? 2 : 1;
  const int64_t groups = k / kGroup;
  F32x4 out[R][kVecs] = {};
  for (int64_t g = 0; g < groups; ++g) {
    I32x4 acc[R][kParts][kVecs];
    group_sums<R>(w, nt, g, x.pick(0, g), x.stride, acc);
    float d[2][kTileCols], m[2][kTileCols];
    w.group_scales(nt, g, d, m);
    for (int part = 0; part < kParts; ++part) {
      for (int v = 0; v < kVecs; ++v) {
        F32x4 dv, mv;
        std::memcpy(&dv, d[part] + 4 * v, sizeof dv);
        std::memcpy(&mv, m[part] + 4 * v, sizeof mv);
        for (int i = 0; i < R; ++i) {
          const F32x4 dot = __builtin_convertvector(acc[i][part][v], F32x4);
          const float sum = x.sum[(i * groups + g) * kParts + part];
          out[i][v] += dot * (dv * x.scale[i * groups + g]) + mv * sum;
        }
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    float v[kTileCols];
    std::memcpy(v, out[i], sizeof v);
    store_out(y + i * n + nt * kTileCols, v, bias ? bias + nt * kTileCols : nullptr, kTileCols);
  }
}

constexpr int64_t kPassRows = 4;  // more spill the 16-bit sums out of SSE2's 16 registers

// A chunk's rows through column tiles [begin, end), kPassRows at a time.
template <typename F, typename T>
void chunk_tiles(const QuantizedRows& x, int64_t rows, int64_t k, const F& w, const float* bias,
                 T* y, int64_t n, int64_t begin, int64_t end) {
  for (int64_t nt = begin; nt < end; ++nt) {
    for (int64_t i0 = 0; i0 < rows; i0 += kPassRows) {
      PAGEDSERVE_ROWS_1_TO_4(std::min(kPassRows, rows - i0), tile_rows, x.rows_from(i0, k), k,
                             w, nt, bias, y + i0 * n, n);
    }
  }
}

#endif

}  // namespace

template <typename T, typename F>
void int8_linear(const T* x, int64_t m, int64_t k, const F& w, const float* bias, T* y,
                 int64_t n) {
  // Nibble-tile codes (all but Q8_0's) take the activations in their nibbles' order.
  const QuantizedRows q = quantize_rows<F::kBits != 8, F::kHalvesDiffer>(x, m, k);
  // One parallel region, not one a chunk (a 2048-token prefill step met ~4,000 barriers); the
  // threads claim a chunk's tiles before the next chunk's, so each chunk is read from memory
  // once (a claim's tiles through every chunk had streamed all of x per claim).
  parallel_chunk_tiles((m + kChunkRows - 1) / kChunkRows, n / kTileCols,
                       [&](int64_t c, int64_t begin, int64_t end) {
                         const int64_t m0 = c * kChunkRows, rows = std::min(kChunkRows, m - m0);
                         chunk_tiles(q.rows_from(m0, k), rows, k, w, bias, y + m0 * n, n,
                                     begin, end);
                       });
}

#define INSTANTIATE(F)                                                                        \
  template void int8_linear<float, F>(const float*, int64_t, int64_t, const F&, const float*, \
                                      float*, int64_t);                                       \
  template void int8_linear<at::BFloat16, F>(const at::BFloat16*, int64_t, int64_t, const F&, \
                                             const float*, at::BFloat16*, int64_t);
PAGEDSERVE_FOR_EACH_FORMAT(INSTANTIATE)
