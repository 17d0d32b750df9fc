// Stream-ordered device workspace: flashmsa's per-device pool that keeps its memory between calls,
// or the allocator the caller installed (set_workspace_allocator). Every temporary device buffer
// of the CUDA backend goes through these two functions.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace flashmsa::cuda {

// `bytes` (> 0) of device memory on the current device, usable in the order of `stream`; throws
// Error when none can be had.
void* workspace_allocate(size_t bytes, cudaStream_t stream);

// Gives `ptr` back once its last use is enqueued on `stream`. Returns the pool's cudaFreeAsync
// status (cudaSuccess with a caller's allocator), for the caller to check or, on an error path
// or in a destructor, to drop.
cudaError_t workspace_free(void* ptr, cudaStream_t stream);

}  // namespace flashmsa::cuda
