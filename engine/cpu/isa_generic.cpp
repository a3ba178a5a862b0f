// corekv's native kernels for the build's own target where there is no run-time choice (not x86-64,
// or not GCC; native.py builds with -march=native there), with AVX-512's blocking (kernels.h).
#include "kernels.h"

#if !COREKV_X86_DISPATCH
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#define COREKV_ISA generic
#define COREKV_VL 16
#define COREKV_REGISTERS 32
#define COREKV_NVEC 4
#include "kernels_isa.h"

namespace corekv_native {
namespace {
bool always() { return true; }
}  // namespace

const IsaKernels generic_kernels = COREKV_TABLE(generic, &always);
}  // namespace corekv_native
#endif
