// Paged decode attention on the CPU: one query token per sequence, keys and values read in
// place from their KV blocks (no gather), grouped-query heads sharing each K/V row.
//
// query        [num_seqs, num_heads, head_dim]
// key_cache    [num_blocks, block_size, num_kv_heads, head_dim]   (value_cache the same)
// block_tables [num_seqs, max_blocks] int64, seq_lens [num_seqs] int64
// returns      [num_seqs, num_heads, head_dim], the query's dtype
//
// Work items are (sequence, KV head) pairs. Each computes the scores of its query heads
// against every cached key (one pass over K), a float32 softmax, then the weighted sum of the
// values (one pass over V). Arithmetic is float32; bfloat16 is widened by a shift.

#include <ATen/ATen.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_math.h"

namespace {

using mmserve_cpu::exp_nonpositive;

// Widen one row of head_dim elements to float32. Written as plain loops over raw bits so that
// the compiler vectorizes them (bfloat16 is the upper half of a float32).
inline void widen_row(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
inline void widen_row(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}
inline void widen_row(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// kHeadDim > 0 fixes the head size at compile time (fully unrolled rows); 0 reads it at run time.
template <typename T, int64_t kHeadDim>
void decode_attention_impl(const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t token_stride = num_kv_heads * head_dim;  // between tokens of one block
  const int64_t block_stride = block_size * token_stride;

  const T* q_ptr = query.data_ptr<T>();
  const T* k_ptr = key_cache.data_ptr<T>();
  const T* v_ptr = value_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* o_ptr = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), row(head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t len = lens[seq];
      const int64_t* table = tables + seq * max_blocks;
      const int64_t head_offset = kv_head * head_dim;
      scores.resize(group * len);
      for (int64_t g = 0; g < group; ++g) {
        const T* src = q_ptr + (seq * num_heads + kv_head * group + g) * head_dim;
        widen_row(src, q.data() + g * head_dim, head_dim);
        for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] *= fscale;
      }
      // Calls fn(t, row) for every cached token t of this sequence, in order, with the token's
      // K or V row of this KV head (read in place from its block) widened to float32.
      auto for_each_row = [&](const T* cache, auto&& fn) {
        for (int64_t t0 = 0; t0 < len; t0 += block_size) {
          const T* block = cache + table[t0 / block_size] * block_stride + head_offset;
          const int64_t n = std::min(block_size, len - t0);
          for (int64_t i = 0; i < n; ++i) {
            widen_row(block + i * token_stride, row.data(), head_dim);
            fn(t0 + i, row.data());
          }
        }
      };
      // Scores: one pass over the keys.
      for_each_row(k_ptr, [&](int64_t t, const float* kf) {
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q.data() + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * kf[d];
          scores[g * len + t] = dot;
        }
      });
      // Softmax per query head, float32.
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        float max_score = std::numeric_limits<float>::lowest();
#pragma omp simd reduction(max : max_score)
        for (int64_t t = 0; t < len; ++t) max_score = std::max(max_score, s[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          s[t] = exp_nonpositive(s[t] - max_score);
          sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      // Weighted values: one pass over the values.
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_row(v_ptr, [&](int64_t t, const float* vf) {
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* a = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vf[d];
        }
      });
      for (int64_t g = 0; g < group; ++g) {
        T* dst = o_ptr + (seq * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(acc[g * head_dim + d]);
      }
    }
  });
}

template <typename T>
void dispatch_head_dim(const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_tables,
                       const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  switch (query.size(2)) {
    case 64:
      return decode_attention_impl<T, 64>(query, key_cache, value_cache, block_tables,
                                          seq_lens, scale, out);
    case 128:
      return decode_attention_impl<T, 128>(query, key_cache, value_cache, block_tables,
                                           seq_lens, scale, out);
    default:
      return decode_attention_impl<T, 0>(query, key_cache, value_cache, block_tables, seq_lens,
                                         scale, out);
  }
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "decode_attention: expected query [seqs, heads, dim] and caches "
              "[blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "decode_attention: query and caches must be contiguous");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() &&
                  key_cache.scalar_type() == value_cache.scalar_type(),
              "decode_attention: query and caches must share a dtype");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && query.size(1) % key_cache.size(2) == 0,
              "decode_attention: head sizes differ or heads are not a multiple of KV heads");
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(tables.size(0) == query.size(0) && lens.size(0) == query.size(0),
              "decode_attention: one block table and length per sequence");
  auto out = at::empty_like(query);
  switch (query.scalar_type()) {
    case at::kFloat:
      dispatch_head_dim<float>(query, key_cache, value_cache, tables, lens, scale, out);
      break;
    case at::kBFloat16:
      dispatch_head_dim<c10::BFloat16>(query, key_cache, value_cache, tables, lens, scale,
                                           out);
      break;
    case at::kHalf:
      dispatch_head_dim<c10::Half>(query, key_cache, value_cache, tables, lens, scale, out);
      break;
    default:
      TORCH_CHECK(false, "decode_attention: unsupported dtype ", query.scalar_type());
  }
  return out;
}
