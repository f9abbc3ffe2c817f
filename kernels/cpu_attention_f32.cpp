// float32 flash attention on x86 CPUs with AVX2 and FMA, for many query rows at once: prompt
// chunks (causal, after any cached prefix) and vision towers (bidirectional).
//
// query  [batch, q_len, num_heads, head_dim]        any strides but a contiguous last dim
// key    [batch, kv_len, num_kv_heads, head_dim]    value the same
// causal_offset >= 0: query row i sees keys 0 .. i + causal_offset; < 0: every key
// returns [batch, q_len, num_heads, head_dim], contiguous; head_dim a multiple of 16, <= 256
//
// torch's CPU attention for one short prompt (a few hundred tokens) spends more time in its
// blocking than in arithmetic. Here both products are the linear layers' register tile
// (cpu_tile_f32.h): first each (batch, KV head) packs its keys as [kv_len/16][head_dim][16
// keys] and its values as [head_dim/16][kv_len][16 dims]; then each tile of 6 query rows of
// one head walks the keys 64 at a time with an online softmax: scores = q x key panels,
// probabilities x value panels added to the running output, all in float32.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_math.h"
#include "cpu_tile_f32.h"

namespace {

#ifdef MMSERVE_F32_FMA

using mmserve_cpu::exp_nonpositive;
using mmserve_cpu::kCols;
using mmserve_cpu::kTileRows;
using mmserve_cpu::kTiles;

constexpr int64_t kChunk = 64;     // keys per online-softmax step
constexpr int64_t kMaxDim = 256;

// One (batch, KV head): its keys and values in the packed layouts, zero past kv_len.
void pack_kv(const float* k, const float* v, int64_t kv_len, int64_t token_stride, int64_t dim,
             int64_t padded_len, float* k_packed, float* v_packed) {
  for (int64_t t = 0; t < padded_len; ++t) {
    const bool real = t < kv_len;
    const float* krow = k + t * token_stride;
    const float* vrow = v + t * token_stride;
    float* kdst = k_packed + (t / kCols) * dim * kCols + t % kCols;
    for (int64_t d = 0; d < dim; ++d) kdst[d * kCols] = real ? krow[d] : 0.f;
    for (int64_t d0 = 0; d0 < dim; d0 += kCols) {
      float* vdst = v_packed + (d0 / kCols * padded_len + t) * kCols;
      for (int64_t j = 0; j < kCols; ++j) vdst[j] = real ? vrow[d0 + j] : 0.f;
    }
  }
}

// Rows [0, rows) of one head against the packed keys and values of its KV head.
// key_end[r]: keys [0, key_end[r]) are visible to row r.
void attend_tile(const float* const* q_rows, int64_t rows, const int64_t* key_end,
                 const float* k_packed, const float* v_packed, int64_t dim, int64_t padded_len,
                 float scale, float* const* out_rows) {
  alignas(64) float q[kTileRows][kMaxDim];
  alignas(64) float scores[kTileRows][kChunk];
  alignas(64) float out[kTileRows][kMaxDim] = {};
  float row_max[kTileRows], row_sum[kTileRows];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < dim; ++d) q[r][d] = q_rows[r][d] * scale;
    row_max[r] = -1e30f;
    row_sum[r] = 0.f;
  }
  int64_t tile_end = 0;
  for (int64_t r = 0; r < rows; ++r) tile_end = std::max(tile_end, key_end[r]);
  const auto product = kTiles[rows];

  for (int64_t c0 = 0; c0 < tile_end; c0 += kChunk) {
    const int64_t width = std::min(kChunk, (tile_end - c0 + kCols - 1) / kCols * kCols);
    for (int64_t g = 0; g < width; g += kCols)  // scores of 16 keys at a time
      product(&q[0][0], kMaxDim, k_packed + (c0 + g) * dim, dim, true,
              mmserve_cpu::kZeros, &scores[0][g], kChunk, nullptr, 0);
    // Online softmax: keys past a row's end get probability 0.
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = std::clamp<int64_t>(key_end[r] - c0, 0, width);
      float* s = scores[r];
      float chunk_max = -1e30f;
      for (int64_t j = 0; j < n; ++j) chunk_max = std::max(chunk_max, s[j]);
      const float new_max = std::max(row_max[r], chunk_max);
      const float rescale = exp_nonpositive(row_max[r] - new_max);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < width; ++j) {
        const float e = j < n ? exp_nonpositive(s[j] - new_max) : 0.f;
        s[j] = e;
        sum += e;
      }
      row_sum[r] = row_sum[r] * rescale + sum;
      row_max[r] = new_max;
      if (rescale != 1.f) {
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) out[r][d] *= rescale;
      }
    }
    // Output += probabilities x values, 16 dimensions at a time.
    for (int64_t d0 = 0; d0 < dim; d0 += kCols)
      product(&scores[0][0], kChunk, v_packed + (d0 / kCols * padded_len + c0) * kCols, width,
              false, nullptr, &out[0][d0], kMaxDim, nullptr, 0);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / row_sum[r];
    for (int64_t d = 0; d < dim; ++d) out_rows[r][d] = out[r][d] * inv;
  }
}

#endif  // MMSERVE_F32_FMA

}  // namespace

bool flash_attention_f32_supported(int64_t head_dim) {
#ifdef MMSERVE_F32_FMA
  return head_dim % kCols == 0 && head_dim > 0 && head_dim <= kMaxDim;
#else
  (void)head_dim;
  return false;
#endif
}

at::Tensor flash_attention_f32(const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, double scale, int64_t causal_offset) {
  // Everything the pointer arithmetic below assumes is checked here, before any data pointer
  // is read.
  mmserve_cpu::check_cpu_tensor(query, "flash_attention_f32", "query");
  mmserve_cpu::check_cpu_tensor(key, "flash_attention_f32", "key");
  mmserve_cpu::check_cpu_tensor(value, "flash_attention_f32", "value");
  MMSERVE_CHECK(query.dim() == 4 && key.dim() == 4 && value.sizes() == key.sizes(),
                "flash_attention_f32: expected query [batch, q_len, heads, dim] and key/value "
                "[batch, kv_len, kv_heads, dim]");
  MMSERVE_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                    value.scalar_type() == at::kFloat,
                "flash_attention_f32: float32 only");
  MMSERVE_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1,
                "flash_attention_f32: the head dimension must be contiguous");
  MMSERVE_CHECK(key.size(2) > 0, "flash_attention_f32: key and value have no KV heads");
  MMSERVE_CHECK(query.size(0) == key.size(0) && query.size(3) == key.size(3) &&
                    query.size(2) % key.size(2) == 0,
                "flash_attention_f32: batch or head sizes differ, or heads are not a multiple of "
                "KV heads");
  MMSERVE_CHECK(flash_attention_f32_supported(query.size(3)),
                "flash_attention_f32: needs AVX2 and FMA and a head size that is a multiple of 16, "
                "at most 256");
  MMSERVE_CHECK(key.size(1) > 0 || query.size(1) == 0, "flash_attention_f32: no keys");
  MMSERVE_CHECK(key.strides() == value.strides(),
                "flash_attention_f32: key and value strides differ");
  auto out = at::empty(query.sizes(), query.options());  // contiguous, whatever q's strides
#ifdef MMSERVE_F32_FMA
  const int64_t batch = query.size(0);
  const int64_t kv_len = key.size(1), num_kv_heads = key.size(2), dim = query.size(3);
  const int64_t padded_len = (kv_len + kChunk - 1) / kChunk * kChunk;
  const int64_t packed_stride = padded_len * dim;
  auto k_packed = at::empty({batch * num_kv_heads, packed_stride}, query.options());
  auto v_packed = at::empty_like(k_packed);
  const float* q_ptr = query.data_ptr<float>();
  const float* k_ptr = key.data_ptr<float>();
  const float* v_ptr = value.data_ptr<float>();
  float* kp_ptr = k_packed.data_ptr<float>();
  float* vp_ptr = v_packed.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      pack_kv(k_ptr + b * key.stride(0) + h * key.stride(2),
              v_ptr + b * value.stride(0) + h * value.stride(2), kv_len, key.stride(1), dim,
              padded_len, kp_ptr + item * packed_stride, vp_ptr + item * packed_stride);
    }
  });

  mmserve_cpu::for_query_tiles<kTileRows>(
      query, q_ptr, o_ptr, kv_len, num_kv_heads, causal_offset, kTileRows,
      [&](const float* const* q_rows, int64_t rows, const int64_t* key_end,
          float* const* out_rows, int64_t kv_item, bool, bool) {
        attend_tile(q_rows, rows, key_end, kp_ptr + kv_item * packed_stride,
                    vp_ptr + kv_item * packed_stride, dim, padded_len, static_cast<float>(scale),
                    out_rows);
      });
#endif
  return out;
}
