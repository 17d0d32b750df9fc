// The CPU compute compiled for AVX2 + FMA, chosen at run time when the CPU has both
// (dispatch.cpp). Everything defined below the target pragma gets the wider ISA; the standard
// library and common.h are included above it, so their out-of-line code stays baseline.
#include "cpu/backend.h"

#if FLASHMSA_CPU_HAVE_AVX2

#pragma GCC push_options
#pragma GCC target("avx2,fma")

// 8-float vectors (ymm); six register rows x two vectors = 12 of the 16 ymm registers.
#define FLASHMSA_CPU_VEC 8
#define FLASHMSA_CPU_MR 6

namespace flashmsa {
namespace cpu {
namespace avx2 {
#include "cpu/isa_kernels.h"
#include "cpu/isa_select.h"
#include "cpu/isa_forward.h"
#include "cpu/isa_backward.h"
}  // namespace avx2
}  // namespace cpu
}  // namespace flashmsa

#pragma GCC pop_options

#endif  // FLASHMSA_CPU_HAVE_AVX2
