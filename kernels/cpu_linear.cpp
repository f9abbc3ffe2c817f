// bfloat16 linear layers on the CPU with AVX512-BF16, from weights packed once at load time.
//
// Decode steps multiply a few dozen rows by every weight of the model, so each weight is
// streamed from memory once per step and used for only those rows. torch's bfloat16 matmul
// reads weights in their [out, in] layout, which it must reblock on the fly; packed panels
// are read front to back instead, at the pace the prefetcher keeps up with.
//
// pack_linear_weight(weight [N, K])    -> panels [ceil(N/32), K/2, 32, 2]: for 32 outputs at a
//                                         time, each pair of inputs (k, k+1) of each output,
//                                         the layout of the pair dot-product instruction
// packed_linear(x [M, K], panels, bias, N) -> x @ weight.T + bias, [M, N]; the bias float32,
//                                         zero-padded to whole panels, or None
//
// Each work item is one panel (32 outputs) for up to 64 rows: tiles of 8 rows by 32 outputs
// accumulate in 16 float32 registers over all of K, then round to bfloat16 once.

#include <ATen/ATen.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_math.h"

namespace {

#ifdef MMSERVE_BF16_DOT

constexpr int64_t kCols = 32;       // outputs per panel (two vectors of 16 float32)
constexpr int64_t kTileRows = 8;    // rows per register tile
constexpr int64_t kChunkRows = 64;  // rows per work item

template <int64_t R>
void tile(const uint16_t* x, int64_t x_stride, const uint16_t* panel, int64_t pairs,
          const float* bias, uint16_t* out, int64_t out_stride, int64_t cols) {
  __m512 acc[R][2];
  for (int64_t r = 0; r < R; ++r) {
    acc[r][0] = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    acc[r][1] = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + p * 2 * kCols);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + p * 2 * kCols + kCols);
    for (int64_t r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * x_stride + 2 * p, sizeof pair);
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, w1);
    }
  }
  const __mmask16 lo = mmserve_cpu::first_lanes(cols), hi = mmserve_cpu::first_lanes(cols - 16);
  for (int64_t r = 0; r < R; ++r) {
    uint16_t* dst = out + r * out_stride;
    _mm256_mask_storeu_epi16(dst, lo, (__m256i)_mm512_cvtneps_pbh(acc[r][0]));
    _mm256_mask_storeu_epi16(dst + 16, hi, (__m256i)_mm512_cvtneps_pbh(acc[r][1]));
  }
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*,
                        uint16_t*, int64_t, int64_t);
constexpr TileFn kTiles[kTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>,
                                          tile<5>, tile<6>, tile<7>, tile<8>};

#endif  // MMSERVE_BF16_DOT

void check_weight(const at::Tensor& weight) {
  mmserve_cpu::check_cpu_tensor(weight, "pack_linear_weight", "the weight");
  MMSERVE_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
                "pack_linear_weight: expected a contiguous bfloat16 [out, in] weight");
  MMSERVE_CHECK(weight.size(1) % 2 == 0, "pack_linear_weight: the input size must be even");
}

}  // namespace

bool packed_linear_supported() {
#ifdef MMSERVE_BF16_DOT
  return true;
#else
  return false;
#endif
}

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  check_weight(weight);
  const int64_t n = weight.size(0), k = weight.size(1), pairs = k / 2, panels = (n + 31) / 32;
  auto packed = at::zeros({panels, pairs, 32, 2}, weight.options());
  const auto* src = reinterpret_cast<const uint32_t*>(weight.data_ptr());  // (k, k+1) pairs
  auto* dst = reinterpret_cast<uint32_t*>(packed.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      for (int64_t j = 0; j < 32 && panel * 32 + j < n; ++j) {
        const uint32_t* row = src + (panel * 32 + j) * pairs;
        for (int64_t p = 0; p < pairs; ++p) dst[(panel * pairs + p) * 32 + j] = row[p];
      }
    }
  });
  return packed;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias, int64_t out_features) {
  MMSERVE_CHECK(packed_linear_supported(), "packed_linear: needs AVX512-BF16");
  // Everything the pointer arithmetic below assumes is checked here, before any data pointer
  // is read.
  mmserve_cpu::check_cpu_tensor(x, "packed_linear", "x");
  mmserve_cpu::check_cpu_tensor(packed, "packed_linear", "the packed weight");
  MMSERVE_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
                "packed_linear: expected bfloat16 x [rows, in] with contiguous rows");
  MMSERVE_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.size(2) == 32 &&
                    packed.size(3) == 2 && packed.is_contiguous(),
                "packed_linear: the weight must come from pack_linear_weight");
  MMSERVE_CHECK(x.size(1) == 2 * packed.size(1), "packed_linear: x has ", x.size(1),
                " features, the weight takes ", 2 * packed.size(1));
  MMSERVE_CHECK(out_features >= 0 && out_features > 32 * (packed.size(0) - 1) &&
                    out_features <= 32 * packed.size(0),
                "packed_linear: out_features does not match the packed weight (", out_features,
                " outputs, ", packed.size(0), " panels of 32)");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) mmserve_cpu::check_cpu_tensor(*bias, "packed_linear", "the bias");
  MMSERVE_CHECK(!has_bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                              bias->numel() == 32 * packed.size(0)),
                "packed_linear: the bias must be float32, padded to ", 32 * packed.size(0));
  const int64_t rows = x.size(0), pairs = packed.size(1), panels = packed.size(0);
  auto out = at::empty({rows, out_features}, x.options());
#ifdef MMSERVE_BF16_DOT
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t x_stride = x.stride(0), chunks = (rows + kChunkRows - 1) / kChunkRows;
  // Items are (row chunk, panel), panels inner: consecutive items of one thread share rows.
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / panels, panel = item % panels;
      const int64_t row_end = std::min(rows, (chunk + 1) * kChunkRows);
      const int64_t cols = std::min<int64_t>(kCols, out_features - panel * kCols);
      const uint16_t* w = wp + panel * pairs * 2 * kCols;
      const float* b = bp ? bp + panel * kCols : nullptr;
      for (int64_t r = chunk * kChunkRows; r < row_end; r += kTileRows) {
        const int64_t n = std::min(kTileRows, row_end - r);
        kTiles[n](xp + r * x_stride, x_stride, w, pairs, b, op + r * out_features + panel * kCols,
                  out_features, cols);
      }
    }
  });
#endif
  return out;
}
