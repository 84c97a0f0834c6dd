// Causal attention of prefill chunks over their pages (prefill_attention.cpp).
#pragma once

#include <torch/extension.h>

#include <vector>

// Whether prefill_attention_ serves queries of q's dtype and head size [T, Hq, D] on this CPU.
bool prefill_attention_supported(const at::Tensor& q);

// out = causal attention of prefill chunks over their pages: chunk i's queries are rows
// [starts[i], starts[i] + lens[i]) of q [T, Hq, D] (row-strided allowed, heads dense) and the
// last lens[i] of its context_lens[i] tokens, whose keys and values (its own included) are in
// k_cache and v_cache [pages, page_size, Hk, D] through block_tables [chunks, max_pages];
// out [T, Hq, D] likewise. Grouped-query heads share their KV head.
void prefill_attention_(const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, at::Tensor& out,
                        const std::vector<int64_t>& starts, const std::vector<int64_t>& lens,
                        const at::Tensor& context_lens, const at::Tensor& block_tables,
                        double scale);
