// Thin wrappers for Hopper warpgroup MMA (wgmma, sm_90a): shared-memory matrix descriptors for
// the 128-byte-swizzled layout that TMA writes (operands K-major or MN-major), m64nNk16
// bf16 -> fp32 with A from shared memory (SS) or registers (RS), and the few other PTX pieces a
// warp-specialised FlashAttention-3 style kernel needs (named barriers, setmaxnreg, proxy fence).
//
// Tile layout (every operand, bf16): a tile of R rows x C columns (C a multiple of 64) is split
// into 64-column slabs; slab s (columns 64s..64s+63) is R x 128 bytes at byte offset s*R*128.
// Inside a slab, row r occupies bytes r*128..r*128+127 and its 16-byte chunk c (columns
// 64s+8c..64s+8c+7) sits at chunk position c ^ (r % 8). Tile bases are 1024-byte aligned (R is a
// multiple of 8, so every slab and every 8-row group is too). This is what a TMA box of 64
// columns with CU_TENSOR_MAP_SWIZZLE_128B writes, and it is one 8-row x 128-byte swizzle atom
// after another, read two ways:
//   K-major  (imm-trans 0): tile rows are M (or N), columns are K -> wgmma_desc_sw128.
//   MN-major (imm-trans 1): tile rows are K, columns are M (or N) -> wgmma_desc_sw128_mn.
//
// Accumulator layout of m64nNk16 (thread t of the warpgroup, w = t / 32, g = (t % 32) / 4,
// c = t % 4): d[4j + 0..1] = row 16w + g, columns 8j + 2c + 0..1; d[4j + 2..3] = row 16w + g + 8,
// same columns -- the mma.sync m16n8 C layout repeated over N / 8 column chunks.
// The register A operand of m64nNk16 (64 x 16, four bf16x2 registers a0a1, a2a3, a4a5, a6a7,
// low half = lower index) has the same layout as the accumulator of an m64n16 tile: a0,a1 =
// row 16w+g, columns 2c, 2c+1; a2,a3 = row +8; a4..a7 = the same at columns +8 (PTX ISA
// "Register Fragments", Figure "WGMMA .m64nNk16 register fragment layout for matrix A"; CUTLASS
// uses ALayout_64x16 = CLayout_64x16). So k-step kk of an RS product reads accumulator
// elements 8kk..8kk+7 of a preceding m64nN product: acc_to_a_frag.
#pragma once

#include <cstdint>

namespace flashmsa::cuda {

// Byte offset of element (row, col) in a tile of `rows` rows laid out as above.
__host__ __device__ __forceinline__ uint32_t sw128_offset(int row, int col, int rows) {
  const uint32_t chunk = static_cast<uint32_t>(((col & 63) >> 3) ^ (row & 7));
  return static_cast<uint32_t>(col >> 6) * static_cast<uint32_t>(rows) * 128u +
         static_cast<uint32_t>(row) * 128u + chunk * 16u + static_cast<uint32_t>(col & 7) * 2u;
}

// Matrix descriptor (PTX ISA, wgmma "Matrix Descriptor Format"), 64 bits:
//   bits  0-13  start address  >> 4 (shared-window address of the first 16-byte chunk)
//   bits 16-29  leading dimension byte offset (LBO) >> 4
//   bits 32-45  stride dimension byte offset (SBO) >> 4
//   bits 49-51  base offset: 0 because every swizzle pattern we use starts on a 1024-byte
//               boundary (the tile base is 1024-aligned, and the start addresses below only
//               move by whole 1024-byte groups or inside a 128-byte row)
//   bits 62-63  swizzle mode, 1 = 128-byte swizzle
// The swizzle (XOR of address bits 4-6 with bits 7-9) is a function of the final address, so a
// start address inside an atom (the K-major +32-byte K-step) keeps the
// pattern as long as its origin stays 1024-aligned.

// K-major 128B-swizzled operand: tile rows are M (A) or N (B), columns are K. For k-step ks
// (16 columns), addr = tile + (ks / 4) * R * 128 + (ks % 4) * 32 (+ r0 * 128 for a sub-block of
// rows starting at a multiple of 8). The 16 K elements of a row lie inside one 128-byte row, so
// the leading offset is unused (the ISA says "assumed 1"); SBO = 1024 bytes is the distance
// between consecutive 8-row groups along M/N (larger when the groups of the two 64-column slabs
// are interleaved: [group][slab][8 rows], sbo = 2048).
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t addr, uint32_t sbo = 1024) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>(1) << 16;            // leading byte offset (ignored), 16 B units
  d |= static_cast<uint64_t>(sbo >> 4) << 32;     // stride byte offset, 16 B units
  d |= static_cast<uint64_t>(1) << 62;            // layout: 128-byte swizzle
  return d;
}

// The descriptor of addr + bytes from that of addr (bytes a multiple of 16): the start address
// field is bits 0-13 and a shared address below 2^18 cannot carry out of it, so only the low
// word changes (one integer add instead of rebuilding the descriptor per k-step).
__device__ __forceinline__ uint64_t wgmma_desc_advance(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}

// MN-major 128B-swizzled operand: tile rows are K, columns are M (A) or N (B). addr = address of
// row k0 of the first 64-column slab used (tile + k0 * 128 [+ s * slab_bytes]); for k-step ks,
// k0 = 16 ks. slab_bytes = R * 128, the distance between 64-column slabs.
// The ISA's canonical MN-major SW128 layout ("Canonical Layouts", T = 8 bf16 per 16 bytes) is
//   Swizzle<3,4,3> o ((T, 8, m), (8, k)) : ((1, T, LBO), (8T, SBO))   [(M/N), (K)]
// i.e. 64 contiguous M/N elements per 128-byte row, 8 K rows 128 bytes apart (one 1024-byte
// atom), then LBO = step to the next 64 M/N elements and SBO = step to the next 8 K rows
// ("Leading Dimension Byte Offset", MN-major swizzled: offset between repeats of
// swizzle-bytes/16 = 8 16-byte elements along M/N; "Stride Dimension Byte Offset", MN-major
// swizzled: offset from the first 8 K columns to the next 8). In our tile the next 64 M/N
// elements are the next slab (LBO = slab_bytes; used only when N = 128 spans two slabs) and the
// next 8 K rows are 1024 bytes further (SBO = 1024). Both fit the 14-bit fields up to R = 2047.
// Tiles whose slabs' 8-row groups are interleaved ([group][slab][8 rows]) pass LBO = 1024 and
// sbo = 2048.
__device__ __forceinline__ uint64_t wgmma_desc_sw128_mn(uint32_t addr, uint32_t slab_bytes, uint32_t sbo = 1024) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((slab_bytes & 0x3FFFF) >> 4) << 16;  // LBO: next 64 M/N columns
  d |= static_cast<uint64_t>(sbo >> 4) << 32;                     // SBO: next 8 K rows
  d |= static_cast<uint64_t>(1) << 62;                            // layout: 128-byte swizzle
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
// Same for register A fragments: reading them is asynchronous too, so they must stay live (and
// unmodified) until the wgmma_wait that covers the MMA; fence them after that wait.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// Orders this thread's generic-proxy shared-memory writes (st.shared, non-bulk cp.async) before
// later async-proxy reads (wgmma, TMA store) of the same bytes; issue it before the barrier that
// hands the tile to the MMA warps.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Named barriers (id 0 is __syncthreads'); nthreads is a multiple of 32 and the same for every
// participant.
__device__ __forceinline__ void bar_sync(int id, int nthreads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(nthreads) : "memory");
}

// Per-thread register budget of the calling warpgroup (warp-specialised kernels: producers give
// registers back, MMA warpgroups take them). R in [24, 256], a multiple of 8.
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(R >= 24 && R <= 256 && R % 8 == 0, "setmaxnreg: 24..256, multiple of 8");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(R >= 24 && R <= 256 && R % 8 == 0, "setmaxnreg: 24..256, multiple of 8");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}

// Operand lists of the m64nN accumulators (N / 2 fp32 registers per thread).
#define FLASHMSA_WG_D8(b)                                                                   \
  "+f"(d[(b) + 0]), "+f"(d[(b) + 1]), "+f"(d[(b) + 2]), "+f"(d[(b) + 3]), "+f"(d[(b) + 4]), \
      "+f"(d[(b) + 5]), "+f"(d[(b) + 6]), "+f"(d[(b) + 7])
#define FLASHMSA_WG_D32 FLASHMSA_WG_D8(0), FLASHMSA_WG_D8(8), FLASHMSA_WG_D8(16), FLASHMSA_WG_D8(24)
#define FLASHMSA_WG_D64 \
  FLASHMSA_WG_D32, FLASHMSA_WG_D8(32), FLASHMSA_WG_D8(40), FLASHMSA_WG_D8(48), FLASHMSA_WG_D8(56)
#define FLASHMSA_WG_R32                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
#define FLASHMSA_WG_R64                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
  "%56, %57, %58, %59, %60, %61, %62, %63}, "

// d (64 x N fp32 per warpgroup) = (accumulate ? d : 0) + A (64 x 16) * B (16 x N), both operands
// in shared memory. TRANS_A / TRANS_B: 0 = K-major (wgmma_desc_sw128), 1 = MN-major
// (wgmma_desc_sw128_mn).
template <int N, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_ss_bf16(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                              int accumulate) {
  static_assert(N == 64 || N == 128, "wgmma_ss_bf16: N is 64 or 128");
  static_assert((TRANS_A == 0 || TRANS_A == 1) && (TRANS_B == 0 || TRANS_B == 1), "trans: 0/1");
  if constexpr (N == 64) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " FLASHMSA_WG_R32
        "%32, %33, p, 1, 1, %35, %36;\n}\n"
        : FLASHMSA_WG_D32
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " FLASHMSA_WG_R64
        "%64, %65, p, 1, 1, %67, %68;\n}\n"
        : FLASHMSA_WG_D64
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));
  }
}

// Same with A (64 x 16) from registers in the layout described at the top (acc_to_a_frag).
// The ISA has no transpose for a register A. `a` must stay unmodified until the wgmma_wait
// covering this MMA.
template <int N, int TRANS_B>
__device__ __forceinline__ void wgmma_rs_bf16(float (&d)[N / 2], const uint32_t (&a)[4],
                                              uint64_t desc_b, int accumulate) {
  static_assert(N == 64 || N == 128, "wgmma_rs_bf16: N is 64 or 128");
  static_assert(TRANS_B == 0 || TRANS_B == 1, "trans: 0/1");
  if constexpr (N == 64) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " FLASHMSA_WG_R32
        "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : FLASHMSA_WG_D32
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate),
          "n"(TRANS_B));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " FLASHMSA_WG_R64
        "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : FLASHMSA_WG_D64
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate),
          "n"(TRANS_B));
  }
}

#undef FLASHMSA_WG_D8
#undef FLASHMSA_WG_D32
#undef FLASHMSA_WG_D64
#undef FLASHMSA_WG_R32
#undef FLASHMSA_WG_R64

// Register A fragment of k-step kk from accumulator elements acc8 = &acc[8 * kk] of an m64nN
// product (fp32 -> bf16, round to nearest even). cvt.rn.bf16x2.f32 puts its FIRST source in the
// HIGH half, hence (hi, lo) order.
__device__ __forceinline__ void acc_to_a_frag(uint32_t (&a)[4], const float* acc8) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(a[i]) : "f"(acc8[2 * i + 1]), "f"(acc8[2 * i]));
}

// The selector's product (both operands K-major, N = 128).
__device__ __forceinline__ void wgmma_m64n128k16_bf16(float (&d)[64], uint64_t desc_a,
                                                      uint64_t desc_b, int accumulate) {
  wgmma_ss_bf16<128, 0, 0>(d, desc_a, desc_b, accumulate);
}

}  // namespace flashmsa::cuda
