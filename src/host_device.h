// Internal: FLASHMSA_HOST_DEVICE marks the CUDA-free helpers (src/*.h) that the kernels call too.
#pragma once

#if defined(__CUDACC__)
#define FLASHMSA_HOST_DEVICE __host__ __device__
#else
#define FLASHMSA_HOST_DEVICE
#endif
