// corekv's native kernels compiled for AVX2 and FMA (x86-64 with GCC), chosen at run time (kernels.h).
#include "kernels.h"

#if COREKV_X86_DISPATCH
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define COREKV_ISA avx2
#define COREKV_VL 8
#define COREKV_REGISTERS 16
#define COREKV_NVEC 2
#include "kernels_isa.h"
#pragma GCC pop_options

namespace corekv_native {
namespace {
bool avx2_supported() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
}  // namespace

const IsaKernels avx2_kernels = COREKV_TABLE(avx2, &avx2_supported);
}  // namespace corekv_native
#endif
