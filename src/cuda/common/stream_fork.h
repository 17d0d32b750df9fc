// Fork / join of a caller's stream onto this thread's helper streams (host code), so that
// independent launches of one call can run side by side, also under a CUDA graph capture.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "common/check.cuh"

namespace flashmsa::cuda {

// Helper stream i (0 <= i < kMaxHelperStreams) of `device` for the calling host thread.
constexpr int kMaxHelperStreams = 4;
cudaStream_t helper_stream(int device, int i);

// Whether a call on `stream` may fork onto helpers 0 .. n - 1 (none is in another capture).
bool helpers_usable(cudaStream_t stream, int device, int n);

// How many of `want` lanes (one helper each) a call on `stream` may use: `want`, or 1 (the caller's
// stream alone) where a helper is taken by another capture.
inline int usable_lanes(cudaStream_t stream, int device, int want) {
  return want <= 1 || helpers_usable(stream, device, want) ? want : 1;
}

// Fork of the caller's stream into n helper streams and the join back (event record + stream
// wait only). Every event is created up front, so the error paths (the constructor's catch, the
// destructor) only record and wait: no helper is ever left unjoined while the caller goes on to
// free the workspace. Events are destroyed once their wait is enqueued (the runtime keeps a
// recorded event's resources until it completes).
class StreamFork {
 public:
  // n = 0: no helpers, nothing recorded (the caller's stream does all the work).
  StreamFork(cudaStream_t caller, int device, int n) : caller_(caller) {
    if (n <= 0) return;
    cudaEvent_t fork = nullptr;
    FLASHMSA_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    try {
      for (int i = 0; i < n; ++i) {
        cudaEvent_t ev = nullptr;
        FLASHMSA_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
        joins_.push_back(ev);
      }
      FLASHMSA_CUDA_CHECK(cudaEventRecord(fork, caller));
      for (int i = 0; i < n; ++i) {
        cudaStream_t st = helper_stream(device, i);
        FLASHMSA_CUDA_CHECK(cudaStreamWaitEvent(st, fork, 0));
        helpers_.push_back(st);
      }
    } catch (...) {
      cudaEventDestroy(fork);
      release();
      throw;
    }
    cudaEventDestroy(fork);
  }
  StreamFork(const StreamFork&) = delete;
  StreamFork& operator=(const StreamFork&) = delete;
  ~StreamFork() { release(); }
  cudaStream_t operator[](int i) const { return helpers_[static_cast<size_t>(i)]; }
  // The caller's stream waits for every helper; throws on a CUDA error (the destructor then
  // joins the helpers not yet joined).
  void join() {
    while (!helpers_.empty()) {
      const size_t i = helpers_.size() - 1;
      FLASHMSA_CUDA_CHECK(cudaEventRecord(joins_[i], helpers_[i]));
      FLASHMSA_CUDA_CHECK(cudaStreamWaitEvent(caller_, joins_[i], 0));
      helpers_.pop_back();
    }
  }

 private:
  // Joins what is still forked (unchecked: an error is already in flight) and frees the events.
  void release() noexcept {
    while (!helpers_.empty()) {
      const size_t i = helpers_.size() - 1;
      if (cudaEventRecord(joins_[i], helpers_[i]) == cudaSuccess) cudaStreamWaitEvent(caller_, joins_[i], 0);
      helpers_.pop_back();
    }
    for (cudaEvent_t ev : joins_) cudaEventDestroy(ev);
    joins_.clear();
  }

  cudaStream_t caller_;
  std::vector<cudaStream_t> helpers_;
  std::vector<cudaEvent_t> joins_;  // joins_[i] for helpers_[i]
};

}  // namespace flashmsa::cuda
