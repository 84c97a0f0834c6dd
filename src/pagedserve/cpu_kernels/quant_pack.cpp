// GGUF's block matrices (Q4_0, Q4_1, Q8_0) packed into the tiles of quant_layout.h in one pass
// over the file's bytes: the same layout numpy/torch made in ~6 passes (unpacked codes, a
// permuted copy, nibble pairs), which were most of the default model's load.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <cstring>
#include <tuple>

#include "quant_layout.h"
#include "quant_linear.h"

namespace {

// GGML type ids (ggml.h) and each type's block: a float16 scale d, for Q4_1 a float16 offset m,
// then 16 bytes of nibbles (input i low, i + 16 high) or 32 int8 codes.
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

c10::Half half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return c10::Half(bits, c10::Half::from_bits());
}

// Column c's 32 codes (one block) into a tile of four-bit codes: byte b of word 2c + p in row
// quad q holds inputs 8q + 4b + p (low nibble) and 8q + 4b + 2 + p (high).
void put_nibbles(const uint8_t* qs, int64_t c, uint8_t* tile) {
  auto code = [qs](int x) { return x < 16 ? qs[x] & 0xF : qs[x - 16] >> 4; };
  for (int q = 0; q < 4; ++q)
    for (int p = 0; p < 2; ++p)
      for (int b = 0; b < 2; ++b) {
        const int x = 8 * q + 4 * b + p;
        tile[q * 64 + 2 * (2 * c + p) + b] = static_cast<uint8_t>(code(x) | code(x + 2) << 4);
      }
}

// Column c's 32 int8 codes into a tile of eight-bit ones: row r, lanes 2c and 2c + 1 hold
// inputs 2r and 2r + 1.
void put_bytes(const uint8_t* qs, int64_t c, uint8_t* tile) {
  for (int r = 0; r < kTileRows; ++r) std::memcpy(tile + r * 32 + 2 * c, qs + 2 * r, 2);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, c10::optional<at::Tensor>> pack_quant_blocks(
    const at::Tensor& blocks, int64_t ggml_type) {
  TORCH_CHECK(ggml_type == kQ4_0 || ggml_type == kQ4_1 || ggml_type == kQ8_0,
              "pack_quant_blocks: GGML type ", ggml_type, " is not Q4_0, Q4_1 or Q8_0");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "pack_quant_blocks: blocks must be contiguous uint8 [rows, row bytes]");
  const bool eight = ggml_type == kQ8_0, with_min = ggml_type == kQ4_1;
  const int64_t header = with_min ? 4 : 2, block_bytes = header + (eight ? 32 : 16);
  const int64_t n = blocks.size(0), row_bytes = blocks.size(1);
  TORCH_CHECK(n % kTileCols == 0 && row_bytes % block_bytes == 0,
              "pack_quant_blocks: rows must be whole tiles of 16 and whole blocks");
  const int64_t tiles = n / kTileCols, groups = row_bytes / block_bytes;
  const int64_t tile_bytes = eight ? kTileRows * 32 : kTileRows / 4 * 64;
  auto codes = blocks.new_empty({tiles, groups, tile_bytes});
  auto half = blocks.options().dtype(at::kHalf);
  auto scales = blocks.new_empty({tiles, groups, kTileCols}, half);
  c10::optional<at::Tensor> offsets;
  if (!eight) offsets = blocks.new_empty({tiles, groups, kTileCols}, half);
  const uint8_t* in = blocks.const_data_ptr<uint8_t>();
  uint8_t* out = codes.mutable_data_ptr<uint8_t>();
  c10::Half* d_out = scales.mutable_data_ptr<c10::Half>();
  c10::Half* m_out = eight ? nullptr : offsets->mutable_data_ptr<c10::Half>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* tile = out + (t * groups + g) * tile_bytes;
        const int64_t at_tg = (t * groups + g) * kTileCols;
        for (int64_t c = 0; c < kTileCols; ++c) {
          const uint8_t* block = in + (t * kTileCols + c) * row_bytes + g * block_bytes;
          const c10::Half d = half_at(block);
          d_out[at_tg + c] = d;
          if (eight) {
            put_bytes(block + header, c, tile);
            continue;
          }
          // Q4_0's codes are offset by 8: m = -8 d, exact in float16 (a power of two).
          m_out[at_tg + c] = with_min ? half_at(block + 2) : c10::Half(-8.f * float(d));
          put_nibbles(block + header, c, tile);
        }
      }
  });
  return {codes, scales, offsets};
}
