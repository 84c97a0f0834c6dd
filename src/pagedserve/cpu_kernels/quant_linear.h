// Products with GGUF's quantized weights, packed as quant_layout.h describes (quant_linear.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

// y [M, N] = x [M, K] @ W^T (+ bias), W of a block type (Q4_0/Q4_1: 4 bits, Q8_0: 8); x and
// the bias float32 or bf16, y x's dtype, or float32 with `float_out` (the float32 sums as they
// are: logits without bfloat16's ties). With `int8_activations`, W multiplies x quantized to
// int8 per group where the level has integer products for its codes (quant_linear_int8.cpp);
// without, products are float32 (or bfloat16 where the level computes it).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& offsets,
                        const c10::optional<at::Tensor>& bias, int64_t bits,
                        bool int8_activations, bool float_out);

// Rows `ids` of W, dequantized to `dtype` (float32 or bf16) [M, K] (an embedding lookup on
// tied weights).
at::Tensor quant_rows(const at::Tensor& ids, const at::Tensor& codes, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& offsets, int64_t bits,
                      at::ScalarType dtype);

// The same for W of a K type: Q4_K, Q5_K, Q6_K by `bits` 4, 5, 6 (float32 super-block scales
// `supers`, uint8 group scales `subs`).
at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& supers,
                         const at::Tensor& subs, const c10::optional<at::Tensor>& bias,
                         int64_t bits, bool int8_activations, bool float_out);

at::Tensor kquant_rows(const at::Tensor& ids, const at::Tensor& codes, const at::Tensor& supers,
                       const at::Tensor& subs, int64_t bits, at::ScalarType dtype);

// GGUF's Q4_0 / Q4_1 / Q8_0 matrix (`ggml_type` 2, 3 or 8), its blocks as in the file, uint8
// [N, K / 32 * block bytes], packed for the functions above: codes, scales and offsets (none for
// Q8_0) in quant_layout.h's layout (quant_pack.cpp).
std::tuple<at::Tensor, at::Tensor, c10::optional<at::Tensor>> pack_quant_blocks(
    const at::Tensor& blocks, int64_t ggml_type);

// The same for a K-quant matrix (`ggml_type` 12, 13 or 14: Q4_K, Q5_K, Q6_K), uint8
// [N, K / 256 * super-block bytes]: codes, supers and subs as kquant_linear takes them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_kquant_blocks(const at::Tensor& blocks,
                                                                  int64_t ggml_type);
