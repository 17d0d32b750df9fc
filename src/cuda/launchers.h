// Internal: the kernel launchers behind the CUDA backend. Each is defined in its own .cu file
// under sm90/ so compiles stay parallel and small. All are asynchronous on `stream`, check
// their launches, and raise flashmsa::Error for shapes or dtypes they do not support before
// launching anything. cuda::check_supported (params.h, support.cpp) runs before each of them.
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace flashmsa::cuda {

void launch_select_blocks(const MsaParams& p, cudaStream_t stream);              // sm90/select_blocks.cu
void launch_sparse_attention_forward(const MsaParams& p, cudaStream_t stream);   // sm90/sparse_forward.cu
void launch_fused_backward(const MsaParams& p, cudaStream_t stream);             // sm90/fused_backward.cu
void launch_dense_warmup_forward(const MsaParams& p, cudaStream_t stream);       // sm90/dense_warmup.cu
void launch_dense_warmup_backward(const MsaParams& p, cudaStream_t stream);      // sm90/dense_warmup.cu
void launch_build_selection_index(const MsaParams& p, int32_t* index, cudaStream_t stream);  // sm90/selection_index.cu
// Dense causal attention forward (o, lse; no KL, no index), D = Dv = 128 only.
void launch_dense_attention_forward(const MsaParams& p, cudaStream_t stream);    // sm90/dense_forward.cu

}  // namespace flashmsa::cuda
