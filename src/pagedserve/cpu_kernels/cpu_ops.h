// The fused CPU kernels of a step that Python calls (bound in cpu_ops.cpp): elementwise ones
// (elementwise_ops.cpp), decode attention over the pages (decode_attention.cpp), and the
// one-call decode layer (decode_layer.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

// out = rms_norm(x) * weight; x [T, H] with dense rows, weight [H] of x's dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// In place: residual += x (rounded to the dtype, as `x + residual` would be), then
// x = rms_norm(residual) * weight. Both [T, H], contiguous.
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                   double eps);

// In place rotary embedding in the Hugging Face layout (first and second halves rotated).
// q [T, Hq, D] and k [T, Hk, D] may be row-strided views (the split of a fused qkv output);
// cos, sin float32 [max_positions, D / 2]; positions int64 [T].
void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions,
             const at::Tensor& cos, const at::Tensor& sin);

// silu(gate) * up of x = [gate | up], [T, 2I] -> [T, I].
at::Tensor silu_and_mul(const at::Tensor& x);

// Index of the first maximum of each row of x [B, V] (dense rows), as torch.argmax makes it.
at::Tensor argmax_rows(const at::Tensor& x);

// x [B, V] (dense rows) with, in each row rows[k], the tokens that bits[k] forbids at -inf;
// bits int32 [R, ceil(V / 32)], bit t % 32 of word t / 32 set = token t allowed (llguidance's
// layout). Out of place (a step's logits are inference tensors).
at::Tensor masked_logits(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& bits);

// Copy each new token's k/v rows (row-strided views allowed) to its slot of the paged caches
// [pages, page_size, Hk, D]; slot_mapping int64 [T] (flat page * page_size + offset, or -1 for
// a token to skip).
void write_kv_(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
               at::Tensor& v_cache, const at::Tensor& slot_mapping);

// Decode attention straight from the pages: one query token per sequence, no gathered copy.
// q [B, Hq, D] (row-strided allowed); caches [pages, page_size, Hk, D]; block_tables int64
// [B, max_pages]; context_lens int64 [B]. Returns [B, Hq, D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache,
                                     const at::Tensor& block_tables,
                                     const at::Tensor& context_lens, double scale);

// A packed linear as Python passes it (models/quant_weight.py): codes, scales, offsets, bias,
// bits, int8_activations of a block type (quant_linear), or codes, supers, subs, bias, bits,
// int8_activations of a K type (kquant_linear; whose scales alone are float32).
using PackedLinear = std::tuple<at::Tensor, at::Tensor, c10::optional<at::Tensor>,
                                c10::optional<at::Tensor>, int64_t, bool>;

// One decoder layer of a decode step on packed weights (decode_layer.cpp).
std::tuple<at::Tensor, at::Tensor> decode_layer(
    at::Tensor x, c10::optional<at::Tensor> residual, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const PackedLinear& qkv_proj,
    const PackedLinear& o_proj, const PackedLinear& gate_up_proj, const PackedLinear& down_proj,
    int64_t num_heads, int64_t num_kv_heads, double scale, const at::Tensor& positions,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
    at::Tensor v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& context_lens);
