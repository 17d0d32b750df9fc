// Placeholder until the kernel lands: raises a clear error instead of computing anything.
#include "common/check.cuh"
#include "launchers.h"

namespace flashmsa::cuda {
void launch_fused_backward(const MsaParams&, cudaStream_t) {
  throw Error("flashmsa: launch_fused_backward is not implemented yet");
}
}  // namespace flashmsa::cuda
