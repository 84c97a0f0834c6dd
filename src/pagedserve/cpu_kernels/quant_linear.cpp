// Matrix products straight from GGUF's quantized weights, packed (quant_layout.h), at every
// kernel level: block types (Q4_0/Q4_1, Q8_0) and K types (Q4_K, Q5_K, Q6_K). A step's linears
// are bound by reading weights: at 4-8 bits per weight they read 2-4x fewer bytes than bfloat16
// (4-7x fewer than float32). The kernels by regime:
// - int8_activations (the default but for an explicit float32 model): integer products over
//   activations quantized per group (quant_linear_int8.cpp; every format, every level) where
//   the level has them for the row count (kInt8MaxRows, kInt8EightBitMinRows), except bf16
//   steps of over kInt8MaxAmxRows rows where AMX has tiles;
// - bf16 activations where the level computes bfloat16: block types take AVX-512 BF16 dot
//   products (quant_linear_gemv_bf16.cpp), for a few rows where AMX serves more, for all rows
//   where not; more rows of block types, and K types past a few rows, AMX tiles
//   (quant_linear_amx.cpp).
// - float32 activations, and bf16 ones otherwise (computed in float32, rounded once): dot
//   products for a few rows (quant_linear_few_rows.cpp; from AVX2 on), decoded tiles for more
//   (quant_linear_tiles.cpp; every row count in the portable kernels, whose decoded strips
//   torch's matmul multiplies faster than portable dot products do even at one row).
#include "quant_linear.h"

#include <cstring>
#include <functional>
#include <vector>

#include "amx.h"
#include "quant_kernels.h"

#ifdef PAGEDSERVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

// y = x W^T in float32 products, rounded to T.
template <typename T, typename F>
void float_linear(const float* x, int64_t m, int64_t k, const F& w, const float* bias, T* y,
                  int64_t n) {
#ifdef PAGEDSERVE_AVX2
  if (m <= kDotMaxRows) {
    few_rows_linear(x, m, k, w, bias, y, n);
    return;
  }
#endif
  many_rows_linear(x, m, k, w, bias, y, n);
}

template <typename F>
at::Tensor linear(const at::Tensor& x, const F& w, const c10::optional<at::Tensor>& bias,
                  int64_t n, bool int8_activations, bool float_out) {
  bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || x.scalar_type() == at::kFloat) && x.dim() == 2,
              "quant_linear: x float32 or bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k == w.groups * kGroup, "quant_linear: x has ", k, " columns, weights ",
              w.groups * kGroup);
  TORCH_CHECK(n % (2 * kTileCols) == 0, "quant_linear: output size must be a multiple of 32");
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  auto y = x.new_empty({m, n}, float_out ? at::kFloat : x.scalar_type());
  if (m == 0) return y;
  const float* b = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  const bool int8 = int8_activations && m <= kInt8MaxRows &&
                    (F::kBits != 8 || m >= kInt8EightBitMinRows);
  const bool amx = bf16 && m > kGemvMaxRows && amx_available();
  // AMX tiles take bf16 steps of over kInt8MaxAmxRows rows even where int8 products serve.
  const bool amx_tiles = amx && (!int8 || m > kInt8MaxAmxRows);
  at::Tensor a = x.contiguous();
  if (float_out && bf16 && !amx_tiles) {
    // Float32 sums from float32 activations: bf16 -> float32 is exact, so the products are
    // the same; AMX tiles alone take bf16 rows and write float32.
    a = a.to(at::kFloat);
    bf16 = false;
  }
  if (int8 && !amx_tiles) {
    if (bf16) {
      int8_linear(a.data_ptr<at::BFloat16>(), m, k, w, b, y.data_ptr<at::BFloat16>(), n);
    } else {
      int8_linear(a.data_ptr<float>(), m, k, w, b, y.data_ptr<float>(), n);
    }
    return y;
  }
#ifdef PAGEDSERVE_AVX512_BF16
  if constexpr (!F::kKType) {
    if (bf16 && !amx) {
      gemv_bf16_linear(a, w.codes, w.scales, w.offsets, b, y.data_ptr<at::BFloat16>(), n,
                       F::kBits);
      return y;
    }
  }
#endif
#ifdef PAGEDSERVE_AMX
  if (amx_tiles) {
    const at::BFloat16* xp = a.data_ptr<at::BFloat16>();
    const int64_t full = m / kTileRows * kTileRows;
    // Plain memory, not a tensor: a step's ~120 calls paid ~1 ms for at::zeros and copy_.
    thread_local std::vector<at::BFloat16> tail;
    if (full < m) {
      tail.assign(kTileRows * k, at::BFloat16(0.f));
      std::memcpy(tail.data(), xp + full * k, (m - full) * k * sizeof(at::BFloat16));
    }
    const RowBlocks rows{xp, tail.data(), full, k};
    if (float_out) {
      amx_linear(rows, m, k, w, b, y.data_ptr<float>(), n);
    } else {
      amx_linear(rows, m, k, w, b, y.data_ptr<at::BFloat16>(), n);
    }
    return y;
  }
#endif
  if (!bf16) {
    float_linear(a.data_ptr<float>(), m, k, w, b, y.data_ptr<float>(), n);
    return y;
  }
  thread_local std::vector<float> xf;  // plain memory, as above
  xf.resize(m * k);
  const at::BFloat16* xp = a.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < m * k; ++i) xf[i] = static_cast<float>(xp[i]);
  float_linear(xf.data(), m, k, w, b, y.data_ptr<at::BFloat16>(), n);
  return y;
}

// Rows `ids` of W (columns of the packed tiles), dequantized.
template <typename F, typename T>
void lookup_rows(const F& w, const int64_t* ids, int64_t m, int64_t n, T* out) {
  const int64_t k = w.groups * kGroup;
  for (int64_t i = 0; i < m; ++i) {
    const int64_t row = ids[i];
    TORCH_CHECK(row >= 0 && row < n, "quant_rows: id ", row, " out of range");
    const int64_t nt = row / kTileCols, col = row % kTileCols;
    for (int64_t g = 0; g < w.groups; ++g) {
      float d[2][kTileCols], o[2][kTileCols];
      w.group_scales(nt, g, d, o);
      const uint8_t* c = w.tile(nt, g);
      for (int j = 0; j < kGroup; ++j) {
        const int h = j / kHalf;
        const float code = F::code(c, j / 2, 2 * col + j % 2);
        out[i * k + g * kGroup + j] = static_cast<T>(code * d[h][col] + o[h][col]);
      }
    }
  }
}

void check_codes(const at::Tensor& codes, int64_t tile_bytes) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.is_contiguous(),
              "quantized weights: codes must be contiguous uint8 [tiles, groups, bytes]");
  TORCH_CHECK(codes.size(2) == tile_bytes, "quantized weights: tile size");
}

// Calls fn(format) for a block type's packed weight (quant_layout.h), checked.
template <typename Fn>
auto with_block(const at::Tensor& codes, const at::Tensor& scales,
                const c10::optional<at::Tensor>& offsets, int64_t bits, Fn&& fn) {
  TORCH_CHECK(bits == 4 || bits == 8, "quantized weights: 4 or 8 bits");
  check_codes(codes, kTileRows * kGroup * bits / 8);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({codes.size(0), codes.size(1), kTileCols}),
              "quantized weights: scales must be float16 [tiles, groups, 16]");
  if (offsets.has_value()) {
    TORCH_CHECK(bits == 4, "quantized weights: 8-bit codes take no offsets");
    TORCH_CHECK(offsets->sizes() == scales.sizes() && offsets->scalar_type() == at::kHalf &&
                    offsets->is_contiguous(),
                "quantized weights: offsets must match the scales");
  }
  const void* off = offsets.has_value() ? offsets->data_ptr() : nullptr;
  return with_format(false, bits, codes.data_ptr<uint8_t>(), scales.data_ptr(), off,
                     codes.size(1), fn);
}

// The same for a K type's.
template <typename Fn>
auto with_k(const at::Tensor& codes, const at::Tensor& supers, const at::Tensor& subs,
            int64_t bits, Fn&& fn) {
  TORCH_CHECK(bits >= 4 && bits <= 6, "K-quant weights: 4, 5 or 6 bits");
  check_codes(codes, 256 + 64 * (bits - 4));
  const int64_t tiles = codes.size(0), groups = codes.size(1);
  const int64_t super_rows = bits == 6 ? 1 : 2;
  TORCH_CHECK(supers.scalar_type() == at::kFloat && supers.is_contiguous() &&
                  supers.sizes() == at::IntArrayRef({tiles, (groups + kSuperGroups - 1) /
                                                               kSuperGroups,
                                                     super_rows, kTileCols}),
              "K-quant weights: supers must be float32 [tiles, super-blocks, ", super_rows,
              ", 16]");
  TORCH_CHECK(subs.scalar_type() == at::kByte && subs.is_contiguous() &&
                  subs.sizes() == at::IntArrayRef({tiles, groups, 2, kTileCols}),
              "K-quant weights: subs must be uint8 [tiles, groups, 2, 16]");
  return with_format(true, bits, codes.data_ptr<uint8_t>(), supers.data_ptr(), subs.data_ptr(),
                     groups, fn);
}

at::Tensor rows_of(const at::Tensor& ids, int64_t n, int64_t k, at::ScalarType dtype,
                   const std::function<void(const int64_t*, int64_t, void*)>& lookup) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "quant_rows: ids int64 [M]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quant_rows: float32 or bf16 rows");
  auto out = ids.new_empty({ids.size(0), k}, dtype);
  lookup(ids.data_ptr<int64_t>(), ids.size(0), out.data_ptr());
  return out;
}

template <typename F>
void lookup_as(const F& w, const int64_t* ids, int64_t m, int64_t n, at::ScalarType dtype,
               void* out) {
  if (dtype == at::kFloat) {
    lookup_rows(w, ids, m, n, static_cast<float*>(out));
  } else {
    lookup_rows(w, ids, m, n, static_cast<at::BFloat16*>(out));
  }
}

}  // namespace

bool amx_available() {
#ifdef PAGEDSERVE_AMX
  // Linux hands AMX's tile state to a process only on request (once, for all its threads).
  constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  static const bool ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  return ok;
#else
  return false;
#endif
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& offsets,
                        const c10::optional<at::Tensor>& bias, int64_t bits,
                        bool int8_activations, bool float_out) {
  at::Tensor y;
  with_block(codes, scales, offsets, bits, [&](const auto& w) {
    y = linear(x, w, bias, codes.size(0) * kTileCols, int8_activations, float_out);
  });
  return y;
}

at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& supers,
                         const at::Tensor& subs, const c10::optional<at::Tensor>& bias,
                         int64_t bits, bool int8_activations, bool float_out) {
  at::Tensor y;
  with_k(codes, supers, subs, bits, [&](const auto& w) {
    y = linear(x, w, bias, codes.size(0) * kTileCols, int8_activations, float_out);
  });
  return y;
}

at::Tensor quant_rows(const at::Tensor& ids, const at::Tensor& codes, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& offsets, int64_t bits,
                      at::ScalarType dtype) {
  const int64_t n = codes.size(0) * kTileCols, k = codes.size(1) * kGroup;
  return rows_of(ids, n, k, dtype, [&](const int64_t* id, int64_t m, void* out) {
    with_block(codes, scales, offsets, bits,
               [&](const auto& w) { lookup_as(w, id, m, n, dtype, out); });
  });
}

at::Tensor kquant_rows(const at::Tensor& ids, const at::Tensor& codes, const at::Tensor& supers,
                       const at::Tensor& subs, int64_t bits, at::ScalarType dtype) {
  const int64_t n = codes.size(0) * kTileCols, k = codes.size(1) * kGroup;
  return rows_of(ids, n, k, dtype, [&](const int64_t* id, int64_t m, void* out) {
    with_k(codes, supers, subs, bits, [&](const auto& w) { lookup_as(w, id, m, n, dtype, out); });
  });
}
