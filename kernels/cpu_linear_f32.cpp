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
// Work items are (chunk of up to 96 rows, panel); within one, the panel's inputs go in blocks (of
// 256, 16 KiB of weights; fewer for a chunk of a few tiles), and for each block every tile of 6
// rows by 16 outputs runs its 12 accumulators over the block, starting from the partial sums of the
// block before (kept in the output, in float32, so the result equals one pass over all of K in this
// order). The chunks of one input are of about equal size, and threads take items a few at a time
// as they come free (parallel_claim): with fixed halves of the items, 100 rows (a chunk of 96 and
// one of 4) left one of two threads with 96% of the work, and every step waited for a thread that
// another process held up. Each output is computed the same way whichever thread runs it. While a
// block's tiles compute, they prefetch the weights the thread reads next into L2.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "cpu_math.h"
#include "cpu_tile_f32.h"

namespace {

using mmserve_cpu::kCols;
using mmserve_cpu::kTileRows;
#ifdef MMSERVE_F32_FMA
using mmserve_cpu::kTiles;
#endif
constexpr int64_t kChunkRows = 96;   // rows per work item, at most
constexpr int64_t kClaim = 4;        // items a thread takes at a time: 4 panels in a row

// Inputs per block of a chunk of `rows` rows. A lone tile (up to 6 rows, the weights used
// once) and a chunk of over 48 rows take 256 (16 KiB of one panel, in L1 while the tiles pass
// over it). A chunk of 2-4 tiles, a decode step's, reads each block from memory and uses it
// only a few times: there 64 (4 KiB, beside 4-6 KiB of the rows' inputs) ran 1.08-1.17x the
// speed of 256 at 16 rows, weights from memory, two threads (1.10-1.17x on one); 25-48 rows
// ran best at 128.
int64_t block_depth(int64_t rows) {
  if (rows <= kTileRows || rows > 48) return 256;
  return rows <= 24 ? 64 : 128;
}

}  // namespace

bool packed_linear_f32_supported() {
#ifdef MMSERVE_F32_FMA
  return true;
#else
  return false;
#endif
}

at::Tensor pack_linear_weight_f32(const at::Tensor& weight) {
  mmserve_cpu::check_cpu_tensor(weight, "pack_linear_weight_f32", "the weight");
  MMSERVE_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
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
  MMSERVE_CHECK(packed_linear_f32_supported(), "packed_linear_f32: needs AVX2 and FMA");
  // Everything the pointer arithmetic below assumes is checked here, before any data pointer
  // is read.
  mmserve_cpu::check_cpu_tensor(x, "packed_linear_f32", "x");
  mmserve_cpu::check_cpu_tensor(packed, "packed_linear_f32", "the packed weight");
  MMSERVE_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
                "packed_linear_f32: expected float32 x [rows, in] with contiguous rows");
  MMSERVE_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat &&
                    packed.size(2) == kCols && packed.is_contiguous(),
                "packed_linear_f32: the weight must come from pack_linear_weight_f32");
  MMSERVE_CHECK(x.size(1) == packed.size(1), "packed_linear_f32: x has ", x.size(1),
                " features, the weight takes ", packed.size(1));
  const int64_t panels = packed.size(0);
  MMSERVE_CHECK(out_features >= 0 && out_features > kCols * (panels - 1) &&
                    out_features <= kCols * panels,
                "packed_linear_f32: out_features does not match the packed weight (", out_features,
                " outputs, ", panels, " panels of ", kCols, ")");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) mmserve_cpu::check_cpu_tensor(*bias, "packed_linear_f32", "the bias");
  MMSERVE_CHECK(!has_bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                              bias->numel() == kCols * panels),
                "packed_linear_f32: the bias must be float32, padded to ", kCols * panels);
  const int64_t rows = x.size(0), depth = packed.size(1);
  auto out = at::empty({rows, out_features}, x.options());
#ifdef MMSERVE_F32_FMA
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  // Chunks of equal size, a whole number of tiles (but the last): 100 rows are 54 + 46, not
  // 96 + 4. Rounding up to whole tiles can leave fewer chunks than first counted.
  const int64_t least = (rows + kChunkRows - 1) / kChunkRows;
  const int64_t chunk_rows =
      least > 0 ? ((rows + least - 1) / least + kTileRows - 1) / kTileRows * kTileRows : 0;
  const int64_t chunks = least > 0 ? (rows + chunk_rows - 1) / chunk_rows : 0;
  // Items are (row chunk, panel), panels inner: a thread's batch is a run of consecutive
  // panels of the packed weight over the same rows.
  mmserve_cpu::parallel_claim(chunks * panels, kClaim, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / panels, panel = item % panels;
      const int64_t row_begin = chunk * chunk_rows;
      const int64_t row_end = std::min(rows, row_begin + chunk_rows);
      const int64_t tiles = (row_end - row_begin + kTileRows - 1) / kTileRows;
      const int64_t cols = std::min(kCols, out_features - panel * kCols);
      const float* w = wp + panel * depth * kCols;
      const float* init = bp ? bp + panel * kCols : mmserve_cpu::kZeros;
      // This thread's next item is the next panel, whose weights follow this one's in memory.
      const bool next_adjacent = item + 1 < end && panel + 1 < panels;
      // The last panel's outputs that exist, and room: columns past `cols` are never copied
      // out, but zeroed once so that the tile, which reads all 16, never reads uninitialized
      // memory.
      float scratch[kTileRows * kCols] = {};
      const int64_t step = block_depth(row_end - row_begin);
      // At least one block, so that without inputs (depth 0) the output is the bias (or 0).
      for (int64_t k0 = 0; k0 == 0 || k0 < depth; k0 += step) {
        const int64_t block = std::min(step, depth - k0);
        // The tiles share out the weights this thread reads next (the panel's next block, or
        // the next panel's first), to prefetch as they go: on a decode step the memory then
        // streams while the few tiles compute (16 rows, two threads: 1.14-1.22x the speed).
        const float* ahead = w + (k0 + block) * kCols;
        const int64_t ahead_rows =
            std::min(step, depth - k0 - block + (next_adjacent ? depth : 0));
        const int64_t share = (ahead_rows + tiles - 1) / tiles;
        for (int64_t r = row_begin, t = 0; r < row_end; r += kTileRows, ++t) {
          const int64_t n = std::min(kTileRows, row_end - r);
          const float* prefetch = ahead + t * share * kCols;
          const int64_t prefetch_rows = std::clamp<int64_t>(ahead_rows - t * share, 0, share);
          float* dst = op + r * out_features + panel * kCols;
          if (cols == kCols) {
            kTiles[n](xp + r * x_stride + k0, x_stride, w + k0 * kCols, block, k0 == 0, init,
                      dst, out_features, prefetch, prefetch_rows);
            continue;
          }
          for (int64_t i = 0; i < n; ++i) std::copy_n(dst + i * out_features, cols, scratch + i * kCols);
          kTiles[n](xp + r * x_stride + k0, x_stride, w + k0 * kCols, block, k0 == 0, init,
                    scratch, kCols, prefetch, prefetch_rows);
          for (int64_t i = 0; i < n; ++i) std::copy_n(scratch + i * kCols, cols, dst + i * out_features);
        }
      }
    }
  });
#endif
  return out;
}
