// Fused elementwise layers on the CPU for bfloat16 and float32 activations: one pass over
// memory where torch runs three to six (each with its own temporary tensor). In bfloat16 they
// round at the points torch's unfused ops do, so results match them up to float32 rounding of
// the intermediate math; in float32 only that rounding differs (the sum of squares of a norm
// runs in another order, exp is within 2 ulp).
//
// rms_norm(x [rows, hidden], weight [hidden], eps)  -> weight * T(x * rsqrt(mean(x^2) + eps))
// add_rms_norm(x, residual, weight, eps)            -> residual = T(x + residual), in place;
//                                                      then rms_norm(residual, weight, eps)
// add_layer_norm(x [..., hidden], residual, w, b, eps) -> (s = T(x + residual),
//                                                      T((s - mean) * rstd * w + b)), bfloat16
// silu_and_mul(gate [rows, n], up [rows, n])        -> T(silu(gate)) * up
// quick_gelu(x [...])                               -> x * T(sigmoid(T(1.702 x)))
// quick_gelu_(x)                                    -> the same, into x (contiguous)
// rotary(x [tokens, heads, dim], cos, sin [tokens, 1, dim])
//                                 -> T(x * cos) + T(rotate_half(x) * sin), contiguous
// where T() rounds to the tensors' dtype (nothing in float32).
//
// Plain loops, templated on the element (the bits of a bfloat16, or a float), which the
// compiler vectorizes; any CPU. bfloat16 takes loops on 16 lanes where the build has
// AVX512-BF16.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <tuple>
#include <type_traits>

#include "cpu_math.h"

namespace {

using mmserve_cpu::bf16_bits;
using mmserve_cpu::bf16_value;
using mmserve_cpu::exp_nonpositive;

// Elements as float and back: bfloat16 bits (uint16_t) widen and round, floats pass through.
inline float wide(uint16_t bits) { return bf16_value(bits); }
inline float wide(float f) { return f; }
template <typename T>
inline T narrow(float f) {
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else {
    return bf16_bits(f);
  }
}
// A float rounded to T's precision, as an unfused op that stores a T would leave it.
template <typename T>
inline float rounded(float f) { return wide(narrow<T>(f)); }

// 1 / (1 + exp(-x)) without overflow: exp of a non-positive argument either way.
inline float sigmoid(float x) {
  const float e = exp_nonpositive(-std::fabs(x));
  const float r = 1.f / (1.f + e);
  return x >= 0.f ? r : e * r;
}

// Rows of `width` elements in parallel chunks of about 64k elements.
template <typename Fn>
void for_rows(int64_t rows, int64_t width, Fn&& fn) {
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(width, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r);
  });
}

// Every tensor of a call defined, a dense tensor on the CPU, all of one dtype: bfloat16 or
// float32. Checked before any data pointer is read.
void check_dtype(std::initializer_list<const at::Tensor*> tensors, const char* name) {
  for (const at::Tensor* t : tensors) {
    MMSERVE_CHECK(t->defined(), name, ": undefined tensor");
    MMSERVE_CHECK(t->device().is_cpu(), name, ": CPU tensors only, got one on ", t->device());
    MMSERVE_CHECK(t->layout() == at::kStrided, name, ": dense (strided) tensors only, got ",
                  t->layout());
  }
  const auto dtype = (*tensors.begin())->scalar_type();
  MMSERVE_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, name, ": bfloat16 or float32 only");
  for (const at::Tensor* t : tensors) {
    MMSERVE_CHECK(t->scalar_type() == dtype, name, ": all tensors must have one dtype");
  }
}

// The elements of a bfloat16 (as bits) or float32 tensor.
template <typename T>
T* elements(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// Rows of a 2-D view whose last dimension is contiguous.
template <typename T>
const T* row_of(const at::Tensor& t, int64_t r) {
  return elements<const T>(t) + r * t.stride(0);
}

// fn<T>() for the tensors' element type.
template <typename Fn>
void by_dtype(const at::Tensor& t, Fn&& fn) {
  if (t.scalar_type() == at::kFloat) {
    fn(float{});
  } else {
    fn(uint16_t{});
  }
}

#ifdef MMSERVE_BF16_DOT
// bfloat16 rows on 16 lanes where the build has AVX512-BF16: the arithmetic and the rounding
// points of the scalar loops (which the compiler vectorizes 8 lanes wide, widening and
// rounding bfloat16 in integer steps), with the conversion instruction's rounding, 1.4-2.4 times
// their speed (benchmarks/cpu_elementwise.py). Sums of squares add in another order, so a rare
// norm moves a bfloat16 step.
using mmserve_cpu::for_lanes;
using mmserve_cpu::load_bf16;
using mmserve_cpu::round_bf16;
using mmserve_cpu::sigmoid16;
using mmserve_cpu::store_bf16;

constexpr bool kBf16Lanes = true;

// out = x + y, rounded (out may be y: the residual stream added into in place).
void add_row(const uint16_t* x, const uint16_t* y, uint16_t* out, int64_t n) {
  for_lanes(n, [&](int64_t i, __mmask16 m) {
    store_bf16(out + i, _mm512_add_ps(load_bf16(x + i, m), load_bf16(y + i, m)), m);
  });
}

float sum_of_squares(const uint16_t* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for_lanes(n, [&](int64_t i, __mmask16 m) {
    const __m512 v = load_bf16(x + i, m);
    acc = _mm512_fmadd_ps(v, v, acc);
  });
  return _mm512_reduce_add_ps(acc);
}

void scale_row(const uint16_t* x, float inv, const uint16_t* w, uint16_t* out, int64_t n) {
  const __m512 s = _mm512_set1_ps(inv);
  for_lanes(n, [&](int64_t i, __mmask16 m) {
    const __m512 normed = round_bf16(_mm512_mul_ps(load_bf16(x + i, m), s));
    store_bf16(out + i, _mm512_mul_ps(load_bf16(w + i, m), normed), m);
  });
}

// LayerNorm of a row in float32 (mean, then the variance about it), as torch's CPU kernel
// applies it: x * rstd + (-mean * rstd), then weight and bias.
void layer_norm_row(const uint16_t* x, const uint16_t* w, const uint16_t* b, float eps,
                    uint16_t* out, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for_lanes(n, [&](int64_t i, __mmask16 m) { acc = _mm512_add_ps(acc, load_bf16(x + i, m)); });
  const float mean = _mm512_reduce_add_ps(acc) / static_cast<float>(n);
  const __m512 mu = _mm512_set1_ps(mean);
  acc = _mm512_setzero_ps();
  for_lanes(n, [&](int64_t i, __mmask16 m) {
    const __m512 d = _mm512_maskz_sub_ps(m, load_bf16(x + i, m), mu);
    acc = _mm512_fmadd_ps(d, d, acc);
  });
  const float rstd = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) + eps);
  const __m512 scale = _mm512_set1_ps(rstd), shift = _mm512_set1_ps(-mean * rstd);
  for_lanes(n, [&](int64_t i, __mmask16 m) {
    const __m512 normed = _mm512_fmadd_ps(load_bf16(x + i, m), scale, shift);
    store_bf16(out + i, _mm512_fmadd_ps(normed, load_bf16(w + i, m), load_bf16(b + i, m)), m);
  });
}

void silu_and_mul_row(const uint16_t* g, const uint16_t* u, uint16_t* out, int64_t n) {
  for_lanes(n, [&](int64_t i, __mmask16 m) {
    const __m512 x = load_bf16(g + i, m);
    const __m512 silu = round_bf16(_mm512_mul_ps(x, sigmoid16(x)));
    store_bf16(out + i, _mm512_mul_ps(silu, load_bf16(u + i, m)), m);
  });
}

void quick_gelu_span(const uint16_t* x, uint16_t* out, int64_t n) {
  const __m512 a = _mm512_set1_ps(1.702f);
  for_lanes(n, [&](int64_t i, __mmask16 m) {
    const __m512 v = load_bf16(x + i, m);
    const __m512 s = round_bf16(sigmoid16(round_bf16(_mm512_mul_ps(a, v))));
    store_bf16(out + i, _mm512_mul_ps(v, s), m);
  });
}

// rotate_half(x) = [-x2, x1]: each product rounded, then their sum (no multiply-add can form
// across the rounding).
void rotary_row(const uint16_t* x, const uint16_t* c, const uint16_t* s, uint16_t* out,
                int64_t half) {
  for_lanes(half, [&](int64_t i, __mmask16 m) {
    const __m512 x1 = load_bf16(x + i, m), x2 = load_bf16(x + half + i, m);
    const __m512 first = _mm512_sub_ps(round_bf16(_mm512_mul_ps(x1, load_bf16(c + i, m))),
                                       round_bf16(_mm512_mul_ps(x2, load_bf16(s + i, m))));
    const __m512 second =
        _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, load_bf16(c + half + i, m))),
                      round_bf16(_mm512_mul_ps(x1, load_bf16(s + half + i, m))));
    store_bf16(out + i, first, m);
    store_bf16(out + half + i, second, m);
  });
}
#else
constexpr bool kBf16Lanes = false;
#endif

// Whether elements of type T take the 16-lane loops above.
template <typename T>
constexpr bool lanes_for = kBf16Lanes && std::is_same_v<T, uint16_t>;

}  // namespace

namespace {

// RMSNorm of x's rows into a new tensor; with `residual`, x is first added into it (rounded to
// the dtype, as torch's add), in place, and the sum is what is normalized.
at::Tensor norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                     double eps, const char* name) {
  if (residual != nullptr) {
    check_dtype({&x, residual, &weight}, name);
    MMSERVE_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous(), name,
                  ": residual must be contiguous and of x's shape");
  } else {
    check_dtype({&x, &weight}, name);
  }
  MMSERVE_CHECK(x.dim() == 2 && x.stride(1) == 1, name,
                ": expected [rows, hidden], rows contiguous");
  MMSERVE_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), name,
                ": weight must be [hidden]");
  const int64_t rows = x.size(0), hidden = x.size(1);
  auto out = at::empty({rows, hidden}, x.options());
  const float feps = static_cast<float>(eps);
  by_dtype(x, [&](auto type) {
    using T = decltype(type);
    const T* w = elements<const T>(weight);
    T* o = elements<T>(out);
    T* res = residual != nullptr ? elements<T>(*residual) : nullptr;
    for_rows(rows, hidden, [&](int64_t r) {
      const T* in = row_of<T>(x, r);
      if constexpr (lanes_for<T>) {
        if (res != nullptr) {
          add_row(in, res + r * hidden, res + r * hidden, hidden);
          in = res + r * hidden;
        }
        const float squares = sum_of_squares(in, hidden);
        const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + feps);
        scale_row(in, inv, w, o + r * hidden, hidden);
        return;
      }
      if (res != nullptr) {
        T* sum = res + r * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) sum[i] = narrow<T>(wide(in[i]) + wide(sum[i]));
        in = sum;
      }
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < hidden; ++i) squares += wide(in[i]) * wide(in[i]);
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + feps);
      T* dst = o + r * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) {
        dst[i] = narrow<T>(wide(w[i]) * rounded<T>(wide(in[i]) * inv));
      }
    });
  });
  return out;
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return norm_rows(x, nullptr, weight, eps, "rms_norm");
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  return norm_rows(x, &residual, weight, eps, "add_rms_norm");
}

std::tuple<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                                                  const at::Tensor& weight, const at::Tensor& bias,
                                                  double eps) {
  check_dtype({&x, &residual, &weight, &bias}, "add_layer_norm");
  MMSERVE_CHECK(x.scalar_type() == at::kBFloat16, "add_layer_norm: bfloat16 only");
  MMSERVE_CHECK(x.dim() >= 1 && x.is_contiguous() && residual.is_contiguous() &&
                    residual.sizes() == x.sizes(),
                "add_layer_norm: expected contiguous x and residual of one shape [..., hidden]");
  const int64_t hidden = x.size(-1), rows = hidden > 0 ? x.numel() / hidden : 0;
  MMSERVE_CHECK(weight.dim() == 1 && bias.dim() == 1 && weight.size(0) == hidden &&
                    bias.size(0) == hidden && weight.is_contiguous() && bias.is_contiguous(),
                "add_layer_norm: weight and bias must be [hidden]");
  auto sum = at::empty_like(x);
  auto out = at::empty_like(x);
  const uint16_t* xp = elements<const uint16_t>(x);
  const uint16_t* rp = elements<const uint16_t>(residual);
  const uint16_t* w = elements<const uint16_t>(weight);
  const uint16_t* b = elements<const uint16_t>(bias);
  uint16_t* sp = elements<uint16_t>(sum);
  uint16_t* op = elements<uint16_t>(out);
  const float feps = static_cast<float>(eps);
  for_rows(rows, hidden, [&](int64_t r) {
    const int64_t at = r * hidden;
#ifdef MMSERVE_BF16_DOT
    add_row(xp + at, rp + at, sp + at, hidden);
    layer_norm_row(sp + at, w, b, feps, op + at, hidden);
#else
    float total = 0.f;
    for (int64_t i = 0; i < hidden; ++i) {
      sp[at + i] = bf16_bits(bf16_value(xp[at + i]) + bf16_value(rp[at + i]));
      total += bf16_value(sp[at + i]);
    }
    const float mean = total / static_cast<float>(hidden);
    float squares = 0.f;
    for (int64_t i = 0; i < hidden; ++i) {
      const float d = bf16_value(sp[at + i]) - mean;
      squares += d * d;
    }
    const float rstd = 1.f / std::sqrt(squares / static_cast<float>(hidden) + feps);
    for (int64_t i = 0; i < hidden; ++i) {
      const float normed = bf16_value(sp[at + i]) * rstd + (-mean * rstd);
      op[at + i] = bf16_bits(normed * bf16_value(w[i]) + bf16_value(b[i]));
    }
#endif
  });
  return {sum, out};
}

at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_dtype({&gate, &up}, "silu_and_mul");
  MMSERVE_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 &&
                    up.stride(1) == 1,
                "silu_and_mul: expected gate and up of one shape [rows, n], rows contiguous");
  const int64_t rows = gate.size(0), n = gate.size(1);
  auto out = at::empty({rows, n}, gate.options());
  by_dtype(gate, [&](auto type) {
    using T = decltype(type);
    T* o = elements<T>(out);
    for_rows(rows, n, [&](int64_t r) {
      const T* g = row_of<T>(gate, r);
      const T* u = row_of<T>(up, r);
      T* dst = o + r * n;
      if constexpr (lanes_for<T>) return silu_and_mul_row(g, u, dst, n);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float x = wide(g[i]);
        dst[i] = narrow<T>(rounded<T>(x * sigmoid(x)) * wide(u[i]));
      }
    });
  });
  return out;
}

namespace {

void quick_gelu_into(const at::Tensor& in, at::Tensor& out) {
  by_dtype(in, [&](auto type) {
    using T = decltype(type);
    const T* src = elements<const T>(in);
    T* dst = elements<T>(out);
    at::parallel_for(0, in.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
      if constexpr (lanes_for<T>) return quick_gelu_span(src + begin, dst + begin, end - begin);
#pragma omp simd
      for (int64_t i = begin; i < end; ++i) {
        const float v = wide(src[i]);
        dst[i] = narrow<T>(v * rounded<T>(sigmoid(rounded<T>(1.702f * v))));
      }
    });
  });
}

}  // namespace

at::Tensor quick_gelu(const at::Tensor& x) {
  check_dtype({&x}, "quick_gelu");
  auto in = x.contiguous();
  auto out = at::empty_like(in);
  quick_gelu_into(in, out);
  return out;
}

at::Tensor& quick_gelu_(at::Tensor& x) {
  check_dtype({&x}, "quick_gelu_");
  MMSERVE_CHECK(x.is_contiguous(), "quick_gelu_: expected a contiguous tensor");
  quick_gelu_into(x, x);
  return x;
}

// Each product rounded, then their sum, with no multiply-add fused in between: bit for bit
// torch's ops (mul, then add) in float32 too, not only in bfloat16, whose products are exact.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_dtype({&x, &cos, &sin}, "rotary");
  MMSERVE_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
                "rotary: expected x [tokens, heads, dim] with an even, contiguous last dimension");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  MMSERVE_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * dim &&
                    sin.numel() == tokens * dim,
                "rotary: expected contiguous cos and sin tables of [tokens, 1, dim]");
  auto out = at::empty({tokens, heads, dim}, x.options());
  by_dtype(x, [&](auto type) {
    using T = decltype(type);
    const T* c = elements<const T>(cos);
    const T* s = elements<const T>(sin);
    const T* src = elements<const T>(x);
    T* o = elements<T>(out);
    for_rows(tokens * heads, dim, [&](int64_t row) {
      const int64_t t = row / heads, h = row % heads;
      const T* in = src + t * x.stride(0) + h * x.stride(1);
      const T* ct = c + t * dim;
      const T* st = s + t * dim;
      T* dst = o + row * dim;
      if constexpr (lanes_for<T>) return rotary_row(in, ct, st, dst, half);
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = wide(in[i]), x2 = wide(in[i + half]);
        // rotate_half(x) = [-x2, x1]; each product rounded, then their sum, as torch's ops do.
        dst[i] = narrow<T>(rounded<T>(x1 * wide(ct[i])) + rounded<T>(-x2 * wide(st[i])));
        dst[i + half] = narrow<T>(rounded<T>(x2 * wide(ct[i + half])) +
                                  rounded<T>(x1 * wide(st[i + half])));
      }
    });
  });
  return out;
}
#pragma GCC pop_options

namespace {

// The index of row's first maximum, or of its first NaN (torch.argmax's answer): a pass for
// the maximum (and whether there is a NaN), then a scan for the first element equal to it
// (or unordered), 16 lanes at a time where the build has AVX-512 (with BF16: its lane masks).
#ifdef MMSERVE_BF16_DOT
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) { return load_bf16(p, m); }

template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = mmserve_cpu::first_lanes(n - i);
    const __m512 v = load16(row + i, m);
    nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
    best = _mm512_mask_max_ps(best, m, best, v);
  }
  const __m512 target = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = mmserve_cpu::first_lanes(n - i);
    const __m512 v = load16(row + i, m);
    const __mmask16 hit = nan ? _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q)
                              : _mm512_mask_cmp_ps_mask(m, v, target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;  // unreachable for n > 0
}
#else
template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
  float best = wide(row[0]);
  int64_t at = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = wide(row[i]);
    if (v != v) return i;
    if (v > best) {
      best = v;
      at = i;
    }
  }
  return at;
}
#endif

}  // namespace

at::Tensor argmax_rows(const at::Tensor& logits) {
  check_dtype({&logits}, "argmax_rows");
  MMSERVE_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
                "argmax_rows: expected [rows, n] with n > 0, rows contiguous");
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  by_dtype(logits, [&](auto type) {
    using T = decltype(type);
    // One row a work item: a vocabulary's row is tens of thousands of elements.
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(row_of<T>(logits, r), n);
    });
  });
  return out;
}
