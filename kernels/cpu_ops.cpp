// Python bindings of the compiled CPU kernels (one extension module, built by cpu_ops.py).

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale);
at::Tensor flash_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           double scale, int64_t causal_offset);
bool flash_attention_supported(int64_t head_dim);
bool flash_attention_amx_supported();
bool set_flash_attention_amx(bool enabled);
at::Tensor flash_attention_f32(const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, double scale, int64_t causal_offset);
bool flash_attention_f32_supported(int64_t head_dim);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps);
std::tuple<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                                                  const at::Tensor& weight, const at::Tensor& bias,
                                                  double eps);
at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up);
at::Tensor quick_gelu(const at::Tensor& x);
at::Tensor& quick_gelu_(at::Tensor& x);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor argmax_rows(const at::Tensor& logits);
bool packed_linear_supported();
bool packed_linear_amx_supported();
bool set_packed_linear_amx(bool enabled);
bool bf16_fma();
bool set_bf16_fma(bool enabled);
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias, int64_t out_features);
at::Tensor packed_linear_silu_and_mul(const at::Tensor& x, const at::Tensor& packed,
                                      const c10::optional<at::Tensor>& bias,
                                      int64_t out_features);
bool packed_linear_f32_supported();
at::Tensor pack_linear_weight_f32(const at::Tensor& weight);
at::Tensor packed_linear_f32(const at::Tensor& x, const at::Tensor& packed,
                             const c10::optional<at::Tensor>& bias, int64_t out_features);

// The matmuls and attention kernels run without the interpreter lock, as torch's own operators
// do: for milliseconds at a time, other Python threads (the server's event loop, preprocessing,
// an engine scheduling the next step) go on beside them. Arguments are converted and results
// returned with the lock held. The fused elementwise kernels keep it: they take microseconds,
// less than giving the lock up and taking it back may cost while another thread holds it.
const auto kNoGil = py::call_guard<py::gil_scoped_release>();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention reading KV blocks in place",
        kNoGil);
  m.def("flash_attention", &flash_attention,
        "bfloat16 attention over many query rows (causal from an offset, or bidirectional)",
        kNoGil);
  m.def("flash_attention_supported", &flash_attention_supported,
        "whether this build has the bfloat16 flash attention for a head size");
  m.def("flash_attention_amx_supported", &flash_attention_amx_supported,
        "whether the bfloat16 flash attention multiplies on AMX tiles here (built with AMX, "
        "and the kernel lets the process use them)");
  m.def("set_flash_attention_amx", &set_flash_attention_amx,
        "use AMX tiles in the bfloat16 flash attention where supported (default) or not; "
        "returns the previous setting");
  m.def("flash_attention_f32", &flash_attention_f32,
        "float32 attention over many query rows (causal from an offset, or bidirectional)",
        kNoGil);
  m.def("flash_attention_f32_supported", &flash_attention_f32_supported,
        "whether this build has the float32 flash attention (AVX2 and FMA) for a head size");
  m.def("rms_norm", &rms_norm, "RMSNorm in one pass");
  m.def("add_rms_norm", &add_rms_norm,
        "residual += x (in place), then RMSNorm of the sum, in one pass");
  m.def("add_layer_norm", &add_layer_norm,
        "bfloat16 x + residual and the LayerNorm of the sum, in one pass");
  m.def("silu_and_mul", &silu_and_mul, "bfloat16 silu(gate) * up in one pass");
  m.def("quick_gelu", &quick_gelu, "bfloat16 x * sigmoid(1.702 x) in one pass");
  m.def("quick_gelu_", &quick_gelu_, "quick_gelu in place");
  m.def("rotary", &rotary, "bfloat16 rotary embedding (rotate-half layout) in one pass");
  m.def("argmax_rows", &argmax_rows,
        "each row's torch.argmax (its first maximum, or first NaN), rows in parallel", kNoGil);
  m.def("packed_linear_supported", &packed_linear_supported,
        "whether this build has the packed bfloat16 linear");
  m.def("packed_linear_amx_supported", &packed_linear_amx_supported,
        "whether the packed bfloat16 linear multiplies on AMX tiles here (built with AMX, and "
        "the kernel lets the process use them)");
  m.def("set_packed_linear_amx", &set_packed_linear_amx,
        "use AMX tiles in the packed bfloat16 linear where supported (default) or not; "
        "returns the previous setting");
  m.def("bf16_fma", &bf16_fma,
        "whether the bfloat16 kernels' vector code (the packed linear's tiles at 16 rows or "
        "more, flash attention's) multiplies as float32 FMAs on widened inputs, where this "
        "core runs them faster than the pair dot product (measured on the first call), rather "
        "than with the pair dot product; the same sums either way");
  m.def("set_bf16_fma", &set_bf16_fma,
        "multiply with float32 FMAs or the pair dot product in the bfloat16 kernels' vector "
        "code; returns the previous setting");
  m.def("pack_linear_weight", &pack_linear_weight, "a bfloat16 [out, in] weight as panels",
        kNoGil);
  m.def("packed_linear", &packed_linear, "x @ weight.T + bias from packed panels", kNoGil);
  m.def("packed_linear_silu_and_mul", &packed_linear_silu_and_mul,
        "silu(gate) * up of a gated MLP's gate and up layers packed in 16-output halves",
        kNoGil);
  m.def("packed_linear_f32_supported", &packed_linear_f32_supported,
        "whether this build has the packed float32 linear (AVX2 and FMA)");
  m.def("pack_linear_weight_f32", &pack_linear_weight_f32, "a float32 [out, in] weight as panels",
        kNoGil);
  m.def("packed_linear_f32", &packed_linear_f32, "float32 x @ weight.T + bias from packed panels",
        kNoGil);
}
