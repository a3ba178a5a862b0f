// corekv's native linear for few rows (engine.cpu_kernels on CPU): out = x @ W^T + b for the 1-32 rows
// of a decode step, from a copy of W (float32 or bfloat16) packed once into column panels
// [N / P, K, P], each panel streamed from memory once per call (see engine/cpu/linears.py). P is the
// instruction set's panel width: 64 outputs (4 vectors) for AVX-512, 16 (2 vectors) for AVX2.
//
// NOTE: MKL's GEMM on the [K, N] layout takes longer with every extra row, so a few rows read the
// weights well below the rate one row does (benchmarks/cpu_kernels.py; BENCHMARKS.md, "Native
// float32 linear for 2-32 rows"); a decode step's rows should stream each weight once. Each panel
// row of P outputs is a few vectors that every row of x multiplies with a broadcast scalar (6 rows
// of accumulators: 24 of AVX-512's 32 registers, 12 of AVX2's 16), rows beyond 6 reuse a 128-deep
// slice of the panel from L1 instead of reading the panel again, and the next slice is prefetched
// while they do; panels that do not share evenly among the threads share their rows too (the code:
// kernels_isa.h). A bfloat16 panel is widened to float32 as it is loaded (a
// bfloat16 value is the high half of a float32's bits), so each product is exact in float32 and
// sums in float32, as oneDNN's bfloat16 GEMM does, from half the bytes.
#include <torch/extension.h>

#include "kernels.h"

using corekv_native::IsaKernels;

torch::Tensor pack_linear_weight(const IsaKernels& isa, const torch::Tensor& weight) {
  // NOTE: out a multiple of 64 for every instruction set, so a model's layers get panels on every CPU alike
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == torch::kFloat || weight.scalar_type() == torch::kBFloat16) &&
                  weight.is_cpu() && weight.size(0) % 64 == 0 && weight.size(0) > 0 && 64 % isa.panel == 0,
              "pack_linear_weight: weight must be a float32 or bfloat16 CPU [out, in] tensor with out a multiple of 64");
  const int64_t N = weight.size(0), K = weight.size(1), P = isa.panel;
  return weight.reshape({N / P, P, K}).transpose(1, 2).contiguous();
}

// x and the packed weight share a dtype (float32 or bfloat16); sums are float32, and a bfloat16
// result is rounded once, after the bias.
torch::Tensor small_linear(const IsaKernels& isa, const torch::Tensor& x, const torch::Tensor& packed,
                           const c10::optional<torch::Tensor>& bias) {
  const auto dtype = packed.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.is_cpu() && x.scalar_type() == dtype && (dtype == torch::kFloat || dtype == torch::kBFloat16) &&
                  packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == isa.panel && packed.size(1) == x.size(1),
              "small_linear: x [rows, in] and a packed weight [out / P, in, P] (pack_linear_weight of the same "
              "instruction set, P = ", isa.panel, ") of one dtype, float32 or bfloat16, on CPU");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), N = panels * isa.panel;
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == dtype),
              "small_linear: bias must be [out] of x's dtype");
  const auto xf = x.to(torch::kFloat).contiguous();
  auto out = torch::empty({M, N}, xf.options());
  if (dtype == torch::kFloat)
    isa.linear_f32(xf.data_ptr<float>(), packed.data_ptr<float>(), out.data_ptr<float>(), M, K, panels);
  else
    isa.linear_bf16(xf.data_ptr<float>(), packed.data_ptr<at::BFloat16>(), out.data_ptr<float>(), M, K, panels);
  if (bias.has_value()) out.add_(bias->to(torch::kFloat));
  return dtype == torch::kFloat ? out : out.to(dtype);
}
