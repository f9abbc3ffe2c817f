// float32 linear layers on x86 CPUs with AVX2 and FMA, from weights packed once at load time.
//
// A decode step multiplies a few rows by every weight of the model: it streams the weights
// from memory once, and its speed is how close that stream comes to the memory bandwidth.
// torch's float32 matmul (MKL) reads the [out, in] layout at about half of it for a handful
// of rows; packed panels are read front to back, one contiguous run per thread. Prompt chunks
// and images bring thousands of rows: there the kernel is compute-bound, and keeps a block of
// each panel in the L1 cache while every row tile of a chunk passes over it.
//
// pack_linear_weight_f32(weight [N, K])      -> panels [ceil(N/16), K, 16]: 16 outputs at a
//                                               time, all of their weights for input k side by
//                                               side (two 8-lane vectors), zero-padded
// packed_linear_f32(x [M, K], panels, bias, N) -> x @ weight.T + bias, [M, N] float32
//
// Work items are (chunk of up to 96 rows, panel); within one, the panel's inputs go in blocks
// of 256 (16 KiB of weights), and for each block every tile of 6 rows by 16 outputs runs its
// 12 accumulators over the block, starting from the partial sums of the block before (kept in
// the output, in float32, so the result equals one pass over all of K in this order).

#include <ATen/ATen.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MMSERVE_F32_FMA 1
#endif

namespace {

constexpr int64_t kCols = 16;        // outputs per panel
constexpr int64_t kTileRows = 6;     // rows per register tile: 12 accumulators of 16 registers
constexpr int64_t kChunkRows = 96;   // rows per work item
constexpr int64_t kDepth = 256;      // inputs per block: 16 KiB of one panel, in L1

#ifdef MMSERVE_F32_FMA

// Rows [0, R) of x (stride x_stride) times inputs [0, depth) of one panel, added to the
// tile's sums: from `init` (bias or zeros) when `first`, else from what `out` holds. Full
// 16-output rows only (a narrower last panel goes through a scratch tile), so the 12
// accumulators, two weight vectors and a broadcast are all that live in the loop: 15 of the
// 16 vector registers.
//
// The accumulators are named variables, not an array: GCC keeps an array of vectors that is
// read after the loop in memory, and stores all twelve on every step of it.
#define MMSERVE_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
template <int64_t R>
void tile(const float* x, int64_t x_stride, const float* panel, int64_t depth, bool first,
          const float* init, float* out, int64_t out_stride) {
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
                        int64_t);
constexpr TileFn kTiles[kTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>,
                                          tile<4>, tile<5>, tile<6>};

#endif  // MMSERVE_F32_FMA

}  // namespace

bool packed_linear_f32_supported() {
#ifdef MMSERVE_F32_FMA
  return true;
#else
  return false;
#endif
}

bool has_avx512() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

at::Tensor pack_linear_weight_f32(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "pack_linear_weight_f32: expected a contiguous float32 [out, in] weight");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kCols - 1) / kCols;
  auto packed = at::zeros({panels, k, kCols}, weight.options());
  const float* src = weight.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      for (int64_t j = 0; j < kCols && panel * kCols + j < n; ++j) {
        const float* row = src + (panel * kCols + j) * k;
        for (int64_t i = 0; i < k; ++i) dst[(panel * k + i) * kCols + j] = row[i];
      }
    }
  });
  return packed;
}

at::Tensor packed_linear_f32(const at::Tensor& x, const at::Tensor& packed,
                             const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(packed_linear_f32_supported(), "packed_linear_f32: needs AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "packed_linear_f32: expected float32 x [rows, in] with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat &&
                  packed.size(2) == kCols && packed.is_contiguous(),
              "packed_linear_f32: the weight must come from pack_linear_weight_f32");
  TORCH_CHECK(x.size(1) == packed.size(1), "packed_linear_f32: x has ", x.size(1),
              " features, the weight takes ", packed.size(1));
  const int64_t panels = packed.size(0);
  TORCH_CHECK(out_features > kCols * (panels - 1) && out_features <= kCols * panels,
              "packed_linear_f32: out_features does not match the packed weight");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                            bias->numel() == kCols * panels),
              "packed_linear_f32: the bias must be float32, padded to ", kCols * panels);
  const int64_t rows = x.size(0), depth = packed.size(1);
  auto out = at::empty({rows, out_features}, x.options());
#ifdef MMSERVE_F32_FMA
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const float zeros[kCols] = {};
  const int64_t x_stride = x.stride(0), chunks = (rows + kChunkRows - 1) / kChunkRows;
  // Items are (row chunk, panel), panels inner: one thread's panels are one contiguous run of
  // the packed weight, and its consecutive items share rows.
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / panels, panel = item % panels;
      const int64_t row_end = std::min(rows, (chunk + 1) * kChunkRows);
      const int64_t cols = std::min(kCols, out_features - panel * kCols);
      const float* w = wp + panel * depth * kCols;
      const float* init = bp ? bp + panel * kCols : zeros;
      for (int64_t k0 = 0; k0 < depth; k0 += kDepth) {
        const int64_t block = std::min(kDepth, depth - k0);
        for (int64_t r = chunk * kChunkRows; r < row_end; r += kTileRows) {
          const int64_t n = std::min(kTileRows, row_end - r);
          float* dst = op + r * out_features + panel * kCols;
          if (cols == kCols) {
            kTiles[n](xp + r * x_stride + k0, x_stride, w + k0 * kCols, block, k0 == 0, init,
                      dst, out_features);
            continue;
          }
          float scratch[kTileRows * kCols];  // the last panel's outputs that exist, and room
          for (int64_t i = 0; i < n; ++i) std::copy_n(dst + i * out_features, cols, scratch + i * kCols);
          kTiles[n](xp + r * x_stride + k0, x_stride, w + k0 * kCols, block, k0 == 0, init,
                    scratch, kCols);
          for (int64_t i = 0; i < n; ++i) std::copy_n(scratch + i * kCols, cols, dst + i * out_features);
        }
      }
    }
  });
#endif
  return out;
}
