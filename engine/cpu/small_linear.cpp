// corekv's native linear for few rows (engine.compile on CPU): out = x @ W^T + b for the 1-32 rows
// of a decode step, from a copy of W (float32 or bfloat16) packed once into column panels
// [N / 64, K, 64], each panel streamed from memory once per call (see engine/cpu/linears.py).
//
// NOTE: MKL's GEMM on the [K, N] layout takes longer with every extra row, so a few rows read the
// weights well below the rate one row does (benchmarks/cpu_kernels.py; BENCHMARKS.md, "Native
// float32 linear for 2-32 rows"); a decode step's rows should stream each weight once. Here each
// panel row of 64 outputs is 4 vectors that every row of x multiplies with a broadcast scalar
// (6 rows x 4 vectors of accumulators), the panel is prefetched ahead of the loads, and rows beyond
// 6 reuse a 128-deep slice of the panel from L1 instead of reading the panel again. A bfloat16
// panel is widened to float32 as it is loaded (a bfloat16 value is the high half of a float32's
// bits), so each product is exact in float32 and sums in float32, as oneDNN's bfloat16 GEMM does,
// from half the bytes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace {

typedef float vf __attribute__((vector_size(64)));
typedef unsigned short vh __attribute__((vector_size(32)));
typedef unsigned int vu __attribute__((vector_size(64)));
constexpr int64_t PANEL = 64;       // outputs per panel: 4 vectors
constexpr int64_t DEPTH = 128;      // k per slice of a panel (32 KiB float32, 16 bfloat16: in L1 for every block of rows)
constexpr int64_t PREFETCH = 4096;  // bytes of panel ahead

inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf load(const at::BFloat16* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu bits = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// out[r][0:64] (+)= sum_{k0 <= k < k1} x[r][k] * panel[k][0:64] for R rows.
template <int R, typename W>
void rows_block(const float* x, int64_t K, const W* panel, float* out, int64_t N, int64_t k0, int64_t k1) {
  vf acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = k0 == 0 ? vf{} : load(out + r * N + j * 16);
  for (int64_t k = k0; k < k1; ++k) {
    const W* row = panel + k * PANEL;
    const char* ahead = reinterpret_cast<const char*>(row) + PREFETCH;
    for (size_t line = 0; line < PANEL * sizeof(W); line += 64) __builtin_prefetch(ahead + line);
    const vf w0 = load(row), w1 = load(row + 16), w2 = load(row + 32), w3 = load(row + 48);
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * K + k];
      acc[r][0] += xr * w0;
      acc[r][1] += xr * w1;
      acc[r][2] += xr * w2;
      acc[r][3] += xr * w3;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) store(out + r * N + j * 16, acc[r][j]);
}

}  // namespace

torch::Tensor pack_linear_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == torch::kFloat || weight.scalar_type() == torch::kBFloat16) &&
                  weight.is_cpu() && weight.size(0) % PANEL == 0 && weight.size(0) > 0,
              "pack_linear_weight: weight must be a float32 or bfloat16 CPU [out, in] tensor with out a multiple of 64");
  const int64_t N = weight.size(0), K = weight.size(1);
  return weight.reshape({N / PANEL, PANEL, K}).transpose(1, 2).contiguous();
}

namespace {

template <typename W>
void panels_times_rows(const float* xp, const W* wp, float* op, int64_t M, int64_t K, int64_t panels) {
  const int64_t N = panels * PANEL;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const W* panel = wp + p * K * PANEL;
      for (int64_t k0 = 0; k0 < K; k0 += DEPTH) {
        const int64_t k1 = std::min(K, k0 + DEPTH);
        for (int64_t m0 = 0; m0 < M; m0 += 6) {
          const float* xm = xp + m0 * K;
          float* om = op + m0 * N + p * PANEL;
          switch (std::min<int64_t>(6, M - m0)) {
            case 1: rows_block<1>(xm, K, panel, om, N, k0, k1); break;
            case 2: rows_block<2>(xm, K, panel, om, N, k0, k1); break;
            case 3: rows_block<3>(xm, K, panel, om, N, k0, k1); break;
            case 4: rows_block<4>(xm, K, panel, om, N, k0, k1); break;
            case 5: rows_block<5>(xm, K, panel, om, N, k0, k1); break;
            default: rows_block<6>(xm, K, panel, om, N, k0, k1); break;
          }
        }
      }
    }
  });
}

}  // namespace

// x and the packed weight share a dtype (float32 or bfloat16); sums are float32, and a bfloat16
// result is rounded once, after the bias.
torch::Tensor small_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  const auto dtype = packed.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.is_cpu() && x.scalar_type() == dtype && (dtype == torch::kFloat || dtype == torch::kBFloat16) &&
                  packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == PANEL && packed.size(1) == x.size(1),
              "small_linear: x [rows, in] and a packed weight [out / 64, in, 64] (pack_linear_weight) of one dtype, "
              "float32 or bfloat16, on CPU");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), N = panels * PANEL;
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == dtype),
              "small_linear: bias must be [out] of x's dtype");
  const auto xf = x.to(torch::kFloat).contiguous();
  auto out = torch::empty({M, N}, xf.options());
  if (dtype == torch::kFloat)
    panels_times_rows(xf.data_ptr<float>(), packed.data_ptr<float>(), out.data_ptr<float>(), M, K, panels);
  else
    panels_times_rows(xf.data_ptr<float>(), packed.data_ptr<at::BFloat16>(), out.data_ptr<float>(), M, K, panels);
  if (bias.has_value()) out.add_(bias->to(torch::kFloat));
  return dtype == torch::kFloat ? out : out.to(dtype);
}
