// Fused elementwise layers on the CPU for bfloat16 activations: one pass over memory where
// torch runs three to six (each with its own temporary tensor), rounding to bfloat16 at the
// same points torch's unfused ops do, so results match them up to float32 rounding of the
// intermediate math.
//
// rms_norm(x [rows, hidden], weight [hidden], eps)  -> weight * bf16(x * rsqrt(mean(x^2) + eps))
// silu_and_mul(gate [rows, n], up [rows, n])        -> bf16(silu(gate)) * up
// quick_gelu(x [...])                               -> x * bf16(sigmoid(bf16(1.702 x)))
// rotary(x [tokens, heads, dim], cos, sin [tokens, 1, dim])
//                                 -> bf16(x * cos) + bf16(rotate_half(x) * sin), contiguous
//
// Plain loops over the raw bits, which the compiler vectorizes; any CPU.

#include <ATen/ATen.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "cpu_math.h"

namespace {

using mmserve_cpu::bf16_bits;
using mmserve_cpu::bf16_value;
using mmserve_cpu::exp_nonpositive;

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

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, ": bfloat16 only");
  TORCH_CHECK(t.device().is_cpu(), name, ": CPU tensors only");
}

// Rows of a 2-D view whose last dimension is contiguous.
const uint16_t* row_bits(const at::Tensor& t, int64_t r) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr()) + r * t.stride(0);
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_bf16(x, "rms_norm");
  check_bf16(weight, "rms_norm");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: expected [rows, hidden], rows contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "rms_norm: weight must be [hidden]");
  const int64_t rows = x.size(0), hidden = x.size(1);
  auto out = at::empty({rows, hidden}, x.options());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float feps = static_cast<float>(eps);
  for_rows(rows, hidden, [&](int64_t r) {
    const uint16_t* in = row_bits(x, r);
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < hidden; ++i) squares += bf16_value(in[i]) * bf16_value(in[i]);
    const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + feps);
    uint16_t* dst = o + r * hidden;
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) {
      const float normed = bf16_value(bf16_bits(bf16_value(in[i]) * inv));
      dst[i] = bf16_bits(bf16_value(w[i]) * normed);
    }
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_bf16(gate, "silu_and_mul");
  check_bf16(up, "silu_and_mul");
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 &&
                  up.stride(1) == 1,
              "silu_and_mul: expected gate and up of one shape [rows, n], rows contiguous");
  const int64_t rows = gate.size(0), n = gate.size(1);
  auto out = at::empty({rows, n}, gate.options());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  for_rows(rows, n, [&](int64_t r) {
    const uint16_t* g = row_bits(gate, r);
    const uint16_t* u = row_bits(up, r);
    uint16_t* dst = o + r * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float x = bf16_value(g[i]);
      const float act = bf16_value(bf16_bits(x * sigmoid(x)));
      dst[i] = bf16_bits(act * bf16_value(u[i]));
    }
  });
  return out;
}

at::Tensor quick_gelu(const at::Tensor& x) {
  check_bf16(x, "quick_gelu");
  auto in = x.contiguous();
  auto out = at::empty_like(in);
  const auto* src = reinterpret_cast<const uint16_t*>(in.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, in.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const float v = bf16_value(src[i]);
      const float gate = bf16_value(bf16_bits(sigmoid(bf16_value(bf16_bits(1.702f * v)))));
      dst[i] = bf16_bits(v * gate);
    }
  });
  return out;
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_bf16(x, "rotary");
  check_bf16(cos, "rotary");
  check_bf16(sin, "rotary");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary: expected x [tokens, heads, dim] with an even, contiguous last dimension");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * dim &&
                  sin.numel() == tokens * dim,
              "rotary: expected contiguous cos and sin tables of [tokens, 1, dim]");
  auto out = at::empty({tokens, heads, dim}, x.options());
  const auto* c = reinterpret_cast<const uint16_t*>(cos.data_ptr());
  const auto* s = reinterpret_cast<const uint16_t*>(sin.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
  for_rows(tokens * heads, dim, [&](int64_t row) {
    const int64_t t = row / heads, h = row % heads;
    const uint16_t* in = src + t * x.stride(0) + h * x.stride(1);
    const uint16_t* ct = c + t * dim;
    const uint16_t* st = s + t * dim;
    uint16_t* dst = o + row * dim;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = bf16_value(in[i]), x2 = bf16_value(in[i + half]);
      // rotate_half(x) = [-x2, x1]; each product rounded, then their sum, as torch's ops do.
      dst[i] = bf16_bits(bf16_value(bf16_bits(x1 * bf16_value(ct[i]))) +
                         bf16_value(bf16_bits(-x2 * bf16_value(st[i]))));
      dst[i + half] = bf16_bits(bf16_value(bf16_bits(x2 * bf16_value(ct[i + half]))) +
                                bf16_value(bf16_bits(x1 * bf16_value(st[i + half]))));
    }
  });
  return out;
}
