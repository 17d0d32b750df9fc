// Error checking for CUDA runtime calls and kernel launches: failures become flashmsa::Error
// with the call, file and line, never a silent continue.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "flashmsa/flashmsa.h"

namespace flashmsa::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* what, const char* file,
                                          int line) {
  throw Error(std::string("flashmsa: CUDA error '") + cudaGetErrorString(err) + "' in " + what +
              " at " + file + ":" + std::to_string(line));
}

}  // namespace flashmsa::cuda

#define FLASHMSA_CUDA_CHECK(call)                                                       \
  do {                                                                                  \
    cudaError_t err_ = (call);                                                          \
    if (err_ != cudaSuccess) ::flashmsa::cuda::throw_cuda_error(err_, #call, __FILE__, __LINE__); \
  } while (0)

// After every <<<...>>> launch.
#define FLASHMSA_CHECK_LAUNCH() FLASHMSA_CUDA_CHECK(cudaGetLastError())
