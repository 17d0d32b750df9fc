// Block selection (msa.md forward steps 1-4) on tensor cores.
//
// One CTA = one 128-token block of one sequence (tiles aligned to sequence starts) for one proxy
// head: 8 warps x 16 query rows. Inside a tile every query has the same own block n_loc, so the
// forced blocks (n_loc-L+1 .. n_loc, which include the only causally partial block) are the same
// for all rows and are never scored: only the fully visible blocks 0 .. n_loc-L are streamed.
// Per streamed key block the warp computes its 16 x 128 proxy scores with mma.sync, takes the
// row max (the block max-pool), and pushes it into a per-row top-K list kept in registers. The
// T x T score matrix is never stored.
#include <climits>
#include <cstdint>

#include "common/bf16.cuh"
#include "common/check.cuh"
#include "common/metadata.cuh"
#include "common/mma.cuh"
#include "launchers.h"

namespace flashmsa::cuda {
namespace {

constexpr int kBlk = 128;        // BLK: keys per block and query rows per CTA
constexpr int kSelWarps = kBlk / 16;

// Descending top-K insertion with compile-time indices (stays in registers). A strict '>'
// keeps the earlier (lower-indexed, since blocks arrive in ascending order) of equal scores.
template <int KMAX>
__device__ __forceinline__ void topk_insert(float (&vals)[KMAX], int (&idx)[KMAX], float v, int n) {
#pragma unroll
  for (int i = 0; i < KMAX; ++i) {
    const bool take = v > vals[i];
    const float tv = vals[i];
    const int ti = idx[i];
    vals[i] = take ? v : tv;
    idx[i] = take ? n : ti;
    v = take ? tv : v;
    n = take ? ti : n;
  }
}

template <int DP, int KMAX>
__global__ void __launch_bounds__(kSelWarps * 32, KMAX > 16 ? 1 : 2)
    select_blocks_kernel(const __nv_bfloat16* __restrict__ qp,  // [T, Hp, DP]
                         const __nv_bfloat16* __restrict__ kp,  // [T, Hpk, DP]
                         const int32_t* __restrict__ cu,        // [B+1]
                         const int32_t* __restrict__ tile_off,  // [B+1] block tiles per sequence
                         int64_t T, int B, int Hp, int Hpk, int K, int L, int tile_bound,
                         int32_t* __restrict__ block_idx) {     // [Hp, T, K]
  constexpr int kRowBytes = DP * 2;
  constexpr int kChunks = DP / 8;  // 16-byte chunks per row
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* q_s = smem;                       // [128][DP] swizzled
  unsigned char* k_s = smem + kBlk * kRowBytes;    // [2][128][DP] swizzled

  // Heavy (late) tiles first: the grid is walked backwards.
  const int tile = tile_bound - 1 - static_cast<int>(blockIdx.x);
  if (tile >= __ldg(tile_off + B)) return;
  const int p = blockIdx.y;
  const int pk = p / (Hp / Hpk);
  const int b = find_tile_sequence(tile_off, B, tile);
  const int64_t s0 = __ldg(cu + b);
  const int len = __ldg(cu + b + 1) - static_cast<int>(s0);
  const int n_loc = tile - __ldg(tile_off + b);
  const int row0 = n_loc * kBlk;
  const int rows = min(kBlk, len - row0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  if (n_loc + 1 <= K) {
    // Every visible block is selected: 0..n_loc then -1 padding.
    for (int r = tid; r < rows; r += blockDim.x) {
      int32_t* dst = block_idx + (static_cast<int64_t>(p) * T + s0 + row0 + r) * K;
      for (int i = 0; i < K; ++i) dst[i] = i <= n_loc ? i : -1;
    }
    return;
  }
  const int n_scored = n_loc - L + 1;  // >= 1 here because K >= L

  // Q tile (rows past the sequence end are zero) and the first key block.
  for (int c = tid; c < kBlk * kChunks; c += blockDim.x) {
    const int r = c / kChunks, ch = c % kChunks;
    const bool ok = r < rows;
    const __nv_bfloat16* src = qp + ((s0 + row0 + (ok ? r : 0)) * Hp + p) * DP + ch * 8;
    cp_async_16(smem_u32(q_s + swizzle_offset<kRowBytes>(r, ch)), src, ok);
  }
  auto load_keys = [&](int n, int buf) {
    unsigned char* dst = k_s + buf * kBlk * kRowBytes;
    for (int c = tid; c < kBlk * kChunks; c += blockDim.x) {
      const int r = c / kChunks, ch = c % kChunks;
      const __nv_bfloat16* src = kp + ((s0 + n * kBlk + r) * Hpk + pk) * DP + ch * 8;
      cp_async_16(smem_u32(dst + swizzle_offset<kRowBytes>(r, ch)), src, true);
    }
  };
  load_keys(0, 0);
  cp_async_commit();

  uint32_t qf[DP / 16][4];
  float vals[KMAX];
  int idx[KMAX];
#pragma unroll
  for (int i = 0; i < KMAX; ++i) {
    vals[i] = -INFINITY;
    idx[i] = -1;
  }

  for (int n = 0; n < n_scored; ++n) {
    if (n + 1 < n_scored) {
      load_keys(n + 1, (n + 1) & 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (n == 0) {
#pragma unroll
      for (int ks = 0; ks < DP / 16; ++ks)
        ldmatrix_x4(qf[ks], smem_u32(q_s + swizzle_offset<kRowBytes>(warp * 16 + (lane & 15),
                                                                     ks * 2 + (lane >> 4))));
    }
    const unsigned char* kb = k_s + (n & 1) * kBlk * kRowBytes;
    float s[kBlk / 8][4];
#pragma unroll
    for (int j = 0; j < kBlk / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < DP / 16; ++ks) {
#pragma unroll
      for (int np = 0; np < kBlk / 16; ++np) {
        uint32_t bf[4];
        ldmatrix_x4(bf, smem_u32(kb + swizzle_offset<kRowBytes>(
                                          np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                          ks * 2 + ((lane >> 3) & 1))));
        mma_bf16_16816(s[2 * np], qf[ks], bf[0], bf[1]);
        mma_bf16_16816(s[2 * np + 1], qf[ks], bf[2], bf[3]);
      }
    }
    float lo = -INFINITY, hi = -INFINITY;
#pragma unroll
    for (int j = 0; j < kBlk / 8; ++j) {
      lo = fmaxf(lo, fmaxf(s[j][0], s[j][1]));
      hi = fmaxf(hi, fmaxf(s[j][2], s[j][3]));
    }
    lo = fmaxf(lo, __shfl_xor_sync(0xffffffffu, lo, 1));
    lo = fmaxf(lo, __shfl_xor_sync(0xffffffffu, lo, 2));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, 1));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, 2));
    // Lane 4g+0 keeps row g, lane 4g+1 row g+8 (lanes 4g+2, 4g+3 mirror them).
    topk_insert<KMAX>(vals, idx, (lane & 1) ? hi : lo, n);
    __syncthreads();  // the buffer just read is refilled by the next iteration's load
  }
  for (int n = max(0, n_loc - L + 1); n <= n_loc; ++n) topk_insert<KMAX>(vals, idx, INFINITY, n);

  const int r = warp * 16 + (lane >> 2) + ((lane & 1) ? 8 : 0);
  if ((lane & 2) == 0 && r < rows) {
    int32_t* dst = block_idx + (static_cast<int64_t>(p) * T + s0 + row0 + r) * K;
    // Ascending output: each of the first K entries goes to its rank by block index.
#pragma unroll
    for (int i = 0; i < KMAX; ++i) {
      if (i < K) {
        const int key_i = idx[i] < 0 ? INT_MAX : idx[i];
        int rank = 0;
#pragma unroll
        for (int j = 0; j < KMAX; ++j) {
          const int key_j = idx[j] < 0 ? INT_MAX : idx[j];
          rank += (j < K) && (key_j < key_i || (key_j == key_i && j < i));
        }
        dst[rank] = idx[i];
      }
    }
  }
}

template <int DP, int KMAX>
void launch_select(const MsaParams& p, const int32_t* tile_off, int tile_bound,
                   cudaStream_t stream) {
  const size_t smem = 3 * kBlk * DP * 2;
  auto kernel = select_blocks_kernel<DP, KMAX>;
  FLASHMSA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  dim3 grid(tile_bound, p.Hp);
  kernel<<<grid, kSelWarps * 32, smem, stream>>>(
      static_cast<const __nv_bfloat16*>(p.qp), static_cast<const __nv_bfloat16*>(p.kp),
      p.cu_seqlens, tile_off, p.T, p.B, p.Hp, p.Hpk, p.top_k, p.local_blocks, tile_bound,
      p.block_idx);
  FLASHMSA_CHECK_LAUNCH();
}

}  // namespace

void launch_select_blocks(const MsaParams& p, cudaStream_t stream) {
  if (p.T == 0) return;
  if (p.top_k > 32) throw Error("flashmsa: select_blocks: option 'top_k' must be <= 32 on CUDA");
  // Upper bound on the number of 128-token tiles, sum over b of ceil(len_b / 128), known on the
  // host without reading cu_seqlens: T/128 + B. CTAs past the device-computed total exit.
  const int64_t bound = (p.T + kBlk - 1) / kBlk + p.B;
  if (bound > INT_MAX) throw Error("flashmsa: select_blocks: argument 'q' has too many tokens");
  int32_t* tile_off = nullptr;
  FLASHMSA_CUDA_CHECK(cudaMallocAsync(&tile_off, sizeof(int32_t) * (p.B + 1), stream));
  build_tile_offsets_kernel<<<1, 1024, 0, stream>>>(p.cu_seqlens, p.B, kBlk, tile_off);
  FLASHMSA_CHECK_LAUNCH();
  const int tb = static_cast<int>(bound);
  if (p.Dp == 64) {
    if (p.top_k <= 16) launch_select<64, 16>(p, tile_off, tb, stream);
    else launch_select<64, 32>(p, tile_off, tb, stream);
  } else {
    if (p.top_k <= 16) launch_select<128, 16>(p, tile_off, tb, stream);
    else launch_select<128, 32>(p, tile_off, tb, stream);
  }
  FLASHMSA_CUDA_CHECK(cudaFreeAsync(tile_off, stream));
}

}  // namespace flashmsa::cuda
