// The fused CPU kernels of a step that Python calls (bound in cpu_ops.cpp): elementwise ones
// (elementwise_ops.cpp), decode attention over the pages (decode_attention.cpp), and the
// one-call decode layer (decode_layer.cpp).
#pragma once

#include <torch/extension.h>

#include <tuple>

// out = rms_norm(x) * weight; x [T, H] with dense rows, weight [H] of x's dtype.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// In place: residual += x (rounded to the dtype, as `x + residual` would be), then
// x = rms_norm(residual) * weight. Both [T, H], contiguous.
void add_rms_norm_(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight,
                   double eps);

// In place rotary embedding in the Hugging Face layout (first and second halves rotated).
// q [T, Hq, D] and k [T, Hk, D] may be row-strided views (the split of a fused qkv output);
// cos, sin float32 [max_positions, D / 2]; positions int64 [T].
void rotary_(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& positions,
             const torch::Tensor& cos, const torch::Tensor& sin);

// silu(gate) * up of x = [gate | up], [T, 2I] -> [T, I].
torch::Tensor silu_and_mul(const torch::Tensor& x);

// Index of the first maximum of each row of x [B, V] (dense rows), as torch.argmax makes it.
torch::Tensor argmax_rows(const torch::Tensor& x);

// Copy each new token's k/v rows (row-strided views allowed) to its slot of the paged caches
// [pages, page_size, Hk, D]; slot_mapping int64 [T] (flat page * page_size + offset, or -1 for
// a token to skip).
void write_kv_(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache,
               torch::Tensor& v_cache, const torch::Tensor& slot_mapping);

// Decode attention straight from the pages: one query token per sequence, no gathered copy.
// q [B, Hq, D] (row-strided allowed); caches [pages, page_size, Hk, D]; block_tables int64
// [B, max_pages]; context_lens int64 [B]. Returns [B, Hq, D].
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, double scale);

// A packed linear as Python passes it (models/quant_weight.py): codes, scales, offsets, bias,
// bits of a block type (quant_linear), or codes, supers, subs, bias, bits of a K type
// (kquant_linear), whose scales alone are float32.
using PackedLinear = std::tuple<torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>,
                                c10::optional<torch::Tensor>, int64_t>;

// One decoder layer of a decode step on packed weights (decode_layer.cpp).
std::tuple<torch::Tensor, torch::Tensor> decode_layer(
    torch::Tensor x, c10::optional<torch::Tensor> residual, const torch::Tensor& input_norm,
    const torch::Tensor& post_norm, double eps, const PackedLinear& qkv_proj,
    const PackedLinear& o_proj, const PackedLinear& gate_up_proj, const PackedLinear& down_proj,
    int64_t num_heads, int64_t num_kv_heads, double scale, const torch::Tensor& positions,
    const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor k_cache,
    torch::Tensor v_cache, const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
    const torch::Tensor& context_lens);
