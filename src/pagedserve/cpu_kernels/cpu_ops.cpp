// Fused CPU kernels for the hot path of a step: each reads its inputs once and writes once,
// where the eager torch versions make several passes with casts between them. Math is in
// float32 and results are rounded once to the tensor's dtype (convert.h). Parallel loops use
// torch's own thread pool (at::parallel_for), so they share its threads. Built with -O3
// -ffast-math and each level's -m flags (isa.py): the portable loops below are written so that
// the compiler vectorizes them at every level (exp from glibc's vector math library); fast-math
// allows that, so no code here relies on infinities or NaN. The AMX decode unit is the amx
// level's alone.
#include <torch/extension.h>

#include "amx.h"
#include "claims.h"
#include "convert.h"
#include "prefill_attention.h"
#include "quant_linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <tuple>
#include <vector>

namespace {

// Rows of at least this many elements of work are split across threads.
constexpr int64_t kGrain = 16;
// Tokens per thread at least in write_kv_ (a decode step's few rows stay on one thread).
constexpr int64_t kWriteGrain = 128;

// The largest of x[0, n) as float32.
template <typename T>
inline float max_of(const T* x, int64_t n) {
  float mx = std::numeric_limits<float>::lowest();
  // Written as a select: the vectoriser left a std::max reduction scalar (one vmaxss after
  // another, most of exp_sum_'s time at context 200).
#pragma omp simd reduction(max : mx)
  for (int64_t t = 0; t < n; ++t) mx = to_f(x[t]) > mx ? to_f(x[t]) : mx;
  return mx;
}

// In place: s = exp(s - max(s)); returns the sum (softmax's denominator).
inline float exp_sum_(float* s, int64_t n) {
  const float mx = max_of(s, n);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  return sum;
}

// In place: s = softmax(s).
inline void softmax_(float* s, int64_t n) {
  const float inv = 1.f / exp_sum_(s, n);
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) s[t] *= inv;
}

template <typename T>
inline float dot(const T* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += to_f(a[i]) * b[i];
  return acc;
}

template <typename T>
void rms_norm_rows(T* out, const T* in, const T* w, int64_t rows, int64_t h,
                   int64_t in_stride, int64_t out_stride, float eps) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x = in + r * in_stride;
      T* y = out + r * out_stride;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < h; ++i) {
        float v = to_f(x[i]);
        ss += v * v;
      }
      float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) y[i] = from_f<T>(to_f(x[i]) * inv * to_f(w[i]));
    }
  });
}

}  // namespace

// out = rms_norm(x) * weight; x [T, H] with dense rows, weight [H] of x's dtype.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [T, H] with dense rows");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous());
  auto out = torch::empty(x.sizes(), x.options());
  dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                            weight.data_ptr<scalar_t>(), x.size(0), x.size(1), x.stride(0),
                            out.stride(0), static_cast<float>(eps));
  });
  return out;
}

// In place: residual += x (rounded to the dtype, as `x + residual` would be), then
// x = rms_norm(residual) * weight. Both [T, H], contiguous.
void add_rms_norm_(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight,
                   double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous());
  const int64_t rows = x.size(0), h = x.size(1);
  dispatch(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* xr = xp + r * h;
        scalar_t* rr = rp + r * h;
#pragma omp simd
        for (int64_t i = 0; i < h; ++i)
          rr[i] = from_f<scalar_t>(to_f(xr[i]) + to_f(rr[i]));
      }
    });
    rms_norm_rows<scalar_t>(xp, rp, weight.data_ptr<scalar_t>(), rows, h, h, h,
                            static_cast<float>(eps));
  });
}

// In place rotary embedding in the Hugging Face layout (first and second halves rotated).
// q [T, Hq, D] and k [T, Hk, D] may be row-strided views (the split of a fused qkv output);
// cos, sin float32 [max_positions, D / 2]; positions int64 [T].
void rotary_(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& positions,
             const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "rotary: q heads must be dense");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2), "rotary: k heads must be dense");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && cos.is_contiguous() && sin.is_contiguous());
  const int64_t t = q.size(0), hq = q.size(1), hk = k.size(1), d = q.size(2), half = d / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  dispatch(q.scalar_type(), "rotary", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const int64_t qs = q.stride(0), ks = k.stride(0);
    at::parallel_for(0, t, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const float* c = cos.data_ptr<float>() + pos[i] * half;
        const float* s = sin.data_ptr<float>() + pos[i] * half;
        for (int64_t head = 0; head < hq + hk; ++head) {
          scalar_t* x = head < hq ? qp + i * qs + head * d : kp + i * ks + (head - hq) * d;
#pragma omp simd
          for (int64_t j = 0; j < half; ++j) {
            float x1 = to_f(x[j]), x2 = to_f(x[j + half]);
            x[j] = from_f<scalar_t>(x1 * c[j] - x2 * s[j]);
            x[j + half] = from_f<scalar_t>(x2 * c[j] + x1 * s[j]);
          }
        }
      }
    });
  });
}

// silu(gate) * up of x = [gate | up], [T, 2I] -> [T, I].
torch::Tensor silu_and_mul(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0);
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  auto out = torch::empty({rows, inter}, x.options());
  dispatch(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = xp + r * 2 * inter;
        const scalar_t* u = g + inter;
        scalar_t* y = op + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; ++i) {
          float gv = to_f(g[i]);
          // Rounded after silu, as F.silu(gate) * up rounds each product.
          scalar_t silu = from_f<scalar_t>(gv / (1.f + std::exp(-gv)));
          y[i] = from_f<scalar_t>(to_f(silu) * to_f(u[i]));
        }
      }
    });
  });
  return out;
}

// Index of the first maximum of each row of x [B, V] (dense rows): greedy sampling's choice,
// as torch.argmax makes it, without the float32 copy of the logits that torch's max over a
// dimension needs for speed (together ~1.2 ms a step at batch 32 of the default model).
torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0, "argmax_rows: x [B, V]");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(torch::kLong));
  int64_t* idx = out.data_ptr<int64_t>();
  dispatch(x.scalar_type(), "argmax_rows", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      constexpr int64_t kBlock = 256;
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = xp + r * x.stride(0);
        const float mx = max_of(row, n);
        // The first block that holds the maximum, then its first position there.
        int64_t at = 0;
        for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
          const int64_t b1 = std::min(n, b0 + kBlock);
          int hit = 0;
#pragma omp simd reduction(| : hit)
          for (int64_t i = b0; i < b1; ++i) hit |= to_f(row[i]) == mx;
          if (hit) {
            at = b0;
            while (to_f(row[at]) != mx) ++at;
            break;
          }
        }
        idx[r] = at;
      }
    });
  });
  return out;
}

// Copy each new token's k/v rows (row-strided views allowed) to its slot of the paged caches
// [pages, page_size, Hk, D]; slot_mapping int64 [T] (flat page * page_size + offset, or -1 for
// a token to skip).
void write_kv_(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache,
               torch::Tensor& v_cache, const torch::Tensor& slot_mapping) {
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 &&
              v.stride(1) == v.size(2), "write_kv: heads must be dense");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type());
  const int64_t t = k.size(0), row = k.size(1) * k.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t elem = k.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t ks = k.stride(0) * elem, vs = v.stride(0) * elem, bytes = row * elem;
  // In parallel for prefill chunks: a 2048-token step wrote ~1.5 MB a layer on one thread,
  // often to pages touched for the first time (faulted in as they are written).
  at::parallel_for(0, t, kWriteGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (slots[i] < 0) continue;  // a padding token
      std::copy_n(kp + i * ks, bytes, kc + slots[i] * bytes);
      std::copy_n(vp + i * vs, bytes, vc + slots[i] * bytes);
    }
  });
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
// served by one pass over its keys and one over its values. D is the head size when known at
// compile time (fully unrolled loops), 0 for any other size.
template <typename T, int64_t D>
void decode_unit(const T* q, const T* kc, const T* vc, T* out, const int64_t* pages, int64_t n,
                 int64_t page, int64_t hk, int64_t h, int64_t g, int64_t d_runtime, float scale,
                 std::vector<float>& qf, std::vector<float>& acc, std::vector<float>& scores) {
  const int64_t d = D ? D : d_runtime;
  qf.resize(g * d);
  acc.assign(g * d, 0.f);
  scores.resize(g * n);
  for (int64_t j = 0; j < g * d; ++j) qf[j] = to_f(q[j]) * scale;
  // Scores, then the weighted sum of values: one walk over the head's pages each.
  for_each_row<T, D>(kc, pages, n, page, hk, h, d, [&](int64_t t, const float* row) {
    for (int64_t j = 0; j < g; ++j) {
      const float* qj = qf.data() + j * d;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < d; ++i) dot += row[i] * qj[i];
      scores[j * n + t] = dot;
    }
  });
  for (int64_t j = 0; j < g; ++j) softmax_(scores.data() + j * n, n);
  for_each_row<T, D>(vc, pages, n, page, hk, h, d, [&](int64_t t, const float* row) {
    for (int64_t j = 0; j < g; ++j) {
      const float p = scores[j * n + t];
      float* a = acc.data() + j * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) a[i] += p * row[i];
    }
  });
  for (int64_t j = 0; j < g * d; ++j) out[j] = from_f<T>(acc[j]);
}

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
AmxUnitFn amx_unit(at::ScalarType dtype, int64_t page, int64_t d, int64_t g) {
  if (dtype != at::kBFloat16 || page != 16 || !amx_available()) return nullptr;
  return d == 64 ? amx_unit_for<64>(g) : d == 128 ? amx_unit_for<128>(g) : nullptr;
}
#endif

// Decode attention straight from the pages: one query token per sequence, no gathered copy.
// q [B, Hq, D] (row-strided allowed); caches [pages, page_size, Hk, D]; block_tables int64
// [B, max_pages]; context_lens int64 [B]. Returns [B, Hq, D].
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "decode attention: dense q heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous());
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t page = k_cache.size(1), hk = k_cache.size(2), g = hq / hk;
  TORCH_CHECK(d <= 256, "decode attention: head size above 256");
  const int64_t width = block_tables.size(1);
  auto out = torch::empty({b, hq, d}, q.options());
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  dispatch(q.scalar_type(), "decode_attn", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kc = k_cache.data_ptr<scalar_t>();
    const scalar_t* vc = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t qs = q.stride(0);
    const auto unit_fn = d == 64    ? decode_unit<scalar_t, 64>
                         : d == 128 ? decode_unit<scalar_t, 128>
                                    : decode_unit<scalar_t, 0>;
#ifdef PAGEDSERVE_AMX
    const AmxUnitFn amx_fn = amx_unit(q.scalar_type(), page, d, g);
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
#ifdef PAGEDSERVE_AMX
      if (amx_fn != nullptr) _tile_loadconfig(&tile_config());
#endif
      for (int64_t begin, end; claims.next(begin, end);) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t seq = order[i] / hk, h = order[i] % hk;
          const scalar_t* qu = qp + seq * qs + h * g * d;
          scalar_t* ou = op + (seq * hq + h * g) * d;
#ifdef PAGEDSERVE_AMX
          if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
            if (amx_fn != nullptr) {
              amx_fn(qu, kc, vc, ou, tables + seq * width, lens[seq], hk, h,
                     static_cast<float>(scale), scores);
              continue;
            }
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

// A packed linear as Python passes it: codes, scales, offsets, bias, bits (see quant_linear).
using PackedLinear = std::tuple<torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>,
                                c10::optional<torch::Tensor>, int64_t>;

torch::Tensor packed_linear(const torch::Tensor& x, const PackedLinear& w) {
  const auto& [codes, scales, offsets, bias, bits] = w;
  return quant_linear(x, codes, scales, offsets, bias, bits);
}

// One decoder layer of a decode step (one new token per sequence) on packed weights: the
// steps of models/llama.py's DecoderLayer with the fused attention backend, in one call. At
// batch 1 the Python version spent about as long in the interpreter as in these kernels.
// x: the previous layer's output [B, H]; residual: the residual stream, or None before the
// first layer. Returns (this layer's output, the residual stream before it).
std::tuple<torch::Tensor, torch::Tensor> decode_layer(
    torch::Tensor x, c10::optional<torch::Tensor> residual, const torch::Tensor& input_norm,
    const torch::Tensor& post_norm, double eps, const PackedLinear& qkv_proj,
    const PackedLinear& o_proj, const PackedLinear& gate_up_proj, const PackedLinear& down_proj,
    int64_t num_heads, int64_t num_kv_heads, double scale, const torch::Tensor& positions,
    const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor k_cache,
    torch::Tensor v_cache, const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
    const torch::Tensor& context_lens) {
  torch::Tensor res;
  if (residual.has_value()) {
    res = *residual;
    add_rms_norm_(x, res, input_norm, eps);
  } else {
    res = x;
    x = rms_norm(x, input_norm, eps);
  }
  const int64_t b = x.size(0), d = k_cache.size(3);
  const int64_t q_size = num_heads * d, kv_size = num_kv_heads * d;
  auto qkv = packed_linear(x, qkv_proj);
  auto q = qkv.narrow(1, 0, q_size).view({b, num_heads, d});
  auto k = qkv.narrow(1, q_size, kv_size).view({b, num_kv_heads, d});
  auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({b, num_kv_heads, d});
  rotary_(q, k, positions, cos, sin);
  write_kv_(k, v, k_cache, v_cache, slot_mapping);
  auto attn = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale);
  auto o = packed_linear(attn.view({b, q_size}), o_proj);
  add_rms_norm_(o, res, post_norm, eps);
  auto out = packed_linear(silu_and_mul(packed_linear(o, gate_up_proj)), down_proj);
  return {out, res};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL: the server's event loop thread (streaming the previous step's tokens)
  // runs while a step computes, instead of waiting for the whole forward.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, nogil);
  m.def("add_rms_norm_", &add_rms_norm_, nogil);
  m.def("rotary_", &rotary_, nogil);
  m.def("silu_and_mul", &silu_and_mul, nogil);
  m.def("argmax_rows", &argmax_rows, nogil);
  m.def("write_kv_", &write_kv_, nogil);
  m.def("paged_decode_attention", &paged_decode_attention, nogil);
  m.def("prefill_attention_supported", &prefill_attention_supported, nogil);
  m.def("prefill_attention_", &prefill_attention_, nogil);
  m.def("decode_layer", &decode_layer, nogil);
  m.def("amx_available", &amx_available, nogil);
  m.def("kernel_level", [] { return std::string(kernel_level_name()); });
  m.def("quant_linear", &quant_linear, nogil);
  m.def("quant_rows", &quant_rows, nogil);
}
