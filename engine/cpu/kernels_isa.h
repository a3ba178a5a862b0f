// The native kernels' code for one instruction set, included by isa_avx2.cpp, isa_avx512.cpp and
// isa_generic.cpp (see kernels.h) after each has included this file's headers and defined:
//   COREKV_ISA        the namespace of its table's functions (avx2, avx512, generic)
//   COREKV_VL         float32 lanes per vector register (8 for AVX2, 16 for AVX-512)
//   COREKV_REGISTERS  vector registers (16 for AVX2, 32 for AVX-512)
//   COREKV_NVEC       vectors per small_linear panel row (2 for AVX2, 4 for AVX-512)
// The blockings below are sized from these, so each instruction set keeps its accumulators in its
// registers. Raw pointers only: paged_attention.cpp and small_linear.cpp check the arguments.
//
// NOTE: no #include here: every header is included by the ISA file before it switches the target
// (kernels.h says why).

namespace corekv_native {
namespace COREKV_ISA {
namespace {

constexpr int VL = COREKV_VL;                    // float32 lanes per vector
constexpr int REGISTERS = COREKV_REGISTERS;      // vector registers
constexpr int ACCUMULATORS = REGISTERS * 3 / 4;  // of them, held as accumulators by a register block
constexpr int NVEC = COREKV_NVEC;                // vectors per small_linear panel row

typedef float vf __attribute__((vector_size(VL * 4)));  // GCC vectors: one register of the target
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef unsigned short vh __attribute__((vector_size(VL * 2)));
typedef unsigned int vu __attribute__((vector_size(VL * 4)));

inline vf splat(float x) { return vf{} + x; }
inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// VL float32 values from p, bfloat16 bits widened
inline vf load(const at::BFloat16* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu bits = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

// The sum of v's lanes (-ffast-math lets the compiler add them as a tree of halves).
inline float hsum(vf v) {
  float sum = 0.f;
  for (int i = 0; i < VL; ++i) sum += v[i];
  return sum;
}

constexpr int KT = 64;            // keys per tile of the attention kernels
constexpr float HIDDEN = -1e30f;  // the score of a key a query must not see (finite: -ffast-math)

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

// f.template operator()<N>(g0) for each group of N <= 4 query rows g0 .. g0 + N - 1 of G: the
// attention kernels hold a group's accumulators in registers, so N is a compile-time constant.
template <typename F>
inline void in_row_groups(int64_t G, F&& f) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: f.template operator()<1>(g0); break;
      case 2: f.template operator()<2>(g0); break;
      case 3: f.template operator()<3>(g0); break;
      default: f.template operator()<4>(g0); break;
    }
  }
}

// The offset in a layer's K (or V) pool of key `key` of KV head h for a row whose block table is
// `table`: a layer's pool is [block][token of the block][KV head][D], blocks block_stride apart.
inline int64_t pool_row(const int64_t* table, int64_t key, int64_t h, int64_t H, int64_t D, int64_t block_size,
                        int64_t block_stride) {
  return table[key / block_size] * block_stride + ((key % block_size) * H + h) * D;
}

// Asks for the cache lines of n values from row on, into L1 (LOCALITY 3) or L2 (2).
template <int LOCALITY = 3, typename T>
inline void prefetch_row(const T* row, int64_t n) {
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(row) + b, 0, LOCALITY);
}

// ---- paged_decode ----------------------------------------------------------------------------

// s[g][j] = K[j] . q[g] for the tile's nk keys and GB query rows (q scaled, [GB][D]): each key row
// is loaded once, VL dims at a time, against the GB rows' partial sums in registers. Key j also
// prefetches the K and V lines of row j of the next tile (knext, vnext; np of them).
template <int GB, typename T>
inline void decode_scores(const T* const* krow, const float* q, float* s, int nk, int64_t D,
                          const T* const* knext, const T* const* vnext, int np) {
  const int64_t nv = D / VL * VL;
  for (int j = 0; j < nk; ++j) {
    if (j < np) {
      prefetch_row(knext[j], D);
      prefetch_row(vnext[j], D);
    }
    const T* k = krow[j];
    vf acc[GB];
    for (int g = 0; g < GB; ++g) acc[g] = splat(0.f);
    for (int64_t d = 0; d < nv; d += VL) {
      const vf kv = load(k + d);
      for (int g = 0; g < GB; ++g) acc[g] += kv * load(q + g * D + d);
    }
    for (int g = 0; g < GB; ++g) {
      float x = hsum(acc[g]);
      for (int64_t d = nv; d < D; ++d) x += to_float(k[d]) * q[g * D + d];
      s[g * KT + j] = x;
    }
  }
}

// o[g] += sum_j p[g][j] * V[j] for the tile's nk keys and GB rows ([GB][D]): VL dims at a time,
// the GB rows' accumulators in registers over the keys.
template <int GB, typename T>
inline void decode_values(const T* const* vrow, const float* p, float* o, int nk, int64_t D) {
  const int64_t nv = D / VL * VL;
  for (int64_t d = 0; d < nv; d += VL) {
    vf acc[GB];
    for (int g = 0; g < GB; ++g) acc[g] = load(o + g * D + d);
    for (int j = 0; j < nk; ++j) {
      const vf vv = load(vrow[j] + d);
      for (int g = 0; g < GB; ++g) acc[g] += p[g * KT + j] * vv;
    }
    for (int g = 0; g < GB; ++g) store(o + g * D + d, acc[g]);
  }
  for (int64_t d = nv; d < D; ++d)
    for (int g = 0; g < GB; ++g) {
      float x = o[g * D + d];
      for (int j = 0; j < nk; ++j) x += p[g * KT + j] * to_float(vrow[j][d]);
      o[g * D + d] = x;
    }
}

// One tile's scores (values == false) or weighted values for all G rows, up to 4 at a time.
template <typename T>
void decode_tile(const T* const* krow, const T* const* vrow, const float* q, float* s, float* o, int nk, int64_t G,
                 int64_t D, bool values, const T* const* knext = nullptr, const T* const* vnext = nullptr, int np = 0) {
  in_row_groups(G, [&]<int GB>(int64_t g0) {
    if (values)
      decode_values<GB>(vrow, s + g0 * KT, o + g0 * D, nk, D);
    else
      decode_scores<GB>(krow, q + g0 * D, s + g0 * KT, nk, D, knext, vnext, g0 == 0 ? np : 0);
  });
}

// One task per (KV head, row), flash-attention style over tiles of KT keys: the G scores of each
// key, a running max and sum per query row (the tile's exps as vector operations over its keys),
// then the values weighted into G x D accumulators. Tasks go head by head, each taken by whichever
// thread is free: rows that start with the same blocks (a shared system prompt) read them while the
// previous row's task left them in cache, so the kernel needs no cascade of its own.
template <typename T>
void decode(const float* q, const T* k_pool, const T* v_pool, const int64_t* tables, const int64_t* lens,
            float* out, float* lse, int64_t R, int64_t H, int64_t G, int64_t D, int64_t block_size,
            int64_t block_stride, int64_t max_blocks, float scale) {
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = R * H;
  // krow / vrow = the pool rows of keys t0 .. t0 + nk - 1 (nk <= KT) of a task's context
  auto rows = [&](int64_t task, int64_t t0, const T** krow, const T** vrow) {
    const int64_t h = task / R, r = task % R;
    const int64_t* table = tables + r * max_blocks;
    const int nk = static_cast<int>(std::min<int64_t>(KT, lens[r] - t0));
    for (int j = 0; j < nk; ++j) {
      const int64_t key = t0 + j;
      const int64_t off = pool_row(table, key, h, H, D, block_size, block_stride);
      krow[j] = k_pool + off;
      vrow[j] = v_pool + off;
    }
    return nk;
  };
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1, [&](int64_t, int64_t) {
    std::vector<float> qs(G * D), o(G * D), s(G * KT), m(G), l(G);
    const T* rows_a[2][KT];
    const T* rows_b[2][KT];
    const T** krow = rows_a[0];  // this tile's rows
    const T** vrow = rows_a[1];
    const T** knext = rows_b[0];  // the next tile's, found while this one computes
    const T** vnext = rows_b[1];
    int ready = 0;  // rows of the coming tile already in krow / vrow
    for (int64_t task = next.fetch_add(1), ahead; task < num_tasks; task = ahead) {
      ahead = next.fetch_add(1);  // claimed now, so this task's last tile can prefetch its first
      const int64_t h = task / R, r = task % R, n = lens[r];
      const int64_t base = (r * H + h) * G * D;
      for (int64_t i = 0; i < G * D; ++i) qs[i] = q[base + i] * scale;
      std::fill(o.begin(), o.end(), 0.f);
      std::fill(m.begin(), m.end(), HIDDEN);
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t t0 = 0; t0 < n; t0 += KT) {
        const int nk = ready ? ready : rows(task, t0, krow, vrow);
        // NOTE: the rows of a tile lie in blocks anywhere in the pool, where no hardware prefetcher
        // finds them: the scores of this tile ask for the next tile's lines (the next task's first
        // tile after the last), one row per key, so they arrive while this tile computes.
        const int np = t0 + KT < n          ? rows(task, t0 + KT, knext, vnext)
                       : ahead < num_tasks ? rows(ahead, 0, knext, vnext)
                                           : 0;
        decode_tile(krow, vrow, qs.data(), s.data(), o.data(), nk, G, D, false, knext, vnext, np);
        for (int j = nk; j < np; ++j) {  // a short tile before a long one: the rest of its rows
          prefetch_row(knext[j], D);
          prefetch_row(vnext[j], D);
        }
        for (int64_t g = 0; g < G; ++g) {
          float* sg = s.data() + g * KT;
          for (int j = nk; j < KT; ++j) sg[j] = HIDDEN;  // the tile's tail: weight 0
          vf mv = splat(m[g]);
          for (int j = 0; j < KT; j += VL) mv = mv > load(sg + j) ? mv : load(sg + j);
          float mx = mv[0];
          for (int i = 1; i < VL; ++i) mx = std::max(mx, mv[i]);
          vf sum = splat(0.f);
          for (int j = 0; j < KT; j += VL) {
            const vf p = vexp(load(sg + j) - mx);
            store(sg + j, p);
            sum += p;
          }
          const float alpha = std::exp(m[g] - mx);  // what came before, rescaled to the new max
          for (int64_t d = 0; d < D; ++d) o[g * D + d] *= alpha;
          l[g] = l[g] * alpha + hsum(sum);
          m[g] = mx;
        }
        decode_tile(krow, vrow, qs.data(), s.data(), o.data(), nk, G, D, true);
        std::swap(krow, knext);
        std::swap(vrow, vnext);
        ready = np;
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) out[base + g * D + d] = o[g * D + d] * inv;
        lse[(r * H + h) * G + g] = m[g] + std::log(l[g]);
      }
    }
  });
}

// ---- paged_prefill ---------------------------------------------------------------------------
// A task is (chunk, KV head, VL consecutive queries of the chunk): its G x VL query rows are held
// transposed, one vector lane per query token, so scores, softmax and the weighted values of a tile
// of keys are all vector operations over those lanes; each key and value row of the pool is read as
// scalars broadcast against them. Flash-attention style: a running max and sum per row, no scores
// matrix beyond one tile, no mask tensor (a key after a query's position is hidden in the kernel).

// One pool row of D values as float32: the row itself, or its bfloat16 bits widened into buf.
inline const float* as_float(const float* src, float*, int64_t) { return src; }
inline const float* as_float(const at::BFloat16* src, float* buf, int64_t D) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(buf);
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<uint32_t>(bits[d]) << 16;
  return buf;
}

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
// NV <= 4 of them at a time, with ACCUMULATORS of the REGISTERS vector registers.
// Keys (or dims) per register block of the prefill kernels for NV row vectors: NV x B accumulators.
template <int NV>
constexpr int block_size() {
  return NV == 1 ? ACCUMULATORS * 2 / 3 : ACCUMULATORS / NV;
}

template <int NV>
void tile_part(const float* const* krow, const float* const* vrow, const float* qt, float* s, const float* alpha,
               float* ot, int nk, int g0, int G, int D, bool values) {
  constexpr int B = block_size<NV>();
  if (!values) {
    for (int j0 = 0; j0 < nk; j0 += B) scores_block<NV, B>(krow, qt, s, j0, std::min(B, nk - j0), g0, G, D);
  } else {
    for (int d0 = 0; d0 < D; d0 += B) values_block<NV, B>(vrow, s, alpha, ot, nk, d0, std::min(B, D - d0), g0, G);
  }
}

void tile(const float* const* krow, const float* const* vrow, const float* qt, float* s, const float* alpha, float* ot,
          int nk, int G, int D, bool values) {
  in_row_groups(G, [&]<int NV>(int64_t g0) {
    tile_part<NV>(krow, vrow, qt, s, alpha, ot, nk, static_cast<int>(g0), G, D, values);
  });
}

#if COREKV_BF16_DOT
inline bool bf16_dot_supported() {
  static const bool supported = __builtin_cpu_supports("avx512bf16");
  return supported;
}

// NOTE: only the functions up to pop_options are compiled for AVX-512 BF16; prefill, which every
// AVX-512 CPU runs, calls them only where the CPU has it, through one call that is never inlined.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,avx512bf16")

// bfloat16 scores by AVX-512 BF16's pair dot products, where the CPU has them: each instruction
// multiplies two dims of a key (one 32-bit broadcast straight from the pool row, no widening) with
// the same two dims of 16 queries and adds both products to their float32 sums, half the
// instructions of the float32 scores. qp holds the unscaled queries as [D / 2][G][VL] pairs, dim
// 2i in the low half (the instruction's pair order); scores come out unscaled.
template <int NV, int KB>
inline void scores_block_bf16(const uint16_t* const* kp, const uint32_t* qp, float* s, int j0, int kb, int g0, int G,
                              int D) {
  __m512 acc[KB][NV];
  for (int k = 0; k < KB; ++k)
    for (int v = 0; v < NV; ++v) acc[k][v] = _mm512_setzero_ps();
  auto step = [&](int dp, int keys) {
    __m512bh q[NV];
    for (int v = 0; v < NV; ++v) q[v] = (__m512bh)_mm512_loadu_si512(qp + (dp * G + g0 + v) * VL);
    for (int k = 0; k < keys; ++k) {
      int pair;  // dims 2 dp and 2 dp + 1 of the key
      std::memcpy(&pair, kp[j0 + k] + 2 * dp, sizeof pair);
      const __m512bh kk = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) acc[k][v] = _mm512_dpbf16_ps(acc[k][v], kk, q[v]);
    }
  };
  if (kb == KB) {
    for (int dp = 0; dp < D / 2; ++dp) step(dp, KB);
  } else {
    for (int dp = 0; dp < D / 2; ++dp) step(dp, kb);
  }
  for (int k = 0; k < kb; ++k)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(s + ((j0 + k) * G + g0 + v) * VL, acc[k][v]);
}

template <int NV>
inline void scores_part_bf16(const uint16_t* const* kp, const uint32_t* qp, float* s, int nk, int g0, int G, int D) {
  constexpr int B = block_size<NV>();
  for (int j0 = 0; j0 < nk; j0 += B) scores_block_bf16<NV, B>(kp, qp, s, j0, std::min(B, nk - j0), g0, G, D);
}

// One tile's unscaled scores from bfloat16 keys and query pairs.
__attribute__((noinline)) void scores_tile_bf16(const uint16_t* const* kp, const uint32_t* qp,
                                                float* s, int nk, int G, int D) {
  in_row_groups(G, [&]<int NV>(int64_t g0) { scores_part_bf16<NV>(kp, qp, s, nk, static_cast<int>(g0), G, D); });
}
#pragma GCC pop_options
#endif

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
  // bfloat16 keys on a CPU with AVX-512 BF16: scores by its dot products (scores_tile_bf16)
#if COREKV_BF16_DOT
  const bool dot = std::is_same<T, at::BFloat16>::value && D % 2 == 0 && bf16_dot_supported();
#else
  const bool dot = false;
#endif
  const float score_scale = dot ? scale : 1.f;  // dot products have unscaled queries
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1, [&](int64_t, int64_t) {
    const int64_t rows = G * VL;  // one task's query rows: [G][VL lanes]
    std::vector<float> qt(dot ? 0 : D * rows), ot(D * rows), s(KT * rows), m(rows), l(rows), alpha(rows),
        kbuf(dot ? 0 : KT * D), vbuf(KT * D);
    std::vector<uint32_t> qp(dot ? D / 2 * rows : 0);
    const float* krow[KT];
    const float* vrow[KT];
    const uint16_t* kp[KT];
    for (int64_t t; (t = next.fetch_add(1)) < num_tasks;) {
      const int64_t c = tasks[t].chunk, h = tasks[t].head, i0 = tasks[t].first;
      const int64_t nq = std::min<int64_t>(VL, query_starts[c + 1] - query_starts[c] - i0);
      const int64_t pos0 = start_pos[c] + i0, num_keys = pos0 + nq;
      const int64_t* table = tables + c * max_blocks;
      // qt[d][g][lane] = scaled query of token i0 + lane (lanes past the chunk repeat its last query)
      // (dot: qp[d / 2][g][lane] = the pair of unscaled dims d, d + 1)
      for (int64_t lane = 0; lane < VL; ++lane) {
        const T* qrow = q + (query_starts[c] + i0 + std::min(lane, nq - 1)) * q_stride_t + h * G * q_stride_h;
        for (int64_t g = 0; g < G; ++g) {
          if (dot) {
            const uint16_t* bits = reinterpret_cast<const uint16_t*>(qrow + g * q_stride_h);
            for (int64_t dp = 0; dp < D / 2; ++dp)
              qp[(dp * G + g) * VL + lane] = bits[2 * dp] | static_cast<uint32_t>(bits[2 * dp + 1]) << 16;
          } else {
            for (int64_t d = 0; d < D; ++d) qt[(d * G + g) * VL + lane] = to_float(qrow[g * q_stride_h + d]) * scale;
          }
        }
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
          const int64_t off = pool_row(table, key, h, H, D, block_size, block_stride);
          if (dot)
            kp[j] = reinterpret_cast<const uint16_t*>(k_pool + off);
          else
            krow[j] = as_float(k_pool + off, kbuf.data() + j * D, D);
          vrow[j] = as_float(v_pool + off, vbuf.data() + j * D, D);
        }
#if COREKV_BF16_DOT
        if (dot)
          scores_tile_bf16(kp, qp.data(), s.data(), nk, static_cast<int>(G), static_cast<int>(D));
        else
#endif
          tile(krow, vrow, qt.data(), s.data(), alpha.data(), ot.data(), nk, G, D, false);
        // online softmax per row: rescale what came before by exp(old max - new max)
        const bool diagonal = t0 + nk - 1 > pos0;  // some key of the tile is after some query
        for (int64_t g = 0; g < G; ++g) {
          vf mx = load(m.data() + g * VL);
          for (int j = 0; j < nk; ++j) {
            float* sj = s.data() + (j * G + g) * VL;
            vf sv = load(sj) * score_scale;
            if (diagonal) sv = splat(static_cast<float>(t0 + j)) > pos ? splat(HIDDEN) : sv;
            if (diagonal || dot) store(sj, sv);
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

// ---- small_linear ----------------------------------------------------------------------------
// Each panel row of PANEL outputs is NVEC vectors that every row of x multiplies with a broadcast
// scalar (ROWS rows x NVEC vectors of accumulators), and rows beyond ROWS reuse a DEPTH-deep slice
// of the panel from L1 instead of reading it again; while they do, the next slice is prefetched
// (see Ahead).

constexpr int64_t PANEL = NVEC * VL;  // outputs per panel
constexpr int ROWS = 6;               // rows of x per block of accumulators
constexpr int64_t DEPTH = 128;        // k per slice of a panel (at most 32 KiB: in L1 for every block of rows)
constexpr int64_t PREFETCH = 4096;    // bytes of panel ahead

// What a block of rows prefetches while it multiplies: the first block of a slice reads the slice
// from memory and asks for its lines PREFETCH bytes ahead into L1; the second asks for the next
// slice into L2 while the blocks after the first compute from cache, so the next slice's first
// block does not wait on memory; the rest ask for nothing.
enum Ahead { AHEAD_NONE, AHEAD_SLICE, AHEAD_NEXT_SLICE };

// out[r][0:PANEL] (+)= sum_{k0 <= k < k1} x[r][k] * panel[k][0:PANEL] for R rows.
template <int R, Ahead A, typename W>
void rows_block(const float* x, int64_t K, const W* panel, float* out, int64_t N, int64_t k0, int64_t k1) {
  vf acc[R][NVEC];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NVEC; ++j) acc[r][j] = k0 == 0 ? vf{} : load(out + r * N + j * VL);
  for (int64_t k = k0; k < k1; ++k) {
    const W* row = panel + k * PANEL;
    if constexpr (A == AHEAD_SLICE)
      prefetch_row(row + PREFETCH / sizeof(W), PANEL);
    else if constexpr (A == AHEAD_NEXT_SLICE)
      prefetch_row<2>(row + DEPTH * PANEL, PANEL);
    vf w[NVEC];
    for (int j = 0; j < NVEC; ++j) w[j] = load(row + j * VL);
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * K + k];
      for (int j = 0; j < NVEC; ++j) acc[r][j] += xr * w[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NVEC; ++j) store(out + r * N + j * VL, acc[r][j]);
}

template <Ahead A, typename W>
void rows_block_of(int64_t rows, const float* x, int64_t K, const W* panel, float* out, int64_t N, int64_t k0, int64_t k1) {
  static_assert(ROWS == 6, "the cases below are ROWS' block sizes");
  switch (rows) {
    case 1: rows_block<1, A>(x, K, panel, out, N, k0, k1); break;
    case 2: rows_block<2, A>(x, K, panel, out, N, k0, k1); break;
    case 3: rows_block<3, A>(x, K, panel, out, N, k0, k1); break;
    case 4: rows_block<4, A>(x, K, panel, out, N, k0, k1); break;
    case 5: rows_block<5, A>(x, K, panel, out, N, k0, k1); break;
    default: rows_block<6, A>(x, K, panel, out, N, k0, k1); break;
  }
}

template <typename W>
void panels_times_rows(const float* xp, const W* wp, float* op, int64_t M, int64_t K, int64_t panels) {
  const int64_t N = panels * PANEL;
  // NOTE: a thread per share of the panels, unless the panels do not share evenly (a 576-output
  // weight has 9 of AVX-512's, a 192-output one 3) and the rows are many enough for the multiplying
  // to outweigh reading a panel (two blocks of rows per thread): then each panel's rows split in one
  // part per thread too, so that no thread waits on another's extra panel; the second reader of a
  // panel finds it in the shared cache.
  const int64_t threads = at::get_num_threads();
  const int64_t parts = panels % threads && M >= 2 * ROWS * threads ? threads : 1;
  const int64_t part_rows = (M + parts - 1) / parts;
  at::parallel_for(0, panels * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item / parts, m_begin = item % parts * part_rows, m_end = std::min(M, m_begin + part_rows);
      const W* panel = wp + p * K * PANEL;
      for (int64_t k0 = 0; k0 < K; k0 += DEPTH) {
        const int64_t k1 = std::min(K, k0 + DEPTH);
        for (int64_t m0 = m_begin; m0 < m_end; m0 += ROWS) {
          const int64_t rows = std::min<int64_t>(ROWS, m_end - m0);
          const float* xm = xp + m0 * K;
          float* om = op + m0 * N + p * PANEL;
          if (m0 == m_begin)
            rows_block_of<AHEAD_SLICE>(rows, xm, K, panel, om, N, k0, k1);
          else if (m0 == m_begin + ROWS)
            rows_block_of<AHEAD_NEXT_SLICE>(rows, xm, K, panel, om, N, k0, k1);
          else
            rows_block_of<AHEAD_NONE>(rows, xm, K, panel, om, N, k0, k1);
        }
      }
    }
  });
}

// ---- elementwise: a decoder layer's RMSNorm, gated SiLU and rotary embedding ------------------
// Each computes what its Hugging Face Llama counterpart computes, in float32, rounding to bfloat16
// at the points where that one does (so a bfloat16 model's values are the same up to summation
// order and the exp's last bits). Lengths are whole vectors (elementwise.cpp checks).

inline vu bits_of(vf v) { vu b; std::memcpy(&b, &v, sizeof v); return b; }
inline vf float_of(vu b) { vf v; std::memcpy(&v, &b, sizeof v); return v; }
// bfloat16 bits of v, rounded to nearest even (as c10::BFloat16; no NaNs under -ffast-math)
inline vu bfloat16_bits(vf v) {
  const vu b = bits_of(v);
  return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
}
// v as a T would hold it: unchanged for float32, rounded for bfloat16
inline vf as_stored(vf v, const float*) { return v; }
inline vf as_stored(vf v, const at::BFloat16*) { return float_of(bfloat16_bits(v) << 16); }
inline void store(at::BFloat16* p, vf v) {
  const vh h = __builtin_convertvector(bfloat16_bits(v), vh);
  std::memcpy(p, &h, sizeof h);
}

// Rows of at least this many elements per thread: less work is not worth waking another thread for.
constexpr int64_t ELEMENTWISE_GRAIN = 16384;

// out[r] = w * stored(x[r] / sqrt(mean(x[r]^2) + eps)) for `rows` rows of n (LlamaRMSNorm).
template <typename T>
void rms_norm(const T* x, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, ELEMENTWISE_GRAIN / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      vf acc = splat(0.f);
      for (int64_t i = 0; i < n; i += VL) {
        const vf v = load(xr + i);
        acc += v * v;
      }
      const float inv = 1.f / std::sqrt(hsum(acc) / static_cast<float>(n) + eps);
      for (int64_t i = 0; i < n; i += VL) store(out + r * n + i, load(w + i) * as_stored(load(xr + i) * inv, xr));
    }
  });
}

// out = stored(silu(gate)) * up, elementwise over n values (LlamaMLP's act_fn(gate_proj) * up_proj).
template <typename T>
void silu_mul(const T* gate, const T* up, T* out, int64_t n) {
  at::parallel_for(0, n / VL, std::max<int64_t>(1, ELEMENTWISE_GRAIN / VL), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * VL; i < end * VL; i += VL) {
      const vf x = load(gate + i);
      const vf e = vexp(x > 0.f ? -x : x);  // exp(-|x|) <= 1: no overflow either side
      const vf silu = (x > 0.f ? x : x * e) / (1.f + e);
      store(out + i, as_stored(silu, gate) * load(up + i));
    }
  });
}

// Rotary embedding of `tokens` x `heads` rows of D (LlamaAttention's apply_rotary_pos_emb, the
// rotate_half form): out = stored(x * cos) + stored(rotate_half(x) * sin), cos and sin [tokens, D],
// x's rows `token_stride` / `head_stride` elements apart, out [tokens, heads, D] contiguous.
template <typename T>
void rotary(const T* x, const T* cos, const T* sin, T* out, int64_t tokens, int64_t heads, int64_t D,
            int64_t token_stride, int64_t head_stride) {
  const int64_t half = D / 2;
  at::parallel_for(0, tokens * heads, std::max<int64_t>(1, ELEMENTWISE_GRAIN / D), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / heads, h = row % heads;
      const T* xr = x + t * token_stride + h * head_stride;
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      T* o = out + row * D;
      for (int64_t i = 0; i < half; i += VL) {
        const vf x1 = load(xr + i), x2 = load(xr + half + i);
        store(o + i, as_stored(x1 * load(c + i), xr) - as_stored(x2 * load(s + i), xr));
        store(o + half + i, as_stored(x2 * load(c + half + i), xr) + as_stored(x1 * load(s + half + i), xr));
      }
    }
  });
}

}  // namespace
}  // namespace COREKV_ISA
}  // namespace corekv_native
