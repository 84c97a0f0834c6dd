// Products with GGUF block-quantized weights (quant_linear.cpp).
#pragma once

#include <torch/extension.h>

// y [M, N] = x [M, K] @ W^T (+ bias), W packed as described in quant_linear.cpp; x, y and the
// bias float32 or bf16 (x's dtype).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& offsets,
                        const c10::optional<at::Tensor>& bias, int64_t bits);

// Rows `ids` of W, dequantized to `dtype` (float32 or bf16) [M, K] (an embedding lookup on
// tied weights).
at::Tensor quant_rows(const at::Tensor& ids, const at::Tensor& codes, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& offsets, int64_t bits,
                      at::ScalarType dtype);
