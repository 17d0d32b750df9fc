// Dense warm-up mode on the GPU (msa.md "Dense warm-up mode"): dense causal main attention and
// the proxy's KL over all causal keys. Route: build on the device the "all visible blocks"
// selection (row (p, t) = 0, 1, ..., t's own block, then -1; K = blocks of the longest
// sequence) and run the sparse forward / fused backward over it. Every causal key is then in
// J, so the sparse path computes exactly the dense definitions, with no new kernels and no
// T x T buffer. Cost: the index is Hp*T*K int32 (T^2/128 per proxy head), and the KV-major
// backward sorts Hp*T*K entries; fine for warm-up lengths, quadratic like the mode itself.
// Exception: the forward at D = Dv = 128 runs the dense causal kernel of dense_forward.cu
// instead (no index), and its KL value, on the wgmma shapes, the KV-major KL pass (kl_value.cuh).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "common/check.cuh"
#include "common/metadata.cuh"
#include "kl_value.cuh"
#include "launchers.h"

namespace flashmsa::cuda {
namespace {

constexpr int kBlk = 128;

__global__ void all_blocks_kernel(const int32_t* __restrict__ cu, int B, int64_t T, int K, int64_t n,
                                  int32_t* __restrict__ block_idx) {  // [Hp, T, K]
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int slot = static_cast<int>(i % K);
    const int64_t t = (i / K) % T;
    const int b = find_sequence(cu, B, t);
    const int nloc = static_cast<int>((t - cu[b]) / kBlk);
    block_idx[i] = slot <= nloc ? slot : -1;
  }
}

// Runs `body(dense_params)` with a device-built all-visible-blocks selection.
template <typename Body>
void with_dense_selection(const MsaParams& p, cudaStream_t stream, Body body) {
  const int K = std::max(1, (p.max_seqlen + kBlk - 1) / kBlk);
  const int64_t n = static_cast<int64_t>(p.Hp) * p.T * K;
  if (n >= INT32_MAX)
    throw Error("flashmsa: dense warm-up: Hp*T*ceil(max_seqlen/128) >= 2^31 (argument 'q' too long)");
  MsaParams dense = p;
  dense.top_k = K;
  dense.local_blocks = K;
  dense.all_blocks = true;
  dense.selection_index = nullptr;  // a caller's index would be of another selection
  const StreamAllocation<int32_t> idx(n, stream);
  const int grid = static_cast<int>(std::min<int64_t>(65536, (n + 255) / 256));
  all_blocks_kernel<<<grid, 256, 0, stream>>>(p.cu_seqlens, p.B, p.T, K, n, idx.get());
  FLASHMSA_CHECK_LAUNCH();
  dense.block_idx = idx.get();
  body(dense);
}

}  // namespace

void launch_dense_warmup_forward(const MsaParams& p, cudaStream_t stream) {
  if (p.T == 0) {
    if (p.kl) FLASHMSA_CUDA_CHECK(cudaMemsetAsync(p.kl, 0, sizeof(float), stream));
    return;
  }
  // The main attention is plain dense causal attention: the dedicated kernel needs no index.
  // The KL value, where the wgmma backward's shapes hold, is then the KV-major KL_ONLY pass over
  // the all-blocks index (the index and its sort are the backward's, so no new memory peak).
  // Other head dims go through the all-blocks sparse forward.
  if (p.D == 128 && p.Dv == 128 && (p.kl == nullptr || wgmma_kv_applies(p))) {
    MsaParams main = p;
    main.kl = nullptr;
    launch_dense_attention_forward(main, stream);
    if (p.kl) with_dense_selection(p, stream, [&](const MsaParams& dense) { launch_kl_value(dense, stream); });
    return;
  }
  with_dense_selection(p, stream, [&](const MsaParams& dense) { launch_sparse_attention_forward(dense, stream); });
}

void launch_dense_warmup_backward(const MsaParams& p, cudaStream_t stream) {
  if (p.T == 0) {
    if (p.kl) FLASHMSA_CUDA_CHECK(cudaMemsetAsync(p.kl, 0, sizeof(float), stream));
    return;
  }
  with_dense_selection(p, stream, [&](const MsaParams& dense) { launch_fused_backward(dense, stream); });
}

}  // namespace flashmsa::cuda
