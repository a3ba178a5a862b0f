// corekv's native CPU attention (engine.cpu_kernels), reading K/V straight from the paged pool through
// block tables, where the torch path gathers blocks into contiguous buffers and calls SDPA (see
// engine/cpu/native.py). Pools are [num_blocks, block_size, H, D] (float32 or bfloat16; each
// block's [block_size, H, D] contiguous, blocks any stride apart, as KVPool.layer_kv's views);
// H KV heads, G query heads per KV head.
//
// paged_decode: each decoding row's single query attends its context in one call per layer.
//   q [R, H, G, D] (any float dtype), block_tables [R, max_blocks] int64, context_lens [R] int64
//   (>= 1; positions past a row's length are never read). Returns (out [R, H, G, D] float32,
//   lse [R, H, G] float32), lse being the log-sum-exp of the scaled scores, so a cascade can merge
//   this with attention over shared blocks.
// paged_prefill: every prefill chunk of a step attends causally over its sequence's blocks (the
//   chunk's own K/V already written) in one call per layer.
//   q [T, H * G, D] (the pool's dtype, last dim contiguous), block_tables [C, max_blocks] int64,
//   query_starts [C + 1] int64 (chunk c's queries are q[query_starts[c] : query_starts[c + 1]]),
//   start_pos [C] int64 (the position of chunk c's first query); writes out [T, H * G, D]
//   (contiguous, q's dtype).
// The kernels themselves are in kernels_isa.h, compiled once per instruction set (kernels.h); the
// functions here check their arguments and call the table of the instruction set they are bound to.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "kernels.h"

using corekv_native::IsaKernels;

namespace {

// Shapes, layout, dtype and device of the pools (and q's heads); `who` names the calling kernel in errors.
void check_pools(const char* who, const torch::Tensor& k_pool, const torch::Tensor& v_pool, int64_t q_heads,
                 int64_t q_dim, const torch::Tensor& q, const torch::Tensor& block_tables) {
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes(), who, ": bad shapes");
  TORCH_CHECK(k_pool.strides() == v_pool.strides() && k_pool.stride(3) == 1 && k_pool.stride(2) == k_pool.size(3) &&
                  k_pool.stride(1) == k_pool.size(2) * k_pool.size(3) && k_pool.scalar_type() == v_pool.scalar_type(),
              who, ": each K/V pool block must be contiguous, both pools laid out alike and of one dtype");
  TORCH_CHECK(k_pool.scalar_type() == torch::kFloat || k_pool.scalar_type() == torch::kBFloat16, who,
              ": pools must be float32 or bfloat16");
  TORCH_CHECK(k_pool.size(2) == q_heads && k_pool.size(3) == q_dim, who, ": q and pool heads differ");
  TORCH_CHECK(q.is_cpu() && k_pool.is_cpu() && v_pool.is_cpu() && block_tables.is_cpu(), who,
              ": a CPU kernel: every tensor must be on the CPU");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && block_tables.dim() == 2, who,
              ": block_tables must be int64 [rows, max_blocks]");
}

// The first `num_tokens` positions of a block table row are in it and name blocks of the pool.
void check_table_row(const char* who, const int64_t* row, int64_t max_blocks, int64_t num_tokens, int64_t block_size,
                     int64_t num_blocks) {
  TORCH_CHECK(num_tokens >= 1 && num_tokens <= max_blocks * block_size, who,
              ": a context length is outside its block table");
  for (int64_t j = 0; j < (num_tokens + block_size - 1) / block_size; ++j)
    TORCH_CHECK(row[j] >= 0 && row[j] < num_blocks, who, ": a block id is outside the pool");
}

std::vector<torch::Tensor> paged_decode(const IsaKernels& isa, const torch::Tensor& q, const torch::Tensor& k_pool,
                                        const torch::Tensor& v_pool, const torch::Tensor& block_tables,
                                        const torch::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 4, "paged_decode: bad shapes");
  check_pools("paged_decode", k_pool, v_pool, q.size(1), q.size(3), q, block_tables);
  TORCH_CHECK(context_lens.is_cpu() && context_lens.scalar_type() == torch::kLong && context_lens.dim() == 1 &&
                  block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0),
              "paged_decode: block_tables [R, max_blocks] / context_lens [R] must be int64 with one row per query");
  const int64_t R = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  const auto qf = q.to(torch::kFloat).contiguous();
  const auto tables = block_tables.contiguous();
  const auto lens = context_lens.contiguous();
  auto out = torch::empty({R, H, G, D}, qf.options());
  auto lse = torch::empty({R, H, G}, qf.options());
  const int64_t block_size = k_pool.size(1), max_blocks = tables.size(1);
  for (int64_t r = 0; r < R; ++r)
    check_table_row("paged_decode", tables.data_ptr<int64_t>() + r * max_blocks, max_blocks,
                    lens.data_ptr<int64_t>()[r], block_size, k_pool.size(0));
  if (k_pool.scalar_type() == torch::kFloat) {
    isa.decode_f32(qf.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), tables.data_ptr<int64_t>(),
                  lens.data_ptr<int64_t>(), out.data_ptr<float>(), lse.data_ptr<float>(), R, H, G, D, block_size,
                  k_pool.stride(0), max_blocks, static_cast<float>(scale));
  } else {
    isa.decode_bf16(qf.data_ptr<float>(), k_pool.data_ptr<at::BFloat16>(), v_pool.data_ptr<at::BFloat16>(),
                         tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                         lse.data_ptr<float>(), R, H, G, D, block_size, k_pool.stride(0), max_blocks,
                         static_cast<float>(scale));
  }
  return {out, lse};
}

void paged_prefill(const IsaKernels& isa, const torch::Tensor& q, const torch::Tensor& k_pool,
                   const torch::Tensor& v_pool, const torch::Tensor& block_tables, const torch::Tensor& query_starts,
                   const torch::Tensor& start_pos, double scale, torch::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_prefill: q must be [T, query heads, D], D contiguous");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.size(2) >= 1 && q.size(1) % k_pool.size(2) == 0,
              "paged_prefill: q's heads must be a multiple of the pool's KV heads");
  const int64_t H = k_pool.size(2), G = q.size(1) / H, D = q.size(2), T = q.size(0);
  check_pools("paged_prefill", k_pool, v_pool, H, D, q, block_tables);
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && out.scalar_type() == q.scalar_type() &&
                  out.sizes() == q.sizes() && out.is_contiguous() && out.is_cpu(),
              "paged_prefill: q and out must be of the pool's dtype, out contiguous and of q's shape");
  const int64_t C = block_tables.size(0);
  TORCH_CHECK(query_starts.is_cpu() && start_pos.is_cpu() && query_starts.scalar_type() == torch::kLong &&
                  start_pos.scalar_type() == torch::kLong && query_starts.dim() == 1 && start_pos.dim() == 1 &&
                  query_starts.size(0) == C + 1 && start_pos.size(0) == C,
              "paged_prefill: query_starts [C + 1] / start_pos [C] must be int64 for the C rows of block_tables");
  const auto tables = block_tables.contiguous(), starts = query_starts.contiguous(), first = start_pos.contiguous();
  const int64_t *qs = starts.data_ptr<int64_t>(), *sp = first.data_ptr<int64_t>();
  TORCH_CHECK(C >= 1 && qs[0] == 0 && qs[C] == T, "paged_prefill: query_starts must run from 0 to q's tokens");
  for (int64_t c = 0; c < C; ++c) {
    TORCH_CHECK(qs[c + 1] > qs[c] && sp[c] >= 0, "paged_prefill: every chunk needs a query and start_pos >= 0");
    check_table_row("paged_prefill", tables.data_ptr<int64_t>() + c * tables.size(1), tables.size(1),
                    sp[c] + qs[c + 1] - qs[c], k_pool.size(1), k_pool.size(0));
  }
  if (k_pool.scalar_type() == torch::kFloat) {
    isa.prefill_f32(q.data_ptr<float>(), q.stride(0), q.stride(1), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(),
                   tables.data_ptr<int64_t>(), qs, sp, out.data_ptr<float>(), C, H, G, D, k_pool.size(1),
                   k_pool.stride(0), tables.size(1), static_cast<float>(scale));
  } else {
    isa.prefill_bf16(q.data_ptr<at::BFloat16>(), q.stride(0), q.stride(1), k_pool.data_ptr<at::BFloat16>(),
                          v_pool.data_ptr<at::BFloat16>(), tables.data_ptr<int64_t>(), qs, sp,
                          out.data_ptr<at::BFloat16>(), C, H, G, D, k_pool.size(1), k_pool.stride(0), tables.size(1),
                          static_cast<float>(scale));
  }
}

}  // namespace

torch::Tensor pack_linear_weight(const IsaKernels& isa, const torch::Tensor& weight);  // small_linear.cpp
torch::Tensor small_linear(const IsaKernels& isa, const torch::Tensor& x, const torch::Tensor& packed,
                           const c10::optional<torch::Tensor>& bias);
torch::Tensor rms_norm(const IsaKernels& isa, const torch::Tensor& x, const torch::Tensor& weight, double eps);  // elementwise.cpp
torch::Tensor silu_mul(const IsaKernels& isa, const torch::Tensor& gate, const torch::Tensor& up);
torch::Tensor rotary(const IsaKernels& isa, const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

namespace {
// The instruction sets this build holds, widest first.
const IsaKernels* const COMPILED[] = {
#if COREKV_X86_DISPATCH
    &corekv_native::avx512_kernels, &corekv_native::avx2_kernels,
#else
    &corekv_native::generic_kernels,
#endif
};
}  // namespace

// One submodule per instruction set this build holds and this CPU runs (`isas()`, widest first),
// each with the kernels bound to that set's code.
// NOTE: the GIL is released while they run: the engine steps in its own thread beside a server's event loop.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  std::vector<std::string> names;
  for (const IsaKernels* isa : COMPILED) {
    if (!isa->supported()) continue;
    names.emplace_back(isa->name);
    auto sub = m.def_submodule(isa->name);
    const auto release = py::call_guard<py::gil_scoped_release>();
    sub.def("paged_decode", [isa](const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                                  const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale) {
      return paged_decode(*isa, q, k_pool, v_pool, block_tables, context_lens, scale);
    }, release);
    sub.def("paged_prefill", [isa](const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                                   const torch::Tensor& block_tables, const torch::Tensor& query_starts,
                                   const torch::Tensor& start_pos, double scale, torch::Tensor& out) {
      paged_prefill(*isa, q, k_pool, v_pool, block_tables, query_starts, start_pos, scale, out);
    }, release);
    sub.def("pack_linear_weight", [isa](const torch::Tensor& weight) { return pack_linear_weight(*isa, weight); });
    sub.def("small_linear", [isa](const torch::Tensor& x, const torch::Tensor& packed,
                                  const c10::optional<torch::Tensor>& bias) {
      return small_linear(*isa, x, packed, bias);
    }, release);
    sub.def("rms_norm", [isa](const torch::Tensor& x, const torch::Tensor& weight, double eps) {
      return rms_norm(*isa, x, weight, eps);
    }, release);
    sub.def("silu_mul", [isa](const torch::Tensor& gate, const torch::Tensor& up) { return silu_mul(*isa, gate, up); },
            release);
    sub.def("rotary", [isa](const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
      return rotary(*isa, x, cos, sin);
    }, release);
    sub.attr("panel") = isa->panel;
  }
  m.def("isas", [names] { return names; });
}
