// corekv's native CPU attention (engine.compile), reading K/V straight from the paged pool through
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
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
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

std::vector<torch::Tensor> paged_decode(const torch::Tensor& q, const torch::Tensor& k_pool,
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
    decode<float>(qf.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), tables.data_ptr<int64_t>(),
                  lens.data_ptr<int64_t>(), out.data_ptr<float>(), lse.data_ptr<float>(), R, H, G, D, block_size,
                  k_pool.stride(0), max_blocks, static_cast<float>(scale));
  } else {
    decode<at::BFloat16>(qf.data_ptr<float>(), k_pool.data_ptr<at::BFloat16>(), v_pool.data_ptr<at::BFloat16>(),
                         tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                         lse.data_ptr<float>(), R, H, G, D, block_size, k_pool.stride(0), max_blocks,
                         static_cast<float>(scale));
  }
  return {out, lse};
}

// ---- paged_prefill ---------------------------------------------------------------------------
// A task is (chunk, KV head, 16 consecutive queries of the chunk): its G x 16 query rows are held
// transposed, one vector lane per query token, so scores, softmax and the weighted values of a tile
// of keys are all vector operations over those lanes; each key and value row of the pool is read as
// scalars broadcast against them. Flash-attention style: a running max and sum per row, no scores
// matrix beyond one tile, no mask tensor (a key after a query's position is hidden in the kernel).

typedef float vf __attribute__((vector_size(64)));  // GCC vectors: one AVX-512 register, split where narrower
typedef int32_t vi __attribute__((vector_size(64)));
constexpr int VL = 16;            // lanes per vector = query tokens per task
constexpr int KT = 64;            // keys per tile
constexpr float HIDDEN = -1e30f;  // the score of a key a query must not see (finite: -ffast-math)

inline vf splat(float x) { return vf{} + x; }
inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// exp(x) for x <= 0 (a score minus its row's running max), 0 below -80: 2^n * p(f) with p the
// degree-6 Taylor polynomial of 2^f on |f| <= 1/2 (relative error < 2e-7).
inline vf vexp(vf x) {
  const vf y = x * 1.44269504088896341f;
  const vf n = __builtin_convertvector(__builtin_convertvector(y - 0.5f, vi), vf);  // y <= 0: round
  const vf f = y - n;
  vf p = splat(1.5403530393381609e-4f);
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  return x < -80.f ? splat(0.f) : p * reinterpret_cast<const vf&>(bits);
}

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, at::BFloat16* out) { *out = static_cast<at::BFloat16>(x); }

// s[j][g] = sum_d K[j][d] * qt[d][g] for keys j0 .. j0 + kb - 1 of the tile and the row vectors
// g0 .. g0 + NV - 1: KB x NV accumulators stay in registers over d.
template <int NV, int KB>
inline void scores_block(const float* const* krow, const float* qt, float* s, int j0, int kb, int g0, int G, int D) {
  vf acc[KB][NV];
  for (int k = 0; k < KB; ++k)
    for (int v = 0; v < NV; ++v) acc[k][v] = splat(0.f);
  auto step = [&](int d, int keys) {
    vf q[NV];
    for (int v = 0; v < NV; ++v) q[v] = load(qt + (d * G + g0 + v) * VL);
    for (int k = 0; k < keys; ++k) {
      const float kk = krow[j0 + k][d];
      for (int v = 0; v < NV; ++v) acc[k][v] += kk * q[v];
    }
  };
  if (kb == KB) {
    for (int d = 0; d < D; ++d) step(d, KB);  // KB known at compile time: fully unrolled
  } else {
    for (int d = 0; d < D; ++d) step(d, kb);
  }
  for (int k = 0; k < kb; ++k)
    for (int v = 0; v < NV; ++v) store(s + ((j0 + k) * G + g0 + v) * VL, acc[k][v]);
}

// ot[d][g] = ot[d][g] * alpha[g] + sum_j V[j][d] * p[j][g] for d0 .. d0 + db - 1 and the row
// vectors g0 .. g0 + NV - 1: DB x NV accumulators stay in registers over the tile's keys.
template <int NV, int DB>
inline void values_block(const float* const* vrow, const float* p, const float* alpha, float* ot, int nk, int d0,
                         int db, int g0, int G) {
  vf acc[DB][NV];
  for (int x = 0; x < db; ++x)
    for (int v = 0; v < NV; ++v) acc[x][v] = load(ot + ((d0 + x) * G + g0 + v) * VL) * load(alpha + (g0 + v) * VL);
  auto step = [&](int j, int dims) {
    vf pj[NV];
    for (int v = 0; v < NV; ++v) pj[v] = load(p + (j * G + g0 + v) * VL);
    for (int x = 0; x < dims; ++x) {
      const float vv = vrow[j][d0 + x];
      for (int v = 0; v < NV; ++v) acc[x][v] += vv * pj[v];
    }
  };
  if (db == DB) {
    for (int j = 0; j < nk; ++j) step(j, DB);
  } else {
    for (int j = 0; j < nk; ++j) step(j, db);
  }
  for (int x = 0; x < db; ++x)
    for (int v = 0; v < NV; ++v) store(ot + ((d0 + x) * G + g0 + v) * VL, acc[x][v]);
}

// One tile's scores (values == false) or weighted values (values == true) for all G row vectors,
// NV <= 4 of them at a time, with ~24 accumulators of the 32 vector registers.
template <int NV>
void tile_part(const float* const* krow, const float* const* vrow, const float* qt, float* s, const float* alpha,
               float* ot, int nk, int g0, int G, int D, bool values) {
  constexpr int B = NV == 1 ? 16 : 24 / NV;
  if (!values) {
    for (int j0 = 0; j0 < nk; j0 += B) scores_block<NV, B>(krow, qt, s, j0, std::min(B, nk - j0), g0, G, D);
  } else {
    for (int d0 = 0; d0 < D; d0 += B) values_block<NV, B>(vrow, s, alpha, ot, nk, d0, std::min(B, D - d0), g0, G);
  }
}

void tile(const float* const* krow, const float* const* vrow, const float* qt, float* s, const float* alpha, float* ot,
          int nk, int G, int D, bool values) {
  for (int g0 = 0; g0 < G; g0 += 4) {
    switch (std::min(4, G - g0)) {
      case 1: tile_part<1>(krow, vrow, qt, s, alpha, ot, nk, g0, G, D, values); break;
      case 2: tile_part<2>(krow, vrow, qt, s, alpha, ot, nk, g0, G, D, values); break;
      case 3: tile_part<3>(krow, vrow, qt, s, alpha, ot, nk, g0, G, D, values); break;
      default: tile_part<4>(krow, vrow, qt, s, alpha, ot, nk, g0, G, D, values); break;
    }
  }
}

struct Task {
  int64_t chunk, head, first;  // first: the task's first query, counted within its chunk
  int64_t keys;                // keys it attends (its cost)
};

template <typename T>
void prefill(const T* q, int64_t q_stride_t, int64_t q_stride_h, const T* k_pool, const T* v_pool,
             const int64_t* tables, const int64_t* query_starts, const int64_t* start_pos, T* out, int64_t C, int64_t H,
             int64_t G, int64_t D, int64_t block_size, int64_t block_stride, int64_t max_blocks, float scale) {
  std::vector<Task> tasks;
  for (int64_t c = 0; c < C; ++c)
    for (int64_t i0 = 0; i0 < query_starts[c + 1] - query_starts[c]; i0 += VL)
      for (int64_t h = 0; h < H; ++h) tasks.push_back({c, h, i0, start_pos[c] + i0 + VL});
  // NOTE: costliest first, each taken by whichever thread is free: a long chunk's later queries
  // see many more keys than its first ones, so an even split of the list would be uneven work.
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.keys > b.keys; });
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1, [&](int64_t, int64_t) {
    const int64_t rows = G * VL;  // one task's query rows: [G][16 lanes]
    std::vector<float> qt(D * rows), ot(D * rows), s(KT * rows), m(rows), l(rows), alpha(rows), kbuf(KT * D),
        vbuf(KT * D);
    const float* krow[KT];
    const float* vrow[KT];
    for (int64_t t; (t = next.fetch_add(1)) < num_tasks;) {
      const int64_t c = tasks[t].chunk, h = tasks[t].head, i0 = tasks[t].first;
      const int64_t nq = std::min<int64_t>(VL, query_starts[c + 1] - query_starts[c] - i0);
      const int64_t pos0 = start_pos[c] + i0, num_keys = pos0 + nq;
      const int64_t* table = tables + c * max_blocks;
      // qt[d][g][lane] = scaled query of token i0 + lane (lanes past the chunk repeat its last query)
      for (int64_t lane = 0; lane < VL; ++lane) {
        const T* qrow = q + (query_starts[c] + i0 + std::min(lane, nq - 1)) * q_stride_t + h * G * q_stride_h;
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < D; ++d) qt[(d * G + g) * VL + lane] = to_float(qrow[g * q_stride_h + d]) * scale;
      }
      std::fill(ot.begin(), ot.end(), 0.f);
      std::fill(m.begin(), m.end(), HIDDEN);
      std::fill(l.begin(), l.end(), 0.f);
      vf pos;
      for (int lane = 0; lane < VL; ++lane) pos[lane] = static_cast<float>(pos0 + std::min<int64_t>(lane, nq - 1));
      for (int64_t t0 = 0; t0 < num_keys; t0 += KT) {
        const int nk = static_cast<int>(std::min<int64_t>(KT, num_keys - t0));
        for (int j = 0; j < nk; ++j) {
          const int64_t key = t0 + j;
          const int64_t off = table[key / block_size] * block_stride + ((key % block_size) * H + h) * D;
          krow[j] = as_float(k_pool + off, kbuf.data() + j * D, D);
          vrow[j] = as_float(v_pool + off, vbuf.data() + j * D, D);
        }
        tile(krow, vrow, qt.data(), s.data(), alpha.data(), ot.data(), nk, G, D, false);
        // online softmax per row: rescale what came before by exp(old max - new max)
        const bool diagonal = t0 + nk - 1 > pos0;  // some key of the tile is after some query
        for (int64_t g = 0; g < G; ++g) {
          vf mx = load(m.data() + g * VL);
          for (int j = 0; j < nk; ++j) {
            float* sj = s.data() + (j * G + g) * VL;
            vf sv = load(sj);
            if (diagonal) {
              sv = splat(static_cast<float>(t0 + j)) > pos ? splat(HIDDEN) : sv;
              store(sj, sv);
            }
            mx = mx > sv ? mx : sv;
          }
          vf sum = splat(0.f);
          for (int j = 0; j < nk; ++j) {
            float* sj = s.data() + (j * G + g) * VL;
            const vf p = vexp(load(sj) - mx);
            store(sj, p);
            sum += p;
          }
          const vf a = vexp(load(m.data() + g * VL) - mx);
          store(alpha.data() + g * VL, a);
          store(l.data() + g * VL, load(l.data() + g * VL) * a + sum);
          store(m.data() + g * VL, mx);
        }
        tile(krow, vrow, qt.data(), s.data(), alpha.data(), ot.data(), nk, G, D, true);
      }
      for (int64_t lane = 0; lane < nq; ++lane) {
        T* orow = out + (query_starts[c] + i0 + lane) * H * G * D + h * G * D;
        for (int64_t g = 0; g < G; ++g) {
          const float inv = 1.f / l[g * VL + lane];
          for (int64_t d = 0; d < D; ++d) from_float(ot[(d * G + g) * VL + lane] * inv, orow + g * D + d);
        }
      }
    }
  });
}

void paged_prefill(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                   const torch::Tensor& block_tables, const torch::Tensor& query_starts,
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
    prefill<float>(q.data_ptr<float>(), q.stride(0), q.stride(1), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(),
                   tables.data_ptr<int64_t>(), qs, sp, out.data_ptr<float>(), C, H, G, D, k_pool.size(1),
                   k_pool.stride(0), tables.size(1), static_cast<float>(scale));
  } else {
    prefill<at::BFloat16>(q.data_ptr<at::BFloat16>(), q.stride(0), q.stride(1), k_pool.data_ptr<at::BFloat16>(),
                          v_pool.data_ptr<at::BFloat16>(), tables.data_ptr<int64_t>(), qs, sp,
                          out.data_ptr<at::BFloat16>(), C, H, G, D, k_pool.size(1), k_pool.stride(0), tables.size(1),
                          static_cast<float>(scale));
  }
}

}  // namespace

torch::Tensor pack_linear_weight(const torch::Tensor& weight);  // small_linear.cpp
torch::Tensor small_linear(const torch::Tensor& x, const torch::Tensor& packed,
                           const c10::optional<torch::Tensor>& bias);

// NOTE: the GIL is released while it runs: the engine steps in its own thread beside a server's event loop.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, py::call_guard<py::gil_scoped_release>());
  m.def("paged_prefill", &paged_prefill, py::call_guard<py::gil_scoped_release>());
  m.def("pack_linear_weight", &pack_linear_weight);
  m.def("small_linear", &small_linear, py::call_guard<py::gil_scoped_release>());
}
