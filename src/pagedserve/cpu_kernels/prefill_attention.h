// Causal attention of prefill chunks that start their sequences (prefill_attention.cpp).
#pragma once

#include <torch/extension.h>

#include <vector>

// Whether prefill_attention_ serves queries of q's dtype and head size [T, Hq, D] on this CPU.
bool prefill_attention_supported(const at::Tensor& q);

// out[t] = causal attention of each chunk's queries over its own keys and values, chunk i being
// rows [starts[i], starts[i] + lens[i]) of q [T, Hq, D], k and v [T, Hk, D] (row-strided views
// allowed, heads dense) and out [T, Hq, D]; grouped-query heads share their KV head.
void prefill_attention_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        at::Tensor& out, const std::vector<int64_t>& starts,
                        const std::vector<int64_t>& lens, double scale);
