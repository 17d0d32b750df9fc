// Tile-level building blocks of the backward kernels: swizzled smem tiles, ldmatrix fragment
// loaders for the four operand orientations the backward needs, gathered-row tile loads, the
// per-(proxy head, key block) context, and the two accumulation modes (fp32 atomics, or int64
// fixed point whose sums do not depend on the order of the atomics).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/bf16.cuh"
#include "common/mma.cuh"
#include "token_divider.h"

namespace flashmsa::cuda::bwd {

using bf16 = __nv_bfloat16;

constexpr int kBlk = 128;     // keys per block (BLK); the CUDA backend only takes 128
constexpr int kTileTok = 64;  // gathered query tokens per inner iteration

// ---- fragment loaders (g = lane / 4, c = lane % 4; see common/mma.cuh) ----------------------
// Every tile is row-major with RB bytes per row, 16-byte chunks XOR-swizzled by row & 7.

// A (16 rows m0.., 16 columns k0..) from a tile stored [m][k].
template <int RB>
__device__ __forceinline__ void load_a_mk(uint32_t (&a)[4], uint32_t base, int m0, int k0, int lane) {
  const int row = m0 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int chunk = (k0 >> 3) + (lane >> 4);
  ldmatrix_x4(a, base + swizzle_offset<RB>(row, chunk));
}

// A (16 rows m0.., 16 columns k0..) from a tile stored [k][m] (the transpose of A).
template <int RB>
__device__ __forceinline__ void load_a_km(uint32_t (&a)[4], uint32_t base, int m0, int k0, int lane) {
  const int row = k0 + (lane & 7) + (lane >> 4) * 8;
  const int chunk = (m0 >> 3) + ((lane >> 3) & 1);
  ldmatrix_x4_trans(a, base + swizzle_offset<RB>(row, chunk));
}

// B for two n-tiles (n0..n0+15) and k0..k0+15 from a tile stored [n][k]:
// b[0], b[1] feed n-tile n0/8, b[2], b[3] feed n-tile n0/8 + 1.
template <int RB>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], uint32_t base, int n0, int k0, int lane) {
  const int row = n0 + (lane & 7) + (lane >> 4) * 8;
  const int chunk = (k0 >> 3) + ((lane >> 3) & 1);
  ldmatrix_x4(b, base + swizzle_offset<RB>(row, chunk));
}

// Same operand from a tile stored [k][n].
template <int RB>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], uint32_t base, int n0, int k0, int lane) {
  const int row = k0 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int chunk = (n0 >> 3) + (lane >> 4);
  ldmatrix_x4_trans(b, base + swizzle_offset<RB>(row, chunk));
}

// The accumulators of two adjacent n-tiles (16 columns) re-read as an A fragment whose k runs
// over those columns (P^T and dS^T feed the next product straight from registers).
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack_bf16x2(c0[0], c0[1]);
  a[1] = pack_bf16x2(c0[2], c0[3]);
  a[2] = pack_bf16x2(c1[0], c1[1]);
  a[3] = pack_bf16x2(c1[2], c1[3]);
}

// Copies `rows` rows of E bf16 into a swizzled tile; row r is read from src(r), or zero-filled
// when src(r) is null (padding rows, keys past a sequence end). `any` is a valid global address
// handed to the zero-fill copies, which read nothing.
template <int E, int NTHREADS, typename Src>
__device__ __forceinline__ void load_rows_async(uint32_t base, int rows, const bf16* any, Src src) {
  constexpr int kChunks = E / 8;
  for (int i = threadIdx.x; i < rows * kChunks; i += NTHREADS) {
    const int r = i / kChunks, c = i % kChunks;
    const bf16* row = src(r);
    cp_async_16(base + swizzle_offset<E * 2>(r, c), row != nullptr ? row + c * 8 : any,
                row != nullptr);
  }
}

// 4-byte global -> shared copy (per-row scalars such as lse); zero-filled when !valid.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// Stores a pair of accumulator values (row, col..col+1) as bf16 into a swizzled [rows][64] tile.
__device__ __forceinline__ void store_pair_64(unsigned char* tile, int row, int col, float x0, float x1) {
  *reinterpret_cast<uint32_t*>(tile + swizzle_offset<128>(row, col >> 3) + (col & 7) * 2) =
      pack_bf16x2(x0, x1);
}

// ---- accumulation into global buffers shared by several CTAs --------------------------------
// fx == 0: fp32 atomics (fast, order-dependent rounding). Otherwise: the value times fx (a power
// of two chosen so the whole sum fits in 62 bits) is rounded to int64 and added with integer
// atomics, which are associative: the result is bitwise independent of the order. (fx is NaN
// after a non-finite input: it stays on the integer path, and the output, divided by fx, is NaN.)
__device__ __forceinline__ void acc_add(void* base, int64_t i, float x, float fx) {
  if (fx != 0.f)
    atomicAdd(reinterpret_cast<unsigned long long*>(base) + i,
              static_cast<unsigned long long>(__float2ll_rn(x * fx)));
  else
    atomicAdd(reinterpret_cast<float*>(base) + i, x);
}

// Two adjacent elements (i even): one vector fp32 atomic (sm_90) in the fast mode.
__device__ __forceinline__ void acc_add2(void* base, int64_t i, float x0, float x1, float fx) {
  if (fx != 0.f) {
    acc_add(base, i, x0, fx);
    acc_add(base, i + 1, x1, fx);
  } else {
    atomicAdd(reinterpret_cast<float2*>(reinterpret_cast<float*>(base) + i), make_float2(x0, x1));
  }
}

// ---- the inverted selection index -----------------------------------------------------------
struct Index {
  const int32_t* cu;         // [B+1] cu_seqlens
  const int32_t* blk_off;    // [B+1] first global block of each sequence
  const int32_t* blk_seq;    // [NB] the sequence of each global block
  const int32_t* seg_start;  // [Hp*NB+1] entries of (p, g): vals[seg_start[p*NB+g] .. [p*NB+g+1])
  const int32_t* vals;       // [Hp*T*K] t*K + slot, grouped by (p, g), ascending t inside a group
  int B = 0, NB = 0, K = 0;
  int64_t T = 0;
  TokenDivider k_div;  // set_top_k: token_of without a division (src/token_divider.h)

  __host__ void set_top_k(int k) {
    K = k;
    k_div = TokenDivider::make(k);
  }
  // The token t of an entry t K + slot (entry >= 0).
  __device__ __forceinline__ int token_of(int entry) const { return k_div(entry); }
};

// What a CTA working on (proxy head p, global key block g) needs to know about its block.
struct BlockCtx {
  int64_t seq_start;  // packed index of the sequence's first token
  int seq_len;
  int key0;           // position (inside the sequence) of the block's first key
  int begin, end;     // range of the block's list in Index::vals
};

__device__ __forceinline__ BlockCtx block_ctx(const Index& ix, int p, int g) {
  BlockCtx c;
  const int b = ix.blk_seq[g];
  c.seq_start = ix.cu[b];
  c.seq_len = ix.cu[b + 1] - ix.cu[b];
  c.key0 = (g - ix.blk_off[b]) * kBlk;
  c.begin = ix.seg_start[static_cast<int64_t>(p) * ix.NB + g];
  c.end = ix.seg_start[static_cast<int64_t>(p) * ix.NB + g + 1];
  return c;
}

}  // namespace flashmsa::cuda::bwd
