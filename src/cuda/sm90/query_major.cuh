// Building blocks of the query-major kernels (sparse_forward.cu, backward_dq.cu): one warp owns
// one token and up to 16 main heads that share the token's proxy head (so its selection) and one
// kv head -- the 16 MMA rows -- and streams the selected blocks as 32-key sub-tiles of K and V.
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/mma.cuh"
#include "params.h"

namespace flashmsa::cuda {

constexpr int kSub = 32;  // keys per streamed sub-tile
constexpr int kMaxItems = 512;

// Row groups: runs of <= 16 consecutive main heads that share one proxy head and one kv head.
// Built on the host from head counts only (no data), ordered by proxy head.
struct HeadItems {
  int n = 0;
  int32_t packed[kMaxItems];      // h0 | (rows << 16)
  int16_t p_begin[kMaxItems + 1];  // items of proxy head p: [p_begin[p], p_begin[p+1])
};

inline HeadItems make_items(const MsaParams& p, const char* operation) {
  HeadItems it;
  const int m = p.H / p.Hp, G = p.H / p.Hkv;
  for (int ph = 0; ph < p.Hp; ++ph) {
    it.p_begin[ph] = static_cast<int16_t>(it.n);
    int h = ph * m;
    const int end = (ph + 1) * m;
    while (h < end) {
      const int kv_end = (h / G + 1) * G;
      const int rows = std::min(16, std::min(end, kv_end) - h);
      if (it.n >= kMaxItems)
        throw Error(std::string("flashmsa: ") + operation + ": argument 'q' has too many heads for CUDA");
      it.packed[it.n++] = h | (rows << 16);
      h += rows;
    }
  }
  it.p_begin[p.Hp] = static_cast<int16_t>(it.n);
  return it;
}

// Loads rows j0 .. j0+31 (positions in the sequence) of one head of a [T, heads, DIM] tensor;
// rows after tpos are zero-filled.
template <int DIM>
__device__ __forceinline__ void load_sub_tile(unsigned char* dst, const __nv_bfloat16* base,
                                              int64_t s0, int heads, int head, int j0, int tpos,
                                              int lane) {
  constexpr int kChunks = DIM / 8;
  constexpr int kRowsPerIter = 32 / kChunks;
  const int r0 = lane / kChunks, ch = lane % kChunks;
  // One pointer stepped by whole rows keeps the address arithmetic out of the register budget.
  const __nv_bfloat16* src = base + ((s0 + j0 + r0) * heads + head) * DIM + ch * 8;
  const int64_t step = static_cast<int64_t>(kRowsPerIter) * heads * DIM;
  const uint32_t dst0 = smem_u32(dst);
#pragma unroll
  for (int i = 0; i < kSub / kRowsPerIter; ++i) {
    const int r = r0 + i * kRowsPerIter;
    const bool ok = j0 + r <= tpos;
    cp_async_16(dst0 + swizzle_offset<DIM * 2>(r, ch), ok ? src + i * step : base, ok);
  }
}

// Up to 16 rows of a [T, heads, DIM] tensor starting at (t, h0); missing rows are zero. With
// REPEAT, every row is a copy of the first.
template <int DIM, bool REPEAT = false>
__device__ __forceinline__ void load_rows(unsigned char* dst, const __nv_bfloat16* src_row0,
                                          int rows, int lane) {
  constexpr int kChunks = DIM / 8;
#pragma unroll
  for (int i = 0; i < 16 * kChunks / 32; ++i) {
    const int c = i * 32 + lane;
    const int r = c / kChunks, ch = c % kChunks;
    const bool ok = r < rows;
    const int src_r = (REPEAT || !ok) ? 0 : r;
    cp_async_16(smem_u32(dst + swizzle_offset<DIM * 2>(r, ch)), src_row0 + src_r * DIM + ch * 8, ok);
  }
}

template <int DIM>
__device__ __forceinline__ void load_a_frags(uint32_t (&f)[DIM / 16][4], const unsigned char* src,
                                             int lane) {
#pragma unroll
  for (int ks = 0; ks < DIM / 16; ++ks)
    ldmatrix_x4(f[ks], smem_u32(src + swizzle_offset<DIM * 2>(lane & 15, ks * 2 + (lane >> 4))));
}

// s (16 x 32) = A (16 x DIM) * tile^T, tile = 32 keys x DIM in shared memory.
template <int DIM>
__device__ __forceinline__ void scores_16x32(float (&s)[kSub / 8][4], const uint32_t (&a)[DIM / 16][4],
                                             const unsigned char* tile, int lane) {
#pragma unroll
  for (int j = 0; j < kSub / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
  for (int ks = 0; ks < DIM / 16; ++ks) {
#pragma unroll
    for (int np = 0; np < kSub / 16; ++np) {
      uint32_t bf[4];
      ldmatrix_x4(bf, smem_u32(tile + swizzle_offset<DIM * 2>(np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                                              ks * 2 + ((lane >> 3) & 1))));
      mma_bf16_16816(s[2 * np], a[ks], bf[0], bf[1]);
      mma_bf16_16816(s[2 * np + 1], a[ks], bf[2], bf[3]);
    }
  }
}

// acc (16 x DIM) += A (16 x 32, bf16 fragments in registers) * tile, tile = 32 keys x DIM in
// shared memory (read transposed: the keys are the product's k dimension).
template <int DIM>
__device__ __forceinline__ void rows_times_tile_16x32(float (&acc)[DIM / 8][4], const uint32_t (&a)[kSub / 16][4],
                                                      const unsigned char* tile, int lane) {
#pragma unroll
  for (int kk = 0; kk < kSub / 16; ++kk) {
#pragma unroll
    for (int dp = 0; dp < DIM / 16; ++dp) {
      uint32_t bf[4];
      ldmatrix_x4_trans(bf, smem_u32(tile + swizzle_offset<DIM * 2>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                                    dp * 2 + (lane >> 4))));
      mma_bf16_16816(acc[2 * dp], a[kk], bf[0], bf[1]);
      mma_bf16_16816(acc[2 * dp + 1], a[kk], bf[2], bf[3]);
    }
  }
}

}  // namespace flashmsa::cuda
