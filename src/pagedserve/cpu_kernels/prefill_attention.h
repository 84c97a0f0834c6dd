// Causal attention of prefill chunks over their pages (prefill_attention.cpp; the bfloat16
// unit in prefill_attention_bf16.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "isa.h"

// Whether prefill_attention_ serves queries of q's dtype and head size [T, Hq, D] here.
bool prefill_attention_supported(const at::Tensor& q);

// out = causal attention of prefill chunks over their pages: chunk i's queries are rows
// [starts[i], starts[i] + lens[i]) of q [T, Hq, D] (row-strided allowed, heads dense) and the
// last lens[i] of its context_lens[i] tokens, whose keys and values (its own included) are in
// k_cache and v_cache [pages, page_size, Hk, D] (q's dtype, 16-bit under float32 q, or int8
// with D + 4, convert.h)
// through block_tables [chunks, max_pages];
// out [T, Hq, D] likewise. Grouped-query heads share their KV head.
void prefill_attention_(const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, at::Tensor& out,
                        const std::vector<int64_t>& starts, const std::vector<int64_t>& lens,
                        const at::Tensor& context_lens, const at::Tensor& block_tables,
                        double scale);

// Token t's row of one KV head in a paged cache [pages, page_size, Hk, D (+ kRowExtra)].
template <typename T>
struct PagedRows {
  const T* cache;  // at the head's first dim
  const int64_t* pages;
  int64_t page_size, stride;  // stride: Hk * a row's elements
  const T* at(int64_t t) const {
    return cache + (pages[t / page_size] * page_size + t % page_size) * stride;
  }
};

// One unit of work: a chunk's q_len queries of the g query heads sharing one KV head (q: its
// first row at the first of those heads; out likewise; strides in elements between tokens),
// the last q_len of its n_keys tokens, whose keys and values are in the pages (of type C).
template <typename T, typename C = T>
struct PrefillUnit {
  const T* q;
  int64_t q_stride;
  PagedRows<C> k, v;
  T* out;
  int64_t out_stride, q_len, n_keys, g, d;
  float scale;
};

#ifdef PAGEDSERVE_AVX512_BF16
// Whether the bfloat16 unit serves q (bf16, head size 64 or 128), over bf16 or int8 pages (C:
// at::BFloat16 or int8_t): on AMX tiles where this build and Linux allow, else in vdpbf16ps.
bool prefill_unit_bf16_supported(const at::Tensor& q);
template <typename C>
void prefill_unit_bf16(const PrefillUnit<at::BFloat16, C>& u);
#endif
