// Thin PTX wrappers for the warp-level tensor-core path (mma.sync m16n8k16 bf16, ldmatrix,
// cp.async) and the shared-memory swizzle the tiles use.
//
// Fragment layouts of mma.m16n8k16 (g = lane / 4, c = lane % 4):
//   A 16x16 row-major, 4 regs: (g, 2c..2c+1) (g+8, 2c..) (g, 2c+8..) (g+8, 2c+8..)
//   B 16x8 "col", 2 regs:      (k 2c..2c+1, n g) (k 2c+8.., n g)
//   C 16x8 fp32, 4 floats:     (g, 2c) (g, 2c+1) (g+8, 2c) (g+8, 2c+1)
#pragma once

#include <cstdint>

namespace flashmsa::cuda {

// The kernels' softmax runs in base 2 (exp2 on the SFU): scores times log2(e), lse back times ln 2.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 2^x on the SFU alone (-inf -> +0). exp2f wraps MUFU.EX2 in a range fix-up for results below
// 2^-126 (a compare, two multiplies and predicate shuffling per element); flushing those to 0 moves
// a probability by < 1.2e-38, invisible next to bf16 operands and softmax sums.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// d += a * b, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4],
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Same, each matrix transposed (B fragments from a row-major [k][n] tile such as V).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 16-byte global -> shared copy; when `valid` is false the destination is zero-filled and the
// source is not read (rows past a sequence end must never bring NaN/Inf garbage into a tile).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}

// A 256-byte row (two 64-column slabs, kSlabBytes apart in shared memory) copied by a QUAD of threads,
// thread i (0..3) taking the 16-byte chunks c = 4n + i, n = 0..3: the quad reads 64 contiguous bytes
// (two sectors of one 128-byte line) per instruction, so a warp instruction covers 8 rows x 64 bytes.
// Measured on the gathered rows of the backward / KL value: a thread per 128-byte slab put every lane
// of an instruction in its own sector, half of it used (ncu of the KL-value kernel: L2 tag requests at
// 76% of peak, sectors at 27%); pairs per 32-byte sector (16 rows x 32 bytes) took 7% off the backward
// and 18% off the KL value, quads 4% more off the backward (perf-notes). Chunk c goes to the swizzled
// slot (c & 7) ^ (row & 7) of slab c >> 3: dst_sw is the row's 128-byte aligned slab-0 address |
// ((i ^ (row & 7)) << 4), chunk 4 + i's slot is chunk i's XOR 4 (address ^ 64), and slab 1 lies
// kSlabBytes on. src: the thread's first chunk, the row's element 8 i. One asm block, so the source
// stays one register pair with immediate offsets and the second slab's address is formed inside it
// (the 40-register producers spilled otherwise). valid = false zero-fills the thread's chunks.
template <int kSlabBytes>
__device__ __forceinline__ void cp_async_row_quarter_swizzled(uint32_t dst_sw, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  uint32_t dst = dst_sw;  // moved to the second slab inside the block
  asm volatile(
      "{\n"
      ".reg .b32 d;\n"
      "cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
      "xor.b32 d, %0, 64;\n  cp.async.cg.shared.global [d], [%1+64], 16, %2;\n"
      "add.u32 %0, %0, %3;\n cp.async.cg.shared.global [%0], [%1+128], 16, %2;\n"
      "xor.b32 d, %0, 64;\n  cp.async.cg.shared.global [d], [%1+192], 16, %2;\n"
      "}\n"
      : "+r"(dst)
      : "l"(src), "r"(src_bytes), "n"(kSlabBytes));
}

// The calling thread's earlier cp.async copies arrive on the mbarrier `bar` when they complete
// (the count given at init must include this arrival: .noinc).
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile whose rows are ROW_BYTES long.
// The chunk index is XORed with the row's low 3 bits so that the 8 row addresses of one
// ldmatrix (same logical chunk, 8 consecutive rows) hit 8 different bank groups.
template <int ROW_BYTES>
__device__ __forceinline__ uint32_t swizzle_offset(int row, int chunk) {
  static_assert(ROW_BYTES % 128 == 0, "rows must hold a multiple of 8 chunks");
  return static_cast<uint32_t>(row * ROW_BYTES + ((chunk ^ (row & 7)) << 4));
}

}  // namespace flashmsa::cuda
