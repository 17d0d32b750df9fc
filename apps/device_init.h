// Fills device tensors with N(0,1) values directly on the GPU, so large benchmark inputs do not
// cost minutes of host random-number generation and transfer.
#pragma once

#include <cstdint>

#include "flashmsa/flashmsa.h"

namespace flashmsa::app {

// Writes n normal(0,1) values of `dtype` (bf16, fp16 or fp32) at device pointer `data`;
// deterministic in (seed, index). Synchronous; throws flashmsa::Error on a CUDA failure.
void fill_normal_device(void* data, DType dtype, int64_t n, uint64_t seed);

}  // namespace flashmsa::app
