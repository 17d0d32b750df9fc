// KV-major block-sparse forward (o, lse and the KL value) for the shapes where one proxy group is
// m = 2, 4, 8 or 16 main heads on one kv head, D = 128. See forward_kv.cu for the design.
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace flashmsa::cuda {

// True when launch_kv_forward takes this problem (shape, head dims, non-deterministic mode).
bool kv_forward_applies(const MsaParams& p);

// o, lse and (when p.kl) kl_loss; p.T > 0 and kv_forward_applies(p) must hold.
void launch_kv_forward(const MsaParams& p, cudaStream_t stream);

}  // namespace flashmsa::cuda
