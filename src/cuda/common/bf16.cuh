// bf16 helpers shared by the sm90 kernels. Conversions round to nearest even (the cuda_bf16
// intrinsics do), which is the project's rounding rule.
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

namespace flashmsa::cuda {

// Two floats -> one register of two bf16 (lo in the low half), as mma fragments expect.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ float bf16_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

}  // namespace flashmsa::cuda
