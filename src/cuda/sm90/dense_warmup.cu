// Placeholder until the kernels land: raises a clear error instead of computing anything.
#include "common/check.cuh"
#include "launchers.h"

namespace flashmsa::cuda {
void launch_dense_warmup_forward(const MsaParams&, cudaStream_t) {
  throw Error("flashmsa: launch_dense_warmup_forward is not implemented yet");
}
void launch_dense_warmup_backward(const MsaParams&, cudaStream_t) {
  throw Error("flashmsa: launch_dense_warmup_backward is not implemented yet");
}
}  // namespace flashmsa::cuda
