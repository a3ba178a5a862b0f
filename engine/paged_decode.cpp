// corekv's native CPU decode attention (engine.compile): each decoding row's single query attends
// its KV read straight from the paged pool through its block table, in one call per layer, where the
// torch path gathers the blocks into a contiguous buffer and calls SDPA (see engine/native_attention.py).
//
// q [R, H, G, D] (any float dtype; H KV heads, G query heads per KV head), k/v pool
// [num_blocks, block_size, H, D] (float32 or bfloat16; each block's [block_size, H, D] contiguous,
// blocks any stride apart, as KVPool.layer_kv's views), block_tables [R, max_blocks] int64,
// context_lens [R] int64 (>= 1; positions past a row's length are never read).
// Returns (out [R, H, G, D] float32, lse [R, H, G] float32), lse being the log-sum-exp of the
// scaled scores, so a cascade can merge this with attention over shared blocks.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

// One pool row of D values as float32: the row itself, or its bfloat16 bits widened into buf.
inline const float* as_float(const float* src, float*, int64_t) { return src; }
inline const float* as_float(const at::BFloat16* src, float* buf, int64_t D) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(buf);
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<uint32_t>(bits[d]) << 16;
  return buf;
}

// One task per (row, KV head): scores of its G queries over the row's keys, softmax, then the
// probability-weighted sum of the values; every K and V row is read once per task.
template <typename T>
void decode(const float* q, const T* k_pool, const T* v_pool, const int64_t* tables, const int64_t* lens,
            float* out, float* lse, int64_t R, int64_t H, int64_t G, int64_t D, int64_t block_size,
            int64_t block_stride, int64_t max_blocks, float scale) {
  at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(G * D), row(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / H, h = task % H, n = lens[r];
      const float* qr = q + task * G * D;
      const int64_t* table = tables + r * max_blocks;
      auto offset = [&](int64_t t) { return table[t / block_size] * block_stride + ((t % block_size) * H + h) * D; };
      scores.resize(G * n);
      for (int64_t t = 0; t < n; ++t) {
        const float* k = as_float(k_pool + offset(t), row.data(), D);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qr + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * k[d];
          scores[g * n + t] = s * scale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        const float m = *std::max_element(sg, sg + n);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) {
          sg[t] = std::exp(sg[t] - m);
          sum += sg[t];
        }
        lse[task * G + g] = m + std::log(sum);
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const float* v = as_float(v_pool + offset(t), row.data(), D);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * n + t];
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
        }
      }
      std::memcpy(out + task * G * D, acc.data(), sizeof(float) * G * D);
    }
  });
}

std::vector<torch::Tensor> paged_decode(const torch::Tensor& q, const torch::Tensor& k_pool,
                                        const torch::Tensor& v_pool, const torch::Tensor& block_tables,
                                        const torch::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 4 && k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes(), "paged_decode: bad shapes");
  TORCH_CHECK(k_pool.strides() == v_pool.strides() && k_pool.stride(3) == 1 && k_pool.stride(2) == k_pool.size(3) &&
                  k_pool.stride(1) == k_pool.size(2) * k_pool.size(3) && k_pool.scalar_type() == v_pool.scalar_type(),
              "paged_decode: each K/V pool block must be contiguous, both pools laid out alike and of one dtype");
  TORCH_CHECK(k_pool.size(2) == q.size(1) && k_pool.size(3) == q.size(3), "paged_decode: q and pool heads differ");
  TORCH_CHECK(q.is_cpu() && k_pool.is_cpu() && block_tables.is_cpu() && context_lens.is_cpu(),
              "paged_decode: a CPU kernel: every tensor must be on the CPU");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong &&
                  block_tables.dim() == 2 && context_lens.dim() == 1 && block_tables.size(0) == q.size(0) &&
                  context_lens.size(0) == q.size(0),
              "paged_decode: block_tables [R, max_blocks] / context_lens [R] must be int64 with one row per query");
  const int64_t R = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  const auto qf = q.to(torch::kFloat).contiguous();
  const auto tables = block_tables.contiguous();
  const auto lens = context_lens.contiguous();
  auto out = torch::empty({R, H, G, D}, qf.options());
  auto lse = torch::empty({R, H, G}, qf.options());
  const int64_t block_size = k_pool.size(1), max_blocks = tables.size(1);
  const int64_t num_blocks = k_pool.size(0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = lens.data_ptr<int64_t>()[r];
    TORCH_CHECK(n >= 1 && n <= max_blocks * block_size, "paged_decode: a context length is outside its block table");
    for (int64_t j = 0; j < (n + block_size - 1) / block_size; ++j) {
      const int64_t block = tables.data_ptr<int64_t>()[r * max_blocks + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode: a block id is outside the pool");
    }
  }
  if (k_pool.scalar_type() == torch::kFloat) {
    decode<float>(qf.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), tables.data_ptr<int64_t>(),
                  lens.data_ptr<int64_t>(), out.data_ptr<float>(), lse.data_ptr<float>(), R, H, G, D, block_size,
                  k_pool.stride(0), max_blocks, static_cast<float>(scale));
  } else {
    TORCH_CHECK(k_pool.scalar_type() == torch::kBFloat16, "paged_decode: pools must be float32 or bfloat16");
    decode<at::BFloat16>(qf.data_ptr<float>(), k_pool.data_ptr<at::BFloat16>(), v_pool.data_ptr<at::BFloat16>(),
                         tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                         lse.data_ptr<float>(), R, H, G, D, block_size, k_pool.stride(0), max_blocks,
                         static_cast<float>(scale));
  }
  return {out, lse};
}

}  // namespace

// NOTE: the GIL is released while it runs: the engine steps in its own thread beside a server's event loop.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, py::call_guard<py::gil_scoped_release>());
}
