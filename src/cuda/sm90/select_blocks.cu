// Block selection (msa.md forward steps 1-4) on Hopper tensor cores (wgmma + TMA).
//
// One CTA = one 128-token block of one sequence (tiles aligned to sequence starts) for one proxy
// head. Inside a tile every query has the same own block n_loc, so the forced blocks
// (n_loc-L+1 .. n_loc, which include the only causally partial block) are the same for all rows
// and are never scored: only the fully visible blocks 0 .. n_loc-L are streamed, and no causal
// mask is needed. Per streamed key block the 128 x 128 proxy scores are reduced to their row max
// (the block max-pool) and pushed into a per-row top-K list kept in registers. The T x T score
// matrix is never stored.
#include <climits>
#include <cstdint>

#include "common/bf16.cuh"
#include "common/check.cuh"
#include "common/metadata.cuh"
#include "common/mma.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"
#include "launchers.h"

namespace flashmsa::cuda {
namespace {

constexpr int kBlk = 128;        // BLK: keys per block and query rows per CTA

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

// One CTA = one 128-token tile of one proxy head, warp-specialised: warpgroup 0 (one thread)
// streams the query tile and key blocks with TMA into a ring of kStages buffers; warpgroups 1
// and 2 each own 64 query rows and, per key block, compute their 64 x 128 proxy scores with
// wgmma (both operands from shared memory, so a key block is read once per warpgroup, not once
// per warp as with mma.sync), take the row max and push it into the per-row top-K list. Each
// consumer issues two blocks' products back to back and pools the first while the second runs:
// waiting for one product at a time and relying on the other warpgroup to keep the tensor core
// busy measured 3.85 ms against 3.13-3.16 at m3/64k (H200, same call; the benchmark at 9647a8f:
// 3.09 ms = 90% of the measured matmul ceiling, 73% before).
template <int DP>
struct SelectTiles {
  static constexpr int kSlabBytes = kBlk * 128;           // 128 rows x 64 bf16
  static constexpr int kTileBytes = kBlk * DP * 2;        // query tile or one key block
  static constexpr int kStages = DP == 128 ? 4 : 8;
  static_assert(kStages >= 2, "a consumer holds two stages at once (a pair of products)");
  static constexpr int kThreads = 384;
  static constexpr int kConsumerThreads = 256;
  static constexpr size_t kSmem = 1024 + (1 + kStages) * kTileBytes + (1 + 2 * kStages) * 8;
};

template <int DP, int KMAX>
__global__ void __launch_bounds__(SelectTiles<DP>::kThreads, 1)
    select_blocks_kernel(const __grid_constant__ CUtensorMap qp_map,  // qp [T, Hp, DP]
                         const __grid_constant__ CUtensorMap kp_map,  // kp [T, Hpk, DP]
                         const int32_t* __restrict__ cu,              // [B+1]
                         const int32_t* __restrict__ tile_off,        // [B+1] tiles per sequence
                         int64_t T, int B, int Hp, int Hpk, int K, int L, int tile_bound,
                         int32_t* __restrict__ block_idx) {           // [Hp, T, K]
  using Tiles = SelectTiles<DP>;
  constexpr int kStages = Tiles::kStages;
  extern __shared__ unsigned char smem_raw[];
  // TMA's 128-byte swizzle and the wgmma descriptors need 1024-byte aligned tiles.
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));
  unsigned char* q_s = smem;                          // [DP/64][128][128 B]
  unsigned char* k_s = smem + Tiles::kTileBytes;      // [kStages][DP/64][128][128 B]
  uint64_t* bars = reinterpret_cast<uint64_t*>(k_s + kStages * Tiles::kTileBytes);
  uint64_t* q_full = bars;                            // [1]
  uint64_t* k_full = bars + 1;                        // [kStages]
  uint64_t* k_empty = bars + 1 + kStages;             // [kStages]

  // Heavy (late) tiles first: the grid is walked backwards.
  const int tile = tile_bound - 1 - static_cast<int>(blockIdx.x);
  if (tile >= __ldg(tile_off + B)) return;
  const int p = blockIdx.y;
  const int pk = p / (Hp / Hpk);
  const TileInSequence ts = tile_in_sequence(tile_off, cu, B, tile, kBlk);
  const int s0 = ts.s0, n_loc = ts.n_loc, row0 = ts.row0, rows = ts.rows;
  const int tid = threadIdx.x, lane = tid & 31;

  if (n_loc + 1 <= K) {
    // Every visible block is selected: 0..n_loc then -1 padding.
    for (int r = tid; r < rows; r += blockDim.x) {
      int32_t* dst = block_idx + (static_cast<int64_t>(p) * T + s0 + row0 + r) * K;
      for (int i = 0; i < K; ++i) dst[i] = i <= n_loc ? i : -1;
    }
    return;
  }
  const int n_scored = n_loc - L + 1;  // >= 1 here because K >= L

  if (tid == 0) {
    ::cuda::ptx::mbarrier_init(q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      ::cuda::ptx::mbarrier_init(k_full + s, 1);
      ::cuda::ptx::mbarrier_init(k_empty + s, Tiles::kConsumerThreads);
    }
    ::cuda::ptx::fence_mbarrier_init(::cuda::ptx::sem_release, ::cuda::ptx::scope_cluster);
  }
  __syncthreads();

  const int wg = tid / 128;
  if (wg == 0) {
    // The consumers hold two 64 x 128 fp32 score tiles (64 registers a thread each) and the
    // top-K lists: the producer's registers go to them (128 x 40 + 256 x 232 <= 64 K).
    setmaxnreg_dec<40>();
    // Producer. Rows of the query tile past the sequence end are loaded (the next sequence or
    // TMA's zero fill past T) but never written out.
    if (tid == 0) {
      ::cuda::ptx::mbarrier_arrive_expect_tx(::cuda::ptx::sem_release, ::cuda::ptx::scope_cta,
                                             ::cuda::ptx::space_shared, q_full, Tiles::kTileBytes);
      for (int slab = 0; slab < DP / 64; ++slab)
        tma_load_3d(q_s + slab * Tiles::kSlabBytes, &qp_map, slab * 64, p, s0 + row0, q_full);
      for (int n = 0; n < n_scored; ++n) {
        const int s = n % kStages;
        if (n >= kStages) mbarrier_wait(k_empty + s, ((n / kStages) - 1) & 1);
        ::cuda::ptx::mbarrier_arrive_expect_tx(::cuda::ptx::sem_release, ::cuda::ptx::scope_cta,
                                               ::cuda::ptx::space_shared, k_full + s,
                                               Tiles::kTileBytes);
        unsigned char* dst = k_s + s * Tiles::kTileBytes;
        for (int slab = 0; slab < DP / 64; ++slab)
          tma_load_3d(dst + slab * Tiles::kSlabBytes, &kp_map, slab * 64, pk, s0 + n * kBlk,
                      k_full + s);
      }
    }
    return;
  }

  setmaxnreg_inc<232>();
  const int half = wg - 1;  // this warpgroup's 64 query rows
  float vals[KMAX];
  int idx[KMAX];
#pragma unroll
  for (int i = 0; i < KMAX; ++i) {
    vals[i] = -INFINITY;
    idx[i] = -1;
  }
  const uint64_t q_desc = wgmma_desc_sw128(smem_u32(q_s) + half * 64 * 128);
  const uint64_t k_desc0 = wgmma_desc_sw128(smem_u32(k_s));  // stage 0
  mbarrier_wait(q_full, 0);

  // Blocks go in pairs: the second block's product runs on the tensor core while the first's
  // max-pool and top-K run on the ALUs. Nothing is in flight at the loop's back edge (a product
  // in flight across it drew ptxas's wgmma serialisation, C7514, and spills at K <= 32).
  auto issue = [&](float (&acc)[64], int n) {
    const int s = n % kStages;
    mbarrier_wait(k_full + s, (n / kStages) & 1);
    wgmma_fence_operands(acc);
    wgmma_fence();
    const uint64_t k_desc = wgmma_desc_advance(k_desc0, s * Tiles::kTileBytes);
#pragma unroll
    for (int ks = 0; ks < DP / 16; ++ks) {
      const uint32_t slab_off = (ks / 4) * Tiles::kSlabBytes + (ks % 4) * 32;
      wgmma_m64n128k16_bf16(acc, wgmma_desc_advance(q_desc, slab_off), wgmma_desc_advance(k_desc, slab_off), ks > 0);
    }
    wgmma_commit();
  };
  // After the wgmma_wait that covers block n's product.
  auto pool_and_insert = [&](float (&acc)[64], int n) {
    wgmma_fence_operands(acc);
    ::cuda::ptx::mbarrier_arrive(k_empty + n % kStages);
    float lo = -INFINITY, hi = -INFINITY;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      lo = fmaxf(lo, fmaxf(acc[4 * j], acc[4 * j + 1]));
      hi = fmaxf(hi, fmaxf(acc[4 * j + 2], acc[4 * j + 3]));
    }
    lo = fmaxf(lo, __shfl_xor_sync(0xffffffffu, lo, 1));
    lo = fmaxf(lo, __shfl_xor_sync(0xffffffffu, lo, 2));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, 1));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, 2));
    // Lane 4g+0 keeps row g, lane 4g+1 row g+8 (lanes 4g+2, 4g+3 mirror them). Most blocks
    // lose to the current K-th best once the lists fill, so the insertion is mostly skipped.
    const float v = (lane & 1) ? hi : lo;
    if (__any_sync(0xffffffffu, v > vals[KMAX - 1])) topk_insert<KMAX>(vals, idx, v, n);
  };
  float acc0[64], acc1[64];
  int n = 0;
  for (; n + 1 < n_scored; n += 2) {
    issue(acc0, n);
    issue(acc1, n + 1);
    wgmma_wait<1>();
    pool_and_insert(acc0, n);
    wgmma_wait<0>();
    pool_and_insert(acc1, n + 1);
  }
  if (n < n_scored) {
    issue(acc0, n);
    wgmma_wait<0>();
    pool_and_insert(acc0, n);
  }
  for (int n = max(0, n_loc - L + 1); n <= n_loc; ++n) topk_insert<KMAX>(vals, idx, INFINITY, n);

  const int warp_in_wg = (tid / 32) % 4;
  const int r = half * 64 + warp_in_wg * 16 + (lane >> 2) + ((lane & 1) ? 8 : 0);
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
  using Tiles = SelectTiles<DP>;
  auto kernel = select_blocks_kernel<DP, KMAX>;
  FLASHMSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(Tiles::kSmem)));
  const CUtensorMap qp_map = make_bf16_row_map(p.qp, p.T, p.Hp, DP, kBlk);
  const CUtensorMap kp_map = make_bf16_row_map(p.kp, p.T, p.Hpk, DP, kBlk);
  dim3 grid(tile_bound, p.Hp);
  kernel<<<grid, Tiles::kThreads, Tiles::kSmem, stream>>>(
      qp_map, kp_map, p.cu_seqlens, tile_off, p.T, p.B, p.Hp, p.Hpk, p.top_k, p.local_blocks,
      tile_bound, p.block_idx);
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
  // Freed on every path, also when a launch throws (e.g. a driver without cuTensorMapEncodeTiled).
  const StreamAllocation<int32_t> tile_alloc(p.B + 1, stream);
  int32_t* tile_off = tile_alloc.get();
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
}

}  // namespace flashmsa::cuda
