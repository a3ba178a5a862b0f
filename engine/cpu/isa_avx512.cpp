// corekv's native kernels compiled for AVX-512 (x86-64 with GCC), chosen at run time (kernels.h).
#include "kernels.h"

#if COREKV_X86_DISPATCH
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")
#define COREKV_ISA avx512
#define COREKV_VL 16
#define COREKV_REGISTERS 32
#define COREKV_NVEC 4
#define COREKV_BF16_DOT 1  // bfloat16 prefill scores by AVX-512 BF16 where the CPU has it (checked at run time)
#include "kernels_isa.h"
#pragma GCC pop_options

namespace corekv_native {
namespace {
bool avx512_supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
}
}  // namespace

const IsaKernels avx512_kernels = COREKV_TABLE(avx512, &avx512_supported);
}  // namespace corekv_native
#endif
