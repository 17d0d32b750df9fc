// The forward's KL value computed KV-major by the wgmma backward's machinery (fused_backward.cu,
// backward_wgmma.cuh with KL_ONLY): for the shapes the wgmma backward takes, the query-major
// forward skips its own KL pass (which re-streams K and kp per token and group) and this runs
// after it, reading the lse the forward wrote.
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace flashmsa::cuda {

// The shapes of the wgmma kernels (D = Dv = Dp = 128, proxy groups of m = H/Hp >= 2 heads, each
// kv head holding G = Hp/Hkv >= 1 whole groups: (H/Hkv) % m == 0), unless
// FLASHMSA_BACKWARD_PATH=mma asks for the old kernels. The backward adds its own condition
// (deterministic mode only with top_k <= 32); the KL value has no atomics and needs none.
bool wgmma_kv_applies(const MsaParams& p);

// wgmma_kv_applies, T > 0, K <= 32 (the dense warm-up's all-blocks index would make the inverted
// index too large) and launch_kl_value's workspace <= size(q) / 2 (Hp*T*K < 2^31 is already
// check_supported's). Launches nothing.
bool kl_value_applies(const MsaParams& p);

// FLASHMSA_BACKWARD_PATH=wgmma: the backward and the forward's KL value must take the wgmma kernels
// (an error where they do not; tests). Read per call.
bool backward_path_requires_wgmma();

// kl_loss into p.kl from q, k, qp, kp, block_idx and the forward's lse; p.T > 0 and
// wgmma_kv_applies(p) must hold (the sparse forward also asks kl_value_applies; the dense
// warm-up takes the larger workspace of its all-blocks index, as its backward does). Workspace allocated and freed on `stream`.
void launch_kl_value(const MsaParams& p, cudaStream_t stream);

}  // namespace flashmsa::cuda
