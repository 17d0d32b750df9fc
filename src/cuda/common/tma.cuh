// Tensor Memory Accelerator (TMA) loads and mbarrier waits (sm_90). The device side uses CCCL's
// cuda::ptx; the host side encodes tensor maps through the driver entry point that the runtime
// hands out, so the library does not link libcuda.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <cuda/ptx>

#include "common/check.cuh"

namespace flashmsa::cuda {

// A [rows, heads, cols] bf16 tensor (cols contiguous, row stride heads * cols) seen by TMA as a
// 3-d map with a box of 64 columns x 1 head x box_rows rows, written to shared memory with the
// 128-byte swizzle that wgmma_desc_sw128 describes. Rows past `rows` read as zeros.
inline CUtensorMap make_bf16_row_map(const void* base, int64_t rows, int heads, int cols,
                                     int box_rows) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    FLASHMSA_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                         cudaEnableDefault, &status));
    if (status != cudaDriverEntryPointSuccess || fn == nullptr)
      throw Error("flashmsa: the CUDA driver does not provide cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  CUtensorMap map{};
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(cols) * 2,
                                 static_cast<cuuint64_t>(cols) * 2 * heads};
  const cuuint32_t box[3] = {64, 1, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base),
                            dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error("flashmsa: cuTensorMapEncodeTiled failed with CUresult " + std::to_string(r));
  return map;
}

// Loads the box at (col, head, row) into `dst`, completing `bytes` on the mbarrier `bar`.
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, int col, int head,
                                            int row, uint64_t* bar) {
  const int32_t coords[3] = {col, head, row};
  ::cuda::ptx::cp_async_bulk_tensor(::cuda::ptx::space_cluster, ::cuda::ptx::space_global, dst,
                                    map, coords, bar);
}

__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  while (!::cuda::ptx::mbarrier_try_wait_parity(bar, parity)) {
  }
}

}  // namespace flashmsa::cuda
