// The CPU compute for the baseline instruction set (SSE2 on x86-64): the portable fallback.
#include "cpu/backend.h"

// 4-float vectors (xmm); two register rows x four vectors = 8 of the 16 xmm registers.
#define FLASHMSA_CPU_VEC 4
#define FLASHMSA_CPU_MR 2

namespace flashmsa {
namespace cpu {
namespace generic {
#include "cpu/isa_kernels.h"
#include "cpu/isa_select.h"
#include "cpu/isa_forward.h"
#include "cpu/isa_backward.h"
}  // namespace generic
}  // namespace cpu
}  // namespace flashmsa
