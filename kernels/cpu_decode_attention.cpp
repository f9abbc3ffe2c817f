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
//
// float32 with head sizes 64 and 128 (and blocks of a multiple of 8 tokens), on CPUs with AVX2
// and FMA, computes the scores 8 keys at a time (a vector of partial sums per key, the 8 summed
// across lanes at once) instead of one horizontal sum per key and head; float32 rows are read
// in place, never copied. Its work items are a sequence's KV heads, all of them where there
// are sequences enough, so that both passes go token by token over whole rows (see
// `f32_decode_attention`).
//
// bfloat16 with head sizes that are multiples of 32, on CPUs with AVX512-BF16, takes a faster
// path: the dot-product instruction on bfloat16 pairs for both passes (probabilities rounded
// to bfloat16 for the values, as torch's fused attention does; the softmax writes them), the
// value pass keeping the sums of a compile-time number of heads in registers.
//
// The bfloat16 path prefetches, since consecutive blocks are scattered in memory. The key pass
// of a sequence's first KV head asks for the whole K and V rows of every head (a head's part of
// a row is two or four cache lines at head sizes 64 and 128) some keys ahead, so that its value
// pass, and the sequence's other heads where the same thread runs them next (parallel_for
// gives each thread consecutive items) and they still fit in its L2, find them in cache.
// Meanwhile every pass over a sequence (keys and values, each head) also fetches a share of
// the next sequence's rows into L2 (`NextRows`), so that memory is read while the arithmetic
// runs rather than before it: with only the first head's key pass fetching, a thread read
// memory during a quarter of its work (four KV heads) and computed from cache the rest. Each
// KV head of a sequence fetched this way prefetches only its own rows.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_math.h"
#include "cpu_tile_f32.h"

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

// Each of `rows` rows of `len` scores replaced by its softmax, in float32.
inline void softmax_rows(float* scores, int64_t rows, int64_t len) {
  for (int64_t g = 0; g < rows; ++g) {
    float* s = scores + g * len;
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
}

// `bytes` bytes from `start`, a cache line at a time (0: nothing).
inline void prefetch_span(const void* start, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    __builtin_prefetch(static_cast<const char*>(start) + line, 0, 3);
}

#ifdef MMSERVE_F32_FMA
// The 8 horizontal sums of 8 vectors: lane j of the result is the sum of v[j]'s lanes.
inline __m256 sum_lanes_of_8(const __m256 v[8]) {
  // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // Each holds [sums of lanes 0-3 of v0..v3 | sums of lanes 4-7 of v0..v3] (v4..v7 for s4567).
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// The float32 path. A work item is a sequence's KV heads: all of them, or an equal share where
// there are too few sequences for two items per thread. With all of them, a token's K (or V) row
// of the item is one contiguous run (1 KiB at 4 KV heads of 64) and both passes go token by token,
// reading each block front to back; an item of some of the heads goes head by head, a block at a
// time. Items of one KV head each, head by head with software prefetches (this path before), read
// memory at 7-8 GB/s on two AVX2 cores that stream 11 GB/s each: the passes jumped between the
// quarters of every row. Token by token: 1.1-1.8x their speed at 16-64 sequences of 310-1,500
// tokens (benchmarks/cpu_decode_attention.py), and reading half of each row token by token (a
// sequence split between threads) ran slower than head by head. Both passes ask for the rows they
// read next 32 tokens ahead, into L2: within 2% either way on those cores (medians of 21
// alternating rounds), kept for machines where fetching ahead paid (on an AVX-512 EPYC,
// prefetching took a 64-sequence call of the head-by-head path from 0.87 to 0.50 ms; this path is
// not measured there). Items are taken as threads come free (`parallel_claim`), since sequences
// differ in length. Each output is computed in the same order either way: a score is one key's
// vector of partial sums over D, a weighted value one fused multiply-add per key, in key order.
struct ItemRows {
  const float* k;  // the item's first KV head in the caches
  const float* v;
  const int64_t* table;
  int64_t len, heads, block_size, block_stride, token_stride;
  int64_t row_bytes;  // of the item's part of a row
  bool whole;  // the item holds every KV head: its part of a row is the whole row

  // Token t's row from the item's first KV head, as an offset into either cache.
  int64_t offset(int64_t t) const {
    return table[t / block_size] * block_stride + (t % block_size) * token_stride;
  }
  // Asks for row s of the item's stream (its K rows, then its V rows; past them, nothing)
  // in L2, kAheadRows rows before a pass reads it.
  void prefetch(int64_t s) const {
    if (s >= 2 * len) return;
    const char* row = reinterpret_cast<const char*>(s < len ? k + offset(s) : v + offset(s - len));
    for (int64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(row + line, 0, 2);
  }
};
constexpr int64_t kAheadRows = 32;

// Scores of the item's query heads (`group` per KV head, already scaled; q is
// [heads * group, D]) against its keys, 8 keys at a time (block_size is a multiple of 8, so the
// 8 keys of a step share a block). scores is [heads * group, len].
template <int64_t D>
void f32_scores(const float* q, int64_t group, const ItemRows& rows, float* scores) {
  const int64_t len = rows.len, count = rows.heads * group;
  auto dot = [](const float* qg, const float* key) {  // a key's vector of partial sums
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + c), _mm256_loadu_ps(key + c), acc);
    return acc;
  };
  // Query head i's scores of keys t0 .. t0+n-1 from their 8 vectors of partial sums.
  auto store = [&](int64_t i, int64_t t0, int64_t n, const float* partial) {
    __m256 v[8];
    for (int64_t j = 0; j < 8; ++j) v[j] = _mm256_loadu_ps(partial + 8 * j);
    alignas(32) float sums[8];
    _mm256_store_ps(sums, sum_lanes_of_8(v));
    float* dst = scores + i * len + t0;
    for (int64_t j = 0; j < n; ++j) dst[j] = sums[j];
  };
  std::vector<float> partial(64 * (rows.whole ? count : 1));  // [heads][8 keys][8 lanes]
  for (int64_t s = 0; s < std::min(kAheadRows, 2 * len); ++s) rows.prefetch(s);
  for (int64_t t0 = 0; t0 < len; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, len - t0);
    for (int64_t j = 0; j < 8; ++j) rows.prefetch(t0 + kAheadRows + j);
    const float* first = rows.k + rows.offset(t0);
    if (rows.whole) {  // token by token, each row front to back
      for (int64_t j = 0; j < 8; ++j) {
        const float* row = first + j * rows.token_stride;
        for (int64_t i = 0; i < count; ++i)
          _mm256_storeu_ps(&partial[64 * i + 8 * j], j < n ? dot(q + i * D, row + i / group * D)
                                                           : _mm256_setzero_ps());
      }
      for (int64_t i = 0; i < count; ++i) store(i, t0, n, &partial[64 * i]);
      continue;
    }
    for (int64_t i = 0; i < count; ++i) {  // head by head
      for (int64_t j = 0; j < 8; ++j) {
        _mm256_storeu_ps(&partial[8 * j],
                         j < n ? dot(q + i * D, first + j * rows.token_stride + i / group * D)
                               : _mm256_setzero_ps());
      }
      store(i, t0, n, partial.data());
    }
  }
}

// out[i] = sum over keys t of probs[i, t] * value row t of query head i's KV head, for the
// item's query heads, in key order. Token by token (the sums in `out`, in L1) where the item
// holds whole rows; else head by head a block at a time, 64 dimensions in 8 accumulator
// registers across the block.
template <int64_t D>
void f32_weighted_values(const float* probs, int64_t group, const ItemRows& rows, float* out) {
  static_assert(D % 64 == 0);
  const int64_t len = rows.len, count = rows.heads * group;
  std::fill_n(out, count * D, 0.f);
  if (rows.whole) {
    for (int64_t t = 0; t < len; ++t) {
      rows.prefetch(len + t + kAheadRows);
      const float* row = rows.v + rows.offset(t);
      for (int64_t i = 0; i < count; ++i) {
        const float* v = row + i / group * D;
        const __m256 p = _mm256_set1_ps(probs[i * len + t]);
        float* o = out + i * D;
        for (int64_t c = 0; c < D; c += 8)
          _mm256_storeu_ps(o + c,
                           _mm256_fmadd_ps(p, _mm256_loadu_ps(v + c), _mm256_loadu_ps(o + c)));
      }
    }
    return;
  }
  for (int64_t t0 = 0; t0 < len; t0 += rows.block_size) {
    const int64_t n = std::min(rows.block_size, len - t0);
    for (int64_t r = 0; r < n; ++r) rows.prefetch(len + t0 + kAheadRows + r);
    const float* block = rows.v + rows.table[t0 / rows.block_size] * rows.block_stride;
    for (int64_t i = 0; i < count; ++i) {
      const float* p = probs + i * len + t0;
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        float* o = out + i * D + d0;
        const float* first = block + i / group * D + d0;
        __m256 a0 = _mm256_loadu_ps(o), a1 = _mm256_loadu_ps(o + 8);
        __m256 a2 = _mm256_loadu_ps(o + 16), a3 = _mm256_loadu_ps(o + 24);
        __m256 a4 = _mm256_loadu_ps(o + 32), a5 = _mm256_loadu_ps(o + 40);
        __m256 a6 = _mm256_loadu_ps(o + 48), a7 = _mm256_loadu_ps(o + 56);
        for (int64_t r = 0; r < n; ++r) {
          const float* v = first + r * rows.token_stride;
          const __m256 pr = _mm256_set1_ps(p[r]);
          a0 = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v), a0);
          a1 = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + 8), a1);
          a2 = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + 16), a2);
          a3 = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + 24), a3);
          a4 = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + 32), a4);
          a5 = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + 40), a5);
          a6 = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + 48), a6);
          a7 = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + 56), a7);
        }
        _mm256_storeu_ps(o, a0);
        _mm256_storeu_ps(o + 8, a1);
        _mm256_storeu_ps(o + 16, a2);
        _mm256_storeu_ps(o + 24, a3);
        _mm256_storeu_ps(o + 32, a4);
        _mm256_storeu_ps(o + 40, a5);
        _mm256_storeu_ps(o + 48, a6);
        _mm256_storeu_ps(o + 56, a7);
      }
    }
  }
}

// The float32 path's whole call (block_size a multiple of 8); query and out [seqs, heads, D],
// contiguous.
template <int64_t D>
void f32_decode_attention(const float* q_ptr, const float* k_ptr, const float* v_ptr,
                          const int64_t* tables, const int64_t* lens, int64_t num_seqs,
                          int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                          int64_t max_blocks, float scale, float* o_ptr) {
  if (num_seqs == 0) return;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * D, block_stride = block_size * token_stride;
  const int64_t wanted = std::min(num_kv_heads, (2 * at::get_num_threads() + num_seqs - 1) /
                                                    num_seqs);  // items per sequence
  const int64_t per_item = (num_kv_heads + wanted - 1) / wanted;
  const int64_t parts = (num_kv_heads + per_item - 1) / per_item;
  mmserve_cpu::parallel_claim(num_seqs * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q, scores, acc;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / parts, h0 = item % parts * per_item;
      const int64_t heads = std::min(per_item, num_kv_heads - h0);
      const ItemRows rows{k_ptr + h0 * D, v_ptr + h0 * D, tables + seq * max_blocks, lens[seq],
                          heads, block_size, block_stride, token_stride,
                          static_cast<int64_t>(sizeof(float)) * heads * D, parts == 1};
      // The item's query heads, consecutive in the query and the output.
      const int64_t first = (seq * num_heads + h0 * group) * D, count = heads * group;
      q.resize(count * D);
      for (int64_t i = 0; i < count * D; ++i) q[i] = q_ptr[first + i] * scale;
      scores.resize(count * rows.len);
      acc.resize(count * D);
      f32_scores<D>(q.data(), group, rows, scores.data());
      softmax_rows(scores.data(), count, rows.len);
      f32_weighted_values<D>(scores.data(), group, rows, acc.data());
      std::copy_n(acc.data(), count * D, o_ptr + first);
    }
  });
}
#endif  // MMSERVE_F32_FMA

#ifdef MMSERVE_BF16_DOT
// The 16 horizontal sums of 16 vectors: lane j of the result is the sum of v[j]'s lanes.
inline __m512 sum_lanes_of_16(__m512 v[16]) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [v2i.0+v2i.2, v2i+1.0+.2, v2i.1+.3, v2i+1.1+.3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sums of v4i .. v4i+3
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Sum the four 128-bit lanes, leaving the sums of v4i .. v4i+3 in lane i.
  const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0b10001000),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0b11011101));
  const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0b10001000),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], 0b11011101));
  return _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0b10001000),
                       _mm512_shuffle_f32x4(h01, h23, 0b11011101));
}

// Where token t's row of one KV head lives in the paged cache: head_rows points at the head's
// first dimension in the cache, offsets[t] is the row's distance from there (worked out once
// per sequence, so that no key's address takes a division by the block size).
struct PagedRows {
  const uint16_t* head_rows;
  const int64_t* offsets;

  const uint16_t* operator()(int64_t t) const { return head_rows + offsets[t]; }
};

// How far ahead of the key pass rows are prefetched: two steps of 16 keys, about the time
// memory takes to answer.
constexpr int64_t kAheadKeys = 32;

// Scaled scores of `group` bfloat16 query heads against a sequence's keys, 16 keys at a time:
// one bfloat16-pair dot product per 32 dimensions into a float32 vector per key, then the 16
// vectors summed across lanes at once. scores is [group, len]. Each key's K and V rows are
// prefetched kAheadKeys keys ahead, `prefetch_bytes` of each from the head's first dimension.
template <int64_t D, typename Tick>
void bf16_scores(const uint16_t* q, int64_t group, const PagedRows& keys,
                 const PagedRows& values, int64_t len, int64_t prefetch_bytes, float scale,
                 float* scores, Tick&& tick) {
  static const uint16_t zeros[D] = {};
  const uint16_t* rows[16];
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t = 0; t < std::min(kAheadKeys, len); ++t) {
    prefetch_span(keys(t), prefetch_bytes);
    prefetch_span(values(t), prefetch_bytes);
  }
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    tick();
    for (int64_t j = 0; j < 16; ++j) {
      rows[j] = t0 + j < len ? keys(t0 + j) : zeros;
      if (t0 + kAheadKeys + j < len) {
        prefetch_span(keys(t0 + kAheadKeys + j), prefetch_bytes);
        prefetch_span(values(t0 + kAheadKeys + j), prefetch_bytes);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      __m512i qv[D / 32];
      for (int64_t c = 0; c < D / 32; ++c) qv[c] = _mm512_loadu_si512(q + g * D + 32 * c);
      __m512 acc[16];
      for (int64_t j = 0; j < 16; ++j) {
        acc[j] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D / 32; ++c)
          acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)qv[c],
                                    (__m512bh)_mm512_loadu_si512(rows[j] + 32 * c));
      }
      const __m512 sums = _mm512_mul_ps(sum_lanes_of_16(acc), vscale);
      float* dst = scores + g * len + t0;
      _mm512_mask_storeu_ps(dst, mmserve_cpu::first_lanes(len - t0), sums);
    }
  }
}

// Each of `group` rows of `len` scores (row g at scores + g * len) made its softmax and
// written as bfloat16 bits, rounded to nearest even, to row g of prob_bits (2 * pairs wide,
// pairs = (len + 1) / 2, the odd slot past len zero): the value pass's input.
inline void softmax_rows_bf16(const float* scores, int64_t group, int64_t len,
                              uint16_t* prob_bits, float* exps) {
  const int64_t width = 2 * ((len + 1) / 2);
  for (int64_t g = 0; g < group; ++g) {
    const float* s = scores + g * len;
    __m512 vmax = _mm512_set1_ps(std::numeric_limits<float>::lowest());
    for (int64_t t = 0; t < len; t += 16)
      vmax = _mm512_mask_max_ps(vmax, mmserve_cpu::first_lanes(len - t), vmax,
                                _mm512_maskz_loadu_ps(mmserve_cpu::first_lanes(len - t), s + t));
    const __m512 max_score = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
      const __mmask16 m = mmserve_cpu::first_lanes(len - t);
      const __m512 e = mmserve_cpu::exp_nonpositive(
          _mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), max_score));
      vsum = _mm512_mask_add_ps(vsum, m, vsum, e);
      _mm512_mask_storeu_ps(exps + t, m, e);
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vsum));
    uint16_t* dst = prob_bits + g * width;
    for (int64_t t = 0; t < width; t += 16) {
      const __mmask16 m = mmserve_cpu::first_lanes(width - t);
      const __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(mmserve_cpu::first_lanes(len - t),
                                                           exps + t), inv);
      _mm256_mask_storeu_epi16(dst + t, m, (__m256i)_mm512_cvtneps_pbh(p));
    }
  }
}

// out[h] += sum over t of probs[h, t] * V[t] for kH heads at once (their sums in registers
// across the whole sequence), two keys per instruction: the bfloat16 probability pairs
// (t, t+1) against the two value rows interleaved into (V[t][d], V[t+1][d]) pairs.
// Interleaving works within 128-bit lanes, so accumulator lane i of chunk c holds dimension
// 32c + 8(i/4) + i%4 (+4 for the high half); the store undoes it.
template <int64_t D, int64_t kH, typename Tick>
void bf16_values_of_heads(const uint16_t* prob_bits, int64_t width, const PagedRows& values,
                          int64_t len, c10::BFloat16* out, Tick& tick) {
  constexpr int64_t kChunks = D / 32;
  static const uint16_t zeros[D] = {};
  __m512 acc[kH][2 * kChunks];
  for (int64_t h = 0; h < kH; ++h)
    for (int64_t c = 0; c < 2 * kChunks; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 2) {
    if (t % 16 == 0) tick();
    const uint16_t* even = values(t);
    const uint16_t* odd = t + 1 < len ? values(t + 1) : zeros;
    if (t + 16 < len) prefetch_span(values(t + 16), 2 * D);  // from L2 (the key pass)
    if (t + 17 < len) prefetch_span(values(t + 17), 2 * D);
    __m512i vpairs[2 * kChunks];
    for (int64_t c = 0; c < kChunks; ++c) {
      const __m512i a = _mm512_loadu_si512(even + 32 * c), b = _mm512_loadu_si512(odd + 32 * c);
      vpairs[2 * c] = _mm512_unpacklo_epi16(a, b);
      vpairs[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
    }
    for (int64_t h = 0; h < kH; ++h) {
      uint32_t pair;
      std::memcpy(&pair, prob_bits + h * width + t, sizeof pair);
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int64_t c = 0; c < 2 * kChunks; ++c)
        acc[h][c] = _mm512_dpbf16_ps(acc[h][c], p, (__m512bh)vpairs[c]);
    }
  }
  for (int64_t h = 0; h < kH; ++h) {
    c10::BFloat16* dst = out + h * D;
    alignas(64) float lanes[16];
    for (int64_t c = 0; c < 2 * kChunks; ++c) {
      _mm512_store_ps(lanes, acc[h][c]);
      for (int64_t i = 0; i < 16; ++i)
        dst[32 * (c / 2) + 8 * (i / 4) + 4 * (c % 2) + i % 4] = c10::BFloat16(lanes[i]);
    }
  }
}

// out[g] = sum over t of probs[g, t] * V[t] for `group` heads, as many heads per pass over
// the values as their accumulators fit in 24 registers; each pass's head count is a
// compile-time constant, so its accumulators never leave the registers.
template <int64_t D, typename Tick>
void bf16_weighted_values(const uint16_t* prob_bits, int64_t group, const PagedRows& values,
                          int64_t len, c10::BFloat16* out, Tick&& tick) {
  constexpr int64_t kHeads = 24 / (2 * (D / 32));
  static_assert(kHeads >= 1 && kHeads <= 6, "the dispatch below runs passes of 1 to 6 heads");
  const int64_t width = 2 * ((len + 1) / 2);
  for (int64_t g0 = 0; g0 < group; g0 += kHeads) {
    const uint16_t* probs = prob_bits + g0 * width;
    c10::BFloat16* dst = out + g0 * D;
    const auto pass = [&](auto heads) {
      bf16_values_of_heads<D, decltype(heads)::value>(probs, width, values, len, dst, tick);
    };
    using std::integral_constant;
    switch (std::min(kHeads, group - g0)) {  // kHeads: 6 at head size 64, 3 at 128
      case 1: pass(integral_constant<int64_t, 1>{}); break;
      case 2: pass(integral_constant<int64_t, 2>{}); break;
      case 3: pass(integral_constant<int64_t, 3>{}); break;
      case 4: if constexpr (kHeads >= 4) pass(integral_constant<int64_t, 4>{}); break;
      case 5: if constexpr (kHeads >= 5) pass(integral_constant<int64_t, 5>{}); break;
      default: if constexpr (kHeads >= 6) pass(integral_constant<int64_t, 6>{}); break;
    }
  }
}
#endif  // MMSERVE_BF16_DOT

// Brings the next sequence's K and V rows (every head's) towards L2 while this one computes,
// a few tokens per tick, so that memory works beside the arithmetic instead of before it.
constexpr int64_t kMaxRowsPerTick = 8;

struct NextRows {
  const char* k = nullptr;
  const char* v = nullptr;
  const int64_t* table = nullptr;
  int64_t len = 0, next = 0, per_tick = 0, block_size = 1, block_bytes = 0, row_bytes = 0;

  void operator()() {
    for (int64_t end = std::min(len, next + per_tick); next < end; ++next) {
      const int64_t at = table[next / block_size] * block_bytes + (next % block_size) * row_bytes;
      for (int64_t line = 0; line < row_bytes; line += 64) {
        __builtin_prefetch(k + at + line, 0, 2);  // into L2 (prefetcht1)
        __builtin_prefetch(v + at + line, 0, 2);
      }
    }
  }
};

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
#ifdef MMSERVE_F32_FMA
  if constexpr (std::is_same_v<T, float> && kHeadDim % 64 == 0 && kHeadDim > 0) {
    if (block_size % 8 == 0) {
      f32_decode_attention<kHeadDim>(q_ptr, k_ptr, v_ptr, tables, lens, num_seqs, num_heads,
                                     num_kv_heads, block_size, max_blocks, fscale, o_ptr);
      return;
    }
  }
#endif
  // Whether this instance's passes tick `NextRows` (the bfloat16 fast path).
  constexpr bool kFetchesAhead =
#ifdef MMSERVE_BF16_DOT
      (std::is_same_v<T, c10::BFloat16> && kHeadDim % 32 == 0 && kHeadDim > 0) ||
#endif
      false;

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), row(head_dim), scores;
    std::vector<uint16_t> prob_bits;  // bfloat16 probabilities of the fast path
    std::vector<float> exps;  // the fast path's softmax numerators of one head
    std::vector<int64_t> row_offsets;  // the fast path's rows of the sequence `offsets_of`
    [[maybe_unused]] int64_t offsets_of = -1;
    NextRows next_rows;  // ticked by the fast paths' passes
    [[maybe_unused]] bool fetched_ahead = false;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t len = lens[seq];
      const int64_t* table = tables + seq * max_blocks;
      const int64_t head_offset = kv_head * head_dim;
      if (kFetchesAhead && kv_head == 0) {
        // Were all of this sequence's rows fetched during the one before? (Not if that one
        // was too short to spread them over, or its passes ticked less than planned.)
        fetched_ahead = next_rows.k != nullptr && next_rows.table == table &&
                        next_rows.next >= next_rows.len;
        const int64_t next_seq = seq + 1;
        if (next_seq * num_kv_heads < end) {
          const int64_t next_len = lens[next_seq];
          // A tick per 16 keys of each pass; at most kMaxRowsPerTick rows a tick, so that a
          // short sequence before a long one fetches the long one's first rows, not a burst.
          const int64_t ticks = std::max<int64_t>(1, num_kv_heads * 2 * ((len + 15) / 16));
          const int64_t per_tick = std::min(kMaxRowsPerTick, (next_len + ticks - 1) / ticks);
          next_rows = NextRows{reinterpret_cast<const char*>(k_ptr),
                               reinterpret_cast<const char*>(v_ptr),
                               tables + next_seq * max_blocks, next_len, 0, per_tick,
                               block_size, static_cast<int64_t>(sizeof(T)) * block_stride,
                               static_cast<int64_t>(sizeof(T)) * token_stride};
        } else {
          next_rows = NextRows{};
        }
      }
      scores.resize(group * len);
      // Calls fn(t, row) for every cached token t of this sequence, in order, with the token's
      // K or V row of this KV head (read in place from its block) widened to float32.
      auto for_each_row = [&](const T* cache, auto&& fn) {
        for (int64_t t0 = 0; t0 < len; t0 += block_size) {
          const T* block = cache + table[t0 / block_size] * block_stride + head_offset;
          const int64_t n = std::min(block_size, len - t0);
          for (int64_t i = 0; i < n; ++i) {
            if constexpr (std::is_same_v<T, float>) {
              fn(t0 + i, block + i * token_stride);  // already float32: read in place
            } else {
              widen_row(block + i * token_stride, row.data(), head_dim);
              fn(t0 + i, row.data());
            }
          }
        }
      };
#ifdef MMSERVE_BF16_DOT
      if constexpr (std::is_same_v<T, c10::BFloat16> && kHeadDim % 32 == 0 && kHeadDim > 0) {
        const auto* q_bits = reinterpret_cast<const uint16_t*>(q_ptr) +
                             (seq * num_heads + kv_head * group) * head_dim;
        // Bytes of each upcoming row a pass prefetches: a sequence's first KV head fetches
        // every head's rows, unless the sequence before fetched them already.
        const int64_t prefetch_bytes = static_cast<int64_t>(sizeof(T)) *
                                       (kv_head == 0 && !fetched_ahead ? token_stride : head_dim);
        if (offsets_of != seq) {  // a sequence's KV heads are consecutive items
          row_offsets.resize(len);
          for (int64_t t0 = 0; t0 < len; t0 += block_size) {
            const int64_t block = table[t0 / block_size] * block_stride;
            for (int64_t i = 0; i < std::min(block_size, len - t0); ++i)
              row_offsets[t0 + i] = block + i * token_stride;
          }
          offsets_of = seq;
        }
        const PagedRows keys{reinterpret_cast<const uint16_t*>(k_ptr) + head_offset,
                             row_offsets.data()};
        const PagedRows values{reinterpret_cast<const uint16_t*>(v_ptr) + head_offset,
                               row_offsets.data()};
        bf16_scores<kHeadDim>(q_bits, group, keys, values, len, prefetch_bytes, fscale,
                              scores.data(), next_rows);
        prob_bits.resize(group * (len + 1));
        exps.resize(len);
        softmax_rows_bf16(scores.data(), group, len, prob_bits.data(), exps.data());
        bf16_weighted_values<kHeadDim>(prob_bits.data(), group, values, len,
                                       o_ptr + (seq * num_heads + kv_head * group) * head_dim,
                                       next_rows);
        continue;
      }
#endif
      // Scores: one pass over the keys, with the query heads widened and scaled first.
      for (int64_t g = 0; g < group; ++g) {
        const T* src = q_ptr + (seq * num_heads + kv_head * group + g) * head_dim;
        widen_row(src, q.data() + g * head_dim, head_dim);
        for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] *= fscale;
      }
      // One horizontal sum per key and head.
      for_each_row(k_ptr, [&](int64_t t, const float* kf) {
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q.data() + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * kf[d];
          scores[g * len + t] = dot;
        }
      });
      softmax_rows(scores.data(), group, len);
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
  // Everything the pointer arithmetic below assumes is checked here, before any data pointer
  // is read: shapes, dtypes, strides, devices, and that every block a sequence reads lies in
  // the caches.
  using mmserve_cpu::check_cpu_tensor;
  check_cpu_tensor(query, "decode_attention", "query");
  check_cpu_tensor(key_cache, "decode_attention", "key_cache");
  check_cpu_tensor(value_cache, "decode_attention", "value_cache");
  check_cpu_tensor(block_tables, "decode_attention", "block_tables");
  check_cpu_tensor(seq_lens, "decode_attention", "seq_lens");
  MMSERVE_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
                "decode_attention: expected query [seqs, heads, dim] and caches "
                "[blocks, block_size, kv_heads, dim]");
  MMSERVE_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
                "decode_attention: query and caches must be contiguous");
  MMSERVE_CHECK(query.scalar_type() == key_cache.scalar_type() &&
                    key_cache.scalar_type() == value_cache.scalar_type(),
                "decode_attention: query and caches must share a dtype");
  MMSERVE_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16 ||
                    query.scalar_type() == at::kHalf,
                "decode_attention: unsupported dtype ", query.scalar_type(),
                " (float32, bfloat16 or float16 only)");
  const int64_t num_seqs = query.size(0), num_blocks = key_cache.size(0);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  MMSERVE_CHECK(block_size > 0 && num_kv_heads > 0,
                "decode_attention: the caches need a block size and a number of KV heads of at "
                "least 1, got block_size ", block_size, " and ", num_kv_heads, " KV heads");
  MMSERVE_CHECK(query.size(2) == key_cache.size(3) && query.size(1) % num_kv_heads == 0,
                "decode_attention: head sizes differ or heads are not a multiple of KV heads");
  MMSERVE_CHECK(block_tables.dim() == 2 &&
                    at::isIntegralType(block_tables.scalar_type(), /*includeBool=*/false),
                "decode_attention: block_tables must be an integer tensor [seqs, max_blocks], got ",
                block_tables.scalar_type(), " ", block_tables.sizes());
  MMSERVE_CHECK(seq_lens.dim() == 1 && at::isIntegralType(seq_lens.scalar_type(), false),
                "decode_attention: seq_lens must be an integer tensor [seqs], got ",
                seq_lens.scalar_type(), " ", seq_lens.sizes());
  MMSERVE_CHECK(block_tables.size(0) == num_seqs && seq_lens.size(0) == num_seqs,
                "decode_attention: one block table and length per sequence (", num_seqs,
                " sequences, ", block_tables.size(0), " block tables, ", seq_lens.size(0),
                " lengths)");
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = seq_lens.to(at::kLong).contiguous();
  // The kernel reads block ids table[0 .. ceil(len / block_size)) of each sequence and the rows
  // of those blocks: each length must fit its table, each id it reads must name a cache block.
  // (Entries past a sequence's blocks are padding, never read, so never checked.)
  const int64_t max_blocks = tables.size(1);
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t len = len_ptr[seq];
    MMSERVE_CHECK(len >= 0 && len <= max_blocks * block_size, "decode_attention: sequence ", seq,
                  " has length ", len, ", but its block table holds ", max_blocks,
                  " blocks of ", block_size, " tokens");
    for (int64_t i = 0; i < (len + block_size - 1) / block_size; ++i) {
      const int64_t block = table_ptr[seq * max_blocks + i];
      MMSERVE_CHECK(block >= 0 && block < num_blocks, "decode_attention: block table entry ", i,
                    " of sequence ", seq, " is ", block, ", outside the caches' ", num_blocks,
                    " blocks");
    }
  }
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
      MMSERVE_CHECK(false, "decode_attention: unsupported dtype ", query.scalar_type());
  }
  return out;
}
