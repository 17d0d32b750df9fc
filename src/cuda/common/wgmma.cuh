// Thin wrappers for Hopper warpgroup MMA (wgmma, sm_90a): shared-memory matrix descriptors for
// the 128-byte-swizzled K-major layout that TMA writes, and m64n128k16 bf16 -> fp32 with both
// operands in shared memory.
//
// Layout (both operands K-major, bf16): a tile of R rows x 64 elements (128 bytes per row) is
// stored row after row; inside each 1024-byte atom of 8 rows, 16-byte chunk c of row r sits at
// chunk position c ^ (r % 8). Wider rows are split into 64-element column slabs of R x 128 bytes
// each. Tile bases must be 1024-byte aligned.
//
// Accumulator layout of m64nNk16 (thread t of the warpgroup, w = t / 32, g = (t % 32) / 4,
// c = t % 4): d[4j + 0..1] = row 16w + g, columns 8j + 2c + 0..1; d[4j + 2..3] = row 16w + g + 8,
// same columns -- the mma.sync m16n8 C layout repeated over N / 8 column chunks.
#pragma once

#include <cstdint>

namespace flashmsa::cuda {

// Descriptor of a 128B-swizzled K-major tile starting at shared address `addr` (byte offset
// inside a 128-byte row selects the K step: +32 bytes per 16 bf16). Stride between 8-row atoms
// is 1024 bytes; the leading offset is unused for this layout.
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t addr) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>(1) << 16;            // leading byte offset (ignored), 16 B units
  d |= static_cast<uint64_t>(1024 >> 4) << 32;    // stride byte offset, 16 B units
  d |= static_cast<uint64_t>(1) << 62;            // layout: 128-byte swizzle
  return d;
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across the asynchronous MMA.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (64 x 128 fp32 per warpgroup) = (accumulate ? d : 0) + A (64 x 16) * B (128 x 16)^T.
__device__ __forceinline__ void wgmma_m64n128k16_bf16(float (&d)[64], uint64_t desc_a,
                                                      uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),
        "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
        "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]),
        "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

}  // namespace flashmsa::cuda
