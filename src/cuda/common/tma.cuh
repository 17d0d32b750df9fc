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

// The driver's cuTensorMapEncodeTiled, looked up once.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    FLASHMSA_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                         cudaEnableDefault, &status));
    if (status != cudaDriverEntryPointSuccess || fn == nullptr)
      throw Error("flashmsa: the CUDA driver does not provide cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A [rows, heads, cols] bf16 tensor (cols contiguous, row stride heads * cols) seen by TMA as a
// 3-d map with a box of 64 columns x 1 head x box_rows rows (a tile of rows of one head), written
// to shared memory with the 128-byte swizzle that wgmma_desc_sw128 describes. Rows past `rows`
// read as zeros.
inline CUtensorMap make_bf16_row_map(const void* base, int64_t rows, int heads, int cols, int box_rows) {
  CUtensorMap map{};
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(cols) * 2,
                                 static_cast<cuuint64_t>(cols) * 2 * heads};
  const cuuint32_t box[3] = {64, 1, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base),
                                          dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error("flashmsa: cuTensorMapEncodeTiled failed with CUresult " + std::to_string(r));
  return map;
}

// The rows of q [T, H, 128] (H a multiple of 8) as a 5-D map {64 columns, 8 heads, 2 slabs, H / 8
// head groups, T} (strides 256, 128, 2048, H * 256 bytes: the slab dimension is the inner one in
// memory but the outer one in the box), box {64, 8, 2, box_groups, 1}. A box lands as [group]
// [slab][8 rows][128 B]: both 64-column halves of 8 heads of a token per group, the [8-row
// group][slab] tile layout (wgmma SBO 2048) of the KV-major forward.
inline CUtensorMap make_bf16_head_group_map(const void* base, int64_t rows, int heads, int box_groups) {
  CUtensorMap map{};
  const cuuint64_t dims[5] = {64, 8, 2, static_cast<cuuint64_t>(heads / 8), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[4] = {256, 128, 8 * 256, static_cast<cuuint64_t>(heads) * 256};
  const cuuint32_t box[5] = {64, 8, 2, static_cast<cuuint32_t>(box_groups), 1};
  const cuuint32_t elem_strides[5] = {1, 1, 1, 1, 1};
  const CUresult r = tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 5, const_cast<void*>(base), dims,
                                          strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error("flashmsa: cuTensorMapEncodeTiled (head groups) failed with CUresult " + std::to_string(r));
  return map;
}

// Loads the box at coordinates (c0 .. c4) of a 5-D map into `dst`, completing its bytes on `bar`.
__device__ __forceinline__ void tma_load_5d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            int c4, uint64_t* bar) {
  const int32_t coords[5] = {c0, c1, c2, c3, c4};
  ::cuda::ptx::cp_async_bulk_tensor(::cuda::ptx::space_cluster, ::cuda::ptx::space_global, dst, map, coords, bar);
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

// Bulk (non-tensor) reduce-add of `bytes` bytes of fp32 from shared memory into global memory
// (cp.reduce.async.bulk, async proxy, one instruction from one thread; each element is added
// atomically, in no fixed order across CTAs). dst, src 16-byte aligned, bytes a multiple of 16.
// The source must not be rewritten before bulk_wait_group_read covers the op, and generic
// st.shared writes of the source must be ordered before it with fence_proxy_async_shared.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src_smem, uint32_t bytes) {
  const uint64_t gaddr = static_cast<uint64_t>(__cvta_generic_to_global(dst));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gaddr),
               "r"(src_smem), "r"(bytes)
               : "memory");
}
// The same for int64 fixed point (.add.u64: two's complement, so signed values add alike);
// integer adds commute, so the result does not depend on the order (deterministic mode).
__device__ __forceinline__ void bulk_reduce_add_u64(long long* dst, uint32_t src_smem, uint32_t bytes) {
  const uint64_t gaddr = static_cast<uint64_t>(__cvta_generic_to_global(dst));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64 [%0], [%1], %2;\n" ::"l"(gaddr),
               "r"(src_smem), "r"(bytes)
               : "memory");
}
// The same for int32 fixed point (.add.s32).
__device__ __forceinline__ void bulk_reduce_add_s32(int32_t* dst, uint32_t src_smem, uint32_t bytes) {
  const uint64_t gaddr = static_cast<uint64_t>(__cvta_generic_to_global(dst));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.s32 [%0], [%1], %2;\n" ::"l"(gaddr),
               "r"(src_smem), "r"(bytes)
               : "memory");
}
// Closes this thread's pending bulk operations into one bulk async-group.
__device__ __forceinline__ void bulk_commit_group() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until at most N of this thread's bulk groups are still READING their shared-memory
// source (their global writes may still be in flight).
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Waits until at most N of this thread's bulk groups are still pending at all.
template <int N>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace flashmsa::cuda
