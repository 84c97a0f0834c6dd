// One decoder layer of a decode step (one new token per sequence) on packed weights: the
// steps of models/llama.py's DecoderLayer with the fused attention backend, in one call. At
// batch 1 the Python version spent about as long in the interpreter as in these kernels.
#include "convert.h"
#include "cpu_ops.h"
#include "quant_linear.h"

namespace {

at::Tensor packed_linear(const at::Tensor& x, const PackedLinear& w) {
  const auto& [codes, scales, offsets, bias, bits, int8_activations] = w;
  if (scales.scalar_type() == at::kFloat) {
    return kquant_linear(x, codes, scales, offsets.value(), bias, bits, int8_activations, false);
  }
  return quant_linear(x, codes, scales, offsets, bias, bits, int8_activations, false);
}

}  // namespace

// x: the previous layer's output [B, H]; residual: the residual stream, or None before the
// first layer. Returns (this layer's output, the residual stream before it).
std::tuple<at::Tensor, at::Tensor> decode_layer(
    at::Tensor x, c10::optional<at::Tensor> residual, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const PackedLinear& qkv_proj,
    const PackedLinear& o_proj, const PackedLinear& gate_up_proj, const PackedLinear& down_proj,
    int64_t num_heads, int64_t num_kv_heads, double scale, const at::Tensor& positions,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
    at::Tensor v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& context_lens) {
  at::Tensor res;
  if (residual.has_value()) {
    res = *residual;
    add_rms_norm_(x, res, input_norm, eps);
  } else {
    res = x;
    x = rms_norm(x, input_norm, eps);
  }
  const int64_t b = x.size(0), d = cache_head_dim(k_cache);
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
