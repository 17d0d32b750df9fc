#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>

#include "device_init.h"

namespace flashmsa::app {
namespace {

// SplitMix64: a counter-based generator, so every element is independent of launch shape.
__device__ uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

template <typename T>
__device__ T from_float(float x);
template <> __device__ float from_float<float>(float x) { return x; }
template <> __device__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __half from_float<__half>(float x) { return __float2half_rn(x); }

template <typename T>
__device__ float to_float(T x);
template <> __device__ float to_float<float>(float x) { return x; }
template <> __device__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ float to_float<__half>(__half x) { return __half2float(x); }

template <typename T>
__global__ void add_to_first_channel_kernel(T* x, int64_t rows, int heads, int dim, const int32_t* cu, int B,
                                            int64_t first_tokens, float c) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows * heads;
       r += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = r / heads;
    int lo = 0;  // the sequence of token t: the last b with cu[b] <= t
    for (int hi = B; hi - lo > 1;) {
      const int mid = (lo + hi) / 2;
      if (cu[mid] <= t) lo = mid;
      else hi = mid;
    }
    if (first_tokens < 0 || t - cu[lo] < first_tokens) x[r * dim] = from_float<T>(to_float<T>(x[r * dim]) + c);
  }
}

template <typename T>
__global__ void fill_normal_kernel(T* out, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t r = splitmix64(seed * 0x100000001b3ull + uint64_t(i));
    // Box-Muller on two 32-bit uniforms in (0, 1].
    const float u1 = (float(uint32_t(r >> 32)) + 1.f) * 2.3283064365386963e-10f;
    const float u2 = float(uint32_t(r)) * 2.3283064365386963e-10f;
    out[i] = from_float<T>(sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
  }
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(std::string("flashmsa_run: CUDA error in ") + what + ": " + cudaGetErrorString(e));
}

}  // namespace

void fill_normal_device(void* data, DType dtype, int64_t n, uint64_t seed) {
  if (n == 0) return;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, 65536));
  switch (dtype) {
    case DType::bf16: fill_normal_kernel<<<blocks, threads>>>(static_cast<__nv_bfloat16*>(data), n, seed); break;
    case DType::fp16: fill_normal_kernel<<<blocks, threads>>>(static_cast<__half*>(data), n, seed); break;
    case DType::fp32: fill_normal_kernel<<<blocks, threads>>>(static_cast<float*>(data), n, seed); break;
    default: throw Error("fill_normal_device: unsupported dtype");
  }
  check(cudaGetLastError(), "fill_normal_kernel launch");
  check(cudaDeviceSynchronize(), "fill_normal_kernel");
}

void add_to_first_channel_device(void* data, DType dtype, int64_t rows, int heads, int dim, const int32_t* cu,
                                 int B, int64_t first_tokens, float c) {
  if (rows == 0) return;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((rows * heads + threads - 1) / threads, 65536));
  switch (dtype) {
    case DType::bf16:
      add_to_first_channel_kernel<<<blocks, threads>>>(static_cast<__nv_bfloat16*>(data), rows, heads, dim, cu, B,
                                                       first_tokens, c);
      break;
    case DType::fp16:
      add_to_first_channel_kernel<<<blocks, threads>>>(static_cast<__half*>(data), rows, heads, dim, cu, B,
                                                       first_tokens, c);
      break;
    case DType::fp32:
      add_to_first_channel_kernel<<<blocks, threads>>>(static_cast<float*>(data), rows, heads, dim, cu, B,
                                                       first_tokens, c);
      break;
    default: throw Error("add_to_first_channel_device: unsupported dtype");
  }
  check(cudaGetLastError(), "add_to_first_channel_kernel launch");
  check(cudaDeviceSynchronize(), "add_to_first_channel_kernel");
}

}  // namespace flashmsa::app
