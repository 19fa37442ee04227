// One-row fp32 or bf16 linear (a matrix-vector product) as a torch operator, for the cpu backend's
// one-token graphs and eager runner: portside_cpu_native::linear_row(Tensor x, Tensor weight,
// Tensor? bias) -> Tensor. bf16 (x and weight bf16): the weight is streamed as bf16 and widened in
// each dot product, x and the sums are fp32, the output is rounded to bf16 once (after the bias),
// as torch's bf16 linear rounds; on CPUs without bf16 arithmetic torch's own bf16 GEMV is ~100x
// slower than this.
//
// Built on first use by portside.backends.cpu.native_ops against the running torch and loaded
// with torch.ops.load_library, so a compiled graph (cpp_wrapper) calls it through the dispatcher
// without going back to Python. Inputs it was not written for (another dtype, more than one row,
// a weight that is not contiguous) go to at::linear, so it is always correct to call.
//
// Batch-1 decode is bound by reading the weights once per token: each thread streams one
// contiguous range of output rows (row_dot.h).

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include "row_dot.h"

namespace {

using portside_rows::rows;

at::Tensor linear_row(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  const bool fits = x.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16) &&
                    weight.scalar_type() == dtype && x.dim() == 2 && x.size(0) == 1 && weight.dim() == 2 &&
                    weight.is_contiguous() && x.size(1) == weight.size(1) &&
                    (!bias.has_value() || (bias->scalar_type() == dtype && bias->numel() == weight.size(0)));
  if (!fits) return at::linear(x, weight, bias);
  const at::Tensor xc = x.to(at::kFloat).contiguous();  // bf16: K values widened once
  const int64_t N = weight.size(0), K = weight.size(1);
  at::Tensor out = at::empty({1, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  // Each thread gets one contiguous range of rows (at::parallel_for splits evenly by thread).
  if (dtype == at::kFloat) {
    const float* wp = weight.data_ptr<float>();
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { rows(xp, wp, yp, K, n0, n1); });
  } else {
    const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { rows(xp, wp, yp, K, n0, n1); });
  }
  if (bias.has_value()) out.add_(bias->reshape({1, N}).to(at::kFloat));
  return dtype == at::kFloat ? out : out.to(dtype);
}

}  // namespace

TORCH_LIBRARY(portside_cpu_native, m) {
  m.def("linear_row(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(portside_cpu_native, CPU, m) {
  m.impl("linear_row", &linear_row);
}

