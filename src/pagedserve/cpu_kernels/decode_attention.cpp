// Paged decode attention: one query token per sequence, read straight from the KV pages
// (portable loops the compiler vectorizes; AVX2 intrinsics from the avx2 level on; for
// bfloat16 over bfloat16 pages, AVX-512 BF16 products where the CPU has them, with AMX for
// the scores at the amx level). Sums in float32.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "claims.h"
#include "convert.h"
#include "cpu_ops.h"
#include "softmax.h"

namespace {

template <typename T>
inline float dot(const T* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += to_f(a[i]) * b[i];
  return acc;
}

// Calls fn(t, row) for the first n tokens of one KV head in a paged cache [pages, page_size,
// Hk, D (+ kRowExtra)], in order, with token t's row of head h converted to float32 (D: as
// decode_unit).
template <typename T, int64_t D, typename Fn>
inline void for_each_row(const T* cache, const int64_t* pages, int64_t n, int64_t page,
                         int64_t hk, int64_t h, int64_t d_runtime, Fn&& fn) {
  const int64_t d = D ? D : d_runtime, len = d + kRowExtra<T>;
  float row[D ? D : 256];
  for (int64_t first = 0; first < n; first += page) {
    const int64_t count = std::min(page, n - first);
    const T* r = cache + (pages[first / page] * page * hk + h) * len;
    for (int64_t o = 0; o < count; ++o, r += hk * len) {
      const float s = row_scale(r, d);
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) row[i] = to_f(r[i]) * s;
      fn(first + o, row);
    }
  }
}

// One (sequence, KV head) of decode attention: the g query heads that share the KV head are
// served by one pass over its keys and one over its values. T: the query's and output's type,
// C: the cache's. D is the head size when known at compile time (fully unrolled loops), 0 for
// any other size.
template <typename T, typename C, int64_t D>
void decode_unit(const T* q, const C* kc, const C* vc, T* out, const int64_t* pages, int64_t n,
                 int64_t page, int64_t hk, int64_t h, int64_t g, int64_t d_runtime, float scale,
                 std::vector<float>& qf, std::vector<float>& acc, std::vector<float>& scores) {
  const int64_t d = D ? D : d_runtime;
  qf.resize(g * d);
  acc.assign(g * d, 0.f);
  scores.resize(g * n);
  for (int64_t j = 0; j < g * d; ++j) qf[j] = to_f(q[j]) * scale;
  // Scores, then the weighted sum of values: one walk over the head's pages each.
  for_each_row<C, D>(kc, pages, n, page, hk, h, d, [&](int64_t t, const float* row) {
    for (int64_t j = 0; j < g; ++j) {
      const float* qj = qf.data() + j * d;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < d; ++i) dot += row[i] * qj[i];
      scores[j * n + t] = dot;
    }
  });
  for (int64_t j = 0; j < g; ++j) softmax_(scores.data() + j * n, n);
  for_each_row<C, D>(vc, pages, n, page, hk, h, d, [&](int64_t t, const float* row) {
    for (int64_t j = 0; j < g; ++j) {
      const float p = scores[j * n + t];
      float* a = acc.data() + j * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) a[i] += p * row[i];
    }
  });
  for (int64_t j = 0; j < g * d; ++j) out[j] = from_f<T>(acc[j]);
}

#ifdef PAGEDSERVE_AVX2
// decode_unit with AVX2 intrinsics (caches of float32, bfloat16 or float16), head sizes a
// multiple of 32. The portable loops reduced every (token, head) dot product across lanes on
// its own and copied each row before use: 16 GFLOP/s at batch 32 (a fifth of a decode step at
// avx2).
// Here scores are summed over 2 tokens x up to 3 heads at once (6 accumulators; the query
// rows read from L1) and reduced across lanes 8 tokens at a time; the weighted sum of values
// keeps 3 heads x 32 dims in registers over all tokens (unit_values3: 12 of AVX2's 16
// registers, named one by one), fewer heads x 16 dims. 4 tokens x 3 heads, and 3 heads x 32
// dims held in an array, had kept an accumulator, or all of them, on the stack (a store and a
// reload each token: decode attention ~3x its FMAs' time on AMD Zen 1).

// The lane sums of v[0..7], in order.
inline __m256 lane_sums(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 ce = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, ce, 0x20), _mm256_permute2f128_ps(ab, ce, 0x31));
}

constexpr int64_t kUnitHeads = 3;  // query heads a pass

// Rows sit in pages anywhere in the pool, beyond the hardware prefetcher's reach: rows
// kPrefetchRows tokens ahead are fetched while these are used. 16 (~30 ns of work ahead of a
// ~100 ns miss) left the bfloat16 unit at a third of its in-cache speed; 48 took 15-22% off it
// and 22-31% off the AVX2 unit over float16 pages at contexts 100-400 (AMD Zen 5, batch 32, 30
// layers' pools); 32, 64, 96 and 160 measured slower or no faster (benchmarks/RESULTS.md,
// stop 48).
constexpr int64_t kPrefetchRows = 48;
// The lines of d elements from row (and of an int8 row's scale after them), wherever the row
// starts in its first line (an int8 row of 68 bytes mostly spans two). In asm: GCC deletes a
// loop whose body is _mm_prefetch alone as an empty loop (C++'s finite loops), as it did
// prefetch_ahead_rows' at -O3.
template <typename T>
inline void prefetch_row(const T* row, int64_t d) {
  const auto begin = reinterpret_cast<uintptr_t>(row);
  const uintptr_t end = begin + (d + kRowExtra<T>) * sizeof(T);
  for (uintptr_t line = begin & ~uintptr_t{63}; line < end; line += 64) {
    asm volatile("prefetcht0 (%0)" : : "r"(line));
  }
}

// At token t of a pass over n tokens that takes `step` a time: d elements of each row
// kPrefetchRows ahead, and at t = 0 of every row up to there. row(t): token t's row.
template <typename Row>
inline void prefetch_ahead_rows(const Row& row, int64_t t, int64_t step, int64_t n, int64_t d) {
  const int64_t end = std::min(n, t + kPrefetchRows + step);
  for (int64_t u = t == 0 ? 0 : t + kPrefetchRows; u < end; ++u) prefetch_row(row(u), d);
}

// The cache element type of row lambdas.
template <typename Row>
using RowElement = std::remove_cv_t<std::remove_pointer_t<std::invoke_result_t<Row, int64_t>>>;

// Scores of tokens [0, n) for query heads [0, G) (qf: their scaled float32 rows) into
// scores[j * stride + t]; row(t): token t's key row (an int8 row's dot products times its
// scale, read here with the row's lines).
template <int64_t G, typename Row>
inline void unit_scores(const float* qf, int64_t d, int64_t n, const Row& row, float* scores,
                        int64_t stride) {
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    prefetch_ahead_rows(row, t0, 8, n, d);
    __m256 part[G][8];
    for (int64_t u0 = 0; u0 < 8; u0 += 2) {
      const auto* r0 = row(std::min(t0 + u0, n - 1));
      const auto* r1 = row(std::min(t0 + u0 + 1, n - 1));
      __m256 a[G][2];
      for (int64_t j = 0; j < G; ++j) a[j][0] = a[j][1] = _mm256_setzero_ps();
      for (int64_t c = 0; c < d; c += 8) {
        const __m256 k0 = load8_f32(r0 + c), k1 = load8_f32(r1 + c);
        for (int64_t j = 0; j < G; ++j) {
          const __m256 qj = _mm256_loadu_ps(qf + j * d + c);
          a[j][0] = _mm256_fmadd_ps(k0, qj, a[j][0]);
          a[j][1] = _mm256_fmadd_ps(k1, qj, a[j][1]);
        }
      }
      for (int64_t j = 0; j < G; ++j) {
        part[j][u0] = a[j][0];
        part[j][u0 + 1] = a[j][1];
      }
    }
    // Tokens past n repeat the last one: their scores land in the padding.
    __m256 key_scales = _mm256_set1_ps(1.f);
    if constexpr (std::is_same_v<RowElement<Row>, int8_t>) {
      alignas(32) float s[8];
      for (int u = 0; u < 8; ++u) s[u] = row_scale(row(std::min(t0 + u, n - 1)), d);
      key_scales = _mm256_load_ps(s);
    }
    for (int64_t j = 0; j < G; ++j) {
      __m256 sums = lane_sums(part[j]);
      if constexpr (std::is_same_v<RowElement<Row>, int8_t>) sums = _mm256_mul_ps(sums, key_scales);
      _mm256_storeu_ps(scores + j * stride + t0, sums);
    }
  }
}

// out[0, 8N) = the lanes of v[0..N), in out's type.
template <int N, typename T>
inline void store_dims(const __m256 (&v)[N], T* out) {
  alignas(32) float lanes[8 * N];
  for (int c = 0; c < N; ++c) _mm256_store_ps(lanes + 8 * c, v[c]);
  for (int i = 0; i < 8 * N; ++i) out[i] = from_f<T>(lanes[i]);
}

constexpr int64_t kValueDims = 16;  // dims of the values a pass over the tokens sums

// out[j * d + c] for query heads [0, G), dims [c0, c0 + kValueDims): sum over tokens of
// p * value.
template <int64_t G, typename T, typename Row>
inline void unit_values(const float* probs, int64_t stride, int64_t n, const Row& row,
                        int64_t c0, int64_t d, T* out) {
  __m256 acc[G][2];
  for (int64_t j = 0; j < G; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    prefetch_ahead_rows([&](int64_t u) { return row(u) + c0; }, t, 1, n, kValueDims);
    const auto* r = row(t) + c0;
    __m256 v0 = load8_f32(r), v1 = load8_f32(r + 8);
    if constexpr (std::is_same_v<RowElement<Row>, int8_t>) {
      const __m256 scale = _mm256_set1_ps(row_scale(row(t), d));
      v0 = _mm256_mul_ps(v0, scale);
      v1 = _mm256_mul_ps(v1, scale);
    }
    for (int64_t j = 0; j < G; ++j) {
      const __m256 p = _mm256_broadcast_ss(probs + j * stride + t);
      acc[j][0] = _mm256_fmadd_ps(p, v0, acc[j][0]);
      acc[j][1] = _mm256_fmadd_ps(p, v1, acc[j][1]);
    }
  }
  for (int64_t j = 0; j < G; ++j) store_dims(acc[j], out + j * d + c0);
}

// unit_values for 3 query heads (the default model's 9 / 3) over 32 dims a pass: half the
// passes over the tokens, 12 sums in named registers (held in an array, GCC stored all 12 to
// the stack every token). Against 16 dims a pass, batch 32, float16 pages, 30 layers' pools:
// 8-17% less time on AMD Zen 3 (benchmarks/RESULTS.md, stop 46).
template <typename T, typename Row>
inline void unit_values3(const float* probs, int64_t stride, int64_t n, const Row& row,
                         int64_t c0, int64_t d, T* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0,
         b3 = a0, e0 = a0, e1 = a0, e2 = a0, e3 = a0;
  for (int64_t t = 0; t < n; ++t) {
    prefetch_ahead_rows([&](int64_t u) { return row(u) + c0; }, t, 1, n, 32);
    const auto* r = row(t) + c0;
    __m256 p = _mm256_broadcast_ss(probs + t), q = _mm256_broadcast_ss(probs + stride + t),
           u = _mm256_broadcast_ss(probs + 2 * stride + t);
    if constexpr (std::is_same_v<RowElement<Row>, int8_t>) {
      const __m256 scale = _mm256_set1_ps(row_scale(row(t), d));
      p = _mm256_mul_ps(p, scale);
      q = _mm256_mul_ps(q, scale);
      u = _mm256_mul_ps(u, scale);
    }
    // Dims [8c, 8c + 8) of the row into each head's sums.
    const auto add = [&](int c, __m256& x, __m256& y, __m256& z) {
      const __m256 v = load8_f32(r + 8 * c);
      x = _mm256_fmadd_ps(p, v, x);
      y = _mm256_fmadd_ps(q, v, y);
      z = _mm256_fmadd_ps(u, v, z);
    };
    add(0, a0, b0, e0);
    add(1, a1, b1, e1);
    add(2, a2, b2, e2);
    add(3, a3, b3, e3);
  }
  const __m256 sums[3][4] = {{a0, a1, a2, a3}, {b0, b1, b2, b3}, {e0, e1, e2, e3}};
  for (int64_t j = 0; j < 3; ++j) store_dims(sums[j], out + j * d + c0);
}

template <int64_t G, typename T, typename Keys, typename Values>
inline void unit_heads(const float* qf, int64_t d, int64_t n, const Keys& keys,
                       const Values& values, float* scores, int64_t stride, T* out) {
  unit_scores<G>(qf, d, n, keys, scores, stride);
  for (int64_t j = 0; j < G; ++j) softmax_(scores + j * stride, n);
  if constexpr (G == 3) {
    for (int64_t c0 = 0; c0 < d; c0 += 32) unit_values3(scores, stride, n, values, c0, d, out);
  } else {
    for (int64_t c0 = 0; c0 < d; c0 += kValueDims) {
      unit_values<G>(scores, stride, n, values, c0, d, out);
    }
  }
}

// Each token's row offset in the cache for KV head h, once (a division by the page size a row
// read took most of the time); len: a row's elements.
inline const int64_t* row_offsets(const int64_t* pages, int64_t n, int64_t page, int64_t hk,
                                  int64_t h, int64_t len, std::vector<int64_t>& offsets) {
  offsets.resize(n);
  for (int64_t first = 0; first < n; first += page) {
    const int64_t base = (pages[first / page] * page * hk + h) * len;
    for (int64_t o = 0; o < std::min(page, n - first); ++o) {
      offsets[first + o] = base + o * hk * len;
    }
  }
  return offsets.data();
}

template <typename T, typename C>
void decode_unit_avx2(const T* q, const C* kc, const C* vc, T* out, const int64_t* pages,
                      int64_t n, int64_t page, int64_t hk, int64_t h, int64_t g, int64_t d,
                      float scale, std::vector<float>& qf, std::vector<float>& scores,
                      std::vector<int64_t>& offsets) {
  const int64_t stride = (n + 7) / 8 * 8;  // scores of a head, padded to whole 8-token blocks
  qf.resize(g * d);
  scores.resize(kUnitHeads * stride);
  for (int64_t j = 0; j < g * d; ++j) qf[j] = to_f(q[j]) * scale;
  const int64_t* at = row_offsets(pages, n, page, hk, h, d + kRowExtra<C>, offsets);
  const auto keys = [=](int64_t t) { return kc + at[t]; };
  const auto values = [=](int64_t t) { return vc + at[t]; };
  for (int64_t j0 = 0; j0 < g; j0 += kUnitHeads) {
    const float* qj = qf.data() + j0 * d;
    T* oj = out + j0 * d;
    switch (std::min(kUnitHeads, g - j0)) {
      case 1: unit_heads<1>(qj, d, n, keys, values, scores.data(), stride, oj); break;
      case 2: unit_heads<2>(qj, d, n, keys, values, scores.data(), stride, oj); break;
      default: unit_heads<3>(qj, d, n, keys, values, scores.data(), stride, oj);
    }
  }
}
#endif

#ifdef PAGEDSERVE_AVX512
// Pieces of the AVX-512 units (head size D = 64 or 128, G query heads per KV head).

// kTokenSlot[u]: where token u's partial sums go, so that lane_sums16 hands back token u in lane
// u (its additions leave the tokens in the 4 x 4 transposed order; a transposition is its own
// inverse).
constexpr int kTokenSlot[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

// The lane sums of v[0..15] (in kTokenSlot order): 15 additions and 30 shuffles for 16 sums.
inline __m512 lane_sums16(__m512* v) {
  for (int k = 0; k < 8; ++k) {  // 256-bit halves: lanes 0-7 of v[2k], then of v[2k + 1]
    v[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  }
  for (int k = 0; k < 4; ++k) {  // 128-bit quarters: one token each
    v[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xDD));
  }
  for (int k = 0; k < 2; ++k) {  // within quarters: two lanes a token
    v[k] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(v[2 * k], v[2 * k + 1], 0xEE));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
}

// Unit::fn<D, G> for this head size and count, or nullptr.
template <typename Unit, int64_t D>
auto unit_for(int64_t g) -> decltype(&Unit::template fn<D, 1>) {
  switch (g) {
    case 1: return Unit::template fn<D, 1>;
    case 2: return Unit::template fn<D, 2>;
    case 3: return Unit::template fn<D, 3>;
    case 4: return Unit::template fn<D, 4>;
    case 6: return Unit::template fn<D, 6>;
    case 8: return Unit::template fn<D, 8>;
    default: return nullptr;
  }
}

template <typename Unit>
auto unit_for(int64_t d, int64_t g) -> decltype(&Unit::template fn<64, 1>) {
  return d == 64 ? unit_for<Unit, 64>(g) : d == 128 ? unit_for<Unit, 128>(g) : nullptr;
}

// 16 int8 codes as float32.
inline __m512 load16_codes(const int8_t* p) {
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes));
}

// out[j * D, + D) for query heads [0, G): the sum over tokens of probs[j * stride + t] times
// value row t (at[t] in vc) times its scale, each row widened once, the sums in registers.
template <int64_t D, int64_t G, typename T>
inline void int8_values(const float* probs, int64_t stride, int64_t n, const int8_t* vc,
                        const int64_t* at, T* out) {
  constexpr int64_t kSteps = D / 16;
  __m512 acc[G][kSteps];
  for (int64_t j = 0; j < G; ++j) {
    for (int64_t i = 0; i < kSteps; ++i) acc[j][i] = _mm512_setzero_ps();
  }
  for (int64_t t = 0; t < n; ++t) {
    prefetch_ahead_rows([=](int64_t u) { return vc + at[u]; }, t, 1, n, D);
    const int8_t* r = vc + at[t];
    const float scale = row_scale(r, D);
    __m512 x[kSteps];
    for (int64_t i = 0; i < kSteps; ++i) x[i] = load16_codes(r + 16 * i);
    for (int64_t j = 0; j < G; ++j) {
      const __m512 p = _mm512_set1_ps(probs[j * stride + t] * scale);
      for (int64_t i = 0; i < kSteps; ++i) acc[j][i] = _mm512_fmadd_ps(p, x[i], acc[j][i]);
    }
  }
  alignas(64) float sums[16];
  for (int64_t j = 0; j < G; ++j) {
    for (int64_t i = 0; i < kSteps; ++i) {
      _mm512_store_ps(sums, acc[j][i]);
      for (int64_t l = 0; l < 16; ++l) out[j * D + 16 * i + l] = from_f<T>(sums[l]);
    }
  }
}

// The int8 unit: int8 pages (convert.h) under float32 or bfloat16 queries, pages of any size,
// float32 math in 512-bit vectors with every key and value row widened once. Scores: 16 tokens
// a block, each key row widened to D / 16 vectors and multiplied by the G query rows held in
// registers, summed across lanes as in the bfloat16 units, times the block's key scales; the
// weighted sum of values in int8_values, a group of heads at a time (their sums in registers).
template <typename T>
struct Avx512Int8Unit {
  template <int64_t D, int64_t G>
  static void fn(const T* q, const int8_t* kc, const int8_t* vc, T* out, const int64_t* pages,
                 int64_t n, int64_t page, int64_t hk, int64_t h, float scale,
                 std::vector<float>& scores, std::vector<int64_t>& offsets) {
    constexpr int64_t kSteps = D / 16;
    const int64_t padded_n = (n + 15) / 16 * 16;
    scores.resize(G * padded_n);
    const int64_t* at = row_offsets(pages, n, page, hk, h, D + kRowExtra<int8_t>, offsets);
    __m512 qv[G][kSteps];
    alignas(64) float row[16];
    for (int64_t j = 0; j < G; ++j) {
      for (int64_t i = 0; i < kSteps; ++i) {
        for (int64_t l = 0; l < 16; ++l) row[l] = to_f(q[j * D + 16 * i + l]) * scale;
        qv[j][i] = _mm512_load_ps(row);
      }
    }
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      prefetch_ahead_rows([=](int64_t u) { return kc + at[u]; }, t0, 16, n, D);
      __m512 v[G][16];
      alignas(64) float key_scales[16];
      for (int u = 0; u < 16; ++u) {
        const int8_t* r = kc + at[std::min(t0 + u, n - 1)];  // past n: the last again
        key_scales[u] = row_scale(r, D);
        __m512 k[kSteps];
        for (int64_t i = 0; i < kSteps; ++i) k[i] = load16_codes(r + 16 * i);
        for (int64_t j = 0; j < G; ++j) {
          __m512 a = _mm512_mul_ps(k[0], qv[j][0]);
          for (int64_t i = 1; i < kSteps; ++i) a = _mm512_fmadd_ps(k[i], qv[j][i], a);
          v[j][kTokenSlot[u]] = a;
        }
      }
      const __m512 ks = _mm512_load_ps(key_scales);
      for (int64_t j = 0; j < G; ++j) {
        _mm512_storeu_ps(scores.data() + j * padded_n + t0, _mm512_mul_ps(lane_sums16(v[j]), ks));
      }
    }
    for (int64_t j = 0; j < G; ++j) softmax_(scores.data() + j * padded_n, n);
    constexpr int64_t kGroup = D == 64 ? 4 : 2;  // heads a pass over the values
    for (int64_t j0 = 0; j0 < G; j0 += kGroup) {
      const float* p = scores.data() + j0 * padded_n;
      T* o = out + j0 * D;
      switch (std::min(kGroup, G - j0)) {
        case 1: int8_values<D, 1>(p, padded_n, n, vc, at, o); break;
        case 2: int8_values<D, 2>(p, padded_n, n, vc, at, o); break;
        case 3: int8_values<D, 3>(p, padded_n, n, vc, at, o); break;
        default: int8_values<D, 4>(p, padded_n, n, vc, at, o);
      }
    }
  }
};
#endif  // PAGEDSERVE_AVX512

#ifdef PAGEDSERVE_AVX512_BF16
// Pieces of the bfloat16 units (bfloat16 queries over bfloat16 pages, head size D = 64 or 128,
// G query heads per KV head): AVX-512 BF16's vdpbf16ps multiplies bfloat16 pairs straight from
// the pages, summing in float32 (the AVX2 unit widens every value first: at the avx512 level a
// third of a batch-32 decode step went to attention).

// Scaled scores of tokens [0, n) for query heads [0, g) into scores[j * stride + t]; row(t):
// token t's key row. 16 tokens a block, each (token, head) in D / 32 vdpbf16ps, the block's
// keys read again from L1 for each head.
template <int64_t D, typename Row>
inline void bf16_scores(const at::BFloat16* q, int64_t g, int64_t n, const Row& row, float scale,
                        float* scores, int64_t stride) {
  constexpr int64_t kSteps = D / 32;
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    prefetch_ahead_rows(row, t0, 16, n, D);
    const at::BFloat16* r[16];
    for (int u = 0; u < 16; ++u) r[u] = row(std::min(t0 + u, n - 1));  // past n: the last again
    for (int64_t j = 0; j < g; ++j) {
      __m512bh qv[kSteps];
      for (int64_t s = 0; s < kSteps; ++s) {
        qv[s] = (__m512bh)_mm512_loadu_si512(q + j * D + 32 * s);
      }
      __m512 v[16];
      for (int u = 0; u < 16; ++u) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t s = 0; s < kSteps; ++s) {
          a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(r[u] + 32 * s), qv[s]);
        }
        v[kTokenSlot[u]] = a;
      }
      _mm512_storeu_ps(scores + j * stride + t0, _mm512_mul_ps(lane_sums16(v), scale_v));
    }
  }
}

// Softmax of each head's scores [j * padded_n, + n) as bfloat16 pairs (t, t + 1), zeros after
// the last token (padded_n: a multiple of 32): one conversion turns 32 probabilities into 16
// pairs in order. Returns p [g, padded_n / 2].
inline const uint32_t* bf16_probs(float* scores, int64_t g, int64_t n, int64_t padded_n) {
  const int64_t pairs = padded_n / 2;
  thread_local std::vector<uint32_t> p;  // reused: one unit after another on this thread
  p.resize(g * pairs);
  for (int64_t j = 0; j < g; ++j) {
    float* sj = scores + j * padded_n;
    const __m512 scale_by = _mm512_set1_ps(1.f / exp_sum_(sj, n));
    for (int64_t t = n; t < padded_n; ++t) sj[t] = 0.f;
    for (int64_t t = 0; t < padded_n; t += 32) {
      const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(sj + t), scale_by);
      const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(sj + t + 16), scale_by);
      _mm512_storeu_si512(p.data() + j * pairs + t / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
  return p.data();
}

// out[j * D, + D) for query heads [0, G): the weighted sum of values in vdpbf16ps over token
// pairs (two value rows interleaved by unpack, so lanes hold dims in a fixed permutation undone
// at the end; probabilities p from bf16_probs, rounded to bfloat16 as in flash attention), the
// sums in registers. row(t): token t's value row.
template <int64_t D, int64_t G, typename Row>
inline void bf16_values(const uint32_t* p, int64_t pairs, int64_t n, const Row& row,
                        at::BFloat16* out) {
  constexpr int64_t kSteps = D / 32;  // 32 bf16: one zmm of V
  __m512 acc[G][2 * kSteps];
  for (int64_t j = 0; j < G; ++j) {
    for (int64_t i = 0; i < 2 * kSteps; ++i) acc[j][i] = _mm512_setzero_ps();
  }
  for (int64_t t = 0; t < n; t += 2) {
    prefetch_ahead_rows(row, t, 2, n, D);
    const at::BFloat16* a = row(t);
    const at::BFloat16* b = t + 1 < n ? row(t + 1) : a;  // an odd last token pairs with p = 0
    __m512i lo[kSteps], hi[kSteps];
    for (int64_t i = 0; i < kSteps; ++i) {
      const __m512i va = _mm512_loadu_si512(a + 32 * i), vb = _mm512_loadu_si512(b + 32 * i);
      lo[i] = _mm512_unpacklo_epi16(va, vb);
      hi[i] = _mm512_unpackhi_epi16(va, vb);
    }
    for (int64_t j = 0; j < G; ++j) {
      const auto pj = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(p[j * pairs + t / 2]));
      for (int64_t i = 0; i < kSteps; ++i) {
        acc[j][2 * i] = _mm512_dpbf16_ps(acc[j][2 * i], (__m512bh)lo[i], pj);
        acc[j][2 * i + 1] = _mm512_dpbf16_ps(acc[j][2 * i + 1], (__m512bh)hi[i], pj);
      }
    }
  }
  // Lane 4L + e of the unpack-low sum of 32 dims holds dim 8L + e; unpack-high 8L + 4 + e.
  alignas(64) float sums[2 * kSteps][16];
  for (int64_t j = 0; j < G; ++j) {
    for (int64_t i = 0; i < 2 * kSteps; ++i) _mm512_store_ps(sums[i], acc[j][i]);
    for (int64_t i = 0; i < kSteps; ++i) {
      for (int64_t lane = 0; lane < 16; ++lane) {
        const int64_t dim = 32 * i + 8 * (lane / 4) + lane % 4;
        out[j * D + dim] = from_f<at::BFloat16>(sums[2 * i][lane]);
        out[j * D + dim + 4] = from_f<at::BFloat16>(sums[2 * i + 1][lane]);
      }
    }
  }
}

// The AVX-512 BF16 unit (pages of any size). Against the AVX2 unit at batch 32, contexts
// 145-800: 10-20% less time (Intel SPR capped at avx512; at these sizes the pages' reads from
// L3 bound both).
struct Avx512Bf16Unit {
  template <int64_t D, int64_t G>
  static void fn(const at::BFloat16* q, const at::BFloat16* kc, const at::BFloat16* vc,
                 at::BFloat16* out, const int64_t* pages, int64_t n, int64_t page, int64_t hk,
                 int64_t h, float scale, std::vector<float>& scores,
                 std::vector<int64_t>& offsets) {
    const int64_t padded_n = (n + 31) / 32 * 32;
    scores.resize(G * padded_n);
    const int64_t* at = row_offsets(pages, n, page, hk, h, D, offsets);
    bf16_scores<D>(q, G, n, [=](int64_t t) { return kc + at[t]; }, scale, scores.data(),
                   padded_n);
    const uint32_t* p = bf16_probs(scores.data(), G, n, padded_n);
    bf16_values<D, G>(p, padded_n / 2, n, [=](int64_t t) { return vc + at[t]; }, out);
  }
};
#endif  // PAGEDSERVE_AVX512_BF16

#ifdef PAGEDSERVE_AMX
// The AMX unit, for 16-token pages. Scores: S^T = K Q^T on AMX, a page of keys per tile loaded
// straight from the cache (rows past n of a last page are computed, not kept), the query tiles
// held in registers; the weighted sum of values in bf16_values. Against decode_unit, 7-10%
// faster at batch 32 and ~30% at batch 1, context 880. The caller loads the tile configuration.
struct AmxUnit {
  template <int64_t D, int64_t G>
  static void fn(const at::BFloat16* q, const at::BFloat16* kc, const at::BFloat16* vc,
                 at::BFloat16* out, const int64_t* pages, int64_t n, int64_t /*page: 16*/,
                 int64_t hk, int64_t h, float scale, std::vector<float>& scores,
                 std::vector<int64_t>& /*offsets*/) {
    constexpr int64_t kSteps = D / 32;  // 32 bf16: one tile row of K
    const int64_t stride = hk * D;      // elements from one token to the next in a page
    // This head's row of token `first` (a multiple of 16) of the page holding it.
    const auto page_rows = [&](const at::BFloat16* cache, int64_t first) {
      return cache + (pages[first / 16] * 16 * hk + h) * D;
    };
    const int64_t padded_n = (n + 31) / 32 * 32;  // the pair packing reads whole vectors
    scores.resize(G * padded_n);
    alignas(64) uint16_t qt[kSteps][16][32] = {};  // pair layout: row r, lane 2j+p = q[j][2r+p]
    for (int64_t s = 0; s < kSteps; ++s) {
      for (int64_t r = 0; r < 16; ++r) {
        for (int64_t j = 0; j < G; ++j) {
          std::memcpy(&qt[s][r][2 * j], q + j * D + s * 32 + 2 * r, 2 * sizeof(uint16_t));
        }
      }
    }
    _tile_loadd(2, qt[0], 64);
    _tile_loadd(3, qt[1], 64);
    if constexpr (kSteps == 4) {
      _tile_loadd(4, qt[2], 64);
      _tile_loadd(5, qt[3], 64);
    }
    // Pages sit anywhere in the pool, beyond the hardware prefetcher's reach: fetch the rows
    // of this head two pages ahead (pages go through the tiles in pairs) while the current
    // one is multiplied.
    const auto prefetch_page = [&](const at::BFloat16* cache, int64_t first) {
      if (first >= n) return;
      const at::BFloat16* row = page_rows(cache, first);
      for (int64_t r = 0; r < 16; ++r, row += stride) prefetch_row(row, D);
    };
    // Each page's 16 x 16 block (token rows, query-head columns) goes straight to memory, and
    // pages alternate between two sum/key tile pairs, so that the tile unit never waits for
    // the previous page's results to be read.
    thread_local std::vector<float> blocks;
    blocks.resize(padded_n * 16);
    // (A macro: the tile intrinsics take tile numbers as literals.)
#define PAGEDSERVE_PAGE_SCORES(first, sum, key)          \
  do {                                                   \
    const at::BFloat16* k = page_rows(kc, first);        \
    prefetch_page(kc, (first) + 32);                     \
    _tile_zero(sum);                                     \
    _tile_loadd(key, k, stride * 2);                     \
    _tile_dpbf16ps(sum, key, 2);                         \
    _tile_loadd(key, k + 32, stride * 2);                \
    _tile_dpbf16ps(sum, key, 3);                         \
    if constexpr (kSteps == 4) {                         \
      _tile_loadd(key, k + 64, stride * 2);              \
      _tile_dpbf16ps(sum, key, 4);                       \
      _tile_loadd(key, k + 96, stride * 2);              \
      _tile_dpbf16ps(sum, key, 5);                       \
    }                                                    \
    _tile_stored(sum, blocks.data() + (first) * 16, 64); \
  } while (0)
    prefetch_page(kc, 16);
    for (int64_t first = 0; first < n; first += 32) {
      PAGEDSERVE_PAGE_SCORES(first, 0, 1);
      if (first + 16 < n) PAGEDSERVE_PAGE_SCORES(first + 16, 6, 7);
    }
#undef PAGEDSERVE_PAGE_SCORES
    // Column j of the blocks is query head j's scores.
    const __m512i column = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(16));
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t j = 0; j < G; ++j) {
      for (int64_t t = 0; t < n; t += 16) {
        const __m512 v = _mm512_i32gather_ps(column, blocks.data() + t * 16 + j, 4);
        _mm512_storeu_ps(scores.data() + j * padded_n + t, _mm512_mul_ps(v, scale_v));
      }
    }
    const uint32_t* p = bf16_probs(scores.data(), G, n, padded_n);
    const auto values = [&](int64_t t) { return page_rows(vc, t - t % 16) + (t % 16) * stride; };
    bf16_values<D, G>(p, padded_n / 2, n, values, out);
  }
};

#endif  // PAGEDSERVE_AMX

#ifdef PAGEDSERVE_AVX512_BF16
// A bfloat16 unit: one (sequence, KV head), as decode_unit.
using Bf16UnitFn = decltype(&Avx512Bf16Unit::fn<64, 1>);

// The bfloat16 unit for this shape (AMX where it has tiles, else AVX-512 BF16), or nullptr
// where decode_unit_avx2 serves. tiles: whether it is the AMX one.
Bf16UnitFn bf16_unit(at::ScalarType cache_dtype, at::ScalarType dtype, int64_t page, int64_t d,
                     int64_t g, bool& tiles) {
  tiles = false;
  if (dtype != at::kBFloat16 || cache_dtype != dtype) return nullptr;
#ifdef PAGEDSERVE_AMX
  if (page == 16 && amx_available()) {
    if (const Bf16UnitFn fn = unit_for<AmxUnit>(d, g)) {
      tiles = true;
      return fn;
    }
  }
#endif
  return unit_for<Avx512Bf16Unit>(d, g);
}
#endif

}  // namespace

// Decode attention straight from the pages: one query token per sequence, no gathered copy.
// q [B, Hq, D] (row-strided allowed); caches [pages, page_size, Hk, D] of q's dtype, 16-bit
// under float32 q, or int8 [pages, page_size, Hk, D + 4] (dispatch_kv); block_tables int64
// [B, max_pages]; context_lens int64 [B]. Returns [B, Hq, D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache,
                                     const at::Tensor& block_tables,
                                     const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "decode attention: dense q heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous());
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "decode attention: cache dtypes");
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t page = k_cache.size(1), hk = k_cache.size(2), g = hq / hk;
  TORCH_CHECK(d <= 256, "decode attention: head size above 256");
  TORCH_CHECK(cache_head_dim(k_cache) == d && v_cache.sizes() == k_cache.sizes(),
              "decode attention: caches of q's head size");
  const int64_t width = block_tables.size(1);
  auto out = q.new_empty({b, hq, d});
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  dispatch_kv(q.scalar_type(), k_cache.scalar_type(), "decode_attn", [&](auto tag, auto cache_tag) {
    using scalar_t = decltype(tag);
    using cache_t = decltype(cache_tag);
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const cache_t* kc = k_cache.data_ptr<cache_t>();
    const cache_t* vc = v_cache.data_ptr<cache_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t qs = q.stride(0);
    const auto unit_fn = d == 64    ? decode_unit<scalar_t, cache_t, 64>
                         : d == 128 ? decode_unit<scalar_t, cache_t, 128>
                                    : decode_unit<scalar_t, cache_t, 0>;
#ifdef PAGEDSERVE_AVX512
    using Int8Fn = decltype(&Avx512Int8Unit<scalar_t>::template fn<64, 1>);
    Int8Fn int8_fn = nullptr;
    if constexpr (std::is_same_v<cache_t, int8_t> && !std::is_same_v<scalar_t, at::Half>) {
      int8_fn = unit_for<Avx512Int8Unit<scalar_t>>(d, g);
    }
#endif
#ifdef PAGEDSERVE_AVX512_BF16
    bool tiles = false;
    const auto bf16_fn =
        bf16_unit(k_cache.scalar_type(), q.scalar_type(), page, d, g, tiles);
#endif
    // Units (sequence, KV head) go longest context first to whichever thread is free: contexts
    // differ a lot (20-900 tokens in the serving benchmark), and an even split of the units
    // made one thread wait for the other ~10% of the kernel's time. A thread takes a whole
    // sequence at a time when there are enough: its heads share the pages' cache lines.
    const int64_t claim = b >= 4 * at::get_num_threads() ? hk : 1;
    const std::vector<int64_t> order = longest_first(lens, b, hk);
    Claims claims(b * hk, claim);
    at::parallel_for(0, claims.threads(), 1, [&](int64_t, int64_t) {
      std::vector<float> qf, acc, scores;
      std::vector<int64_t> offsets;
#ifdef PAGEDSERVE_AMX
      if (tiles) _tile_loadconfig(&tile_config());
#endif
      for (int64_t begin, end; claims.next(begin, end);) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t seq = order[i] / hk, h = order[i] % hk;
          const scalar_t* qu = qp + seq * qs + h * g * d;
          scalar_t* ou = op + (seq * hq + h * g) * d;
#ifdef PAGEDSERVE_AVX512_BF16
          if constexpr (std::is_same_v<scalar_t, at::BFloat16> &&
                        std::is_same_v<cache_t, at::BFloat16>) {
            if (bf16_fn != nullptr) {
              bf16_fn(qu, kc, vc, ou, tables + seq * width, lens[seq], page, hk, h,
                      static_cast<float>(scale), scores, offsets);
              continue;
            }
          }
#endif
#ifdef PAGEDSERVE_AVX512
          if constexpr (std::is_same_v<cache_t, int8_t>) {
            if (int8_fn != nullptr) {
              int8_fn(qu, kc, vc, ou, tables + seq * width, lens[seq], page, hk, h,
                      static_cast<float>(scale), scores, offsets);
              continue;
            }
          }
#endif
#ifdef PAGEDSERVE_AVX2
          if (d % 32 == 0) {
            decode_unit_avx2(qu, kc, vc, ou, tables + seq * width, lens[seq], page, hk, h, g, d,
                             static_cast<float>(scale), qf, scores, offsets);
            continue;
          }
#endif
          unit_fn(qu, kc, vc, ou, tables + seq * width, lens[seq], page, hk, h, g, d,
                  static_cast<float>(scale), qf, acc, scores);
        }
      }
#ifdef PAGEDSERVE_AMX
      if (tiles) _tile_release();
#endif
    });
  });
  return out;
}
