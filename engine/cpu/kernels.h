// The native kernels' entry points for one instruction set (see engine/cpu/native.py).
//
// kernels_isa.h holds the kernels' code, written once with the vector width and register budget
// as constants; isa_avx2.cpp and isa_avx512.cpp compile it for AVX2 + FMA and for AVX-512 (on x86
// with GCC), isa_generic.cpp for the build's own target elsewhere. Each gives one IsaKernels table;
// the torch-facing functions (paged_attention.cpp, small_linear.cpp) check their arguments once and
// call the table of the instruction set they were bound to, so one build serves every x86 CPU and a
// test can run the AVX2 code on an AVX-512 machine.
//
// NOTE: the tables take raw pointers only, and the ISA files include every header before they
// switch the target, so no inline function or template of torch or the C++ library is compiled
// for a wider instruction set than the build's own (the linker keeps one copy of each).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace corekv_native {

struct IsaKernels {
  const char* name;      // "avx512", "avx2" or "generic"
  int64_t panel;         // outputs per packed panel of small_linear (pack_linear_weight's last dim)
  bool (*supported)();   // whether this CPU runs the table's code

  // paged_attention.cpp's decode: out [R, H, G, D] and lse [R, H, G] float32 from q float32
  void (*decode_f32)(const float* q, const float* k_pool, const float* v_pool, const int64_t* tables,
                     const int64_t* lens, float* out, float* lse, int64_t R, int64_t H, int64_t G, int64_t D,
                     int64_t block_size, int64_t block_stride, int64_t max_blocks, float scale);
  void (*decode_bf16)(const float* q, const at::BFloat16* k_pool, const at::BFloat16* v_pool, const int64_t* tables,
                      const int64_t* lens, float* out, float* lse, int64_t R, int64_t H, int64_t G, int64_t D,
                      int64_t block_size, int64_t block_stride, int64_t max_blocks, float scale);
  // paged_attention.cpp's prefill: q and out of the pool's dtype
  void (*prefill_f32)(const float* q, int64_t q_stride_t, int64_t q_stride_h, const float* k_pool,
                      const float* v_pool, const int64_t* tables, const int64_t* query_starts,
                      const int64_t* start_pos, float* out, int64_t C, int64_t H, int64_t G, int64_t D,
                      int64_t block_size, int64_t block_stride, int64_t max_blocks, float scale);
  void (*prefill_bf16)(const at::BFloat16* q, int64_t q_stride_t, int64_t q_stride_h, const at::BFloat16* k_pool,
                       const at::BFloat16* v_pool, const int64_t* tables, const int64_t* query_starts,
                       const int64_t* start_pos, at::BFloat16* out, int64_t C, int64_t H, int64_t G, int64_t D,
                       int64_t block_size, int64_t block_stride, int64_t max_blocks, float scale);
  // small_linear.cpp: out [M, panels * panel] = x [M, K] (float32) times the packed panels
  void (*linear_f32)(const float* x, const float* packed, float* out, int64_t M, int64_t K, int64_t panels);
  void (*linear_bf16)(const float* x, const at::BFloat16* packed, float* out, int64_t M, int64_t K, int64_t panels);
  // elementwise.cpp: a decoder layer's RMSNorm, gated SiLU and rotary embedding, in the tensors' dtype
  void (*rms_norm_f32)(const float* x, const float* w, float* out, int64_t rows, int64_t n, float eps);
  void (*rms_norm_bf16)(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* out, int64_t rows, int64_t n,
                        float eps);
  void (*silu_mul_f32)(const float* gate, const float* up, float* out, int64_t n);
  void (*silu_mul_bf16)(const at::BFloat16* gate, const at::BFloat16* up, at::BFloat16* out, int64_t n);
  void (*rotary_f32)(const float* x, const float* cos, const float* sin, float* out, int64_t tokens, int64_t heads,
                     int64_t D, int64_t token_stride, int64_t head_stride);
  void (*rotary_bf16)(const at::BFloat16* x, const at::BFloat16* cos, const at::BFloat16* sin, at::BFloat16* out,
                      int64_t tokens, int64_t heads, int64_t D, int64_t token_stride, int64_t head_stride);
};

// The tables this build holds, widest first (isa_*.cpp).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define COREKV_X86_DISPATCH 1
extern const IsaKernels avx512_kernels;
extern const IsaKernels avx2_kernels;
#else
#define COREKV_X86_DISPATCH 0
extern const IsaKernels generic_kernels;
#endif

// The table of the kernels kernels_isa.h defined in namespace `ns` (an isa_*.cpp file, after it
// restored the build's own target, so `supported` runs on every CPU).
#define COREKV_TABLE(ns, supported)                                                                  \
  {#ns, ns::PANEL, supported, &ns::decode<float>, &ns::decode<at::BFloat16>, &ns::prefill<float>,    \
   &ns::prefill<at::BFloat16>, &ns::panels_times_rows<float>, &ns::panels_times_rows<at::BFloat16>,             \
   &ns::rms_norm<float>, &ns::rms_norm<at::BFloat16>, &ns::silu_mul<float>, &ns::silu_mul<at::BFloat16>,         \
   &ns::rotary<float>, &ns::rotary<at::BFloat16>}

}  // namespace corekv_native
