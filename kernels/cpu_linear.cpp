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
// packed_linear_silu_and_mul(x, panels, bias, N) -> silu(gate) * up, [M, N / 2], where the
//                                         weight's rows alternate 16 of gate and the same 16
//                                         of up (a gated MLP's merged layers, N a multiple
//                                         of 32)
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
//
// The tiles multiply in one of two ways, the same sums either way (bf16_fma, cpu_math.h): the
// pair dot product of AVX512-BF16 on the bfloat16 inputs, or float32 FMAs on inputs widened
// to float32, which some cores run at twice the pair dot product's rate of work. Where the CPU
// has AMX (and the module was built for it), the tile multiply takes every input whose size
// is a multiple of 32, over the same panels (see amx_linear below).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu_amx.h"
#include "cpu_math.h"

#ifdef MMSERVE_BF16_DOT

namespace mmserve_cpu {
namespace {

// Seconds that 2^14 rounds of 16 independent multiply-adds of one kind take on this core.
template <bool kFma>
double multiply_seconds(__m512 a, __m512bh b) {
  constexpr int kSums = 16;
  __m512 acc[kSums];
  for (int j = 0; j < kSums; ++j) acc[j] = a;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < (int64_t{1} << 14); ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kSums; ++j)
      acc[j] = kFma ? _mm512_fmadd_ps(a, a, acc[j]) : _mm512_dpbf16_ps(acc[j], b, b);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  __m512 sum = acc[0];
  for (int j = 1; j < kSums; ++j) sum = _mm512_add_ps(sum, acc[j]);
  volatile float sink = _mm512_reduce_add_ps(sum);
  (void)sink;
  return seconds;
}

// Whether this core's FMAs do more than 1.25 times the pair dot product's multiply-adds a
// second: the best of five timings of each, taken in turns (about 1.5 ms in all).
bool fma_outpaces_dot() {
  volatile float one = 1.0f;  // not a constant the compiler could fold
  const __m512 a = _mm512_set1_ps(one * 1e-3f);
  const __m512bh b = (__m512bh)_mm512_set1_epi32(0x3a833a83);  // 1e-3 in both halves
  double fma = std::numeric_limits<double>::infinity(), dot = fma;
  for (int i = 0; i < 5; ++i) {
    fma = std::min(fma, multiply_seconds<true>(a, b));
    dot = std::min(dot, multiply_seconds<false>(a, b));
  }
  return 16.0 / fma > 1.25 * 32.0 / dot;
}

// -1 until the first call that asks (then fma_outpaces_dot()), or as set.
std::atomic<int> bf16_fma_state{-1};

}  // namespace

bool bf16_fma() {
  int state = bf16_fma_state.load(std::memory_order_relaxed);
  if (state < 0) {
    static const int measured = fma_outpaces_dot() ? 1 : 0;
    // A setting made meanwhile wins: `state` then holds it.
    if (bf16_fma_state.compare_exchange_strong(state, measured)) state = measured;
  }
  return state == 1;
}

bool set_bf16_fma(bool enabled) {
  const bool previous = bf16_fma();
  bf16_fma_state.store(enabled ? 1 : 0);
  return previous;
}

}  // namespace mmserve_cpu

#endif  // MMSERVE_BF16_DOT

namespace {

mmserve_cpu::AmxSwitch amx;  // the tile path (amx_linear) or the vector tiles

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

// A panel of a gated MLP's merged gate and up layers packed in halves (16 gate outputs, then
// the same 16 of up: ``pack_linear_weight`` of rows so ordered) gives 16 outputs of
// silu(gate) * up: the sums rounded to bfloat16 as the merged layer's output would be, then
// as silu_and_mul (cpu_elementwise.cpp) rounds, the sigmoid the same arithmetic on 16 lanes.
inline __m256i silu_and_mul16(__m512 gate_sums, __m512 up_sums) {
  using mmserve_cpu::round_bf16;
  const __m512 g = round_bf16(gate_sums), u = round_bf16(up_sums);
  return (__m256i)_mm512_cvtneps_pbh(
      _mm512_mul_ps(round_bf16(_mm512_mul_ps(g, mmserve_cpu::sigmoid16(g))), u));
}

// Rows [0, R) of a tile over input pairs [0, pairs) of one block of a panel, the rows bfloat16
// (X uint16_t: the pair dot product) or widened to float32 (X float: FMAs). The sums start
// from `sums` (or the bias, or zero, on the first block) and go back to `sums`, or, on the
// last block, round to bfloat16 into `out`. `prefetch` (or null): the next block, of which the
// tile prefetches the first cache line of each input pair, or both with `both_lines`.
template <int64_t R, typename X>
void tile(const X* x, int64_t x_stride, const uint16_t* panel, int64_t pairs,
          float* sums, bool first, const float* bias, uint16_t* out, int64_t out_stride,
          int64_t cols, const uint16_t* prefetch, bool both_lines, bool silu) {
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
    const __m512i w0 = _mm512_loadu_si512(panel + p * 2 * kCols);
    const __m512i w1 = _mm512_loadu_si512(panel + p * 2 * kCols + kCols);
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + p * 2 * kCols), _MM_HINT_T1);
      if (both_lines) {
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + p * 2 * kCols + kCols), _MM_HINT_T1);
      }
    }
    if constexpr (std::is_same_v<X, float>) {
      // Each 32-bit lane of a weight vector holds inputs k (low half) and k + 1 (high half).
      const __m512 odd0 = mmserve_cpu::odd_bf16(w0), odd1 = mmserve_cpu::odd_bf16(w1);
      const __m512 even0 = mmserve_cpu::even_bf16(w0), even1 = mmserve_cpu::even_bf16(w1);
      for (int64_t r = 0; r < R; ++r) {
        const __m512 xo = _mm512_set1_ps(x[r * x_stride + 2 * p + 1]);
        const __m512 xe = _mm512_set1_ps(x[r * x_stride + 2 * p]);
        acc[r][0] = _mm512_fmadd_ps(xe, even0, _mm512_fmadd_ps(xo, odd0, acc[r][0]));
        acc[r][1] = _mm512_fmadd_ps(xe, even1, _mm512_fmadd_ps(xo, odd1, acc[r][1]));
      }
    } else {
      for (int64_t r = 0; r < R; ++r) {
        uint32_t pair;
        std::memcpy(&pair, x + r * x_stride + 2 * p, sizeof pair);
        const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, (__m512bh)w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, (__m512bh)w1);
      }
    }
  }
  if (out == nullptr) {
    for (int64_t r = 0; r < R; ++r) {
      _mm512_storeu_ps(sums + r * kCols, acc[r][0]);
      _mm512_storeu_ps(sums + r * kCols + 16, acc[r][1]);
    }
    return;
  }
  if (silu) {  // 16 outputs a row (a whole panel: cols == kCols)
    for (int64_t r = 0; r < R; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride),
                          silu_and_mul16(acc[r][0], acc[r][1]));
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

template <typename X>
using TileFn = void (*)(const X*, int64_t, const uint16_t*, int64_t, float*, bool, const float*,
                        uint16_t*, int64_t, int64_t, const uint16_t*, bool, bool);
template <typename X>
constexpr TileFn<X> kTiles[kTileRows + 1] = {nullptr,    tile<1, X>, tile<2, X>,
                                             tile<3, X>, tile<4, X>, tile<5, X>,
                                             tile<6, X>, tile<7, X>, tile<8, X>};

// The vector tiles' multiply (mmserve_cpu::bf16_fma). The FMA does 16 multiply-adds an
// instruction where the pair dot product does 32, but cores differ in how many of each they
// start a cycle. A core of a 2-core Xeon (family 6, model 207, AMX not exposed to the guest),
// 16 independent sums: VDPBF16PS 1.2-1.3 billion a second (78-85 GFLOP/s), VFMADD231PS 4.8-5.4
// billion (153-172 GFLOP/s). There the FMA tiles took 0.6-0.86 times the time of the pair dot
// product's from 16 rows on, and the bench checkpoint's offline throughput rose 1.36-1.41
// times (benchmarks/README.md). At fewer rows the weights' widening costs what the faster
// multiply saves (a decode step of few sequences waits on memory either way): those stay
// bfloat16.
constexpr int64_t kFmaMinRows = 16;

#ifdef MMSERVE_AMX

// On CPUs with AMX the same panels feed the tile multiply, TDPBF16PS: a float32 tile of up to
// 16 rows by 16 outputs += up to 16 rows by 32 inputs times 32 inputs by 16 outputs, the
// inputs in (k, k+1) pairs, which is the layout of a panel's rows. A step of 32 inputs reads a
// panel's two weight tiles in place (16 input pairs by 16 outputs, rows 128 bytes apart) and
// one row tile per 16 rows of input, and multiplies each row tile by each weight tile into its
// accumulator: 32 rows by one panel use the eight tile registers (four accumulators, two row
// tiles, two weight tiles). The tiles are configured to the rows there are, so a decode step of
// 1-16 rows does one row tile's work, not 16 rows of padding.
//
// A weight tile serves every row of a chunk, so up to 32 rows read each panel from memory once
// and the multiplies take a small part of that read: on a 2-core Xeon with AMX
// (benchmarks/cpu_linear.py --dtype bfloat16, weights from memory), 768 -> 4096 at 1, 16 and 32
// rows in 0.21-0.24, 0.23-0.25 and 0.24-0.31 ms, where oneDNN's AMX matmul took 0.26-0.32,
// 0.28-0.34 and 0.35-0.37 and the vector tiles above 0.23-0.24, 0.54-0.59 and 1.1-1.3. Larger
// inputs go in blocks of kAmxBlockRows: an item is a block by a panel, the panel reused from
// cache by each 32-row chunk of the block, and the block's rows (192-512 KiB at 384-1024
// inputs) from L2 by the items that follow. There oneDNN is mostly faster: 64 to 3,152 rows
// took 0.8-1.4 times its time, the most on layers of 768 inputs (24 steps a chunk). Rounding a
// chunk's sums only once the next chunk's multiplies were under way, so that the tiles would
// not wait for it, changed nothing measurable (1.07-1.31 times oneDNN's time at 256 and 2,048
// rows, 1.15-1.24 before); K in blocks kept in L1 across chunks, or the rows repacked into
// whole tiles, did not help either.

constexpr int64_t kAmxChunkRows = 32;   // rows of one multiply: two row tiles of 16
constexpr int64_t kAmxBlockRows = 256;  // rows of a work item of a larger input
constexpr int64_t kAmxStepPairs = 16;   // input pairs a step (32 inputs, one tile's width)

using mmserve_cpu::TileConfig;


// Tiles for a chunk of `rows` (1-32) rows: accumulators 0, 1 (rows 0-15, outputs 0-15 and
// 16-31) and 2, 3 (rows 16-31), row tiles 4 and 5, weight tiles 6 and 7.
void configure_tiles(int64_t rows) {
  const uint8_t upper = static_cast<uint8_t>(std::min<int64_t>(rows, 16));
  const uint8_t lower = static_cast<uint8_t>(rows - upper);
  TileConfig config;
  for (int t : {0, 1, 4}) config.rows[t] = upper;
  for (int t : {2, 3, 5}) config.rows[t] = lower;
  config.rows[6] = config.rows[7] = kAmxStepPairs;
  for (int t = 0; t < 8; ++t) config.colsb[t] = config.rows[t] ? 64 : 0;
  _tile_loadconfig(&config);
}

// One chunk (the configured rows of x, row stride x_stride elements) times one panel of
// `pairs` input pairs (a multiple of kAmxStepPairs), into sums [32 x 32] float32.
template <bool kLower>
void amx_chunk(const uint16_t* x, int64_t x_stride, const uint16_t* panel, int64_t pairs,
               float* sums) {
  _tile_zero(0);
  _tile_zero(1);
  if (kLower) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t p = 0; p < pairs; p += kAmxStepPairs) {
    const uint16_t* w = panel + p * 2 * kCols;
    _tile_loadd(4, x + 2 * p, x_stride * 2);
    _tile_loadd(6, w, 2 * kCols * 2);
    _tile_loadd(7, w + kCols, 2 * kCols * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (kLower) {
      _tile_loadd(5, x + 16 * x_stride + 2 * p, x_stride * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums, kCols * 4);
  _tile_stored(1, sums + 16, kCols * 4);
  if (kLower) {
    _tile_stored(2, sums + 16 * kCols, kCols * 4);
    _tile_stored(3, sums + 16 * kCols + 16, kCols * 4);
  }
}

// x [rows, 2 * pairs] times the panels into out [rows, out_features] (bfloat16), the bias
// added before rounding once; with `silu`, silu(gate) * up of panels packed in halves into
// out [rows, out_features / 2].
void amx_linear(const uint16_t* xp, int64_t x_stride, int64_t rows, const uint16_t* wp,
                int64_t pairs, int64_t panels, const float* bp, uint16_t* op,
                int64_t out_features, bool silu) {
  const int64_t blocks = (rows + kAmxBlockRows - 1) / kAmxBlockRows;
  // A chunk writes one whole cache line to each of its rows where the rows are aligned:
  // written past the cache, the lines are not read in first (and rows a multiple of 2 KiB
  // apart, which fall into a few cache sets, do not thrash them). 2-core Xeon with AMX, a
  // scratch copy, weights in cache, 2,048 rows: 768 -> 4096 6.0 ms against 6.8 with stores
  // through the cache, 768 -> 1280 1.76 against 1.86; 64 rows 0.23 against 0.26 and 0.064
  // against 0.066.
  const bool aligned_rows =
      (out_features * 2) % 64 == 0 && (reinterpret_cast<uintptr_t>(op) & 63) == 0;
  // Items are (row block, panel), panels inner: a decode step's items are its panels, which
  // threads take a few at a time as they come free (parallel_claim).
  mmserve_cpu::parallel_claim(blocks * panels, kClaim, [&](int64_t begin, int64_t end) {
    int64_t configured = 0;  // rows the tiles are configured for
    alignas(64) float sums[kAmxChunkRows * kCols];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t block = item / panels, panel = item % panels;
      const uint16_t* w = wp + panel * pairs * 2 * kCols;
      const int64_t cols = std::min<int64_t>(kCols, out_features - panel * kCols);
      const __mmask16 lo = mmserve_cpu::first_lanes(cols);
      const __mmask16 hi = mmserve_cpu::first_lanes(cols - 16);
      const bool stream = aligned_rows && cols == kCols;
      const float* b = bp ? bp + panel * kCols : nullptr;
      const __m512 b0 = b ? _mm512_loadu_ps(b) : _mm512_setzero_ps();
      const __m512 b1 = b ? _mm512_loadu_ps(b + 16) : _mm512_setzero_ps();
      const int64_t block_end = std::min(rows, (block + 1) * kAmxBlockRows);
      for (int64_t r0 = block * kAmxBlockRows; r0 < block_end; r0 += kAmxChunkRows) {
        const int64_t n = std::min(kAmxChunkRows, block_end - r0);
        if (n != configured) {
          configure_tiles(n);
          configured = n;
        }
        const uint16_t* a = xp + r0 * x_stride;
        if (n > 16) {
          amx_chunk<true>(a, x_stride, w, pairs, sums);
        } else {
          amx_chunk<false>(a, x_stride, w, pairs, sums);
        }
        for (int64_t r = 0; r < n; ++r) {
          const __m512 s0 = _mm512_add_ps(_mm512_load_ps(sums + r * kCols), b0);
          const __m512 s1 = _mm512_add_ps(_mm512_load_ps(sums + r * kCols + 16), b1);
          if (silu) {
            _mm256_storeu_si256(
                reinterpret_cast<__m256i*>(op + (r0 + r) * (out_features / 2) + panel * 16),
                silu_and_mul16(s0, s1));
            continue;
          }
          uint16_t* dst = op + (r0 + r) * out_features + panel * kCols;
          const __m256i h0 = (__m256i)_mm512_cvtneps_pbh(s0), h1 = (__m256i)_mm512_cvtneps_pbh(s1);
          if (stream) {
            _mm512_stream_si512(reinterpret_cast<__m512i*>(dst),
                                _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1));
          } else {
            _mm256_mask_storeu_epi16(dst, lo, h0);
            _mm256_mask_storeu_epi16(dst + 16, hi, h1);
          }
        }
      }
    }
    if (configured) _tile_release();
    _mm_sfence();  // the streamed rows are seen by whatever reads the output next
  });
}

#endif  // MMSERVE_AMX

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

bool packed_linear_amx_supported() { return amx.supported(); }

bool set_packed_linear_amx(bool enabled) { return amx.set(enabled); }

bool bf16_fma() {
#ifdef MMSERVE_BF16_DOT
  return mmserve_cpu::bf16_fma();
#else
  return false;
#endif
}

bool set_bf16_fma(bool enabled) {
#ifdef MMSERVE_BF16_DOT
  return mmserve_cpu::set_bf16_fma(enabled);
#else
  (void)enabled;
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

namespace {

// packed_linear, or with `silu` its gated-MLP form (packed_linear_silu_and_mul).
at::Tensor packed_linear_impl(const at::Tensor& x, const at::Tensor& packed,
                              const c10::optional<at::Tensor>& bias, int64_t out_features,
                              bool silu) {
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
  MMSERVE_CHECK(!silu || out_features == 32 * packed.size(0),
                "packed_linear_silu_and_mul: gate and up must fill whole panels (sizes a "
                "multiple of 16)");
  const int64_t rows = x.size(0), pairs = packed.size(1), panels = packed.size(0);
  const int64_t out_cols = silu ? out_features / 2 : out_features;
  auto out = at::empty({rows, out_cols}, x.options());
#ifdef MMSERVE_BF16_DOT
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
#ifdef MMSERVE_AMX
  if (pairs % kAmxStepPairs == 0 && amx.on()) {
    amx_linear(xp, x.stride(0), rows, wp, pairs, panels, bp, op, out_features, silu);
    return out;
  }
#endif
  // Rows are one chunk (streamed), or chunks of at most kChunkRows, all of about the same size,
  // so that items are of about equal work (197 rows: 50, 50, 50 and 47, not 64, 64, 64 and 5,
  // which left one of two threads 59 rows behind when each took half of the items). Threads
  // take items a few at a time as they come free, so a thread that another process holds up
  // does fewer of them instead of every other thread waiting for it.
  const bool one_chunk =
      rows <= kStreamRows && panels >= kStreamPanelsPerThread * at::get_num_threads();
  // Inputs of kFmaMinRows rows or more, where the FMAs outpace the pair dot product, widened
  // to float32 once for every tile: a copy of 2 bytes an input (at 2,048 rows of 4,096 inputs,
  // 32 MiB, freed on return).
  const at::Tensor wide = rows >= kFmaMinRows && mmserve_cpu::bf16_fma()
                              ? x.to(at::kFloat).contiguous()
                              : at::Tensor();
  const float* xw = wide.defined() ? wide.data_ptr<float>() : nullptr;
  const int64_t x_stride = wide.defined() ? wide.stride(0) : x.stride(0);
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
          const auto run = [&](auto tile_fn, const auto* rows_in) {
            tile_fn(rows_in + r * x_stride + 2 * p0, x_stride, w + p0 * 2 * kCols, block,
                    sums + (r - row_begin) * kCols, first, b,
                    last ? op + r * out_cols + panel * (silu ? kCols / 2 : kCols) : nullptr,
                    out_cols, cols,
                    one_chunk && r - row_begin < 2 * kTileRows
                        ? w + (p0 + block) * 2 * kCols + (r == row_begin ? 0 : kCols)
                        : nullptr,
                    row_end - row_begin <= kTileRows, silu);
          };
          if (xw) {
            run(kTiles<float>[n], xw);
          } else {
            run(kTiles<uint16_t>[n], xp);
          }
        }
      }
    }
    _mm_sfence();  // the streamed rows (tile's) are seen by whatever reads the output next
  });
#endif
  return out;
}

}  // namespace

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias, int64_t out_features) {
  return packed_linear_impl(x, packed, bias, out_features, false);
}

at::Tensor packed_linear_silu_and_mul(const at::Tensor& x, const at::Tensor& packed,
                                      const c10::optional<at::Tensor>& bias,
                                      int64_t out_features) {
  return packed_linear_impl(x, packed, bias, out_features, true);
}
