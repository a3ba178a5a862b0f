// corekv's native elementwise ops of a decoder layer (engine.cpu_kernels on CPU): RMSNorm, the gated
// SiLU of the MLP and the rotary embedding, each one pass over its tensors where Hugging Face's
// Llama modules run several eager ops (and allocate a tensor for each); engine/cpu/elementwise.py wires
// them into a native runner's steps. Float32 or bfloat16, the math in float32, rounded where the
// Hugging Face code rounds (the code: kernels_isa.h).
#include <torch/extension.h>

#include "kernels.h"

using corekv_native::IsaKernels;

namespace {
// Every kernel works in whole vectors of 16 float32 lanes (AVX-512's; AVX2's 8 divide it).
constexpr int64_t LANES = 16;

void check_tensor(const char* who, const torch::Tensor& x, const torch::Tensor& like) {
  TORCH_CHECK(x.is_cpu() && (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16) &&
                  x.scalar_type() == like.scalar_type(),
              who, ": float32 or bfloat16 CPU tensors, all of one dtype");
}
}  // namespace

// x [..., n] normalised over its last dim and scaled by weight [n]; n a multiple of 16.
torch::Tensor rms_norm(const IsaKernels& isa, const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_tensor("rms_norm", x, x);
  check_tensor("rms_norm", weight, x);
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0) && weight.size(0) % LANES == 0,
              "rms_norm: x [..., n] and weight [n], n a multiple of ", LANES);
  const auto xc = x.contiguous(), wc = weight.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t n = x.size(-1), rows = xc.numel() / n;
  if (x.scalar_type() == torch::kFloat)
    isa.rms_norm_f32(xc.data_ptr<float>(), wc.data_ptr<float>(), out.data_ptr<float>(), rows, n, static_cast<float>(eps));
  else
    isa.rms_norm_bf16(xc.data_ptr<at::BFloat16>(), wc.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, n,
                      static_cast<float>(eps));
  return out;
}

// silu(gate) * up, elementwise; gate and up of one shape, a multiple of 16 values.
torch::Tensor silu_mul(const IsaKernels& isa, const torch::Tensor& gate, const torch::Tensor& up) {
  check_tensor("silu_mul", gate, gate);
  check_tensor("silu_mul", up, gate);
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.numel() % LANES == 0,
              "silu_mul: gate and up of one shape, a multiple of ", LANES, " values");
  const auto g = gate.contiguous(), u = up.contiguous();
  auto out = torch::empty_like(g);
  if (gate.scalar_type() == torch::kFloat)
    isa.silu_mul_f32(g.data_ptr<float>(), u.data_ptr<float>(), out.data_ptr<float>(), g.numel());
  else
    isa.silu_mul_bf16(g.data_ptr<at::BFloat16>(), u.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), g.numel());
  return out;
}

// x [1, heads, tokens, D] (D contiguous) rotated by cos / sin [1, tokens, D]; D a multiple of 32.
// The result is laid out [1, tokens, heads, D] in memory (as a projection's output) and returned as
// the [1, heads, tokens, D] view, as Hugging Face's attention code holds queries and keys.
torch::Tensor rotary(const IsaKernels& isa, const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  check_tensor("rotary", x, x);
  check_tensor("rotary", cos, x);
  check_tensor("rotary", sin, x);
  TORCH_CHECK(x.dim() == 4 && x.size(0) == 1 && x.stride(3) == 1 && x.size(3) % (2 * LANES) == 0, "rotary: x must be [1, heads, tokens, D] with D contiguous and a multiple of ",
              2 * LANES);
  const int64_t heads = x.size(1), tokens = x.size(2), D = x.size(3);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 3 && cos.size(0) == 1 && cos.size(1) == tokens &&
                  cos.size(2) == D,
              "rotary: cos and sin must be [1, tokens, D] of x's tokens and D");
  const auto c = cos.contiguous(), s = sin.contiguous();
  auto out = torch::empty({1, tokens, heads, D}, x.options());
  if (x.scalar_type() == torch::kFloat)
    isa.rotary_f32(x.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), out.data_ptr<float>(), tokens, heads,
                   D, x.stride(2), x.stride(1));
  else
    isa.rotary_bf16(x.data_ptr<at::BFloat16>(), c.data_ptr<at::BFloat16>(), s.data_ptr<at::BFloat16>(),
                    out.data_ptr<at::BFloat16>(), tokens, heads, D, x.stride(2), x.stride(1));
  return out.transpose(1, 2);
}
