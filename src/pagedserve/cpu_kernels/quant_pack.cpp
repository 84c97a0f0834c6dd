// GGUF's quantized matrices (Q4_0, Q4_1, Q8_0; Q4_K, Q5_K, Q6_K) packed into the tiles of
// quant_layout.h in one pass over the file's bytes: the same layouts numpy/torch made in ~6
// passes (unpacked codes, a permuted copy, nibble pairs), which were most of a model's load.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <cstring>
#include <tuple>

#include "quant_layout.h"
#include "quant_linear.h"

namespace {

// GGML type ids (ggml.h). A block type's block: a float16 scale d, for Q4_1 a float16 offset
// m, then 16 bytes of nibbles (input i low, i + 16 high) or 32 int8 codes. The K types' in
// unpack_kblock.
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;

c10::Half half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return c10::Half(bits, c10::Half::from_bits());
}

// Column c's nibbles of `rows` code rows into row quads (64 bytes each) from `plane`: byte k of
// word 2c + p in quad q holds nibble(4q + 2k, p) low and nibble(4q + 2k + 1, p) high, where
// nibble(r, p) is what row r holds for input 2r + p of the group.
template <typename Nibble>
void put_plane(int rows, int64_t c, uint8_t* plane, const Nibble& nibble) {
  for (int q = 0; q < rows / 4; ++q)
    for (int p = 0; p < 2; ++p)
      for (int k = 0; k < 2; ++k) {
        const int r = 4 * q + 2 * k;
        plane[q * 64 + 2 * (2 * c + p) + k] =
            static_cast<uint8_t>(nibble(r, p) | nibble(r + 1, p) << 4);
      }
}

// Column c's 32 codes (one block) into a tile of four-bit codes.
void put_nibbles(const uint8_t* qs, int64_t c, uint8_t* tile) {
  auto code = [qs](int x) { return x < 16 ? qs[x] & 0xF : qs[x - 16] >> 4; };
  put_plane(kTileRows, c, tile, [&](int r, int p) { return code(2 * r + p); });
}

// Column c's 32 int8 codes into a tile of eight-bit ones: row r, lanes 2c and 2c + 1 hold
// inputs 2r and 2r + 1.
void put_bytes(const uint8_t* qs, int64_t c, uint8_t* tile) {
  for (int r = 0; r < kTileRows; ++r) std::memcpy(tile + r * 32 + 2 * c, qs + 2 * r, 2);
}

// A K type's super-block of 256 codes, in gguf.quants' order, with its scales.
struct KBlock {
  uint8_t codes[256];
  uint8_t subs[8][2];  // per group: 6-bit scale and min (Q4_K, Q5_K); int8 half scales (Q6_K)
  float supers[2];     // d, dmin (Q4_K, Q5_K); d (Q6_K)
};

// Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of fifth bits,)
// 128 of nibbles: chunk j of 32 bytes holds codes 64j + i (low) and 64j + 32 + i (high).
// Q6_K: 128 bytes of nibbles (chunk j of 64: codes 128j + i low, 128j + 64 + i high), 64 of
// 2-bit highs (code 128j + 32s + i: bits 2s of byte 32j + i), 16 int8 scales, d.
void unpack_kblock(const uint8_t* b, int64_t type, KBlock& k) {
  if (type == kQ6_K) {
    for (int j = 0; j < 2; ++j)
      for (int i = 0; i < 64; ++i) {
        k.codes[128 * j + i] = b[64 * j + i] & 0xF;
        k.codes[128 * j + 64 + i] = b[64 * j + i] >> 4;
      }
    for (int j = 0; j < 2; ++j)
      for (int s = 0; s < 4; ++s)
        for (int i = 0; i < 32; ++i)
          k.codes[128 * j + 32 * s + i] |= ((b[128 + 32 * j + i] >> (2 * s)) & 3) << 4;
    std::memcpy(k.subs, b + 192, 16);
    k.supers[0] = static_cast<float>(half_at(b + 208));
    return;
  }
  const uint8_t* scales = b + 4;
  const uint8_t* qs = b + (type == kQ5_K ? 48 : 16);
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < 32; ++i) {
      k.codes[64 * j + i] = qs[32 * j + i] & 0xF;
      k.codes[64 * j + 32 + i] = qs[32 * j + i] >> 4;
    }
  if (type == kQ5_K)
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 32; ++i) k.codes[32 * j + i] |= ((b[16 + i] >> j) & 1) << 4;
  for (int j = 0; j < 4; ++j) {  // gguf.quants' Q4_K.get_scale_min
    k.subs[j][0] = scales[j] & 0x3F;
    k.subs[j][1] = scales[j + 4] & 0x3F;
    k.subs[j + 4][0] = (scales[j + 8] & 0x0F) | ((scales[j] >> 2) & 0x30);
    k.subs[j + 4][1] = (scales[j + 8] >> 4) | ((scales[j + 4] >> 2) & 0x30);
  }
  k.supers[0] = static_cast<float>(half_at(b));
  k.supers[1] = static_cast<float>(half_at(b + 2));
}

// What both packers take: contiguous uint8 rows of whole blocks, whole tiles of rows.
void check_blocks(const at::Tensor& blocks, int64_t block_bytes, const char* fn) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              fn, ": blocks must be contiguous uint8 [rows, row bytes]");
  TORCH_CHECK(blocks.size(0) % kTileCols == 0 && blocks.size(1) % block_bytes == 0, fn,
              ": rows must be whole tiles of 16 and whole blocks");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_kquant_blocks(const at::Tensor& blocks,
                                                                  int64_t ggml_type) {
  TORCH_CHECK(ggml_type == kQ4_K || ggml_type == kQ5_K || ggml_type == kQ6_K,
              "pack_kquant_blocks: GGML type ", ggml_type, " is not Q4_K, Q5_K or Q6_K");
  const int bits = ggml_type == kQ4_K ? 4 : ggml_type == kQ5_K ? 5 : 6;
  const int64_t block_bytes = ggml_type == kQ4_K ? 144 : ggml_type == kQ5_K ? 176 : 210;
  check_blocks(blocks, block_bytes, "pack_kquant_blocks");
  const int64_t row_bytes = blocks.size(1);
  const int64_t tiles = blocks.size(0) / kTileCols, supers_n = row_bytes / block_bytes;
  const int64_t groups = supers_n * kSuperGroups, n_supers = bits == 6 ? 1 : 2;
  const int64_t tile_bytes = 256 + 64 * (bits - 4);
  // High bits (Q5_K: 1, Q6_K: 2) of quad q's codes: nibble row 4 (q / per) + e of the high
  // planes, at bit high_bits * (q % per), for row 4q + e.
  const int high_bits = bits - 4, per = high_bits > 0 ? 4 / high_bits : 1;
  auto codes = blocks.new_empty({tiles, groups, tile_bytes});
  auto supers = blocks.new_empty({tiles, supers_n, n_supers, kTileCols},
                                 blocks.options().dtype(at::kFloat));
  auto subs = blocks.new_empty({tiles, groups, 2, kTileCols});
  const uint8_t* in = blocks.const_data_ptr<uint8_t>();
  uint8_t* codes_out = codes.mutable_data_ptr<uint8_t>();
  float* supers_out = supers.mutable_data_ptr<float>();
  uint8_t* subs_out = subs.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    KBlock k;
    for (int64_t t = begin; t < end; ++t)
      for (int64_t s = 0; s < supers_n; ++s)
        for (int64_t c = 0; c < kTileCols; ++c) {
          unpack_kblock(in + (t * kTileCols + c) * row_bytes + s * block_bytes, ggml_type, k);
          for (int64_t i = 0; i < n_supers; ++i)
            supers_out[((t * supers_n + s) * n_supers + i) * kTileCols + c] = k.supers[i];
          for (int64_t gg = 0; gg < kSuperGroups; ++gg) {
            const int64_t g = s * kSuperGroups + gg;
            const uint8_t* code = k.codes + gg * kGroup;
            uint8_t* tile = codes_out + (t * groups + g) * tile_bytes;
            put_plane(kTileRows, c, tile, [&](int r, int p) { return code[2 * r + p] & 0xF; });
            if (high_bits > 0) {
              put_plane(kTileRows / per, c, tile + 256, [&](int row, int p) {
                int value = 0;  // high nibble row `row` = 4a + e: quads q = a * per + b
                for (int b = 0; b < per; ++b) {
                  const int r = 4 * ((row / 4) * per + b) + row % 4;
                  value |= (code[2 * r + p] >> 4) << (high_bits * b);
                }
                return value;
              });
            }
            for (int h = 0; h < 2; ++h)
              subs_out[((t * groups + g) * 2 + h) * kTileCols + c] = k.subs[gg][h];
          }
        }
  });
  return {codes, supers, subs};
}

std::tuple<at::Tensor, at::Tensor, c10::optional<at::Tensor>> pack_quant_blocks(
    const at::Tensor& blocks, int64_t ggml_type) {
  TORCH_CHECK(ggml_type == kQ4_0 || ggml_type == kQ4_1 || ggml_type == kQ8_0,
              "pack_quant_blocks: GGML type ", ggml_type, " is not Q4_0, Q4_1 or Q8_0");
  const bool eight = ggml_type == kQ8_0, with_min = ggml_type == kQ4_1;
  const int64_t header = with_min ? 4 : 2, block_bytes = header + (eight ? 32 : 16);
  check_blocks(blocks, block_bytes, "pack_quant_blocks");
  const int64_t row_bytes = blocks.size(1);
  const int64_t tiles = blocks.size(0) / kTileCols, groups = row_bytes / block_bytes;
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
