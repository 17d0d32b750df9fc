// dq of the fused backward without atomics, for the deterministic mode with top_k <= 32 (see
// backward_dq.cu).
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace flashmsa::cuda {

struct HeadItems;  // sm90/query_major.cuh

// Writes p.dq (bf16, every element, once) from q, k, v, dO, lse and di = rowsum(dO * O) [T, H].
// items = make_items(p, ...). Needs p.T > 0, p.top_k <= 32, D = Dv in {64, 128}.
void launch_backward_dq(const MsaParams& p, const HeadItems& items, const float* di, cudaStream_t stream);

}  // namespace flashmsa::cuda
