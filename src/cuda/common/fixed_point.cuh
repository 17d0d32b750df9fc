// Deterministic mode's fixed-point accumulation: a value x is added as the int64 (or, where each
// element takes few adds, int32) round(x * F), with F a power of two chosen from a bound on the
// whole sum, so that integer adds (which commute) give the same bits in any order. Shared by the
// fused backward (fused_backward.cu) and the deterministic KV-major forward (forward_kv_wgmma.cu).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace flashmsa::cuda {
namespace {  // internal linkage, as the other kernels in common/ headers (no relocatable device code)

// max |x| over a bf16 tensor, as float bits (non-negative floats order like their bits); a NaN
// counts as +inf, so that a non-finite input always shows in the maximum (fmaxf skips NaNs).
__global__ void absmax_kernel(const __nv_bfloat16* __restrict__ x, int64_t n8,  // n8 = numel / 8
                              unsigned int* __restrict__ out) {
  float m = 0.f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n8;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 w = reinterpret_cast<const uint4*>(x)[i];
    const uint32_t parts[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&parts[j]));
      const float ax = isnan(f.x) ? INFINITY : fabsf(f.x), ay = isnan(f.y) ? INFINITY : fabsf(f.y);
      m = fmaxf(m, fmaxf(ax, ay));
    }
  }
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if ((threadIdx.x & 31) == 0) atomicMax(out, __float_as_uint(m));
}

// Power of two F with bound * F < 2^bits (so a sum of terms bounded in total by `bound` fits an
// int64 with bits = 62, an int32 with bits = 30, with room for each term's rounding). A non-finite
// bound (a non-finite input) gives NaN: the integer sums are then meaningless, and the outputs,
// divided by F, come out NaN, as the fast mode's would instead of finite garbage.
__device__ __forceinline__ float fixed_point_factor(float bound, int bits = 62) {
  if (!isfinite(bound)) return __int_as_float(0x7fc00000);
  if (!(bound > 0.f)) return 1.f;
  int e;
  frexpf(bound, &e);  // bound < 2^e
  return ldexpf(1.f, max(-126, min(127, bits - e)));
}

}  // namespace
}  // namespace flashmsa::cuda
