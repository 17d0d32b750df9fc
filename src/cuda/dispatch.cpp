// The CUDA backend's entry points: select the device, check support, then launch.
#include <cuda_runtime.h>

#include "common/check.cuh"
#include "launchers.h"

namespace flashmsa {

bool cuda_backend_built() { return true; }

namespace cuda {
namespace {

// Makes p's device current for the call and restores the caller's device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    FLASHMSA_CUDA_CHECK(cudaGetDevice(&previous_));
    if (device != previous_) FLASHMSA_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

void select_blocks(const MsaParams& p, void* stream) {
  check_supported(p, "select_blocks");
  DeviceGuard guard(p.device_index);
  if (p.T > 0) launch_select_blocks(p, as_stream(stream));
}

void sparse_attention_forward(const MsaParams& p, void* stream) {
  check_supported(p, "sparse_attention_forward");
  DeviceGuard guard(p.device_index);
  launch_sparse_attention_forward(p, as_stream(stream));
}

void fused_backward(const MsaParams& p, void* stream) {
  check_supported(p, "fused_backward");
  DeviceGuard guard(p.device_index);
  launch_fused_backward(p, as_stream(stream));
}

void dense_warmup_forward(const MsaParams& p, void* stream) {
  check_supported(p, "dense_warmup_forward");
  DeviceGuard guard(p.device_index);
  launch_dense_warmup_forward(p, as_stream(stream));
}

void dense_warmup_backward(const MsaParams& p, void* stream) {
  check_supported(p, "dense_warmup_backward");
  DeviceGuard guard(p.device_index);
  launch_dense_warmup_backward(p, as_stream(stream));
}

void build_selection_index(const MsaParams& p, int32_t* index, void* stream) {
  check_supported(p, "build_selection_index");
  DeviceGuard guard(p.device_index);
  launch_build_selection_index(p, index, as_stream(stream));
}

bool device_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess)
    return false;
  return major == 9;
}

void copy_to_host(void* dst, const void* src, int64_t bytes, int device_index, void* stream) {
  // On the caller's stream: cu_seqlens may have just been written there (a non-blocking stream
  // would not be ordered with a legacy-default-stream cudaMemcpy).
  DeviceGuard guard(device_index);
  FLASHMSA_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost,
                                      as_stream(stream)));
  FLASHMSA_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
}

}  // namespace cuda
}  // namespace flashmsa
