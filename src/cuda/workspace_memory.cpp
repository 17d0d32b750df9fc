// flashmsa's workspace pools and the caller's allocator hook (include/flashmsa/flashmsa.h).
#include "common/workspace_memory.h"

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "common/check.cuh"

namespace flashmsa {
namespace {

std::mutex g_mutex;
WorkspaceAllocator g_allocator;           // both null: the pools
std::vector<cudaMemPool_t> g_pools;       // per device ordinal, created on first use
int64_t g_outstanding = 0;                // buffers handed out and not yet given back

cudaMemPool_t pool_of(int device) {  // g_mutex held
  if (device < 0) throw Error("flashmsa: workspace_memory_pool: argument 'device_index' is negative");
  if (static_cast<size_t>(device) >= g_pools.size()) g_pools.resize(device + 1, nullptr);
  if (g_pools[device] == nullptr) {
    int count = 0;
    FLASHMSA_CUDA_CHECK(cudaGetDeviceCount(&count));
    if (device >= count)
      throw Error("flashmsa: workspace_memory_pool: argument 'device_index' " + std::to_string(device) +
                  " is not a CUDA device (" + std::to_string(count) + " present)");
    // Creating the pool is not a capturable call: a first call made inside a stream capture (of
    // any mode) would invalidate it. Relaxed mode for this thread makes it legal there.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    FLASHMSA_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    struct RestoreMode {
      cudaStreamCaptureMode mode;
      ~RestoreMode() { cudaThreadExchangeStreamCaptureMode(&mode); }
    } restore{mode};
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t pool = nullptr;
    FLASHMSA_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
    // Keep everything between calls: the next call needs the same buffers again.
    uint64_t keep = UINT64_MAX;
    FLASHMSA_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    g_pools[device] = pool;
  }
  return g_pools[device];
}

}  // namespace

void* workspace_memory_pool(int device_index) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return pool_of(device_index);
}

void set_workspace_allocator(const WorkspaceAllocator& allocator) {
  if ((allocator.allocate == nullptr) != (allocator.deallocate == nullptr))
    throw Error("flashmsa: set_workspace_allocator: argument 'allocator' needs both allocate and deallocate, "
                "or neither");
  std::lock_guard<std::mutex> lock(g_mutex);
  // A buffer must go back to the allocator it came from.
  if (g_outstanding != 0)
    throw Error("flashmsa: set_workspace_allocator: called while a flashmsa call holds workspace "
                "(install the allocator before the first call)");
  g_allocator = allocator;
}

namespace cuda {

void* workspace_allocate(size_t bytes, cudaStream_t stream) {
  int device = 0;
  FLASHMSA_CUDA_CHECK(cudaGetDevice(&device));
  WorkspaceAllocator hook;
  cudaMemPool_t pool = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    hook = g_allocator;
    if (hook.allocate == nullptr) pool = pool_of(device);
    ++g_outstanding;  // before the allocation, so the allocator cannot change under it
  }
  void* ptr = nullptr;
  try {
    if (hook.allocate != nullptr) {
      ptr = hook.allocate(hook.context, bytes, device, stream);
      if (ptr == nullptr)
        throw Error("flashmsa: the installed workspace allocator could not provide " + std::to_string(bytes) +
                    " bytes on device " + std::to_string(device));
      // The kernels' vector loads, TMA and bulk reduce-adds need aligned workspace regions, which
      // are laid out in multiples of 256 bytes from the buffer's start.
      if (reinterpret_cast<uintptr_t>(ptr) % 256 != 0) {
        hook.deallocate(hook.context, ptr, device, stream);
        throw Error("flashmsa: the installed workspace allocator returned memory not aligned to 256 bytes");
      }
    } else {
      FLASHMSA_CUDA_CHECK(cudaMallocFromPoolAsync(&ptr, bytes, pool, stream));
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(g_mutex);
    --g_outstanding;
    throw;
  }
  return ptr;
}

cudaError_t workspace_free(void* ptr, cudaStream_t stream) {
  if (ptr == nullptr) return cudaSuccess;
  WorkspaceAllocator hook;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    hook = g_allocator;
    --g_outstanding;
  }
  if (hook.deallocate == nullptr) return cudaFreeAsync(ptr, stream);
  int device = 0;
  cudaGetDevice(&device);
  hook.deallocate(hook.context, ptr, device, stream);
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace flashmsa
