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
// Each work item is one panel (32 outputs) for a chunk of rows: tiles of 8 rows by 32 outputs
// accumulate in 16 float32 registers over all of K, then round to bfloat16 once. A decode
// step's rows (256 or fewer, where there are panels enough for every thread) are one chunk:
// each panel is read from memory once per step, going through K in blocks of 16 KiB that
// every tile uses in turn from L1 (the sums parked between blocks). The first two tiles prefetch
// the next block as they go, one of each input pair's two cache lines each, so that the
// memory stays busy while all the tiles compute (prefetching it all during the first tile
// left the memory idle for the rest: 10-15% slower at 16 to 128 rows). They prefetch into
// L2, not L1, which the tiles read from a block later (on a 2-core AVX512-BF16 EPYC, weights
// from memory: 768 -> 4096 at 16 rows 12-17% less time a layer than into L1, 0-15% at 1, 4
// and 64 rows; 2048 -> 768 at 16 rows within the noise either way). Larger inputs are cut
// into chunks of up to 64 rows that compute from cache, a whole panel per tile, since each
// panel is read once per chunk. Summation order is the same either way.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_math.h"

namespace {

#ifdef MMSERVE_BF16_DOT

constexpr int64_t kCols = 32;       // outputs per panel (two vectors of 16 float32)
constexpr int64_t kTileRows = 8;    // rows per register tile
constexpr int64_t kChunkRows = 64;  // rows per work item of a larger input

// Inputs of up to kStreamRows rows stream each panel in blocks of kBlockPairs input pairs
// (16 KiB), given at least kStreamPanelsPerThread panels per thread (fewer would leave threads
// idle: larger inputs are then chunked as usual).
constexpr int64_t kStreamRows = 256;
constexpr int64_t kBlockPairs = 128;
constexpr int64_t kStreamPanelsPerThread = 4;
constexpr int64_t kClaim = 4;  // items a thread takes at a time (parallel_claim)

// Rows [0, R) of a tile over input pairs [0, pairs) of one block of a panel. The sums start
// from `sums` (or the bias, or zero, on the first block) and go back to `sums`, or, on the
// last block, round to bfloat16 into `out`. `prefetch` (or null): the next block, of which the
// tile prefetches the first cache line of each input pair, or both with `both_lines`.
template <int64_t R>
void tile(const uint16_t* x, int64_t x_stride, const uint16_t* panel, int64_t pairs,
          float* sums, bool first, const float* bias, uint16_t* out, int64_t out_stride,
          int64_t cols, const uint16_t* prefetch, bool both_lines) {
  __m512 acc[R][2];
  for (int64_t r = 0; r < R; ++r) {
    if (!first) {
      acc[r][0] = _mm512_loadu_ps(sums + r * kCols);
      acc[r][1] = _mm512_loadu_ps(sums + r * kCols + 16);
    } else {
      acc[r][0] = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
      acc[r][1] = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
    }
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + p * 2 * kCols);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + p * 2 * kCols + kCols);
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + p * 2 * kCols), _MM_HINT_T1);
      if (both_lines) {
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + p * 2 * kCols + kCols), _MM_HINT_T1);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * x_stride + 2 * p, sizeof pair);
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, w1);
    }
  }
  if (out == nullptr) {
    for (int64_t r = 0; r < R; ++r) {
      _mm512_storeu_ps(sums + r * kCols, acc[r][0]);
      _mm512_storeu_ps(sums + r * kCols + 16, acc[r][1]);
    }
    return;
  }
  // Output rows a multiple of 4 KiB apart put a tile's rows in one cache set: 12% slower at
  // 4096 outputs. Whole cache lines are then written past the cache (no read for ownership).
  if (cols == kCols && (out_stride * 2) % 4096 == 0 &&
      (reinterpret_cast<uintptr_t>(out) & 63) == 0) {
    for (int64_t r = 0; r < R; ++r) {
      const __m256i a = (__m256i)_mm512_cvtneps_pbh(acc[r][0]);
      const __m256i b = (__m256i)_mm512_cvtneps_pbh(acc[r][1]);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(out + r * out_stride),
                          _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
    }
    return;
  }
  const __mmask16 lo = mmserve_cpu::first_lanes(cols), hi = mmserve_cpu::first_lanes(cols - 16);
  for (int64_t r = 0; r < R; ++r) {
    uint16_t* dst = out + r * out_stride;
    _mm256_mask_storeu_epi16(dst, lo, (__m256i)_mm512_cvtneps_pbh(acc[r][0]));
    _mm256_mask_storeu_epi16(dst + 16, hi, (__m256i)_mm512_cvtneps_pbh(acc[r][1]));
  }
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, bool,
                        const float*, uint16_t*, int64_t, int64_t, const uint16_t*, bool);
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
  // Rows are one chunk (streamed), or chunks of at most kChunkRows, all of about the same size,
  // so that items are of about equal work (197 rows: 50, 50, 50 and 47, not 64, 64, 64 and 5,
  // which left one of two threads 59 rows behind when each took half of the items). Threads
  // take items a few at a time as they come free, so a thread that another process holds up
  // does fewer of them instead of every other thread waiting for it.
  const bool one_chunk =
      rows <= kStreamRows && panels >= kStreamPanelsPerThread * at::get_num_threads();
  const int64_t x_stride = x.stride(0);
  const int64_t chunks = one_chunk ? (rows > 0) : (rows + kChunkRows - 1) / kChunkRows;
  const int64_t chunk_rows = chunks > 0 ? (rows + chunks - 1) / chunks : 0;
  // Items are (row chunk, panel), panels inner: the items of a batch share rows.
  mmserve_cpu::parallel_claim(chunks * panels, kClaim, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / panels, panel = item % panels;
      const int64_t row_begin = chunk * chunk_rows;
      const int64_t row_end = std::min(rows, row_begin + chunk_rows);
      const int64_t cols = std::min<int64_t>(kCols, out_features - panel * kCols);
      const uint16_t* w = wp + panel * pairs * 2 * kCols;
      const float* b = bp ? bp + panel * kCols : nullptr;
      const int64_t block_pairs = one_chunk ? kBlockPairs : std::max<int64_t>(pairs, 1);
      float sums[kStreamRows * kCols];  // the tiles' sums between blocks (32 KiB)
      // At least one block, so that a weight without inputs still writes its bias.
      for (int64_t p0 = 0; p0 == 0 || p0 < pairs; p0 += block_pairs) {
        const int64_t block = std::min(block_pairs, pairs - p0);
        const bool first = p0 == 0, last = p0 + block == pairs;
        for (int64_t r = row_begin; r < row_end; r += kTileRows) {
          const int64_t n = std::min(kTileRows, row_end - r);
          kTiles[n](xp + r * x_stride + 2 * p0, x_stride, w + p0 * 2 * kCols, block,
                    sums + (r - row_begin) * kCols, first, b,
                    last ? op + r * out_features + panel * kCols : nullptr, out_features, cols,
                    one_chunk && r - row_begin < 2 * kTileRows
                        ? w + (p0 + block) * 2 * kCols + (r == row_begin ? 0 : kCols)
                        : nullptr,
                    row_end - row_begin <= kTileRows);
        }
      }
    }
    _mm_sfence();  // the streamed rows (tile's) are seen by whatever reads the output next
  });
#endif
  return out;
}
