// This thread's helper streams and the rule for forking onto them (common/stream_fork.h).
#include "common/stream_fork.h"

#include <vector>

namespace flashmsa::cuda {

// Helper stream i of `device` for the calling host thread: created on first use (non-blocking, so
// the legacy default stream does not serialise against it; in relaxed capture mode, so that a first
// use inside a capture is legal), cached per thread and never destroyed: up to kMaxHelperStreams per
// device for each host thread that calls flashmsa (a program that keeps starting new threads keeps
// adding them; destroying them at thread exit could cut a capture another thread still holds).
// Per thread because a capture that forks onto them keeps them until it ends: another thread's
// work on them would be captured too.
cudaStream_t helper_stream(int device, int i) {
  thread_local std::vector<std::vector<cudaStream_t>> cache;
  if (static_cast<int>(cache.size()) <= device) cache.resize(static_cast<size_t>(device) + 1);
  std::vector<cudaStream_t>& mine = cache[static_cast<size_t>(device)];
  while (static_cast<int>(mine.size()) <= i) {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    FLASHMSA_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    cudaStream_t st = nullptr;
    const cudaError_t err = cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    cudaThreadExchangeStreamCaptureMode(&mode);
    FLASHMSA_CUDA_CHECK(err);
    mine.push_back(st);
  }
  return mine[static_cast<size_t>(i)];
}

// Helpers join a capture of `stream` and stay in it until that capture ends, so they can be forked
// when they are in no capture (they then join the caller's, if it captures) or already in the
// caller's; not when one is in another capture (this thread captures a different stream while making
// this call eagerly).
bool helpers_usable(cudaStream_t stream, int device, int n) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  unsigned long long cid = 0;
  FLASHMSA_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &cs, &cid));
  if (cs == cudaStreamCaptureStatusInvalidated) return false;
  for (int i = 0; i < n; ++i) {
    cudaStreamCaptureStatus hs = cudaStreamCaptureStatusNone;
    unsigned long long hid = 0;
    FLASHMSA_CUDA_CHECK(cudaStreamGetCaptureInfo(helper_stream(device, i), &hs, &hid));
    if (hs == cudaStreamCaptureStatusInvalidated) return false;
    if (hs == cudaStreamCaptureStatusActive && (cs != cudaStreamCaptureStatusActive || hid != cid)) return false;
  }
  return true;
}

}  // namespace flashmsa::cuda
