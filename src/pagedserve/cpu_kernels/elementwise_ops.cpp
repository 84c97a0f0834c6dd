// Elementwise kernels of a step (norms, rotary, activation, KV writes, greedy argmax, grammar
// masks): each reads its inputs once and writes once, where the eager torch versions make
// several passes with casts between them. Math is in float32 and results are rounded once to
// the tensor's dtype (convert.h); portable loops the compiler vectorizes at every level.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "cpu_ops.h"
#include "softmax.h"

namespace {

// Rows of at least this many elements of work are split across threads.
constexpr int64_t kGrain = 16;
// Tokens per thread at least in write_kv_ (a decode step's few rows stay on one thread).
constexpr int64_t kWriteGrain = 128;

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
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [T, H] with dense rows");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous());
  auto out = x.new_empty(x.sizes());
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
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
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
void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions,
             const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "rotary: q heads must be dense");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2), "rotary: k heads must be dense");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous());
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
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0);
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  auto out = x.new_empty({rows, inter});
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
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0, "argmax_rows: x [B, V]");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = x.new_empty({rows}, at::kLong);
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

// -inf of T by its bits: the kernels are built with -ffast-math, under which an infinity
// that arithmetic makes is not guaranteed.
template <typename T>
T negative_infinity() {
  if constexpr (std::is_same_v<T, float>) {
    const uint32_t bits = 0xff800000u;
    float v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    return at::BFloat16(0xff80, at::BFloat16::from_bits());
  } else {
    return at::Half(0xfc00, at::Half::from_bits());
  }
}

// d[i] = s[i] where bit i of `word` is set, else `fill`, for i < m; as and/or over masks (the
// ternary form did not vectorize at the avx2 level, ~20x slower).
template <typename B>
inline void select_word(B* d, const B* s, uint32_t word, B fill, uint32_t m) {
#pragma omp simd
  for (uint32_t i = 0; i < m; ++i) {
    const uint32_t keep = 0u - ((word >> i) & 1u);
    d[i] = static_cast<B>((s[i] & keep) | (fill & ~keep));
  }
}

// One pass over the logits: rows without a mask copied, masked rows' forbidden tokens -inf.
// Grammar masks are mostly all-forbidden or all-allowed words, so whole words are decided at
// once and only mixed words look at each bit.
at::Tensor masked_logits(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& bits) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "masked_logits: x [B, V] with dense rows");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "masked_logits: rows int64 [R]");
  TORCH_CHECK(bits.dim() == 2 && bits.scalar_type() == at::kInt && bits.stride(1) == 1 &&
                  bits.size(0) == rows.size(0) && bits.size(1) * 32 >= x.size(1),
              "masked_logits: bits int32 [R, ceil(V / 32)]");
  const int64_t batch = x.size(0), n = x.size(1);
  std::vector<int64_t> mask_of(batch, -1);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t k = 0; k < rows.size(0); ++k) {
    TORCH_CHECK(rp[k] >= 0 && rp[k] < batch, "masked_logits: row out of range");
    mask_of[rp[k]] = k;
  }
  auto out = x.new_empty({batch, n});
  const auto* words = reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>());
  dispatch(x.scalar_type(), "masked_logits", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    using bits_t = std::conditional_t<sizeof(scalar_t) == 4, uint32_t, uint16_t>;
    const scalar_t ninf = negative_infinity<scalar_t>();
    bits_t ninf_bits;
    std::memcpy(&ninf_bits, &ninf, sizeof ninf_bits);
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* src = xp + r * x.stride(0);
        scalar_t* dst = op + r * n;
        if (mask_of[r] < 0) {
          std::memcpy(dst, src, n * sizeof(scalar_t));
          continue;
        }
        const uint32_t* w = words + mask_of[r] * bits.stride(0);
        const auto* s = reinterpret_cast<const bits_t*>(src);
        auto* d = reinterpret_cast<bits_t*>(dst);
        const int64_t full = n / 32;
        for (int64_t k = 0; k < full;) {
          const uint32_t word = w[k];
          if (word == 0xffffffffu || word == 0) {  // a run of whole words: one copy or fill
            int64_t e = k + 1;
            while (e < full && w[e] == word) ++e;
            if (word)
              std::memcpy(d + 32 * k, s + 32 * k, 32 * (e - k) * sizeof(bits_t));
            else
              std::fill(d + 32 * k, d + 32 * e, ninf_bits);
            k = e;
            continue;
          }
          select_word(d + 32 * k, s + 32 * k, word, ninf_bits, 32);
          ++k;
        }
        if (n > 32 * full) select_word(d + 32 * full, s + 32 * full, w[full], ninf_bits, n % 32);
      }
    });
  });
  return out;
}

// One head's row of d values as an int8 page row (convert.h): codes x * (1 / scale) rounded to
// nearest even, scale = max |x| * (1 / 127), then the scale; an all-zero row gets codes 0,
// scale 0. The same operations as attention/int8_pages.quantize, bit for bit: the scale and
// its reciprocal pass through volatiles, or -ffast-math folds them into x * 127 / max |x|,
// whose roundings differ (a bfloat16 half of the maximum lands on 63.5 exactly).
template <typename T>
inline void quantize_row(const T* from, int64_t d, int8_t* to) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t j = 0; j < d; ++j) amax = std::max(amax, std::fabs(to_f(from[j])));
  volatile float scale_v = amax * (1.f / 127.f);
  const float scale = scale_v;
  if (scale > 0.f) {
    volatile float inv_v = 1.f / scale;
    const float inv = inv_v;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) {
      to[j] = static_cast<int8_t>(std::clamp(std::nearbyint(to_f(from[j]) * inv), -127.f, 127.f));
    }
  } else {
    std::fill_n(to, d, int8_t{0});
  }
  std::memcpy(to + d, &scale, sizeof scale);
}

// Copy each new token's k/v rows (row-strided views allowed) to its slot of the paged caches
// [pages, page_size, Hk, D] (D + 4 for int8 pages), converted to the caches' dtype
// (dispatch_kv's pairs); slot_mapping int64 [T] (flat page * page_size + offset, or -1 for a
// token to skip).
void write_kv_(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
               at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 &&
              v.stride(1) == v.size(2), "write_kv: heads must be dense");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "write_kv: k and v of one dtype, their caches of one dtype");
  TORCH_CHECK(cache_head_dim(k_cache) == k.size(2) && k_cache.sizes() == v_cache.sizes(),
              "write_kv: caches of k's head size");
  const int64_t t = k.size(0), hk = k.size(1), d = k.size(2), row = hk * d;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  dispatch_kv(k.scalar_type(), k_cache.scalar_type(), "write_kv", [&](auto tag, auto cache_tag) {
    using scalar_t = decltype(tag);
    using cache_t = decltype(cache_tag);
    auto* kc = k_cache.data_ptr<cache_t>();
    auto* vc = v_cache.data_ptr<cache_t>();
    const auto* kp = k.data_ptr<scalar_t>();
    const auto* vp = v.data_ptr<scalar_t>();
    const int64_t ks = k.stride(0), vs = v.stride(0);
    const int64_t slot_size = hk * (d + kRowExtra<cache_t>);
    const auto copy_row = [=](const scalar_t* from, cache_t* to) {
      if constexpr (std::is_same_v<cache_t, int8_t>) {
        for (int64_t h = 0; h < hk; ++h) quantize_row(from + h * d, d, to + h * (d + 4));
      } else if constexpr (std::is_same_v<scalar_t, cache_t>) {
        std::copy_n(from, row, to);
      } else {
#pragma omp simd
        for (int64_t j = 0; j < row; ++j) to[j] = from_f<cache_t>(from[j]);
      }
    };
    // In parallel for prefill chunks: a 2048-token step wrote ~1.5 MB a layer on one thread,
    // often to pages touched for the first time (faulted in as they are written).
    at::parallel_for(0, t, kWriteGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        if (slots[i] < 0) continue;  // a padding token
        copy_row(kp + i * ks, kc + slots[i] * slot_size);
        copy_row(vp + i * vs, vc + slots[i] * slot_size);
      }
    });
  });
}
