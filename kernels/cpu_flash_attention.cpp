// Flash attention on the CPU for many query rows at once: prompt chunks (causal, after any
// cached prefix) and vision towers (bidirectional). bfloat16 only, on CPUs with AVX512-BF16,
// whose dot-product instruction multiplies pairs of bfloat16 and adds into float32.
//
// query  [batch, q_len, num_heads, head_dim]        any strides but a contiguous last dim
// key    [batch, kv_len, num_kv_heads, head_dim]    value the same
// causal_offset >= 0: query row i sees keys 0 .. i + causal_offset; < 0: every key
// returns [batch, q_len, num_heads, head_dim], contiguous
//
// Two passes. First each (batch, KV head) packs its keys and values into the layouts the
// instruction reads: keys as [kv_len/16][head_dim/2][16 keys][2 dims], so one vector holds a
// pair of dimensions of 16 keys; values as [kv_len/2][head_dim][2 keys]. Then each tile of 8
// query rows of one head walks the keys 128 at a time with an online softmax: scores in
// float32, probabilities rounded to bfloat16 for the product with V, output summed in float32.
// Where the core runs float32 FMAs faster than the pair dot product (mmserve_cpu::bf16_fma),
// both products are FMAs on the same inputs widened to float32, giving the same bits: on a
// 2-core Xeon without AMX exposed, 0.74-0.86 of the pair dot product's time (see
// benchmarks/README.md). Where the CPU has AMX, tiles of 16 query rows do both products on
// its tile registers, from the same packed keys and values, with the same softmax
// (amx_attend_tile below).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_amx.h"
#include "cpu_math.h"

namespace {

mmserve_cpu::AmxSwitch amx;  // the tile path (amx_attend_tile) or the vector code

#ifdef MMSERVE_BF16_DOT

using mmserve_cpu::exp_nonpositive;
using mmserve_cpu::first_lanes;

constexpr int64_t kRows = 8;    // query rows per tile, one accumulator register each
constexpr int64_t kGroup = 16;  // keys per packed K vector (16 float32 lanes)
constexpr int64_t kChunk = 128;  // keys per online-softmax step

inline uint32_t load_pair(const uint16_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline __m512 dot_pairs(__m512 acc, uint32_t a_pair, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(a_pair)),
                          (__m512bh)b);
}

// One (batch, KV head): its keys and values in the packed layouts, zero past kv_len.
template <int64_t D>
void pack_kv(const uint16_t* k, const uint16_t* v, int64_t kv_len, int64_t token_stride,
             int64_t padded_len, uint16_t* k_packed, uint16_t* v_packed) {
  uint32_t* kp = reinterpret_cast<uint32_t*>(k_packed);
  for (int64_t g = 0; g < padded_len / kGroup; ++g) {
    for (int64_t i = 0; i < kGroup; ++i) {
      const int64_t t = g * kGroup + i;
      const uint16_t* row = k + t * token_stride;
      for (int64_t p = 0; p < D / 2; ++p)
        kp[(g * (D / 2) + p) * kGroup + i] = t < kv_len ? load_pair(row + 2 * p) : 0;
    }
  }
  for (int64_t t = 0; t < padded_len; t += 2) {
    uint16_t* dst = v_packed + t * D;
    const uint16_t* even = v + t * token_stride;
    const uint16_t* odd = even + token_stride;
    const bool has_even = t < kv_len, has_odd = t + 1 < kv_len;
    for (int64_t d = 0; d < D; ++d) {
      dst[2 * d] = has_even ? even[d] : 0;
      dst[2 * d + 1] = has_odd ? odd[d] : 0;
    }
  }
}

// One tile's query rows and what its online softmax carries from chunk to chunk: scores of a
// chunk (unscaled float32 sums), their probabilities in bfloat16, the float32 output sums.
template <int64_t R, int64_t D>
struct TileState {
  alignas(64) uint16_t q[R][D] = {};  // zero past the tile's rows
  alignas(64) float scores[R][kChunk];
  alignas(64) uint16_t probs[R][kChunk];
  alignas(64) float acc_out[R][D] = {};
  float row_max[R], row_sum[R];
  int64_t rows, tile_end = 0;  // keys [0, tile_end) are visible to some row

  TileState(const uint16_t* const* q_rows, int64_t num_rows, const int64_t* key_end)
      : rows(num_rows) {
    for (int64_t r = 0; r < R; ++r) {
      if (r < rows) std::memcpy(q[r], q_rows[r], D * sizeof(uint16_t));
      row_max[r] = -1e30f;
      row_sum[r] = 0.f;
    }
    for (int64_t r = 0; r < rows; ++r) tile_end = std::max(tile_end, key_end[r]);
  }

  // Row r's probabilities for the chunk's keys [c0, c0 + width), float32 math on the scaled
  // scores, 16 keys per vector; keys at or past `scored` (chunk-relative) or the row's end
  // get probability 0. Returns the factor by which the row's earlier output sums shrink.
  float softmax_row(int64_t r, int64_t c0, int64_t width, int64_t scored, int64_t key_end,
                    __m512 vscale) {
    const int64_t n = r < rows ? std::clamp<int64_t>(key_end - c0, 0, scored) : 0;
    const float* s = scores[r];
    __m512 vmax = _mm512_set1_ps(-1e30f);
    for (int64_t j = 0; j < width; j += kGroup)
      vmax = _mm512_mask_max_ps(vmax, first_lanes(n - j), vmax,
                                _mm512_mul_ps(_mm512_load_ps(s + j), vscale));
    const float new_max = std::max(row_max[r], _mm512_reduce_max_ps(vmax));
    const float rescale = exp_nonpositive(row_max[r] - new_max);
    const __m512 vnew_max = _mm512_set1_ps(new_max);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < width; j += kGroup) {
      const __m512 e = _mm512_maskz_mov_ps(
          first_lanes(n - j),
          exp_nonpositive(_mm512_fmsub_ps(_mm512_load_ps(s + j), vscale, vnew_max)));
      vsum = _mm512_add_ps(vsum, e);
      _mm256_store_si256(reinterpret_cast<__m256i*>(&probs[r][j]),
                         (__m256i)_mm512_cvtneps_pbh(e));
    }
    row_sum[r] = row_sum[r] * rescale + _mm512_reduce_add_ps(vsum);
    row_max[r] = new_max;
    return rescale;
  }

  // The tile's rows, normalized, rounded to bfloat16.
  void write(uint16_t* const* out_rows) const {
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 inv = _mm512_set1_ps(1.f / row_sum[r]);
      for (int64_t d0 = 0; d0 < D; d0 += 16)
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(out_rows[r] + d0),
            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&acc_out[r][d0]), inv)));
    }
  }
};

// Rows [0, rows) of one head against the packed keys and values of its KV head.
// key_end[r]: keys [0, key_end[r]) are visible to row r. kFma: both products as float32 FMAs,
// the query rows, keys, probabilities and values widened to float32, in the order the pair
// dot product sums (odd element of a pair, then even: mmserve_cpu::bf16_fma), the same bits.
template <int64_t D, bool kFma>
void attend_tile(const uint16_t* const* q_rows, int64_t rows, const int64_t* key_end,
                 const uint16_t* k_packed, const uint16_t* v_packed, float scale,
                 uint16_t* const* out_rows) {
  using mmserve_cpu::even_bf16;
  using mmserve_cpu::odd_bf16;
  TileState<kRows, D> tile(q_rows, rows, key_end);
  const __m512 vscale = _mm512_set1_ps(scale);
  float rescale[kRows];
  // The FMAs' query rows and a chunk's probabilities, as float32.
  alignas(64) float q_wide[kFma ? kRows : 1][D];
  alignas(64) float probs_wide[kFma ? kRows : 1][kChunk];
  if constexpr (kFma) {
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t d = 0; d < D; d += 16)
        _mm512_store_ps(&q_wide[r][d], mmserve_cpu::load_bf16(&tile.q[r][d], 0xffff));
  }
  for (int64_t c0 = 0; c0 < tile.tile_end; c0 += kChunk) {
    const int64_t groups =
        std::min<int64_t>(kChunk / kGroup, (tile.tile_end - c0 + kGroup - 1) / kGroup);
    const int64_t width = groups * kGroup;
    // Scores: kGroups x 16 keys by kRows rows per pass over the head dimension, each
    // broadcast query pair used for every group.
    const auto score_groups = [&](auto num_groups, int64_t g0) {
      constexpr int64_t kGroups = decltype(num_groups)::value;
      const uint16_t* kg = k_packed + ((c0 / kGroup + g0) * (D / 2)) * (2 * kGroup);
      __m512 acc[kGroups][kRows];
      for (int64_t i = 0; i < kGroups; ++i)
        for (int64_t r = 0; r < kRows; ++r) acc[i][r] = _mm512_setzero_ps();
      for (int64_t p = 0; p < D / 2; ++p) {
        __m512i keys[kGroups];
        for (int64_t i = 0; i < kGroups; ++i)
          keys[i] = _mm512_loadu_si512(kg + (i * (D / 2) + p) * 2 * kGroup);
        if constexpr (kFma) {
          __m512 odd[kGroups], even[kGroups];
          for (int64_t i = 0; i < kGroups; ++i) {
            odd[i] = odd_bf16(keys[i]);
            even[i] = even_bf16(keys[i]);
          }
          for (int64_t r = 0; r < kRows; ++r) {
            const __m512 qo = _mm512_set1_ps(q_wide[r][2 * p + 1]);
            const __m512 qe = _mm512_set1_ps(q_wide[r][2 * p]);
            for (int64_t i = 0; i < kGroups; ++i)
              acc[i][r] = _mm512_fmadd_ps(qe, even[i], _mm512_fmadd_ps(qo, odd[i], acc[i][r]));
          }
        } else {
          for (int64_t r = 0; r < kRows; ++r) {
            const uint32_t pair = load_pair(&tile.q[r][2 * p]);
            for (int64_t i = 0; i < kGroups; ++i)
              acc[i][r] = dot_pairs(acc[i][r], pair, keys[i]);
          }
        }
      }
      for (int64_t i = 0; i < kGroups; ++i)
        for (int64_t r = 0; r < kRows; ++r)
          _mm512_store_ps(&tile.scores[r][(g0 + i) * kGroup], acc[i][r]);
    };
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) score_groups(std::integral_constant<int64_t, 2>{}, g);
    if (g < groups) score_groups(std::integral_constant<int64_t, 1>{}, g);
    for (int64_t r = 0; r < kRows; ++r) {
      rescale[r] = tile.softmax_row(r, c0, width, width, key_end[r], vscale);
      if constexpr (kFma) {
        for (int64_t j = 0; j < width; j += kGroup)
          _mm512_store_ps(&probs_wide[r][j], mmserve_cpu::load_bf16(&tile.probs[r][j], 0xffff));
      }
    }
    // Output += probabilities x values: 32 dimensions by kRows rows per pass over key pairs,
    // each broadcast probability pair used for both 16-dimension halves.
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      __m512 acc[kRows][2];
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512 scale_r = _mm512_set1_ps(rescale[r]);
        acc[r][0] = _mm512_mul_ps(_mm512_load_ps(&tile.acc_out[r][d0]), scale_r);
        acc[r][1] = _mm512_mul_ps(_mm512_load_ps(&tile.acc_out[r][d0 + 16]), scale_r);
      }
      for (int64_t t = 0; t < width; t += 2) {
        const uint16_t* vt = v_packed + (c0 + t) * D + 2 * d0;
        const __m512i lo = _mm512_loadu_si512(vt), hi = _mm512_loadu_si512(vt + 32);
        if constexpr (kFma) {  // key t's values in the pairs' low halves, t + 1's high
          const __m512 lo_odd = odd_bf16(lo), lo_even = even_bf16(lo);
          const __m512 hi_odd = odd_bf16(hi), hi_even = even_bf16(hi);
          for (int64_t r = 0; r < kRows; ++r) {
            const __m512 po = _mm512_set1_ps(probs_wide[r][t + 1]);
            const __m512 pe = _mm512_set1_ps(probs_wide[r][t]);
            acc[r][0] = _mm512_fmadd_ps(pe, lo_even, _mm512_fmadd_ps(po, lo_odd, acc[r][0]));
            acc[r][1] = _mm512_fmadd_ps(pe, hi_even, _mm512_fmadd_ps(po, hi_odd, acc[r][1]));
          }
        } else {
          for (int64_t r = 0; r < kRows; ++r) {
            const uint32_t pair = load_pair(&tile.probs[r][t]);
            acc[r][0] = dot_pairs(acc[r][0], pair, lo);
            acc[r][1] = dot_pairs(acc[r][1], pair, hi);
          }
        }
      }
      for (int64_t r = 0; r < kRows; ++r) {
        _mm512_store_ps(&tile.acc_out[r][d0], acc[r][0]);
        _mm512_store_ps(&tile.acc_out[r][d0 + 16], acc[r][1]);
      }
    }
  }
  tile.write(out_rows);
}

#ifdef MMSERVE_AMX

// Where the CPU has AMX, both products run on its tiles over the same packed keys and values:
// a group of 16 packed keys is a weight tile as it lies (16 dimension pairs by 16 keys, rows 64
// bytes apart), a pair of packed value rows holds 16 key pairs by 32 dimensions, so a value
// tile is 16 dimensions of it (rows 4 * head_dim bytes apart). A tile is 16 query rows: the
// scores of 16 rows by 16 keys are one multiply per 32 dimensions, the probabilities of 16
// rows by 32 keys times 16 dimensions of values one more. The online softmax between them is
// the vector code's, on 16 rows.

constexpr int64_t kAmxRows = 16;  // query rows per tile: one tile register's rows


// Every tile register 16 rows by 64 bytes. Scores: sums 0 and 1 (two groups of 16 keys), key
// tiles 2 and 3, query tiles from 4 (one per 32 dimensions). Probabilities times values: sums
// 0-3 (64 dimensions), probabilities 4, values 5.
void configure_attention_tiles() {
  mmserve_cpu::TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// attend_tile on the tiles, for up to kAmxRows rows; the tiles configured by the caller.
template <int64_t D>
void amx_attend_tile(const uint16_t* const* q_rows, int64_t rows, const int64_t* key_end,
                     const uint16_t* k_packed, const uint16_t* v_packed, float scale,
                     uint16_t* const* out_rows) {
  static_assert(D % 64 == 0 && D / 32 <= 4, "query tiles 4..7 hold the head dimension");
  TileState<kAmxRows, D> tile(q_rows, rows, key_end);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t c0 = 0; c0 < tile.tile_end; c0 += kChunk) {
    const int64_t groups =
        std::min<int64_t>(kChunk / kGroup, (tile.tile_end - c0 + kGroup - 1) / kGroup);
    // Keys this chunk's products cover: whole probability tiles of 32 keys, those past the
    // scored groups with probability 0 (their packed values are zero or real keys).
    const int64_t width = (groups * kGroup + 31) / 32 * 32;
    // The query tiles, reloaded each chunk (the products below take registers 4 and 5).
    _tile_loadd(4, &tile.q[0][0], D * 2);
    _tile_loadd(5, &tile.q[0][32], D * 2);
    if constexpr (D == 128) {
      _tile_loadd(6, &tile.q[0][64], D * 2);
      _tile_loadd(7, &tile.q[0][96], D * 2);
    }
    for (int64_t g = 0; g < groups; g += 2) {
      const bool two = g + 1 < groups;
      const uint16_t* kg = k_packed + (c0 / kGroup + g) * (D / 2) * (2 * kGroup);
      _tile_zero(0);
      _tile_zero(1);
      // _tile_dpbf16ps names its registers in the instruction's text: literals only.
#define MMSERVE_SCORE_STEP(query_tile, half)                               \
  _tile_loadd(2, kg + (half) * 16 * (2 * kGroup), 64);                     \
  _tile_dpbf16ps(0, query_tile, 2);                                        \
  if (two) {                                                               \
    _tile_loadd(3, kg + (D / 2 + (half) * 16) * (2 * kGroup), 64);         \
    _tile_dpbf16ps(1, query_tile, 3);                                      \
  }
      MMSERVE_SCORE_STEP(4, 0)
      MMSERVE_SCORE_STEP(5, 1)
      if constexpr (D == 128) {
        MMSERVE_SCORE_STEP(6, 2)
        MMSERVE_SCORE_STEP(7, 3)
      }
#undef MMSERVE_SCORE_STEP
      _tile_stored(0, &tile.scores[0][g * kGroup], kChunk * 4);
      if (two) _tile_stored(1, &tile.scores[0][(g + 1) * kGroup], kChunk * 4);
    }
    for (int64_t r = 0; r < kAmxRows; ++r) {
      const __m512 rescale =
          _mm512_set1_ps(tile.softmax_row(r, c0, width, groups * kGroup, key_end[r], vscale));
      for (int64_t d = 0; d < D; d += 16)
        _mm512_store_ps(&tile.acc_out[r][d],
                        _mm512_mul_ps(_mm512_load_ps(&tile.acc_out[r][d]), rescale));
    }
    // Output += probabilities x values, 64 dimensions at a time, summed in the tiles.
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      float* acc = &tile.acc_out[0][d0];
      _tile_loadd(0, acc, D * 4);
      _tile_loadd(1, acc + 16, D * 4);
      _tile_loadd(2, acc + 32, D * 4);
      _tile_loadd(3, acc + 48, D * 4);
      for (int64_t t = 0; t < width; t += 32) {
        const uint16_t* vt = v_packed + (c0 + t) * D + 2 * d0;
        _tile_loadd(4, &tile.probs[0][t], kChunk * 2);
        _tile_loadd(5, vt, 4 * D);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, vt + 32, 4 * D);
        _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(5, vt + 64, 4 * D);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, vt + 96, 4 * D);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, acc, D * 4);
      _tile_stored(1, acc + 16, D * 4);
      _tile_stored(2, acc + 32, D * 4);
      _tile_stored(3, acc + 48, D * 4);
    }
  }
  tile.write(out_rows);
}

#endif  // MMSERVE_AMX

template <int64_t D>
void flash_attention_impl(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          double scale, int64_t causal_offset, at::Tensor& out) {
  const int64_t batch = query.size(0);
  const int64_t kv_len = key.size(1), num_kv_heads = key.size(2);
  const int64_t padded_len = (kv_len + kChunk - 1) / kChunk * kChunk;

  auto k_packed = at::empty({batch * num_kv_heads, padded_len * D}, query.options().dtype(at::kShort));
  auto v_packed = at::empty_like(k_packed);
  const auto* q_ptr = reinterpret_cast<const uint16_t*>(query.data_ptr());
  const auto* k_ptr = reinterpret_cast<const uint16_t*>(key.data_ptr());
  const auto* v_ptr = reinterpret_cast<const uint16_t*>(value.data_ptr());
  auto* kp_ptr = reinterpret_cast<uint16_t*>(k_packed.data_ptr());
  auto* vp_ptr = reinterpret_cast<uint16_t*>(v_packed.data_ptr());
  auto* o_ptr = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t packed_stride = padded_len * D;

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t k_off = b * key.stride(0) + h * key.stride(2);
      const int64_t v_off = b * value.stride(0) + h * value.stride(2);
      pack_kv<D>(k_ptr + k_off, v_ptr + v_off, kv_len, key.stride(1), padded_len,
                 kp_ptr + item * packed_stride, vp_ptr + item * packed_stride);
    }
  });

  const float fscale = static_cast<float>(scale);
#ifdef MMSERVE_AMX
  if (amx.on()) {
    mmserve_cpu::for_query_tiles<kAmxRows>(
        query, q_ptr, o_ptr, kv_len, num_kv_heads, causal_offset, kAmxRows,
        [&](const uint16_t* const* q_rows, int64_t rows, const int64_t* key_end,
            uint16_t* const* out_rows, int64_t kv_item, bool first, bool last) {
          if (first) configure_attention_tiles();
          amx_attend_tile<D>(q_rows, rows, key_end, kp_ptr + kv_item * packed_stride,
                             vp_ptr + kv_item * packed_stride, fscale, out_rows);
          if (last) _tile_release();
        });
    return;
  }
#endif
  const auto attend = mmserve_cpu::bf16_fma() ? attend_tile<D, true> : attend_tile<D, false>;
  mmserve_cpu::for_query_tiles<kRows>(
      query, q_ptr, o_ptr, kv_len, num_kv_heads, causal_offset, kRows,
      [&](const uint16_t* const* q_rows, int64_t rows, const int64_t* key_end,
          uint16_t* const* out_rows, int64_t kv_item, bool, bool) {
        attend(q_rows, rows, key_end, kp_ptr + kv_item * packed_stride,
               vp_ptr + kv_item * packed_stride, fscale, out_rows);
      });
}

#endif  // MMSERVE_BF16_DOT

}  // namespace

bool flash_attention_amx_supported() { return amx.supported(); }

bool set_flash_attention_amx(bool enabled) { return amx.set(enabled); }

bool flash_attention_supported(int64_t head_dim) {
#ifdef MMSERVE_BF16_DOT
  return head_dim == 64 || head_dim == 128;
#else
  (void)head_dim;
  return false;
#endif
}

at::Tensor flash_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           double scale, int64_t causal_offset) {
  // Everything the pointer arithmetic below assumes is checked here, before any data pointer
  // is read.
  mmserve_cpu::check_cpu_tensor(query, "flash_attention", "query");
  mmserve_cpu::check_cpu_tensor(key, "flash_attention", "key");
  mmserve_cpu::check_cpu_tensor(value, "flash_attention", "value");
  MMSERVE_CHECK(query.dim() == 4 && key.dim() == 4 && value.sizes() == key.sizes(),
                "flash_attention: expected query [batch, q_len, heads, dim] and key/value "
                "[batch, kv_len, kv_heads, dim]");
  MMSERVE_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
                    value.scalar_type() == at::kBFloat16,
                "flash_attention: bfloat16 only");
  MMSERVE_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1,
                "flash_attention: the head dimension must be contiguous");
  MMSERVE_CHECK(key.size(2) > 0, "flash_attention: key and value have no KV heads");
  MMSERVE_CHECK(query.size(0) == key.size(0) && query.size(3) == key.size(3) &&
                    query.size(2) % key.size(2) == 0,
                "flash_attention: batch or head sizes differ, or heads are not a multiple of KV heads");
  MMSERVE_CHECK(flash_attention_supported(query.size(3)),
                "flash_attention: needs AVX512-BF16 and a head size of 64 or 128");
  MMSERVE_CHECK(key.size(1) > 0 || query.size(1) == 0, "flash_attention: no keys");
  MMSERVE_CHECK(key.strides() == value.strides(), "flash_attention: key and value strides differ");
  auto out = at::empty(query.sizes(), query.options());  // contiguous, whatever q's strides
#ifdef MMSERVE_BF16_DOT
  if (query.size(3) == 64)
    flash_attention_impl<64>(query, key, value, scale, causal_offset, out);
  else
    flash_attention_impl<128>(query, key, value, scale, causal_offset, out);
#endif
  return out;
}
