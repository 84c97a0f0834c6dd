// y = x W^T for many float32 rows (prefill, big batches) over packed codes: each tile is
// decoded to float32 once per chunk of rows and multiplied by all of them.
// - AVX2 and up: a thread decodes one tile (16 columns x 32 inputs) in L1 and multiplies every
//   row of the chunk by it, six rows at a time in registers.
// - Portable: strips of columns decoded to float32, each multiplied by torch's matmul, which
//   beats any portable loop at this size.
#include <ATen/Parallel.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <type_traits>

#include "claims.h"
#include "quant_decode.h"
#include "quant_kernels.h"

#ifdef PAGEDSERVE_AVX2

namespace {

// acc[R][16] += rows [0, R) of x (row stride ldx) times one decoded tile w[32][16].
template <int R>
inline void multiply_tile(const float* w, const float* x, int64_t ldx, float* acc) {
  __m256 a[R][2];
  for (int i = 0; i < R; ++i) {
    a[i][0] = _mm256_loadu_ps(acc + i * 16);
    a[i][1] = _mm256_loadu_ps(acc + i * 16 + 8);
  }
  for (int j = 0; j < kGroup; ++j) {
    const __m256 w0 = _mm256_load_ps(w + j * 16), w1 = _mm256_load_ps(w + j * 16 + 8);
    for (int i = 0; i < R; ++i) {
      const __m256 xb = _mm256_broadcast_ss(x + i * ldx + j);
      a[i][0] = _mm256_fmadd_ps(w0, xb, a[i][0]);
      a[i][1] = _mm256_fmadd_ps(w1, xb, a[i][1]);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(acc + i * 16, a[i][0]);
    _mm256_storeu_ps(acc + i * 16 + 8, a[i][1]);
  }
}

}  // namespace

template <typename T, typename F>
void many_rows_linear(const float* x, int64_t m, int64_t k, const F& wt, const float* bias, T* y,
                      int64_t n) {
  constexpr int kBlock = 6;  // rows a multiply_tile: 12 accumulators in registers
  constexpr int64_t kChunkRows = 64;  // sums of a chunk: 4 KB, in L1 beside the tile
  const int64_t groups = k / kGroup;
  parallel_tiles(n / kTileCols, [&](int64_t begin, int64_t end) {
    alignas(32) float w[kGroup * kTileCols];
    alignas(32) float acc[kChunkRows * kTileCols];
    for (int64_t nt = begin; nt < end; ++nt) {
      for (int64_t m0 = 0; m0 < m; m0 += kChunkRows) {
        const int64_t rows = std::min(kChunkRows, m - m0);
        std::fill(acc, acc + rows * kTileCols, 0.f);
        for (int64_t g = 0; g < groups; ++g) {
          decode_tile_f32(wt, nt, g, w);
          const float* xg = x + m0 * k + g * kGroup;
          for (int64_t i0 = 0; i0 < rows; i0 += kBlock) {
            switch (std::min<int64_t>(kBlock, rows - i0)) {
              case 1: multiply_tile<1>(w, xg + i0 * k, k, acc + i0 * 16); break;
              case 2: multiply_tile<2>(w, xg + i0 * k, k, acc + i0 * 16); break;
              case 3: multiply_tile<3>(w, xg + i0 * k, k, acc + i0 * 16); break;
              case 4: multiply_tile<4>(w, xg + i0 * k, k, acc + i0 * 16); break;
              case 5: multiply_tile<5>(w, xg + i0 * k, k, acc + i0 * 16); break;
              default: multiply_tile<6>(w, xg + i0 * k, k, acc + i0 * 16);
            }
          }
        }
        for (int64_t i = 0; i < rows; ++i) {
          store_out(y + (m0 + i) * n + nt * kTileCols, acc + i * kTileCols,
                    bias ? bias + nt * kTileCols : nullptr, kTileCols);
        }
      }
    }
  });
}

#else  // portable C++

template <typename T, typename F>
void many_rows_linear(const float* x, int64_t m, int64_t k, const F& wt, const float* bias, T* y,
                      int64_t n) {
  // Each thread decodes a strip into its own cache and multiplies it there (one thread per
  // matmul): decoding in parallel and multiplying on every thread moved each strip between
  // the cores' caches, and took 2-3 parallel regions a strip. Strips of about 128 columns,
  // as many for each thread.
  const auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  const int64_t threads = at::get_num_threads(), tiles = n / kTileCols;
  const int64_t strips = ceil_div(ceil_div(tiles, 8), threads) * threads;
  const int64_t strip_cols = ceil_div(tiles, strips) * kTileCols;
  const int64_t groups = k / kGroup;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor xt = at::from_blob(const_cast<float*>(x), {m, k}, f32);
  at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
    const at::Tensor w = xt.new_empty({k, strip_cols});
    float* wp = w.data_ptr<float>();
    for (int64_t strip = begin; strip < end; ++strip) {
      const int64_t n0 = strip * strip_cols, cols = std::min(strip_cols, n - n0);
      if (cols <= 0) break;
      for (int64_t nt = n0 / kTileCols; nt < (n0 + cols) / kTileCols; ++nt) {
        for (int64_t g = 0; g < groups; ++g) {
          decode_tile_f32(wt, nt, g, wp + g * kGroup * strip_cols + (nt * kTileCols - n0),
                          strip_cols);
        }
      }
      const at::Tensor ws = w.narrow(1, 0, cols);
      if constexpr (std::is_same_v<T, float>) {  // straight into y's columns
        at::Tensor out = at::from_blob(y, {m, n}, f32).narrow(1, n0, cols);
        at::mm_out(out, xt, ws);
        if (bias) out.add_(at::from_blob(const_cast<float*>(bias) + n0, {cols}, f32));
      } else {
        const at::Tensor o = at::mm(xt, ws);
        for (int64_t i = 0; i < m; ++i) {
          store_out(y + i * n + n0, o.data_ptr<float>() + i * cols, bias ? bias + n0 : nullptr,
                    cols);
        }
      }
    }
  });
}

#endif  // PAGEDSERVE_AVX2

#define INSTANTIATE(F)                                                                     \
  template void many_rows_linear<float, F>(const float*, int64_t, int64_t, const F&,       \
                                           const float*, float*, int64_t);                 \
  template void many_rows_linear<at::BFloat16, F>(const float*, int64_t, int64_t, const F&, \
                                                  const float*, at::BFloat16*, int64_t);
PAGEDSERVE_FOR_EACH_FORMAT(INSTANTIATE)
