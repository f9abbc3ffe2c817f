// What the CPU kernels share: the argument checks that come before any pointer arithmetic,
// work items handed to threads as they come free, the instruction set test, bfloat16 bits,
// lane masks, and exp (scalar, written so the compiler vectorizes it, and on 16 lanes), with
// bfloat16 loads, stores and the sigmoid on 16 lanes.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

// AVX512-BF16: a dot-product instruction multiplying pairs of bfloat16 into float32 sums.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define MMSERVE_BF16_DOT 1
#endif

namespace mmserve_cpu {

// Error messages, built by appending strings, not through iostreams. TORCH_CHECK's own
// formatting (c10::str) streams every argument into a std::ostringstream compiled into this
// module; where the toolchain links a second copy of libstdc++ into it, that stream's locale
// machinery mixes the two copies and the formatting itself segfaults. A single std::string
// argument passes through c10::str untouched.
inline void append(std::string& out, const char* s) { out += s; }
inline void append(std::string& out, const std::string& s) { out += s; }
inline void append(std::string& out, c10::ScalarType t) { out += c10::toString(t); }
inline void append(std::string& out, const c10::Device& d) { out += d.str(); }
inline void append(std::string& out, c10::Layout layout) {
  switch (layout) {
    case c10::kStrided: out += "Strided"; break;
    case c10::kSparse: out += "Sparse"; break;
    case c10::kMkldnn: out += "Mkldnn"; break;
    default: out += "a non-strided layout"; break;
  }
}
inline void append(std::string& out, at::IntArrayRef sizes) {
  out += '[';
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(sizes[i]);
  }
  out += ']';
}
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void append(std::string& out, T value) { out += std::to_string(value); }

template <typename... Args>
std::string message(const Args&... args) {
  std::string out;
  (append(out, args), ...);
  return out;
}

// TORCH_CHECK with the message above; the arguments are evaluated only when the check fails.
#define MMSERVE_CHECK(cond, ...) TORCH_CHECK(cond, ::mmserve_cpu::message(__VA_ARGS__))

// A tensor argument whose elements the kernel reads or writes through its data pointer and
// strides: it must exist, live in this process's memory (the CPU, not a GPU or the meta
// device, whose data pointer is not host memory or null) and be a plain strided tensor (a
// sparse or oneDNN tensor has no strides to index by). `fn` and `what` name the function and
// the argument in the message.
inline void check_cpu_tensor(const at::Tensor& t, const char* fn, const char* what) {
  MMSERVE_CHECK(t.defined(), fn, ": ", what, " is an undefined tensor");
  MMSERVE_CHECK(t.device().is_cpu(), fn, ": ", what, " must be a CPU tensor, not one on ",
                t.device());
  MMSERVE_CHECK(t.layout() == at::kStrided, fn, ": ", what,
                " must be a dense (strided) tensor, not ", t.layout());
}

// Items [0, total) handed to the process's compute threads in batches of `batch`, in order, each
// thread taking the next batch when it finishes its last one. A static split (parallel_for's
// equal ranges) makes a step wait for its slowest thread: for uneven items, or a core that
// another process or the kernel takes for a while. Here the thread that is held up does fewer
// batches instead. `body(begin, end)` runs once per batch, on any thread, so what an item
// computes must not depend on which thread runs it or on the items run before it there.
template <typename Body>
void parallel_claim(int64_t total, int64_t batch, const Body& body) {
  if (total <= 0) return;
  batch = std::max<int64_t>(batch, 1);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (total + batch - 1) / batch);
  if (threads <= 1) {
    body(0, total);
    return;
  }
  std::atomic<int64_t> next{0};
  // One index per thread; inside another parallel region this runs on the calling thread
  // alone, which then claims every batch itself.
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t begin; (begin = next.fetch_add(batch, std::memory_order_relaxed)) < total;)
      body(begin, std::min(total, begin + batch));
  });
}

// The query tiles of a flash attention over `query` [batch, q_len, heads, dim] (output rows
// contiguous in `out`, the same shape): tiles of up to `tile_rows` (<= kMaxRows) rows of one
// (batch, head), in (batch, head, rows) order, so that contiguous ranges give each thread whole
// heads and the longer causal tiles at the end of every head are spread across threads.
// tile(q_rows, rows, key_end, out_rows, kv_item, first, last) runs once per tile: row r's
// query and output rows, the keys [0, key_end[r]) it sees (causal_offset >= 0: those up to
// its position plus the offset; < 0: all kv_len), the (batch, KV head) index of its keys and
// values, and whether this is the first or last tile the thread runs of its range.
template <int64_t kMaxRows, typename T, typename Tile>
void for_query_tiles(const at::Tensor& query, const T* q_ptr, T* out, int64_t kv_len,
                     int64_t num_kv_heads, int64_t causal_offset, int64_t tile_rows,
                     const Tile& tile) {
  const int64_t batch = query.size(0), q_len = query.size(1), num_heads = query.size(2);
  const int64_t dim = query.size(3), group = num_heads / num_kv_heads;
  const int64_t tiles = (q_len + tile_rows - 1) / tile_rows;
  at::parallel_for(0, batch * num_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    const T* q_rows[kMaxRows];
    T* out_rows[kMaxRows];
    int64_t key_end[kMaxRows];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / tiles / num_heads, h = item / tiles % num_heads;
      const int64_t row0 = item % tiles * tile_rows, rows = std::min(tile_rows, q_len - row0);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = row0 + r;
        q_rows[r] = q_ptr + b * query.stride(0) + i * query.stride(1) + h * query.stride(2);
        out_rows[r] = out + ((b * q_len + i) * num_heads + h) * dim;
        key_end[r] = causal_offset < 0 ? kv_len : std::min(kv_len, i + causal_offset + 1);
      }
      tile(q_rows, rows, key_end, out_rows, b * num_kv_heads + h / group, item == begin,
           item + 1 == end);
    }
  });
}

// bfloat16 is the upper half of a float32: widening is a shift, narrowing rounds to nearest
// even (NaN stays NaN). Plain integer arithmetic, so loops over them vectorize.
inline float bf16_value(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

// exp(x) for x <= 0 (scores minus their maximum), within about 2 ulp of expf over the range
// that matters, in plain arithmetic the compiler vectorizes (std::exp stays a scalar call
// unless the whole file is built with -ffast-math). exp(x) = 2^k * exp(r), |r| <= ln(2)/2,
// with Cephes' polynomial for exp(r).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below this expf is subnormal; 0 is as good for a softmax
  const float k = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(k, -0.693359375f, x);
  r = std::fma(k, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;  // 2^k
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#ifdef MMSERVE_BF16_DOT
// The first n of 16 lanes (none for n <= 0, all for n >= 16).
inline __mmask16 first_lanes(int64_t n) {
  return static_cast<__mmask16>(n >= 16 ? 0xffff : n <= 0 ? 0 : (1u << n) - 1);
}

// exp_nonpositive on 16 lanes: the same reduction and polynomial, 2^k applied by vscalefps.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(-0.693359375f), x);
  r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}

// bfloat16 on 16 lanes: the first lanes of `m` widened to float32, and float32 rounded to
// bfloat16 (to nearest even, subnormals to zero, as the AVX512-BF16 conversion does).
inline __m512 widen_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
  return widen_bf16(_mm256_maskz_loadu_epi16(m, p));
}
inline void store_bf16(uint16_t* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
// A float32 rounded to bfloat16's precision, as an op that stores bfloat16 leaves it.
inline __m512 round_bf16(__m512 v) { return widen_bf16((__m256i)_mm512_cvtneps_pbh(v)); }

// 1 / (1 + exp(-x)) on 16 lanes, as the scalar sigmoid of cpu_elementwise.cpp computes it.
inline __m512 sigmoid16(__m512 x) {
  const __m512 e = exp_nonpositive(_mm512_or_ps(x, _mm512_set1_ps(-0.f)));  // exp(-|x|)
  const __m512 r = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), e));
  return _mm512_mask_mul_ps(r, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), e, r);
}

// fn(i, lanes) for i = 0, 16, 32, ... < n, `lanes` the mask of those of [i, i + 16) below n.
template <typename Fn>
inline void for_lanes(int64_t n, Fn&& fn) {
  for (int64_t i = 0; i < n; i += 16) fn(i, first_lanes(n - i));
}

// How the bfloat16 kernels' vector code multiplies: the pair dot product (VDPBF16PS), or,
// where this core runs them faster (timed at the first call; cpu_linear.cpp), float32 FMAs
// on inputs widened to float32. VDPBF16PS adds to each float32 sum the product of the odd
// bfloat16 inputs of a pair, then that of the even ones, rounding each sum to nearest even;
// products of bfloat16 values are exact in float32, so two FMAs in that order give the same
// bits (but for subnormal numbers, which the instruction flushes to zero). set_bf16_fma
// chooses (returning the previous choice).
bool bf16_fma();
bool set_bf16_fma(bool enabled);

// A vector of bfloat16 pairs (input k in each 32-bit lane's low half, k + 1 in its high
// half) as the two float32 vectors of inputs k and k + 1.
inline __m512 even_bf16(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
}
inline __m512 odd_bf16(__m512i pairs) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
}
#endif

}  // namespace mmserve_cpu
