// The packed weight layouts of the quant_linear kernels, as views the kernels of every level
// share (portable C++; the level-specific decoders are in quant_decode.h).
//
// Every layout cuts W [N, K] into tiles of 16 output columns x 32 inputs (one quantization
// group). In a tile, row r and lane L hold the code of column L/2, input 2r + L%2 (the pair
// layout of a bfloat16 B tile). Eight-bit codes are stored lane by lane (32 bytes a row).
// Four-bit codes come in groups of four rows: 16-bit word j of row quad q holds lane j of rows
// 4q..4q+3 in its four nibbles, lowest first (256 bytes a tile).
//
// Block types (GGUF Q4_0, Q4_1, Q8_0): float16 scales and offsets [tiles, groups, 16], one per
// column and group; weight = code * scale + offset.
//
// K types (GGUF Q4_K, Q5_K, Q6_K; super-blocks of 256 inputs, 8 groups): a tile holds the four
// low bits of its codes as above, then for Q5_K/Q6_K the high bits as more nibble quads (64
// bytes each) of the same shape: the high bits of quad q's codes sit in high quad q / P, at
// bit (B - 4) * (q % P) of each nibble, with B the code width and P = 4 / (B - 4) quads per
// nibble. Scales come from two arrays, as in the GGUF block, exact in float32:
// - supers: float32 [tiles, ceil(groups / 8), S, 16], per super-block and column: d, dmin
//   (Q4_K, Q5_K; S = 2) or d (Q6_K; S = 1);
// - subs: uint8 [tiles, groups, 2, 16], per group and column: the 6-bit scale and min
//   (Q4_K, Q5_K: weight = code * d * scale - dmin * min), or the int8 scales of the group's two
//   halves of 16 inputs (Q6_K: weight = (code - 32) * d * scale).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>

constexpr int64_t kGroup = 32;     // input values per quantization group (one B tile's K)
constexpr int64_t kHalf = 16;      // inputs per scale of a Q6_K group (kernels sum by halves)
constexpr int64_t kTileCols = 16;  // output columns per tile
constexpr int64_t kTileRows = 16;  // code rows per tile (two inputs a row)
constexpr int64_t kSuperGroups = 8;  // groups per K super-block
// float32 steps of at most this many rows take dot products, bigger ones decoded tiles (from
// AVX2 on; the portable kernels decode tiles for every row count).
constexpr int64_t kDotMaxRows = 8;
// bf16 steps of at most this many rows take the AVX-512 BF16 dot products (block types) or the
// float32 dot products (K types); bigger ones AMX where the CPU has it.
constexpr int64_t kGemvMaxRows = 4;
// With int8 activations, bf16 steps of at most this many rows take the integer products
// where AMX would serve; bigger ones AMX (faster from 16 rows on).
constexpr int64_t kInt8MaxAmxRows = 8;

// The code at row r, lane `lane` of a tile of Bits-wide codes (4 or 8).
template <int Bits>
inline int code_at(const uint8_t* tile, int r, int lane) {
  if constexpr (Bits == 4) {
    uint16_t word;
    std::memcpy(&word, tile + r / 4 * 64 + 2 * lane, sizeof word);
    return (word >> (4 * (r % 4))) & 0xF;
  } else {
    return static_cast<int8_t>(tile[r * 32 + lane]);
  }
}

// Per group, each level's kernels get the tile's codes and the float32 scale and offset of
// each column for each half of the group's inputs: weight = code * d[h][c] + m[h][c].
template <int Bits>
struct BlockFormat {
  static constexpr bool kKType = false;
  static constexpr int kBits = Bits;
  static constexpr int kHighBits = 0;
  static constexpr int kQuadsPerHigh = 1;
  static constexpr bool kHalvesDiffer = false;  // one scale and offset for the whole group
  static constexpr int64_t kTileBytes = kTileRows * kGroup * Bits / 8;
  const uint8_t* codes;
  const at::Half* scales;
  const at::Half* offsets;  // nullptr: none (Q4_0's are -8 * scale, Q8_0 has none)
  int64_t groups;

  const uint8_t* tile(int64_t nt, int64_t g) const {
    return codes + (nt * groups + g) * kTileBytes;
  }
  const at::Half* scale(int64_t nt, int64_t g) const { return scales + (nt * groups + g) * 16; }
  const at::Half* offset(int64_t nt, int64_t g) const {
    return offsets ? offsets + (nt * groups + g) * 16 : nullptr;
  }
  static int code(const uint8_t* tile, int r, int lane) { return code_at<Bits>(tile, r, lane); }
  void group_scales(int64_t nt, int64_t g, float (*d)[kTileCols], float (*m)[kTileCols]) const {
    const at::Half* s = scale(nt, g);
    const at::Half* o = offset(nt, g);
    for (int c = 0; c < kTileCols; ++c) {
      d[0][c] = d[1][c] = static_cast<float>(s[c]);
      m[0][c] = m[1][c] = o ? static_cast<float>(o[c]) : 0.f;
    }
  }
};

template <int Bits>
struct KFormat {
  static_assert(Bits >= 4 && Bits <= 6, "K codes are 4, 5 or 6 bits");
  static constexpr bool kKType = true;
  static constexpr int kBits = Bits;
  static constexpr int kHighBits = Bits - 4;
  static constexpr int kQuadsPerHigh = kHighBits ? 4 / kHighBits : 1;  // P above
  static constexpr int64_t kTileBytes = 256 + 64 * kHighBits;
  static constexpr int kSuperRows = Bits == 6 ? 1 : 2;  // S above
  static constexpr bool kHalvesDiffer = Bits == 6;
  const uint8_t* codes;
  const float* supers;
  const uint8_t* subs;
  int64_t groups;

  const uint8_t* tile(int64_t nt, int64_t g) const {
    return codes + (nt * groups + g) * kTileBytes;
  }
  static int code(const uint8_t* tile, int r, int lane) {
    int c = code_at<4>(tile, r, lane);
    if constexpr (kHighBits > 0) {
      const int q = r / 4;
      const int high = code_at<4>(tile + 256, q / kQuadsPerHigh * 4 + r % 4, lane);
      c |= ((high >> (kHighBits * (q % kQuadsPerHigh))) & ((1 << kHighBits) - 1)) << 4;
    }
    return c;
  }
  const float* super(int64_t nt, int64_t g) const {  // d (and dmin) of g's super-block
    const int64_t supers_per_tile = (groups + kSuperGroups - 1) / kSuperGroups;
    return supers + (nt * supers_per_tile + g / kSuperGroups) * kSuperRows * 16;
  }
  const uint8_t* sub(int64_t nt, int64_t g) const { return subs + (nt * groups + g) * 32; }
  // float32 products of a float16 d and a 6- or 8-bit integer: exact, as in gguf's reference.
  void group_scales(int64_t nt, int64_t g, float (*d)[kTileCols], float (*m)[kTileCols]) const {
    const float* s = super(nt, g);
    const uint8_t* u = sub(nt, g);
    for (int c = 0; c < kTileCols; ++c) {
      if constexpr (Bits == 6) {
        for (int h = 0; h < 2; ++h) {
          d[h][c] = s[c] * static_cast<float>(static_cast<int8_t>(u[h * 16 + c]));
          m[h][c] = -32.f * d[h][c];
        }
      } else {
        d[0][c] = d[1][c] = s[c] * static_cast<float>(u[c]);
        m[0][c] = m[1][c] = -(s[16 + c] * static_cast<float>(u[16 + c]));
      }
    }
  }
};

// Calls fn(format) with the format of a packed weight: a block type's (float16 scales, codes
// of `bits` 4 or 8) or a K type's (float32 super-block scales, codes of `bits` 4, 5 or 6).
template <typename Fn>
void with_format(bool k_type, int64_t bits, const uint8_t* codes, const void* scales,
                 const void* offsets, int64_t groups, Fn&& fn) {
  const auto* h = static_cast<const at::Half*>(scales);
  const auto* ho = static_cast<const at::Half*>(offsets);
  const auto* f = static_cast<const float*>(scales);
  const auto* u = static_cast<const uint8_t*>(offsets);
  if (!k_type && bits == 4) return fn(BlockFormat<4>{codes, h, ho, groups});
  if (!k_type && bits == 8) return fn(BlockFormat<8>{codes, h, ho, groups});
  if (k_type && bits == 4) return fn(KFormat<4>{codes, f, u, groups});
  if (k_type && bits == 5) return fn(KFormat<5>{codes, f, u, groups});
  if (k_type && bits == 6) return fn(KFormat<6>{codes, f, u, groups});
  TORCH_CHECK(false, "quantized weights: no layout of ", bits, "-bit codes");
}

// Instantiates X(format) for every layout (explicit instantiations across the kernel files).
#define PAGEDSERVE_FOR_EACH_FORMAT(X) \
  X(BlockFormat<4>)                   \
  X(BlockFormat<8>)                   \
  X(KFormat<4>)                       \
  X(KFormat<5>)                       \
  X(KFormat<6>)

// y[0, count) = v + bias, rounded to y's type.
template <typename T>
inline void store_out(T* y, const float* v, const float* bias, int64_t count) {
  for (int64_t c = 0; c < count; ++c) y[c] = static_cast<T>(v[c] + (bias ? bias[c] : 0.f));
}
