// Dense causal attention forward (the main attention of the dense warm-up mode, msa.md "Dense
// warm-up mode", without the KL), D = Dv = 128, on Hopper tensor cores (wgmma + TMA).
//
// One CTA = one 128-query tile (aligned to its sequence start) of one query head h; it streams
// the K/V blocks 0 .. n_loc of kv head h / (H/Hkv) and keeps an online softmax, so no index and
// no T x T buffer exist. Outputs are the sparse forward's: o [T, H, Dv] bf16 and lse [H, T]
// fp32 (natural log).
//
// Warp specialisation (the selector's producer/consumer split; here warpgroup 0 also gives its
// registers back with setmaxnreg): one of its threads issues TMA loads (Q tile once, then K and V blocks into a 2-stage ring with separate
// K and V barriers, so S = Q K^T of block n can start before V of block n lands, and K can be
// refilled while P V still reads V). Warpgroups 1 and 2 own 64 query rows each. Inside a
// consumer warpgroup the S product of block n is issued together with the P V product of
// block n-1, and the softmax of block n runs while P V(n-1) is still on the tensor cores
// (FlashAttention-3's intra-warpgroup overlap); the two warpgroups also drift out of phase.
#include <climits>
#include <cmath>
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

constexpr int kBlk = 128;                     // queries per tile = keys per block
constexpr int kHeadDim = 128;                 // D = Dv
constexpr int kSlabBytes = kBlk * 128;        // 128 rows x 64 bf16 (one TMA box)
constexpr int kTileBytes = kBlk * kHeadDim * 2;  // Q tile, K block or V block: 2 slabs
constexpr int kStages = 2;
constexpr int kThreads = 384;
constexpr int kConsumerThreads = 256;
// Q, K ring, V ring, then the barriers; +1024 for aligning the dynamic base.
constexpr size_t kSmem = 1024 + (1 + 2 * kStages) * static_cast<size_t>(kTileBytes) +
                         (1 + 4 * kStages) * sizeof(uint64_t);
static_assert(kSmem <= 227 * 1024, "dense forward: shared memory over the sm_90 limit");

// Row statistics for this thread's two accumulator rows (16w + g and 16w + g + 8). m is the
// running max of the raw scores; l the running sum of exp, partial over this thread's 32
// columns (the quad's four partials are added once, at the end: every rescale multiplies all
// four alike).
struct RowStats {
  float m[2];
  float l[2];
};

// In place: s (raw scores) -> p = exp(scale * (s - m_new)), with the causal mask on the
// diagonal block; returns the factors exp(scale * (m_old - m_new)) for O and l.
template <bool kDiagonal>
__device__ __forceinline__ void online_softmax(float (&s)[64], RowStats& st, float scale_log2,
                                               int row_in_tile, int c, float (&corr)[2]) {
  if constexpr (kDiagonal) {
    // Key column 8j + 2c + e of the diagonal block is visible to query row r iff col <= r.
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * j + 2 * c + (e & 1);
        const int row = row_in_tile + ((e & 2) ? 8 : 0);
        if (col > row) s[4 * j + e] = -INFINITY;
      }
  }
  float mx[2] = {st.m[0], st.m[1]};
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    mx[0] = fmaxf(mx[0], fmaxf(s[4 * j], s[4 * j + 1]));
    mx[1] = fmaxf(mx[1], fmaxf(s[4 * j + 2], s[4 * j + 3]));
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    // Every row sees key 0 of block 0 (and row r of the diagonal block sees key r), so mx is
    // finite from the first block on; the first correction is exp2(-inf) = 0.
    corr[i] = fast_exp2((st.m[i] - mx[i]) * scale_log2);
    st.m[i] = mx[i];
  }
  const float ms0 = mx[0] * scale_log2, ms1 = mx[1] * scale_log2;
  float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    s[4 * j + 0] = fast_exp2(fmaf(s[4 * j + 0], scale_log2, -ms0));
    s[4 * j + 1] = fast_exp2(fmaf(s[4 * j + 1], scale_log2, -ms0));
    s[4 * j + 2] = fast_exp2(fmaf(s[4 * j + 2], scale_log2, -ms1));
    s[4 * j + 3] = fast_exp2(fmaf(s[4 * j + 3], scale_log2, -ms1));
    sum0 += s[4 * j] + s[4 * j + 1];
    sum1 += s[4 * j + 2] + s[4 * j + 3];
  }
  st.l[0] = st.l[0] * corr[0] + sum0;
  st.l[1] = st.l[1] * corr[1] + sum1;
}

__device__ __forceinline__ void issue_qk(float (&s)[64], uint32_t q_base, uint32_t k_tile) {
  const uint64_t q_desc = wgmma_desc_sw128(q_base), k_desc = wgmma_desc_sw128(k_tile);
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    const uint32_t off = (ks / 4) * kSlabBytes + (ks % 4) * 32;
    wgmma_ss_bf16<128, 0, 0>(s, wgmma_desc_advance(q_desc, off), wgmma_desc_advance(k_desc, off), ks > 0);
  }
}

// O += P V: k-step kk covers keys 16kk .. 16kk+15, i.e. rows of the V tile (MN-major B).
__device__ __forceinline__ void issue_pv(float (&o)[64], const uint32_t (&pf)[8][4],
                                         uint32_t v_tile) {
  const uint64_t v_desc = wgmma_desc_sw128_mn(v_tile, kSlabBytes);
#pragma unroll
  for (int kk = 0; kk < kBlk / 16; ++kk)
    wgmma_rs_bf16<128, 1>(o, pf[kk], wgmma_desc_advance(v_desc, kk * 16 * 128), 1);
}

__global__ void __launch_bounds__(kThreads, 1)
    dense_fwd_kernel(const __grid_constant__ CUtensorMap q_map,  // q [T, H, 128]
                     const __grid_constant__ CUtensorMap k_map,  // k [T, Hkv, 128]
                     const __grid_constant__ CUtensorMap v_map,  // v [T, Hkv, 128]
                     const int32_t* __restrict__ cu,             // [B+1]
                     const int32_t* __restrict__ tile_off,       // [B+1] tiles per sequence
                     int64_t T, int B, int H, int Hkv, int tile_bound, float scale_log2,
                     __nv_bfloat16* __restrict__ o,              // [T, H, 128]
                     float* __restrict__ lse) {                  // [H, T]
  extern __shared__ unsigned char smem_raw[];
  // TMA's 128-byte swizzle and the wgmma descriptors need 1024-byte aligned tiles.
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));
  unsigned char* q_s = smem;                                  // [2 slabs][128][128 B]
  unsigned char* k_s = smem + kTileBytes;                     // [kStages][2][128][128 B]
  unsigned char* v_s = k_s + kStages * kTileBytes;            // [kStages][2][128][128 B]
  uint64_t* bars = reinterpret_cast<uint64_t*>(v_s + kStages * kTileBytes);
  uint64_t* q_full = bars;                                    // [1]
  uint64_t* k_full = bars + 1;                                // [kStages]
  uint64_t* v_full = bars + 1 + kStages;                      // [kStages]
  uint64_t* k_empty = bars + 1 + 2 * kStages;                 // [kStages]
  uint64_t* v_empty = bars + 1 + 3 * kStages;                 // [kStages]

  // Heavy (late) tiles first, all heads of a tile next to each other (they share K/V in L2).
  const int tile = tile_bound - 1 - static_cast<int>(blockIdx.x / H);
  const int h = static_cast<int>(blockIdx.x % H);
  if (tile >= __ldg(tile_off + B)) return;
  const int kvh = h / (H / Hkv);
  const TileInSequence ts = tile_in_sequence(tile_off, cu, B, tile, kBlk);
  const int s0 = ts.s0, n_loc = ts.n_loc, row0 = ts.row0, rows = ts.rows;
  const int n_blocks = n_loc + 1;
  const int tid = threadIdx.x;

  if (tid == 0) {
    ::cuda::ptx::mbarrier_init(q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      ::cuda::ptx::mbarrier_init(k_full + s, 1);
      ::cuda::ptx::mbarrier_init(v_full + s, 1);
      ::cuda::ptx::mbarrier_init(k_empty + s, kConsumerThreads);
      ::cuda::ptx::mbarrier_init(v_empty + s, kConsumerThreads);
    }
    ::cuda::ptx::fence_mbarrier_init(::cuda::ptx::sem_release, ::cuda::ptx::scope_cluster);
  }
  __syncthreads();

  const int wg = tid / 128;
  if (wg == 0) {
    setmaxnreg_dec<24>();
    // Producer. Query rows past the sequence end are loaded (the next sequence, or zeros past
    // T) but never written; key rows past it only occur in the diagonal block, where they
    // lie above every valid query row and are masked.
    if (tid == 0) {
      ::cuda::ptx::mbarrier_arrive_expect_tx(::cuda::ptx::sem_release, ::cuda::ptx::scope_cta,
                                             ::cuda::ptx::space_shared, q_full, kTileBytes);
      for (int slab = 0; slab < 2; ++slab)
        tma_load_3d(q_s + slab * kSlabBytes, &q_map, slab * 64, h, s0 + row0, q_full);
      for (int n = 0; n < n_blocks; ++n) {
        const int s = n % kStages;
        const uint32_t parity = ((n / kStages) - 1) & 1;
        const int key0 = s0 + n * kBlk;
        if (n >= kStages) mbarrier_wait(k_empty + s, parity);
        ::cuda::ptx::mbarrier_arrive_expect_tx(::cuda::ptx::sem_release, ::cuda::ptx::scope_cta,
                                               ::cuda::ptx::space_shared, k_full + s, kTileBytes);
        for (int slab = 0; slab < 2; ++slab)
          tma_load_3d(k_s + s * kTileBytes + slab * kSlabBytes, &k_map, slab * 64, kvh, key0,
                      k_full + s);
        if (n >= kStages) mbarrier_wait(v_empty + s, parity);
        ::cuda::ptx::mbarrier_arrive_expect_tx(::cuda::ptx::sem_release, ::cuda::ptx::scope_cta,
                                               ::cuda::ptx::space_shared, v_full + s, kTileBytes);
        for (int slab = 0; slab < 2; ++slab)
          tma_load_3d(v_s + s * kTileBytes + slab * kSlabBytes, &v_map, slab * 64, kvh, key0,
                      v_full + s);
      }
    }
    return;
  }
  setmaxnreg_inc<240>();

  const int half = wg - 1;  // this warpgroup's 64 query rows
  const int t128 = tid % 128, w = t128 / 32, g = (t128 % 32) / 4, c = t128 % 4;
  const int row_in_tile = half * 64 + 16 * w + g;  // this thread's first row; second is +8
  const uint32_t q_base = smem_u32(q_s) + half * 64 * 128;
  const uint32_t k_base = smem_u32(k_s), v_base = smem_u32(v_s);

  RowStats st;
  st.m[0] = st.m[1] = -INFINITY;
  st.l[0] = st.l[1] = 0.f;
  float sacc[64], oacc[64], corr[2];
  uint32_t pf[8][4];
#pragma unroll
  for (int i = 0; i < 64; ++i) oacc[i] = 0.f;

  mbarrier_wait(q_full, 0);

  // Block 0 alone: S(0), softmax, P(0).
  mbarrier_wait(k_full, 0);
  wgmma_fence_operands(sacc);
  wgmma_fence();
  issue_qk(sacc, q_base, k_base);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operands(sacc);
  ::cuda::ptx::mbarrier_arrive(k_empty);
  if (n_blocks == 1) online_softmax<true>(sacc, st, scale_log2, row_in_tile, c, corr);
  else online_softmax<false>(sacc, st, scale_log2, row_in_tile, c, corr);
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) acc_to_a_frag(pf[kk], sacc + 8 * kk);

  for (int n = 1; n < n_blocks; ++n) {
    const int s = n % kStages, sp = (n - 1) % kStages;
    // Both waits before the first issue: a wait loop between the two products would make ptxas
    // insert a warpgroup fence there. V(n-1) was requested before K(n), so it rarely waits.
    mbarrier_wait(v_full + sp, ((n - 1) / kStages) & 1);
    mbarrier_wait(k_full + s, (n / kStages) & 1);
    wgmma_fence_operands(sacc);
    wgmma_fence_operands(oacc);
    wgmma_fence();  // pf and oacc were written by ordinary instructions
    issue_qk(sacc, q_base, k_base + s * kTileBytes);
    wgmma_commit();
    issue_pv(oacc, pf, v_base + sp * kTileBytes);
    wgmma_commit();

    wgmma_wait<1>();  // S(n) is done; P V(n-1) may still run
    wgmma_fence_operands(sacc);
    ::cuda::ptx::mbarrier_arrive(k_empty + s);
    if (n == n_blocks - 1) online_softmax<true>(sacc, st, scale_log2, row_in_tile, c, corr);
    else online_softmax<false>(sacc, st, scale_log2, row_in_tile, c, corr);

    wgmma_wait<0>();  // P V(n-1) is done: oacc may be rescaled, pf and V(n-1) reused
    wgmma_fence_operands(oacc);
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) wgmma_fence_operands(pf[kk]);
    ::cuda::ptx::mbarrier_arrive(v_empty + sp);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      oacc[4 * j + 0] *= corr[0];
      oacc[4 * j + 1] *= corr[0];
      oacc[4 * j + 2] *= corr[1];
      oacc[4 * j + 3] *= corr[1];
    }
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) acc_to_a_frag(pf[kk], sacc + 8 * kk);
  }

  // P V of the last block.
  {
    const int sp = (n_blocks - 1) % kStages;
    mbarrier_wait(v_full + sp, ((n_blocks - 1) / kStages) & 1);
    wgmma_fence_operands(oacc);
    wgmma_fence();
    issue_pv(oacc, pf, v_base + sp * kTileBytes);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(oacc);
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) wgmma_fence_operands(pf[kk]);
    // Nobody refills this stage; the arrive keeps the barrier protocol uniform.
    ::cuda::ptx::mbarrier_arrive(v_empty + sp);
  }

  // o = O / l, lse = (m * scale * log2 e + log2 l) * ln 2.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    st.l[i] += __shfl_xor_sync(0xffffffffu, st.l[i], 1);
    st.l[i] += __shfl_xor_sync(0xffffffffu, st.l[i], 2);
  }
  const float inv[2] = {1.f / st.l[0], 1.f / st.l[1]};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = row_in_tile + 8 * i;
    if (r >= rows) continue;
    const int64_t t = static_cast<int64_t>(s0) + row0 + r;
    __nv_bfloat16* orow = o + (t * H + h) * kHeadDim;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      *reinterpret_cast<uint32_t*>(orow + 8 * j + 2 * c) =
          pack_bf16x2(oacc[4 * j + 2 * i] * inv[i], oacc[4 * j + 2 * i + 1] * inv[i]);
    }
    if (c == 0)
      lse[static_cast<int64_t>(h) * T + t] =
          (st.m[i] * scale_log2 + __log2f(st.l[i])) * kLn2;
  }
}

}  // namespace

void launch_dense_attention_forward(const MsaParams& p, cudaStream_t stream) {
  if (p.T == 0) return;
  if (p.D != kHeadDim || p.Dv != kHeadDim)
    throw Error("flashmsa: dense attention forward: head dims D = Dv = 128 only (argument 'q')");
  // Upper bound on the tiles, sum over b of ceil(len_b / 128) <= T/128 + B, known on the host
  // without reading cu_seqlens; CTAs past the device-computed total exit at once.
  const int64_t bound = (p.T + kBlk - 1) / kBlk + p.B;
  if (bound * p.H > INT_MAX)
    throw Error("flashmsa: dense attention forward: argument 'q' has too many tokens x heads");
  const StreamAllocation<int32_t> tile_alloc(p.B + 1, stream);
  int32_t* tile_off = tile_alloc.get();
  build_tile_offsets_kernel<<<1, 1024, 0, stream>>>(p.cu_seqlens, p.B, kBlk, tile_off);
  FLASHMSA_CHECK_LAUNCH();
  FLASHMSA_CUDA_CHECK(cudaFuncSetAttribute(
      dense_fwd_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
  const CUtensorMap q_map = make_bf16_row_map(p.q, p.T, p.H, kHeadDim, kBlk);
  const CUtensorMap k_map = make_bf16_row_map(p.k, p.T, p.Hkv, kHeadDim, kBlk);
  const CUtensorMap v_map = make_bf16_row_map(p.v, p.T, p.Hkv, kHeadDim, kBlk);
  const float scale_log2 = p.scale * kLog2e;
  const int tb = static_cast<int>(bound);
  dense_fwd_kernel<<<static_cast<unsigned>(bound * p.H), kThreads, kSmem, stream>>>(
      q_map, k_map, v_map, p.cu_seqlens, tile_off, p.T, p.B, p.H, p.Hkv, tb, scale_log2,
      static_cast<__nv_bfloat16*>(p.o), p.lse);
  FLASHMSA_CHECK_LAUNCH();
}

}  // namespace flashmsa::cuda
