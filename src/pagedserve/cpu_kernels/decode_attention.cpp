// Paged decode attention: one query token per sequence, read straight from the KV pages
// (portable loops the compiler vectorizes; AVX2 intrinsics from the avx2 level on, an AMX unit
// at the amx level). Math in float32.
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
// Hk, D], in order, with token t's row of head h converted to float32 (D: as decode_unit).
template <typename T, int64_t D, typename Fn>
inline void for_each_row(const T* cache, const int64_t* pages, int64_t n, int64_t page,
                         int64_t hk, int64_t h, int64_t d_runtime, Fn&& fn) {
  const int64_t d = D ? D : d_runtime;
  float row[D ? D : 256];
  for (int64_t first = 0; first < n; first += page) {
    const int64_t count = std::min(page, n - first);
    const T* r = cache + (pages[first / page] * page * hk + h) * d;
    for (int64_t o = 0; o < count; ++o, r += hk * d) {
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) row[i] = to_f(r[i]);
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
// multiple of 32. The portable loops reduced every (token, head) dot product across lanes on its own and
// copied each row before use: 16 GFLOP/s at batch 32 (a fifth of a decode step at avx2).
// Here scores are summed over 4 tokens x up to 3 heads at once (12 accumulators; the query
// rows read from L1) and reduced across lanes 8 tokens at a time; the weighted sum of values
// keeps 3 heads x 32 dims in registers over all tokens.

// The lane sums of v[0..7], in order.
inline __m256 lane_sums(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 ce = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, ce, 0x20), _mm256_permute2f128_ps(ab, ce, 0x31));
}

constexpr int64_t kUnitHeads = 3;  // query heads a pass

// Rows sit in pages anywhere in the pool, beyond the hardware prefetcher's reach: a row
// kPrefetchRows tokens ahead is fetched while this one is used.
constexpr int64_t kPrefetchRows = 16;
template <typename T>
inline void prefetch_row(const T* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t line = 0; line < d * static_cast<int64_t>(sizeof(T)); line += 64) {
    _mm_prefetch(p + line, _MM_HINT_T0);
  }
}

// Scores of tokens [0, n) for query heads [0, G) (qf: their scaled float32 rows) into
// scores[j * stride + t]; row(t): token t's key row.
template <int64_t G, typename Row>
inline void unit_scores(const float* qf, int64_t d, int64_t n, const Row& row, float* scores,
                        int64_t stride) {
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    for (int64_t t = t0 + kPrefetchRows; t < std::min(n, t0 + kPrefetchRows + 8); ++t) {
      prefetch_row(row(t), d);
    }
    __m256 part[G][8];
    for (int64_t u0 = 0; u0 < 8; u0 += 4) {
      const auto* r0 = row(std::min(t0 + u0, n - 1));
      const auto* r1 = row(std::min(t0 + u0 + 1, n - 1));
      const auto* r2 = row(std::min(t0 + u0 + 2, n - 1));
      const auto* r3 = row(std::min(t0 + u0 + 3, n - 1));
      __m256 a[G][4];
      for (int64_t j = 0; j < G; ++j) {
        for (int u = 0; u < 4; ++u) a[j][u] = _mm256_setzero_ps();
      }
      for (int64_t c = 0; c < d; c += 8) {
        const __m256 k[4] = {load8_f32(r0 + c), load8_f32(r1 + c), load8_f32(r2 + c), load8_f32(r3 + c)};
        for (int64_t j = 0; j < G; ++j) {
          const __m256 qj = _mm256_loadu_ps(qf + j * d + c);
          for (int u = 0; u < 4; ++u) a[j][u] = _mm256_fmadd_ps(k[u], qj, a[j][u]);
        }
      }
      for (int64_t j = 0; j < G; ++j) {
        for (int u = 0; u < 4; ++u) part[j][u0 + u] = a[j][u];
      }
    }
    // Tokens past n repeat the last one: their scores land in the padding.
    for (int64_t j = 0; j < G; ++j) _mm256_storeu_ps(scores + j * stride + t0, lane_sums(part[j]));
  }
}

// out[j * d + c] for query heads [0, G), dims [c0, c0 + 32): sum over tokens of p * value.
template <int64_t G, typename T, typename Row>
inline void unit_values(const float* probs, int64_t stride, int64_t n, const Row& row,
                        int64_t c0, int64_t d, T* out) {
  __m256 acc[G][4];
  for (int64_t j = 0; j < G; ++j) {
    for (int i = 0; i < 4; ++i) acc[j][i] = _mm256_setzero_ps();
  }
  for (int64_t t = 0; t < n; ++t) {
    if (t + kPrefetchRows < n) prefetch_row(row(t + kPrefetchRows) + c0, 32);
    const auto* r = row(t) + c0;
    const __m256 v[4] = {load8_f32(r), load8_f32(r + 8), load8_f32(r + 16), load8_f32(r + 24)};
    for (int64_t j = 0; j < G; ++j) {
      const __m256 p = _mm256_broadcast_ss(probs + j * stride + t);
      for (int i = 0; i < 4; ++i) acc[j][i] = _mm256_fmadd_ps(p, v[i], acc[j][i]);
    }
  }
  alignas(32) float sums[32];
  for (int64_t j = 0; j < G; ++j) {
    for (int i = 0; i < 4; ++i) _mm256_store_ps(sums + 8 * i, acc[j][i]);
    for (int i = 0; i < 32; ++i) out[j * d + c0 + i] = from_f<T>(sums[i]);
  }
}

template <int64_t G, typename T, typename Keys, typename Values>
inline void unit_heads(const float* qf, int64_t d, int64_t n, const Keys& keys,
                       const Values& values, float* scores, int64_t stride, T* out) {
  unit_scores<G>(qf, d, n, keys, scores, stride);
  for (int64_t j = 0; j < G; ++j) softmax_(scores + j * stride, n);
  for (int64_t c0 = 0; c0 < d; c0 += 32) unit_values<G>(scores, stride, n, values, c0, d, out);
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
  // Each token's row offset, once (a division by the page size a row read took most of the
  // time).
  offsets.resize(n);
  for (int64_t first = 0; first < n; first += page) {
    const int64_t base = (pages[first / page] * page * hk + h) * d;
    for (int64_t o = 0; o < std::min(page, n - first); ++o) offsets[first + o] = base + o * hk * d;
  }
  const int64_t* at = offsets.data();
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

#ifdef PAGEDSERVE_AMX
// decode_unit for bfloat16 16-token pages with AMX, head size D (64 or 128), G query heads per
// KV head. Scores: S^T = K Q^T on AMX, a page of keys per tile loaded straight from the cache
// (rows past n of a last page are computed, not kept), the query tiles held in registers. The
// weighted sum of values: vdpbf16ps over token pairs (two value rows interleaved by unpack, so
// lanes hold dims in a fixed permutation undone at the end; probabilities rounded to bfloat16
// as in flash attention), sums in registers. Against decode_unit, 7-10% faster at batch 32
// and ~30% at batch 1, context 880. The caller loads the tile configuration.
template <int64_t D, int64_t G>
void decode_unit_amx(const at::BFloat16* q, const at::BFloat16* kc, const at::BFloat16* vc,
                     at::BFloat16* out, const int64_t* pages, int64_t n, int64_t hk, int64_t h,
                     float scale, std::vector<float>& scores) {
  constexpr int64_t kSteps = D / 32;  // 32 bf16: one tile row of K, one zmm of V
  const int64_t stride = hk * D;  // elements from one token to the next in a page
  // This head's row of token `first` (a multiple of 16) of the page holding it.
  const auto page_rows = [&](const at::BFloat16* cache, int64_t first) {
    return cache + (pages[first / 16] * 16 * hk + h) * D;
  };
  const int64_t padded_n = (n + 31) / 32 * 32;  // the pair packing below reads whole vectors
  scores.resize(G * padded_n);
  // Scores.
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
  // Pages sit anywhere in the pool, beyond the hardware prefetcher's reach: fetch a later
  // page's rows of this head while the current one is multiplied (keys two pages ahead, as
  // pages go through the tiles in pairs; values one page ahead).
  const auto prefetch_page = [&](const at::BFloat16* cache, int64_t first) {
    if (first >= n) return;
    const char* row = reinterpret_cast<const char*>(page_rows(cache, first));
    for (int64_t r = 0; r < 16; ++r, row += stride * 2) {
      for (int64_t line = 0; line < D * 2; line += 64) _mm_prefetch(row + line, _MM_HINT_T0);
    }
  };
  // Each page's 16 x 16 block (token rows, query-head columns) goes straight to memory, and
  // pages alternate between two sum/key tile pairs, so that the tile unit never waits for the
  // previous page's results to be read.
  thread_local std::vector<float> blocks;
  blocks.resize(padded_n * 16);
  // (A macro: the tile intrinsics take tile numbers as literals.)
#define PAGEDSERVE_PAGE_SCORES(first, sum, key)                   \
  do {                                                            \
    const at::BFloat16* k = page_rows(kc, first);                 \
    prefetch_page(kc, (first) + 32);                              \
    _tile_zero(sum);                                              \
    _tile_loadd(key, k, stride * 2);                              \
    _tile_dpbf16ps(sum, key, 2);                                  \
    _tile_loadd(key, k + 32, stride * 2);                         \
    _tile_dpbf16ps(sum, key, 3);                                  \
    if constexpr (kSteps == 4) {                                  \
      _tile_loadd(key, k + 64, stride * 2);                       \
      _tile_dpbf16ps(sum, key, 4);                                \
      _tile_loadd(key, k + 96, stride * 2);                       \
      _tile_dpbf16ps(sum, key, 5);                                \
    }                                                             \
    _tile_stored(sum, blocks.data() + (first) * 16, 64);          \
  } while (0)
  prefetch_page(kc, 16);
  for (int64_t first = 0; first < n; first += 32) {
    PAGEDSERVE_PAGE_SCORES(first, 0, 1);
    if (first + 16 < n) PAGEDSERVE_PAGE_SCORES(first + 16, 6, 7);
  }
#undef PAGEDSERVE_PAGE_SCORES
  // Column j of the blocks is query head j's scores.
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                               5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < G; ++j) {
    for (int64_t t = 0; t < n; t += 16) {
      const __m512 v = _mm512_i32gather_ps(column, blocks.data() + t * 16 + j, 4);
      _mm512_storeu_ps(scores.data() + j * padded_n + t, _mm512_mul_ps(v, scale_v));
    }
  }
  // Probabilities as bfloat16 pairs (t, t+1), zeros after the last token: one conversion
  // turns 32 probabilities into 16 pairs in order.
  const int64_t pairs = padded_n / 2;  // per head
  thread_local std::vector<uint32_t> p;  // reused: one unit after another on this thread
  p.resize(G * pairs);
  for (int64_t j = 0; j < G; ++j) {
    float* sj = scores.data() + j * padded_n;
    const __m512 scale_by = _mm512_set1_ps(1.f / exp_sum_(sj, n));
    for (int64_t t = n; t < padded_n; ++t) sj[t] = 0.f;
    for (int64_t t = 0; t < padded_n; t += 32) {
      const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(sj + t), scale_by);
      const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(sj + t + 16), scale_by);
      _mm512_storeu_si512(p.data() + j * pairs + t / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
  // Values.
  __m512 acc[G][2 * kSteps];
  for (int64_t j = 0; j < G; ++j) {
    for (int64_t i = 0; i < 2 * kSteps; ++i) acc[j][i] = _mm512_setzero_ps();
  }
  prefetch_page(vc, 0);
  for (int64_t t = 0; t < n; t += 2) {
    if (t % 16 == 0) prefetch_page(vc, t + 16);
    const at::BFloat16* a = page_rows(vc, t - t % 16) + (t % 16) * stride;
    const at::BFloat16* b = t + 1 < n ? a + stride : a;  // an odd last token pairs with p = 0
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

using AmxUnitFn = void (*)(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*,
                           at::BFloat16*, const int64_t*, int64_t, int64_t, int64_t, float,
                           std::vector<float>&);

template <int64_t D>
AmxUnitFn amx_unit_for(int64_t g) {
  switch (g) {
    case 1: return decode_unit_amx<D, 1>;
    case 2: return decode_unit_amx<D, 2>;
    case 3: return decode_unit_amx<D, 3>;
    case 4: return decode_unit_amx<D, 4>;
    case 6: return decode_unit_amx<D, 6>;
    case 8: return decode_unit_amx<D, 8>;
    default: return nullptr;
  }
}

// The AMX unit for this shape, or nullptr where decode_unit serves.
AmxUnitFn amx_unit(at::ScalarType cache_dtype, at::ScalarType dtype, int64_t page, int64_t d,
                   int64_t g) {
  if (dtype != at::kBFloat16 || cache_dtype != dtype || page != 16 || !amx_available()) {
    return nullptr;
  }
  return d == 64 ? amx_unit_for<64>(g) : d == 128 ? amx_unit_for<128>(g) : nullptr;
}
#endif

}  // namespace

// Decode attention straight from the pages: one query token per sequence, no gathered copy.
// q [B, Hq, D] (row-strided allowed); caches [pages, page_size, Hk, D] of q's dtype, or 16-bit
// under float32 q (dispatch_kv); block_tables int64
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
  const int64_t width = block_tables.size(1);
  auto out = at::empty({b, hq, d}, q.options());
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
#ifdef PAGEDSERVE_AMX
    const AmxUnitFn amx_fn = amx_unit(k_cache.scalar_type(), q.scalar_type(), page, d, g);
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
      if (amx_fn != nullptr) _tile_loadconfig(&tile_config());
#endif
      for (int64_t begin, end; claims.next(begin, end);) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t seq = order[i] / hk, h = order[i] % hk;
          const scalar_t* qu = qp + seq * qs + h * g * d;
          scalar_t* ou = op + (seq * hq + h * g) * d;
#ifdef PAGEDSERVE_AMX
          if constexpr (std::is_same_v<scalar_t, at::BFloat16> &&
                        std::is_same_v<cache_t, at::BFloat16>) {
            if (amx_fn != nullptr) {
              amx_fn(qu, kc, vc, ou, tables + seq * width, lens[seq], hk, h,
                     static_cast<float>(scale), scores);
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
      if (amx_fn != nullptr) _tile_release();
#endif
    });
  });
  return out;
}
