// Host cost of the CUDA runtime queries the library's launch paths make per call, in microseconds
// per call (median of 101 after one warm-up call). Why: the backward's default chunk rule read the
// memory clock on every call, and a default backward ran 0.56-0.73 ms behind the same chunks forced by
// FLASHMSA_BWD_CHUNKS (H100, bench/results/h100_host_call_probe.log). Build and run on the GPU machine:
//   nvcc -O2 -arch=sm_90a -o /tmp/host_call_probe apps/host_call_probe.cu && /tmp/host_call_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

__global__ void probe_kernel(float* x) {
  extern __shared__ float s[];
  s[threadIdx.x] = x[threadIdx.x];
  x[threadIdx.x] = s[threadIdx.x ^ 1];
}

static void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

template <typename F>
static double median_us(F&& call) {
  call();
  std::vector<double> t;
  for (int i = 0; i < 101; ++i) {
    const auto a = std::chrono::steady_clock::now();
    call();
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count());
  }
  std::nth_element(t.begin(), t.begin() + 50, t.end());
  return t[50];
}

int main() {
  int device = 0, v = 0;
  check(cudaSetDevice(device), "cudaSetDevice");
  check(cudaFree(nullptr), "context");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  std::printf("device: %s\n", prop.name);
  struct Attr {
    cudaDeviceAttr a;
    const char* name;
  } attrs[] = {{cudaDevAttrMemoryClockRate, "MemoryClockRate"},
               {cudaDevAttrGlobalMemoryBusWidth, "GlobalMemoryBusWidth"},
               {cudaDevAttrMultiProcessorCount, "MultiProcessorCount"},
               {cudaDevAttrComputeCapabilityMajor, "ComputeCapabilityMajor"},
               {cudaDevAttrClockRate, "ClockRate"}};
  for (const Attr& at : attrs) {
    const double us = median_us([&] { check(cudaDeviceGetAttribute(&v, at.a, device), at.name); });
    std::printf("cudaDeviceGetAttribute(%s) = %d: %.2f us\n", at.name, v, us);
  }
  std::printf("cudaGetDevice: %.2f us\n", median_us([&] { check(cudaGetDevice(&v), "cudaGetDevice"); }));
  std::printf("cudaFuncSetAttribute(MaxDynamicSharedMemorySize): %.2f us\n", median_us([&] {
                check(cudaFuncSetAttribute(probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024),
                      "cudaFuncSetAttribute");
              }));
  std::printf("cudaOccupancyMaxActiveBlocksPerMultiprocessor: %.2f us\n", median_us([&] {
                check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, probe_kernel, 128, 100 * 1024),
                      "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
              }));
  std::printf("cudaGetDeviceProperties: %.2f us\n",
              median_us([&] { check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties"); }));
  return 0;
}
