// KV-major block-sparse forward on warpgroup MMA with a fixed softmax reference per row (o and
// lse only; no KL). See forward_kv_wgmma.cu for the design and the overflow rule.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "params.h"

namespace flashmsa::cuda {

// True only where launch_kv_wgmma_forward takes the problem: D = Dv = 128, bf16, block 128,
// m = H/Hp in {4, 8, 16} with each group inside one kv head (deterministic mode: 8 or 16, its
// two-pass fixed-point form, unless FLASHMSA_DET_FWD=query), top_k <= 32, T > 0, Hp*T*K < 2^31 and its
// workspace <= max(T*H*D bytes (half the size of q) less the redo flags below, 64 MiB).
bool kv_wgmma_forward_applies(const MsaParams& p);

// int32s the caller allocates beside this path's workspace for the redo of flagged tokens: [T]
// overflow flags, [T] list of the flagged tokens, their count (the memory goal counts them).
inline int64_t redo_flag_ints(int64_t T) { return 2 * T + 1; }

// Writes o [T, H, Dv] and lse [H, T] of every token and overflow[t] (int32, [T]): 1 where a row
// of token t overflowed the fixed reference or summed to (almost) nothing (its o and lse must then
// be recomputed by the caller), else 0; every element is written. Workspace is allocated and
// freed on `stream` (workspace_memory.h); no host synchronisation. kv_wgmma_forward_applies(p)
// must hold (the caller's routing checks it: planning the workspace twice more per call would only
// repeat that check).
void launch_kv_wgmma_forward(const MsaParams& p, int32_t* overflow, cudaStream_t stream);

}  // namespace flashmsa::cuda
