// Causal attention of prefill chunks over their KV pages (cached context and the chunk's own
// rows), every chunk of a step in one call. A unit is one chunk and KV head, handed out
// longest context first to whichever thread is free; where the CPU multiplies bfloat16
// natively (amx, and avx512 with AVX-512 BF16), bf16 units of head size 64 or 128 over bf16 or
// int8 pages go to the bfloat16 unit (prefill_attention_bf16.cpp: AMX tiles or vdpbf16ps),
// every other unit to the portable unit below, which the compiler vectorizes at each level.
//
// The portable unit converts the unit's keys once to float32 in blocks of 16 keys transposed
// ([block][dim][16]) and its values to float32 rows, both shared by the KV head's query heads.
// Then for each query head and block of kRows queries: scores as register-blocked outer
// products (kRows queries x 16 keys, one dim at a time, in vec.h's vectors), a softmax per query in float32 over
// the keys it sees, and P V in blocks of kRows queries x 16 dims.
#include "prefill_attention.h"

#include <algorithm>
#include <cmath>

#include "claims.h"
#include "convert.h"
#include "softmax.h"
#include "vec.h"

namespace {

constexpr int64_t kKeys = 16;  // keys per score block; dims per value block
constexpr int64_t kRows = 4;   // queries per block: 2 x kRows accumulators of 8 lanes on AVX2

constexpr int64_t kVecs = kKeys / kLanes;  // vectors a block row

struct Scratch {
  std::vector<float> keys;    // [key block][dim][16], zeros past the last key
  std::vector<float> values;  // [key][dim]
  std::vector<float> scores;  // [kRows][ld]
};

// Scores of queries qf[kRows][d] (scaled) against key blocks [0, blocks) into scores rows.
inline void block_scores(const float* qf, int64_t d, const float* keys, int64_t blocks,
                         float* scores, int64_t ld) {
  for (int64_t kb = 0; kb < blocks; ++kb) {
    VecF acc[kRows][kVecs] = {};
    const float* kt = keys + kb * d * kKeys;
    for (int64_t dim = 0; dim < d; ++dim) {
      VecF kv[kVecs];
      for (int64_t c = 0; c < kVecs; ++c) kv[c] = load_vec(kt + dim * kKeys + c * kLanes);
      for (int64_t i = 0; i < kRows; ++i) {
        for (int64_t c = 0; c < kVecs; ++c) acc[i][c] += qf[i * d + dim] * kv[c];
      }
    }
    for (int64_t i = 0; i < kRows; ++i) {
      for (int64_t c = 0; c < kVecs; ++c) {
        store_vec(scores + i * ld + kb * kKeys + c * kLanes, acc[i][c]);
      }
    }
  }
}

// In place over s[0, padded): exp(s - max) for keys [0, seen), 0 after; returns 1 / sum.
inline float softmax_row(float* s, int64_t seen, int64_t padded) {
  const float inv = 1.f / exp_sum_(s, seen);
  std::fill(s + seen, s + padded, 0.f);
  return inv;
}

template <typename T, typename C>
void unit_portable(const PrefillUnit<T, C>& u, Scratch& s) {
  const int64_t d = u.d, n = u.n_keys, blocks = (n + kKeys - 1) / kKeys, ld = blocks * kKeys;
  s.keys.assign(blocks * d * kKeys, 0.f);
  s.values.resize(n * d);
  s.scores.resize(kRows * ld);
  for (int64_t t = 0; t < n; ++t) {
    const C* kr = u.k.at(t);
    const C* vr = u.v.at(t);
    const float k_scale = row_scale(kr, d), v_scale = row_scale(vr, d);
    float* kt = s.keys.data() + (t / kKeys) * d * kKeys + t % kKeys;
    float* vt = s.values.data() + t * d;
    for (int64_t dim = 0; dim < d; ++dim) kt[dim * kKeys] = to_f(kr[dim]) * k_scale;
#pragma omp simd
    for (int64_t dim = 0; dim < d; ++dim) vt[dim] = to_f(vr[dim]) * v_scale;
  }
  const int64_t past = n - u.q_len;
  std::vector<float> qf(kRows * d);
  float inv_sum[kRows];
  for (int64_t j = 0; j < u.g; ++j) {
    for (int64_t r0 = 0; r0 < u.q_len; r0 += kRows) {
      const int64_t rows = std::min(kRows, u.q_len - r0);
      std::fill(qf.begin(), qf.end(), 0.f);
      for (int64_t i = 0; i < rows; ++i) {
        const T* qr = u.q + (r0 + i) * u.q_stride + j * d;
        for (int64_t dim = 0; dim < d; ++dim) qf[i * d + dim] = to_f(qr[dim]) * u.scale;
      }
      const int64_t seen_last = past + r0 + rows;  // keys the block's last query sees
      const int64_t used = (seen_last + kKeys - 1) / kKeys;
      block_scores(qf.data(), d, s.keys.data(), used, s.scores.data(), ld);
      for (int64_t i = 0; i < kRows; ++i) {
        float* row = s.scores.data() + i * ld;
        inv_sum[i] = i < rows ? softmax_row(row, past + r0 + i + 1, seen_last) : 0.f;
        if (i >= rows) std::fill(row, row + seen_last, 0.f);
      }
      for (int64_t c0 = 0; c0 < d; c0 += kKeys) {
        VecF acc[kRows][kVecs] = {};
        for (int64_t t = 0; t < seen_last; ++t) {
          VecF vv[kVecs];
          for (int64_t c = 0; c < kVecs; ++c) vv[c] = load_vec(s.values.data() + t * d + c0 + c * kLanes);
          for (int64_t i = 0; i < kRows; ++i) {
            const float p = s.scores[i * ld + t];
            for (int64_t c = 0; c < kVecs; ++c) acc[i][c] += p * vv[c];
          }
        }
        for (int64_t i = 0; i < rows; ++i) {
          T* o = u.out + (r0 + i) * u.out_stride + j * d + c0;
          for (int64_t l = 0; l < kKeys; ++l) {
            o[l] = from_f<T>(acc[i][l / kLanes][l % kLanes] * inv_sum[i]);
          }
        }
      }
    }
  }
}

}  // namespace

bool prefill_attention_supported(const at::Tensor& q) {
  const auto dtype = q.scalar_type();
  return q.dim() == 3 && q.size(2) % kKeys == 0 &&
         (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf);
}

void prefill_attention_(const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, at::Tensor& out,
                        const std::vector<int64_t>& starts, const std::vector<int64_t>& lens,
                        const at::Tensor& context_lens, const at::Tensor& block_tables,
                        double scale) {
  TORCH_CHECK(prefill_attention_supported(q),
              "prefill attention: float32, bf16 or float16, head size a multiple of 16");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &out}) {
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == q.scalar_type() && t->size(0) == q.size(0) &&
                    t->size(1) == q.size(1) && t->size(2) == q.size(2) && t->stride(2) == 1 &&
                    t->stride(1) == t->size(2),
                "prefill attention: q and out [T, Hq, D] of one dtype with dense heads");
  }
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k_cache, &v_cache}) {
    TORCH_CHECK(t->dim() == 4 && t->is_contiguous() && t->scalar_type() == k_cache.scalar_type() &&
                    t->sizes() == k_cache.sizes() && cache_head_dim(*t) == q.size(2),
                "prefill attention: caches [pages, page_size, Hk, D] of one dtype");
  }
  const int64_t chunks = static_cast<int64_t>(starts.size());
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "prefill attention: head counts");
  TORCH_CHECK(static_cast<int64_t>(lens.size()) == chunks && context_lens.numel() == chunks &&
                  block_tables.dim() == 2 && block_tables.size(0) == chunks &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(),
              "prefill attention: one start, length, context and block table a chunk");
  const int64_t* contexts = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t page = k_cache.size(1), width = block_tables.size(1);
  for (int64_t c = 0; c < chunks; ++c) {
    TORCH_CHECK(starts[c] >= 0 && lens[c] >= 0 && starts[c] + lens[c] <= q.size(0) &&
                    lens[c] <= contexts[c] && contexts[c] <= width * page,
                "prefill attention: chunk ", c, " out of range");
  }
  const int64_t hq = q.size(1), hk = k_cache.size(2), g = hq / hk, d = q.size(2);
  const std::vector<int64_t> order = longest_first(contexts, chunks, hk);
#ifdef PAGEDSERVE_AVX512_BF16
  const bool bf16_unit = prefill_unit_bf16_supported(q);
#endif
  dispatch_kv(q.scalar_type(), k_cache.scalar_type(), "prefill_attention", [&](auto tag,
                                                                               auto cache_tag) {
    using scalar_t = decltype(tag);
    using cache_t = decltype(cache_tag);
    const auto* qp = q.data_ptr<scalar_t>();
    const auto* kc = k_cache.data_ptr<cache_t>();
    const auto* vc = v_cache.data_ptr<cache_t>();
    auto* op = out.data_ptr<scalar_t>();
    const int64_t len = d + kRowExtra<cache_t>;  // a cache row's elements
    parallel_claims(chunks * hk, 1, [&](int64_t i, int64_t) {  // a unit a claim
      thread_local Scratch scratch;
      const int64_t c = order[i] / hk, h = order[i] % hk, row = starts[c];
      const PrefillUnit<scalar_t, cache_t> u{
          qp + row * q.stride(0) + h * g * d,
          q.stride(0),
          {kc + h * len, tables + c * width, page, hk * len},
          {vc + h * len, tables + c * width, page, hk * len},
          op + row * out.stride(0) + h * g * d,
          out.stride(0),
          lens[c],
          contexts[c],
          g,
          d,
          static_cast<float>(scale)};
#ifdef PAGEDSERVE_AVX512_BF16
      if constexpr (std::is_same_v<scalar_t, at::BFloat16> &&
                    (std::is_same_v<cache_t, at::BFloat16> || std::is_same_v<cache_t, int8_t>)) {
        if (bf16_unit) {
          prefill_unit_bf16(u);
          return;
        }
      }
#endif
      unit_portable(u, scratch);
    });
  });
}
