// One CTA sums an fp32 array in a fixed order (thread-strided partial sums, then a tree), so the
// result is bitwise the same every run: the KL value's final reductions (query-major KL rows in
// sparse_forward.cu, per-block shares in fused_backward.cu).
#pragma once

#include <cstdint>

namespace flashmsa::cuda {
namespace {  // internal linkage, as the other kernels in common/ headers (no relocatable device code)

// out[0] = mul * (sum of part[0, n)) / div; launch <<<1, kThreads>>>.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    fixed_order_sum_kernel(const float* __restrict__ part,  // [n]
                           int64_t n, float mul, float div,
                           float* __restrict__ out) {       // [1]
  __shared__ float red[kThreads];
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) s += part[i];
  red[threadIdx.x] = s;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[0] = mul * red[0] / div;
}

}  // namespace
}  // namespace flashmsa::cuda
