// Error checking for CUDA runtime calls and kernel launches: failures become flashmsa::Error
// with the call, file and line, never a silent continue.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <string>

#include "common/workspace_memory.h"
#include "flashmsa/flashmsa.h"

namespace flashmsa::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* what, const char* file,
                                          int line) {
  throw Error(std::string("flashmsa: CUDA error '") + cudaGetErrorString(err) + "' in " + what +
              " at " + file + ":" + std::to_string(line));
}

// A stream-ordered workspace allocation (workspace_memory.h) of `count` T that is freed on its
// stream when the scope ends, also when a later launch throws (the free is then unchecked: an
// error is already in flight).
template <typename T>
class StreamAllocation {
 public:
  StreamAllocation(size_t count, cudaStream_t stream) : stream_(stream) {
    if (count > 0) ptr_ = static_cast<T*>(workspace_allocate(count * sizeof(T), stream));
  }
  ~StreamAllocation() { workspace_free(ptr_, stream_); }
  StreamAllocation(const StreamAllocation&) = delete;
  StreamAllocation& operator=(const StreamAllocation&) = delete;
  T* get() const { return ptr_; }

 private:
  T* ptr_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace flashmsa::cuda

#define FLASHMSA_CUDA_CHECK(call)                                                       \
  do {                                                                                  \
    cudaError_t err_ = (call);                                                          \
    if (err_ != cudaSuccess) ::flashmsa::cuda::throw_cuda_error(err_, #call, __FILE__, __LINE__); \
  } while (0)

// After every <<<...>>> launch.
#define FLASHMSA_CHECK_LAUNCH() FLASHMSA_CUDA_CHECK(cudaGetLastError())

namespace flashmsa::cuda {

// Streaming multiprocessors of `device` (at least 1): persistent grids and wave sizes.
inline int sm_count(int device) {
  int n = 0;
  FLASHMSA_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return n > 1 ? n : 1;
}

// Peak DRAM bandwidth of `device` in bytes per second (memory clock x bus width, double data rate):
// H100 SXM ~3.35e12, H200 ~4.8e12. Tunings whose best point moves with it read this; 0 where the
// driver does not report it (the query's error is cleared, so that no later launch check sees it).
// Queried once per device: the memory clock query is a driver round trip (0.35 ms a call on an H100
// under CUDA 13, bench/results/h100_host_call_probe.log; the backward's default ran 0.56-0.73 ms behind
// the same chunks forced by FLASHMSA_BWD_CHUNKS until it was cached: h100_query_cost_ab.log).
inline double dram_peak_bytes_per_s(int device) {
  static std::mutex mutex;
  static std::map<int, double> known;
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = known.find(device); it != known.end()) return it->second;
  int khz = 0, bits = 0;
  double bytes_per_s = 0.0;
  if (cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess) {
    (void)cudaGetLastError();
  } else {
    bytes_per_s = 2.0 * 1e3 * khz * (bits / 8);
  }
  known.emplace(device, bytes_per_s);
  return bytes_per_s;
}

}  // namespace flashmsa::cuda
