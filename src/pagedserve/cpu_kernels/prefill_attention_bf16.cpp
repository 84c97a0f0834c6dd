// The bfloat16 unit of prefill attention (prefill_attention.cpp hands units out): one chunk
// and KV head, bf16 queries, head size 64 or 128, over bf16 or int8 pages, wherever the CPU
// multiplies bfloat16 natively: on Intel AMX tiles at the amx level (where Linux grants them),
// else in AVX-512 BF16's vdpbf16ps (the avx512 level on AMD Zen 4 and Intel since Cooper Lake).
// Its keys are transposed once into tiles of 16 keys x 32 dims and its values interleaved in
// pairs once (int8 pages dequantized to bf16 on the way), shared by the KV head's query heads.
// Then for each query head and block of 16 queries: scores Q K^T in 16 x 16 blocks (only those
// its queries see), a softmax per query in float32 whose exponentials are rounded to bfloat16
// unnormalised (as flash attention does), P V 16 dims at a time, each row divided by its sum at
// the end. The two products take the same tiles: AMX's tile instructions, or vdpbf16ps with a
// tile row of B in a register and A's pair broadcast from memory, 16 rows of C in registers.
// On the reference 2-core CPU (Intel Xeon with AMX), 32 chunks of 147 tokens of the default
// model (9 heads, 3 KV heads, head size 64) take 1.85 ms in one call on AMX against 6.6 ms for
// torch's SDPA chunk by chunk. Capped at avx512 there, the vdpbf16ps unit took 1.1-1.25x less
// time than the portable float32 unit (scripts/bench_cpu_prefill_attention.py): that Xeon runs
// vdpbf16ps zmm at a quarter of its FMA's rate, and the unit's inner loop is vdpbf16ps and its
// broadcast alone. On AMD Zen 4 (not measured yet), where vdpbf16ps issues at its FMA's rate,
// as public instruction tables have it, each instruction does twice an FMA's products.
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"
#include "convert.h"
#include "prefill_attention.h"

#ifdef PAGEDSERVE_AVX512_BF16
namespace {

constexpr int64_t kRows = 16;  // queries per block; keys per score tile

// Per-thread buffers, reused unit after unit.
struct Scratch {
  std::vector<uint32_t> keys;    // K^T as B tiles: [16-key block][32-dim step][16][16] pairs
  std::vector<uint16_t> values;  // V as B tiles: [32-key block][16-dim column][16][32]
  std::vector<float> scores;     // [16][ld]
  std::vector<uint16_t> probs;   // A tiles: [32-key block][16][32] bfloat16
  alignas(64) uint16_t queries[kRows * 128];  // the block's, rows 2 D bytes apart, zero-padded
  alignas(64) float out[kRows * 64];
};

// exp(x) for x <= 0 (a score minus its row's maximum), inline: 2^n 2^f with n = round(x log2 e),
// |f| <= 1/2, 2^f by its degree-6 Taylor polynomial (relative error ~2e-7, far below the
// bfloat16 rounding of probabilities). glibc's vector expf cost ~3x as much, and it hands
// lanes below about -87 to its scalar path.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Row t of a head's pages as bfloat16: the page row itself, or its int8 codes times their
// scale (convert.h) rounded to bfloat16 in buf.
template <int64_t D>
const uint16_t* bf16_row(const PagedRows<at::BFloat16>& rows, int64_t t, uint16_t*) {
  return reinterpret_cast<const uint16_t*>(rows.at(t));
}

template <int64_t D>
const uint16_t* bf16_row(const PagedRows<int8_t>& rows, int64_t t, uint16_t* buf) {
  const int8_t* row = rows.at(t);
  const __m512 scale = _mm512_set1_ps(row_scale(row, D));
  const auto dequant = [&](int64_t i) {
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)), scale);
  };
  for (int64_t i = 0; i < D; i += 32) {
    _mm512_storeu_si512(buf + i, (__m512i)_mm512_cvtne2ps_pbh(dequant(i + 16), dequant(i)));
  }
  return buf;
}

// Tile (block b, step s), row r, pair lane c = dims 32s + 2r, +1 of key 16b + c; keys past n 0.
template <int64_t D, typename C>
void pack_keys(const PagedRows<C>& k, int64_t n, uint32_t* out) {
  constexpr int64_t kSteps = D / 32;
  alignas(64) uint16_t buf[D];
  std::memset(out, 0, (n + kRows - 1) / kRows * kSteps * 256 * sizeof(uint32_t));
  for (int64_t key = 0; key < n; ++key) {
    const auto* pairs = reinterpret_cast<const uint32_t*>(bf16_row<D>(k, key, buf));
    uint32_t* col = out + key / kRows * kSteps * 256 + key % kRows;
    for (int64_t s = 0; s < kSteps; ++s) {
      for (int64_t r = 0; r < 16; ++r) col[s * 256 + r * 16] = pairs[s * 16 + r];
    }
  }
}

// Tile (block b, column t), row r, lane 2c + p = dim 16t + c of key 32b + 2r + p; keys past n 0.
template <int64_t D, typename C>
void pack_values(const PagedRows<C>& v, int64_t n, uint16_t* out) {
  constexpr int64_t kCols = D / 16;
  alignas(64) static const uint16_t zeros[D] = {};
  alignas(64) uint16_t buf_a[D], buf_b[D];
  __m512i lo_idx, hi_idx;  // interleave two rows' first 16 (lo) or last 16 (hi) of 32 dims
  {
    alignas(64) uint16_t lo[32], hi[32];
    for (int c = 0; c < 16; ++c) {
      lo[2 * c] = c, lo[2 * c + 1] = 32 + c;
      hi[2 * c] = 16 + c, hi[2 * c + 1] = 48 + c;
    }
    lo_idx = _mm512_load_si512(lo);
    hi_idx = _mm512_load_si512(hi);
  }
  for (int64_t key = 0; key < (n + 31) / 32 * 32; key += 2) {
    const uint16_t* a = key < n ? bf16_row<D>(v, key, buf_a) : zeros;
    const uint16_t* b = key + 1 < n ? bf16_row<D>(v, key + 1, buf_b) : zeros;
    uint16_t* row = out + (key / 32 * kCols * 16 + key % 32 / 2) * 32;
    for (int64_t g = 0; g < D / 32; ++g) {
      const __m512i va = _mm512_loadu_si512(a + 32 * g), vb = _mm512_loadu_si512(b + 32 * g);
      _mm512_storeu_si512(row + (2 * g) * 512, _mm512_permutex2var_epi16(va, lo_idx, vb));
      _mm512_storeu_si512(row + (2 * g + 1) * 512, _mm512_permutex2var_epi16(va, hi_idx, vb));
    }
  }
}

#ifdef PAGEDSERVE_AMX
// The products on AMX tiles (the caller loads the tile configuration).
struct AmxTiles {
  // scores[i * ld + t] = the product (unscaled) of query i (16 rows of D dims from qa, 2 D
  // bytes apart) and key t, for keys [0, keys) in blocks of 16.
  template <int64_t D>
  static void scores(const char* qa, const uint32_t* keys_tiles, int64_t keys, float* scores,
                     int64_t ld) {
    constexpr int64_t kSteps = D / 32, q_ld = 2 * D;
    // tmm0-3 queries (32 dims each); blocks of keys alternate between tmm4/tmm5 (keys, sums)
    // and tmm7/tmm6, so that the tile unit does not wait for one block's sums to be stored.
    _tile_loadd(0, qa, q_ld);
    _tile_loadd(1, qa + 64, q_ld);
    if constexpr (kSteps == 4) {
      _tile_loadd(2, qa + 128, q_ld);
      _tile_loadd(3, qa + 192, q_ld);
    }
    // (A macro: the tile intrinsics take tile numbers as literals.)
#define PAGEDSERVE_KEY_BLOCK(kb, key, sum)                             \
  do {                                                                 \
    const uint32_t* kt = keys_tiles + (kb) * kSteps * 256;             \
    _tile_zero(sum);                                                   \
    _tile_loadd(key, kt, 64);                                          \
    _tile_dpbf16ps(sum, 0, key);                                       \
    _tile_loadd(key, kt + 256, 64);                                    \
    _tile_dpbf16ps(sum, 1, key);                                       \
    if constexpr (kSteps == 4) {                                       \
      _tile_loadd(key, kt + 512, 64);                                  \
      _tile_dpbf16ps(sum, 2, key);                                     \
      _tile_loadd(key, kt + 768, 64);                                  \
      _tile_dpbf16ps(sum, 3, key);                                     \
    }                                                                  \
    _tile_stored(sum, scores + (kb) * kRows, ld * sizeof(float));      \
  } while (0)
    for (int64_t kb = 0; kb * kRows < keys; kb += 2) {
      PAGEDSERVE_KEY_BLOCK(kb, 4, 5);
      if ((kb + 1) * kRows < keys) PAGEDSERVE_KEY_BLOCK(kb + 1, 7, 6);
    }
#undef PAGEDSERVE_KEY_BLOCK
  }

  // out [16][64] = probs (A tiles of 32 keys) x 64 dims of the values: tiles
  // vt + b * block_stride + c * 512 for 32-key blocks b over keys [0, keys), columns c < 4.
  static void values64(const uint16_t* probs, int64_t keys, const uint16_t* vt,
                       int64_t block_stride, float* out) {
    // tmm0-3 sums (16 dims each), tmm4 probabilities, tmm5 values.
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = 0; b * 32 < keys; ++b) {
      const uint16_t* v = vt + b * block_stride;
      _tile_loadd(4, probs + b * 512, 64);
      _tile_loadd(5, v, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(5, v + 512, 64);
      _tile_dpbf16ps(1, 4, 5);
      _tile_loadd(5, v + 1024, 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(5, v + 1536, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, out, 256);
    _tile_stored(1, out + 16, 256);
    _tile_stored(2, out + 32, 256);
    _tile_stored(3, out + 48, 256);
  }
};
#endif

// The same products in vdpbf16ps.
struct Bf16Vectors {
  // c[i] += sum over pairs r of A row i's pair r times B row r: one AMX tile product (A: 16 rows
  // of 16 bf16 pairs, kALd bytes apart; B: 16 rows of 16 pairs). B's row is loaded once for the
  // 16 rows of A, whose pairs are broadcast from memory; 16 sums in flight. A constant stride:
  // with a variable one, GCC kept the 16 rows' offsets in vector registers (a move to a general
  // register, on a vector port, every product).
  template <int64_t kALd>
  static inline void dp_tile(__m512 (&c)[kRows], const char* a, const uint32_t* b) {
    for (int r = 0; r < 16; ++r) {
      const auto bv = (__m512bh)_mm512_loadu_si512(b + 16 * r);
      for (int i = 0; i < kRows; ++i) {
        int32_t pair;
        std::memcpy(&pair, a + i * kALd + 4 * r, sizeof pair);
        c[i] = _mm512_dpbf16_ps(c[i], (__m512bh)_mm512_set1_epi32(pair), bv);
      }
    }
  }

  static inline void zero(__m512 (&c)[kRows]) {
    for (int i = 0; i < kRows; ++i) c[i] = _mm512_setzero_ps();
  }

  template <int64_t D>
  static void scores(const char* qa, const uint32_t* keys_tiles, int64_t keys, float* scores,
                     int64_t ld) {
    constexpr int64_t kSteps = D / 32;
    for (int64_t kb = 0; kb * kRows < keys; ++kb) {
      __m512 c[kRows];
      zero(c);
      for (int64_t s = 0; s < kSteps; ++s) {
        dp_tile<2 * D>(c, qa + 64 * s, keys_tiles + (kb * kSteps + s) * 256);
      }
      for (int i = 0; i < kRows; ++i) _mm512_storeu_ps(scores + i * ld + kb * kRows, c[i]);
    }
  }

  static void values64(const uint16_t* probs, int64_t keys, const uint16_t* vt,
                       int64_t block_stride, float* out) {
    for (int64_t col = 0; col < 4; ++col) {
      __m512 c[kRows];
      zero(c);
      for (int64_t b = 0; b * 32 < keys; ++b) {
        dp_tile<64>(c, reinterpret_cast<const char*>(probs + b * 512),
                    reinterpret_cast<const uint32_t*>(vt + b * block_stride + col * 512));
      }
      for (int i = 0; i < kRows; ++i) _mm512_storeu_ps(out + i * 64 + 16 * col, c[i]);
    }
  }
};

// Scores of one block of 16 queries (q: its first row; rows of them real; the first at
// position pos0) against keys [0, pos0 + rows), softmax per query (causal: query i sees keys
// [0, pos0 + i]) over s.keys, written to s.probs as unnormalised bfloat16 with zeros up to a
// multiple of 32 keys; inv_sum[i] = 1 / query i's sum.
template <typename P, int64_t D>
void block_probs(const at::BFloat16* q, int64_t q_stride, int64_t rows, int64_t pos0,
                 float scale, int64_t ld, Scratch& s, float* inv_sum) {
  const int64_t keys = pos0 + rows;
  // A block's products read 16 rows: a partial block is padded with zeros.
  if (rows < kRows) std::memset(s.queries, 0, sizeof s.queries);
  for (int64_t i = 0; i < rows; ++i) std::memcpy(s.queries + i * D, q + i * q_stride, 2 * D);
  P::template scores<D>(reinterpret_cast<const char*>(s.queries), s.keys.data(), keys,
                        s.scores.data(), ld);
  const int64_t padded = (keys + 31) / 32 * 32;
  for (int64_t i = 0; i < kRows; ++i) {
    float* sc = s.scores.data() + i * ld;
    const int64_t seen = i < rows ? pos0 + i + 1 : 0;
    const auto lanes = [&](int64_t t) {  // the lanes of keys [t, t + 16) the query sees
      return static_cast<__mmask16>(t + 16 <= seen ? 0xFFFF : (1u << (seen - t)) - 1);
    };
    __m512 mx = _mm512_set1_ps(std::numeric_limits<float>::lowest());
    for (int64_t t = 0; t < seen; t += 16) {
      mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, lanes(t), sc + t));
    }
    mx = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    const __m512 scale_v = _mm512_set1_ps(scale);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < padded; t += 16) {
      __m512 e = _mm512_setzero_ps();
      if (t < seen) {
        const __m512 x = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(sc + t), mx), scale_v);
        e = _mm512_maskz_mov_ps(lanes(t), exp_nonpositive(x));
      }
      sum = _mm512_add_ps(sum, e);
      _mm512_storeu_ps(sc + t, e);
    }
    inv_sum[i] = seen ? 1.f / _mm512_reduce_add_ps(sum) : 0.f;
    uint16_t* p = s.probs.data() + i * 32;
    for (int64_t t = 0; t < padded; t += 32) {
      _mm512_storeu_si512(p + t * 16, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sc + t + 16),
                                                              _mm512_loadu_ps(sc + t)));
    }
  }
}

// out rows [0, rows) (out: the block's first row) = s.probs x s.values, keys
// [0, keys), each row times inv_sum.
template <typename P, int64_t D>
void block_values(int64_t keys, const float* inv_sum, int64_t rows,
                  at::BFloat16* out, int64_t out_stride, Scratch& s) {
  constexpr int64_t kCols = D / 16;
  for (int64_t half = 0; half < kCols / 4; ++half) {  // 64 dims at a time
    P::values64(s.probs.data(), keys, s.values.data() + half * 4 * 512, kCols * 512,
                s.out);
    for (int64_t i = 0; i < rows; ++i) {
      auto* dst = reinterpret_cast<__m256i*>(out + i * out_stride + half * 64);
      const __m512 inv = _mm512_set1_ps(inv_sum[i]);
      for (int64_t c = 0; c < 4; ++c) {
        const __m512 o = _mm512_mul_ps(_mm512_loadu_ps(s.out + i * 64 + 16 * c), inv);
        _mm256_storeu_si256(dst + c, (__m256i)_mm512_cvtneps_pbh(o));
      }
    }
  }
}

// One unit (prefill_attention.h) of head size D.
template <typename P, int64_t D, typename C>
void chunk_head(const PrefillUnit<at::BFloat16, C>& u, Scratch& s) {
  constexpr int64_t kSteps = D / 32, kCols = D / 16;
  const int64_t n_keys = u.n_keys, q_len = u.q_len;
  const int64_t ld = (n_keys + 31) / 32 * 32;  // scores and probabilities a row
  s.keys.resize((n_keys + kRows - 1) / kRows * kSteps * 256);
  s.values.resize(ld / 32 * kCols * 512);
  s.scores.resize(kRows * ld);
  s.probs.resize(kRows * ld);
  pack_keys<D>(u.k, n_keys, s.keys.data());
  pack_values<D>(u.v, n_keys, s.values.data());
  const int64_t blocks = (q_len + kRows - 1) / kRows, past = n_keys - q_len;
  float inv_sum[kRows];
  for (int64_t idx = 0; idx < u.g * blocks; ++idx) {  // query heads x blocks of 16 queries
    const int64_t j = idx / blocks, r0 = idx % blocks * kRows;
    const int64_t rows = std::min(kRows, q_len - r0);
    block_probs<P, D>(u.q + r0 * u.q_stride + j * D, u.q_stride, rows, past + r0, u.scale, ld,
                      s, inv_sum);
    block_values<P, D>(past + r0 + rows, inv_sum, rows, u.out + r0 * u.out_stride + j * D,
                       u.out_stride, s);
  }
}

template <typename P, typename C>
void unit_with(const PrefillUnit<at::BFloat16, C>& u) {
  thread_local Scratch scratch;
  (u.d == 64 ? chunk_head<P, 64, C> : chunk_head<P, 128, C>)(u, scratch);
}

}  // namespace

bool prefill_unit_bf16_supported(const at::Tensor& q) {
  return q.scalar_type() == at::kBFloat16 && (q.size(2) == 64 || q.size(2) == 128);
}

template <typename C>
void prefill_unit_bf16(const PrefillUnit<at::BFloat16, C>& u) {
#ifdef PAGEDSERVE_AMX
  if (amx_available()) {
    _tile_loadconfig(&tile_config());
    unit_with<AmxTiles>(u);
    _tile_release();
    return;
  }
#endif
  unit_with<Bf16Vectors>(u);
}

template void prefill_unit_bf16(const PrefillUnit<at::BFloat16, at::BFloat16>& u);
template void prefill_unit_bf16(const PrefillUnit<at::BFloat16, int8_t>& u);
#endif
