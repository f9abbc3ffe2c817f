// The float32 register tile shared by the linear layers and the attention of AVX2 machines:
// rows [0, R) of a matrix x (R <= 6, any row stride) times `depth` rows of a 16-wide panel
// (row k of the panel at panel + 16 k), added to a 16-column block of `out`; optionally
// prefetching, one per step, the cache lines of weights the next tiles will read.
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MMSERVE_F32_FMA 1
#endif

namespace mmserve_cpu {

constexpr int64_t kCols = 16;     // columns per panel: two vectors of 8 float32
constexpr int64_t kTileRows = 6;  // rows per register tile: 12 accumulators of 16 registers
inline constexpr float kZeros[kCols] = {};  // the `init` of a tile without a bias

#ifdef MMSERVE_F32_FMA

// Rows [0, R) of x (stride x_stride) times inputs [0, depth) of one panel, added to the
// tile's sums: from `init` (bias or zeros) when `first`, else from what `out` holds. Full
// 16-output rows only (a narrower last panel goes through a scratch tile), so the 12
// accumulators, two weight vectors and a broadcast are all that live in the loop: 15 of the
// 16 vector registers.
//
// The accumulators are named variables, not an array: GCC keeps an array of vectors that is
// read after the loop in memory, and stores all twelve on every step of it.
//
// Steps k < prefetch_rows also prefetch row k of `prefetch` (16 floats, one cache line of a
// packed panel) into L2. A linear layer gives each tile of a block a share of the block that
// follows, so that the memory fetches the next weights while the tiles compute on these.
#define MMSERVE_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
template <int64_t R>
void tile(const float* x, int64_t x_stride, const float* panel, int64_t depth, bool first,
          const float* init, float* out, int64_t out_stride, const float* prefetch,
          int64_t prefetch_rows) {
  static_assert(R >= 1 && R <= kTileRows);
#define MMSERVE_DECLARE(i) __m256 acc##i##a = _mm256_setzero_ps(), acc##i##b = acc##i##a;
  MMSERVE_ROWS(MMSERVE_DECLARE)
#define MMSERVE_LOAD(i)                                          \
  if constexpr (i < R) {                                         \
    const float* from = first ? init : out + i * out_stride;     \
    acc##i##a = _mm256_loadu_ps(from);                           \
    acc##i##b = _mm256_loadu_ps(from + 8);                       \
  }
  MMSERVE_ROWS(MMSERVE_LOAD)
  for (int64_t k = 0; k < depth; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kCols);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kCols + 8);
    if (k < prefetch_rows) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + k * kCols), _MM_HINT_T1);
    }
#define MMSERVE_FMA(i)                                                  \
  if constexpr (i < R) {                                                \
    const __m256 xr = _mm256_broadcast_ss(x + i * x_stride + k);        \
    acc##i##a = _mm256_fmadd_ps(xr, w0, acc##i##a);                     \
    acc##i##b = _mm256_fmadd_ps(xr, w1, acc##i##b);                     \
  }
    MMSERVE_ROWS(MMSERVE_FMA)
  }
#define MMSERVE_STORE(i)                                         \
  if constexpr (i < R) {                                         \
    _mm256_storeu_ps(out + i * out_stride, acc##i##a);           \
    _mm256_storeu_ps(out + i * out_stride + 8, acc##i##b);       \
  }
  MMSERVE_ROWS(MMSERVE_STORE)
#undef MMSERVE_DECLARE
#undef MMSERVE_LOAD
#undef MMSERVE_FMA
#undef MMSERVE_STORE
}
#undef MMSERVE_ROWS

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, bool, const float*, float*,
                        int64_t, const float*, int64_t);
constexpr TileFn kTiles[kTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>,
                                          tile<4>, tile<5>, tile<6>};

#endif  // MMSERVE_F32_FMA

}  // namespace mmserve_cpu
