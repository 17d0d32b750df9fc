// Fills device tensors with N(0,1) values directly on the GPU, so large benchmark inputs do not
// cost minutes of host random-number generation and transfer.
#pragma once

#include <cstdint>

#include "flashmsa/flashmsa.h"

namespace flashmsa::app {

// Writes n normal(0,1) values of `dtype` (bf16, fp16 or fp32) at device pointer `data`;
// deterministic in (seed, index). Synchronous; throws flashmsa::Error on a CUDA failure.
void fill_normal_device(void* data, DType dtype, int64_t n, uint64_t seed);

// Adds c to channel 0 of the rows of x [rows, heads, dim] at device pointer `data` whose token lies
// in the first `first_tokens` positions of its sequence (cu: the device's cu_seqlens [B + 1]), or of
// every row when first_tokens < 0. Synchronous; throws flashmsa::Error on a CUDA failure.
void add_to_first_channel_device(void* data, DType dtype, int64_t rows, int heads, int dim, const int32_t* cu,
                                 int B, int64_t first_tokens, float c);

}  // namespace flashmsa::app
