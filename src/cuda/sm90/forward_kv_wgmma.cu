// KV-major block-sparse forward (msa.md step 5: o, lse) on warpgroup MMA with a FIXED softmax
// reference per row, for D = Dv = 128 and proxy groups of m = 4, 8 or 16 heads inside one kv head.
//
// Why KV-major: the query-major kernel (sparse_forward.cu) reads ~1 MB of K/V per (token, group)
// from L2 and is L2-bound (27 ms at m3/64k). Here one CTA loads a key block's K and V once and
// multiplies them against dense 64-row tiles of gathered query rows (64/m tokens x the m heads of
// proxy group p: the m heads of one token share its selection and its kv head).
//
// Why a fixed reference: in KV-major order a row's softmax spans K blocks owned by different CTAs.
// Instead of per-block (max, sum, o) partials and a merge, every row (t, h) uses a reference known
// before any block is processed: mref = scale * log2(e) * <q[t,h], k[t,kv(h)]>, the score of the
// token's own key. Key t is visible to t and lies in the own block, which is always selected, so
// mref <= the row's true maximum (up to the rounding of two fp32 dot products) and the row sum
// l = sum_j 2^(S_j * scale * log2 e - mref) >= ~1: it cannot underflow as a whole. Each (row,
// block) contribution is then exact and independent of the others:
//   P = 2^(S * scale * log2 e - mref), acc_o += bf16(P) V, acc_l += sum(P)   (fp32, P unrounded for l)
// and at the end o = acc_o / acc_l, lse = (mref + log2 acc_l) * ln 2. No merge, no second pass.
// Overflow rule: if a row's sum of P over some block exceeds 2^64 (any term above 2^64 does that),
// overflow[t] = 1 and the caller recomputes token t exactly (query-major). Below that, a row sums
// at most 32 blocks of <= 2^64: 2^69 * |v| stays far below fp32's 2^128, so flagged tokens are the
// only ones whose o/lse may be wrong (inf or NaN).
//
// Why chunks: an fp32 accumulator for every token (512 MB per group at m3/64k) would live in HBM
// and every reduce-add would be an HBM read-modify-write. Tokens are processed in chunks of C
// (FLASHMSA_FWD_CHUNK overrides: a multiple of 128 >= 128; either is shrunk to keep the workspace
// within its limit) per proxy group p: acc_o [C, m, 128] fp32, acc_l and mref [C, m], which stay
// in the H200's 50 MB L2 while the chunk is processed. S proxy groups (FLASHMSA_FWD_STREAMS,
// default 2, at most Hp) run concurrently, group p on helper stream p % S with that stream's own
// accumulator (the default C then splits 40 MB: 2560 tokens per stream at m = 16), forked
// from and joined back to the caller's stream by events. Per (p, chunk), on its stream:
//   finprep: finalize the previous (p, chunk) from the accumulator (o, lse) and in the same pass
//            prepare this one (mref of its rows, accumulator zeroed);
//   main:    one persistent CTA per SM takes work items (below) from a counter until none is left.
// Work items: a plan kernel (once, all chunks and groups) binary-searches each key block's list
// of the inverted selection index (common/selection_index.cuh; ascending in t) for the entries of
// the chunk and cuts them into pieces of at most max_tiles tiles (kMaxTiles unless
// FLASHMSA_FWD_ITEM_TILES says fewer), so a heavily selected block
// (block 0, the recent blocks) is spread over several CTAs instead of serialising one, and blocks
// no token of the chunk selected cost nothing.
//
// Main kernel (384 threads): warpgroup 0 is the producer (its first warp takes the items and issues
// K and V from one lane and, at m = 8 / 16, a Q tile's boxes by one lane per token; at m = 4 the
// whole warpgroup copies Q), the other two warpgroups are consumers that take alternate 64-row
// tiles of an item.
//   producer: per item, the entries' tokens into a double-buffered shared list (loaded before the
//     previous item is released, so its latency is hidden), then K of the block (TMA, 128 rows
//     past T read as zeros) once every consumer is past its last S of the previous item, the
//     item's first two Q tiles, V once every consumer is past its last PV, the other Q tiles into a
//     kStages-stage ring, lane j issuing token j's boxes. The tile is laid out as 8 groups of 8
//     rows, each group [2 slabs][8 rows][128 B] (wgmma SBO 2048), so that at m = 8 and 16 one 5-D
//     box {64 columns, 8 heads, 2 slabs, m / 8 groups, 1 token} brings a token's m rows whole.
//     Each TMA operation costs the producer a wait for the TMA unit to accept it (it also carries
//     the consumers' bulk reduce-adds): one lane issuing all of a tile's boxes, two boxes per token
//     and one bulk op per token's row sums each cost 2-12% of the forward (perf-notes). At m = 4 a
//     token is half a group (two boxes per token, 32 per tile, were the consumers' main wait at
//     fm16k), so the 128 producer threads copy the tile's rows with cp.async instead, each 64-column
//     slab of a row into the slots the 128-byte swizzle gives it: chunk c of row r at c ^ (r & 7),
//     every slab part of a group starting 1024-aligned (the same XOR key the boxes got from the
//     absolute address, and the one wgmma_desc_sw128 reads with).
//   consumer, per tile: S = Q K^T (SS, 64 x 128 x 128), the Q stage released, the causal mask only
//     where a row's token lies in the block (the own block: the only partially visible block; it
//     also hides keys past the sequence end), P = 2^(S scale log2e - mref), row sums (quad
//     shuffles) and the overflow check on them, O = P V (RS, V MN-major), then O and l into the
//     warpgroup's fp32 staging tile and, per token, ONE bulk reduce-add of its m rows (m * 512
//     bytes) into the chunk accumulator (cp.reduce.async.bulk .add.f32), issued by the thread that
//     holds the token's first row; the row sums go as red.f32 from registers (bulk ops of m * 4
//     bytes were a quarter of the TMA unit's operations per tile and cost ~2% of the forward).
//     Software-pipelined inside the warpgroup (within an item): its next tile's S goes out right
//     behind this tile's PV, so S(next) runs on the tensor core during this tile's PV wait,
//     staging and reduce-add issue. The staging
//     rows store 8-float chunk j at position j ^ (row & 3) so the accumulator-layout stores hit 4
//     bank groups x 2 rows (2 wavefronts per 256 bytes, the minimum); the accumulator keeps that
//     permutation (row & 3 = head-in-group & 3) and finprep undoes it.
//   Rows of a partial last tile are neither loaded (stale data from an earlier tile, or never
//   written shared memory) nor reduced: rows are independent in both products.
//
// Fast form (Form::fast) not deterministic: the fp32 reduce-adds into acc_o / acc_l run in no
// fixed order. Deterministic form (m = 4, 8 or 16): two passes per (p, chunk) over the same items,
// each result in fixed point (round(x * F), F a power of two from a bound), so that the integer
// sums commute and every run gives the same bits:
//   Form::det_sum: S and P only (no V, no PV): each token's m row sums leave as int64 (one bulk
//     .add.u64 of m * 8 bytes) into acc_l. A row is flagged (recomputed query-major, itself
//     deterministic) when its sum over a block exceeds 2^27 instead of 2^64, so l <= 2^27 * K.
//   kvw_det_mid_kernel: lse = (mref + log2 l) ln 2 written, and the row's reference becomes
//     ref = mref + log2 l (rows with l < 2^-8 flagged).
//   Form::det_out: the fast form's tile with P = 2^(S scale log2e - ref) <= 1, the normalised
//     probabilities, so |o| <= (sum of bf16(P)) max|v| <= ~1.004 max|v|: O leaves as INT32 (F from
//     2 max|v|, quantum ~2^-29 max|v|) in the fast form's layout and bytes (bulk .add.s32), no l.
// The one-pass int64 form it replaced (O as int64: twice the fp32 bytes, and those bytes were the
// cost) took 24.1 ms at m3/64k against the fast form's 15.3.
//
// Traffic per 64-row tile (4.2 MFLOP): 16 KB of Q in, 32 KB of fp32 O reduced out (12 KB per
// (token, group, block) against the query-major 64 KB), plus 64 KB of K/V per work item (~16
// tiles at m3/64k): ~1.05 M tiles, ~50 GB through L2 at m3/64k.
// Measured (H200, m3/64k): 27.1 ms query-major -> 19.4 (chunk 2048, one stream) -> 17.7 (chunk
// 4096) -> 15.0-15.2 (two streams); the in-warpgroup pipelining then changed nothing at 64k
// (15.3 ms) and gave 6% at 1M (454 -> 425 ms). ncu of one launch before the streams: L2 69%, SM
// 31%, SM active 83% of elapsed (per-launch ramp and tail, what the streams fill). A double-
// buffered K/V variant (staging in two halves to make room) measured slower and was dropped.
// Known costs: one K/V load latency per item, partly hidden (K and the first Q tiles load under
// the last softmax/PV/staging of the previous item), finprep's pass over the accumulator (~1 ms at
// m3/64k), 2 launches per (group, chunk).
#include "sm90/forward_kv_wgmma.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/bf16.cuh"
#include "common/check.cuh"
#include "common/fixed_point.cuh"
#include "common/mma.cuh"
#include "common/selection_index.cuh"
#include "common/stream_fork.h"
#include "common/tma.cuh"
#include "common/wgmma.cuh"

namespace flashmsa::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kBlk = 128;  // keys per block
static_assert(kBlk == kIndexBlk, "the shared selection index is built for this block size");
constexpr int kD = 128;                         // D = Dv
constexpr int kRows = 64;                       // rows of an M-tile (one consumer warpgroup)
// Q ring. 5, not 4: a consumer waits for its next tile's Q before issuing this tile's PV (the
// two products go out back to back), one stage period earlier than an unpipelined consumer, and
// the gathered q rows come from HBM; the fifth stage (16 KB of the ~29 KB left) lets the producer
// run half a warpgroup-tile further ahead. A stage serves whichever warpgroup owns its tile (one
// full barrier per stage and warpgroup: kFullBars).
constexpr int kStages = 5;
constexpr int kMaxTiles = 32;                   // tiles per work item at most
constexpr int kMaxItemTok = kMaxTiles * kRows / 4;  // tokens per item at most (m = 4)
constexpr int kThreads = 384;
constexpr int kConsumerThreads = 256;
// Default chunk: the tokens whose S fp32 output accumulators fill kAccBudget together. One stream,
// m3/64k, H200: C = 1024 / 2048 / 4096 / 8192 -> forward 25.7 / 19.4 / 17.6 / 21.8 ms (8192: 64 MB,
// past the L2); two streams at b25b95f: 2048 / 2560 / 3072 per stream -> 13.38-13.49 / 13.32-13.34
// / 13.31 ms (perf-notes).
constexpr size_t kAccBudget = size_t{40} << 20;
// A row is flagged (recomputed query-major) when its sum of P over one block exceeds this: the fast
// form's o stays finite below it; the deterministic first pass's bound on l's fixed-point range.
constexpr float kOverflowSum = 0x1p64f;
// 2^27 = 128 keys x 2^20: a block sum above it has a term above 2^20, so det_sum flags no row the
// earlier per-term rule (any term > 2^20) spared, and l's bound, K 2^27, is that rule's.
constexpr float kOverflowSumDet = 0x1p27f;

// What a main-kernel launch computes (the deterministic form takes two launches per (p, chunk)).
enum class Form { fast, det_sum, det_out };

// Shared-memory plan (byte offsets from the 1024-aligned base).
constexpr int kKSlab = kBlk * 128;              // one 64-column slab of K or V
constexpr int kKTile = 2 * kKSlab;              // [128 keys][128] bf16
// Q tile [8 groups of 8 rows][2 slabs][8 rows][128 B]: both 64-column halves of a token's rows
// arrive in one TMA box (m >= 8); wgmma steps over the 8-row groups by kQGroup (its SBO).
constexpr int kQGroup = 2 * 8 * 128;
constexpr int kQTile = kRows / 8 * kQGroup;     // [64 rows][128] bf16
constexpr int kStgBytes = kRows * kD * 4;       // [64 rows][128] fp32 per consumer warpgroup
constexpr int oK = 0;
constexpr int oV = oK + kKTile;
constexpr int oQ = oV + kKTile;
constexpr int oStg = oQ + kStages * kQTile;
constexpr int oList = oStg + 2 * kStgBytes;     // [2][kMaxItemTok] int32 tokens
constexpr int oInfo = oList + 2 * kMaxItemTok * 4;  // [2] int2 {first key row, tokens}
// Q stage "full" barriers: one per (stage, consumer warpgroup), tile tg on full[tg % kFullBars] with
// parity (tg / kFullBars) & 1. A parity wait tells apart only the current phase and the one before
// it, so each waiter must see every phase of its barrier. Tile tg belongs to warpgroup tg & 1 and
// kStages is odd, so a stage's tiles alternate between the warpgroups: with one full barrier per
// stage a warpgroup waited for every other phase only, and its wait for tile tg (phase k) could
// return at once while the other warpgroup's tile tg - kStages (phase k - 1) was still loading (its
// TMA issued before, landing after, this warpgroup's tile tg - 2). tg % (2 kStages) fixes both the
// stage and the owner, so each barrier has one waiter that sees each phase.
constexpr int kFullBars = 2 * kStages;
constexpr int oBar = oInfo + 2 * 8;  // full[kFullBars], empty[kStages], k_full, k_empty, v_full, v_empty
// [2][64] int64 row sums (Form::det_sum); 16-byte aligned: the source of bulk reduce-adds.
constexpr int oStgL64 = (oBar + (kFullBars + kStages + 4) * 8 + 15) / 16 * 16;
constexpr int kSmemBytes = oStgL64 + 2 * kRows * 8;
constexpr int kSmem = kSmemBytes + 1024;        // + alignment slack of the dynamic base
static_assert(kSmem <= 227 * 1024, "forward_kv_wgmma: shared memory over the sm_90 limit");
static_assert(oBar % 8 == 0 && oList % 16 == 0 && oStgL64 % 16 == 0,
              "alignment of the small buffers");

constexpr int kBarStg = 1;  // + consumer warpgroup index: its staging tile's two barriers
constexpr int kBarProducer = 3;  // the producer warpgroup at each item (m = 4: cp.async Q)

// S (64 rows x 128 keys) = Q tile (K-major, 8 KB slabs) x K block^T (K-major, 16 KB slabs).
// q_desc / k_desc: wgmma_desc_sw128 of the Q tile (SBO kQGroup) and of the K tile.
__device__ __forceinline__ void issue_qk(float (&s)[64], uint64_t q_desc, uint64_t k_desc) {
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks)
    wgmma_ss_bf16<128, 0, 0>(s, wgmma_desc_advance(q_desc, (ks >> 2) * 1024 + (ks & 3) * 32),
                             wgmma_desc_advance(k_desc, (ks >> 2) * kKSlab + (ks & 3) * 32), ks > 0);
}

// O = P V: k-step kk covers keys 16kk..16kk+15 (rows of the V tile, read MN-major).
// v_desc: wgmma_desc_sw128_mn(V tile, kKSlab).
__device__ __forceinline__ void issue_pv(float (&o)[64], const uint32_t (&pf)[8][4], uint64_t v_desc) {
#pragma unroll
  for (int kk = 0; kk < kBlk / 16; ++kk)
    wgmma_rs_bf16<128, 1>(o, pf[kk], wgmma_desc_advance(v_desc, kk * 16 * 128), kk > 0);
}

// ---- plan: work items of every (proxy group, chunk) ------------------------------------------

constexpr int kPlanBatch = 48;    // chunks per plan launch (kernel parameter space)
constexpr int kPlanThreads = 512;

struct PlanBatch {
  int n = 0;
  int c0[kPlanBatch];        // first token of the chunk
  int c1[kPlanBatch];        // one past its last token
  int g_lo[kPlanBatch];      // first global key block a token of the chunk can select
  int nb[kPlanBatch];        // blocks from g_lo on that it can select
  int64_t off[kPlanBatch];   // the chunk's first item slot (per group)
};

__device__ __forceinline__ int lower_bound_i32(const int32_t* __restrict__ v, int lo, int hi, int64_t x) {
  while (lo < hi) {
    const int mid = lo + ((hi - lo) >> 1);
    if (static_cast<int64_t>(__ldg(v + mid)) < x) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// Grid (chunks of the batch, Hp). For each block of the chunk's range: the list entries of
// tokens in [c0, c1), cut into pieces of at most max_tiles tiles (equal tile counts), written as
// items {first key row (packed), e0, e1, 0}; then the item count of (p, chunk).
__global__ void __launch_bounds__(kPlanThreads) kvw_plan_kernel(
    const __grid_constant__ PlanBatch pb, int chunk_base, int n_chunks,
    const int32_t* __restrict__ seg,      // [Hp*NB+1] list offsets into vals
    const int32_t* __restrict__ vals,     // [Hp*T*K] t*K + slot, ascending t per list
    const int32_t* __restrict__ cu,       // [B+1]
    const int32_t* __restrict__ blk_off,  // [B+1] first global block of each sequence
    const int32_t* __restrict__ blk_seq,  // [NB] sequence of each global block
    int NB, int K, int tok_per_tile, int max_tiles, int64_t items_per_group,
    int4* __restrict__ items,             // [Hp, items_per_group]
    int32_t* __restrict__ n_items) {      // [Hp, n_chunks]
  __shared__ int warp_sums[kPlanThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int ci = blockIdx.x, p = blockIdx.y;
  const int64_t lo_key = static_cast<int64_t>(pb.c0[ci]) * K, hi_key = static_cast<int64_t>(pb.c1[ci]) * K;
  const int nb = pb.nb[ci];
  int4* out = items + p * items_per_group + pb.off[ci];
  int running = 0;
  for (int b0 = 0; b0 < nb; b0 += kPlanThreads) {
    const int gi = b0 + static_cast<int>(threadIdx.x);
    int pieces = 0, e0 = 0, cnt = 0, per = 0, krow = 0;
    if (gi < nb) {
      const int g = pb.g_lo[ci] + gi;
      const int64_t list = static_cast<int64_t>(p) * NB + g;
      const int begin = __ldg(seg + list), end = __ldg(seg + list + 1);
      e0 = lower_bound_i32(vals, begin, end, lo_key);
      cnt = lower_bound_i32(vals, e0, end, hi_key) - e0;
      if (cnt > 0) {
        const int tiles = (cnt + tok_per_tile - 1) / tok_per_tile;
        pieces = (tiles + max_tiles - 1) / max_tiles;
        per = (tiles + pieces - 1) / pieces * tok_per_tile;
        const int b = __ldg(blk_seq + g);
        krow = __ldg(cu + b) + (g - __ldg(blk_off + b)) * kBlk;
      }
    }
    // Exclusive prefix of `pieces` over the CTA: inclusive warp scans, then the warp totals.
    int incl = pieces;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int x = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += x;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    int first = incl - pieces, total = 0;
    for (int w = 0; w < kPlanThreads / 32; ++w) {
      const int x = warp_sums[w];
      if (w < warp) first += x;
      total += x;
    }
    for (int k = 0; k < pieces; ++k)
      out[running + first + k] = make_int4(krow, e0 + k * per, e0 + min(cnt, (k + 1) * per), 0);
    running += total;
    __syncthreads();  // warp_sums is reused
  }
  if (threadIdx.x == 0) n_items[p * n_chunks + chunk_base + ci] = running;
}

// ---- finalize the previous (p, chunk), prepare the next ---------------------------------------

// One warp per accumulator row R = token * M + hh (lane: columns 4 lane .. 4 lane + 3).
// Finalize (tok < fin_n): o[t, h] = acc_o / acc_l (bf16), lse[h, t] = (mref + log2 acc_l) ln 2;
// overflow[t] = 1 where acc_l < 2^-64 (nothing selected, or every term flushed to zero).
// DET (the two-pass form): acc_o is int32 of the normalised o, o = acc_o / fx[0]; lse and the
// flags were written by kvw_det_mid_kernel.
// Prepare (tok < prep_n): mref = scale log2e <q[t, h], k[t, kvh]>, acc_o = acc_l = 0 (DET: acc_l
// int64).
template <int M, bool DET>
__global__ void __launch_bounds__(256) kvw_finprep_kernel(
    int fin_c0, int fin_n, int fin_head0,
    int prep_c0, int prep_n, int prep_head0, int prep_kvh,
    const bf16* __restrict__ q,  // [T, H, 128]
    const bf16* __restrict__ k,  // [T, Hkv, 128]
    int H, int Hkv, int64_t T, float scale_log2,
    float* __restrict__ mref,    // [C, M]
    float* __restrict__ acc_o,   // [C, M, 128] (DET: int32), 8-element chunk j stored at j ^ (hh & 3)
    float* __restrict__ acc_l,   // [C, M] (DET: int64)
    bf16* __restrict__ o,        // [T, H, 128]
    float* __restrict__ lse,     // [H, T]
    int32_t* __restrict__ overflow,  // [T]
    const float* __restrict__ fx) {  // DET: [1] fixed-point factor of acc_o
  const int lane = threadIdx.x & 31;
  const int rows = max(fin_n, prep_n) * M;
  const int warps = gridDim.x * (blockDim.x >> 5);
  for (int R = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; R < rows; R += warps) {
    const int tok = R / M, hh = R % M;
    float4* a4 = reinterpret_cast<float4*>(acc_o + static_cast<int64_t>(R) * kD) +
                 ((((lane >> 1) ^ (hh & 3)) << 1) | (lane & 1));
    if (tok < fin_n) {
      const int64_t t = static_cast<int64_t>(fin_c0) + tok;
      const int h = fin_head0 + hh;
      float4 a;
      float inv;
      if constexpr (DET) {
        const int4 x = *reinterpret_cast<const int4*>(a4);
        a = make_float4(static_cast<float>(x.x), static_cast<float>(x.y), static_cast<float>(x.z),
                        static_cast<float>(x.w));
        inv = 1.f / __ldg(fx);
      } else {
        a = *a4;
        const float l = acc_l[R];
        inv = 1.f / l;
        if (lane == 0) {
          lse[static_cast<int64_t>(h) * T + t] = (mref[R] + log2f(l)) * kLn2;
          // A row with nothing (all-padding selection, allowed by the API) or whose every term
          // underflowed (own block not selected and the reference far above the row's maximum):
          // the query-major recompute gives the exact answer (o = 0, lse = -inf when empty).
          if (!(l >= 0x1p-64f)) overflow[t] = 1;
        }
      }
      uint2 packed;
      packed.x = pack_bf16x2(a.x * inv, a.y * inv);
      packed.y = pack_bf16x2(a.z * inv, a.w * inv);
      *reinterpret_cast<uint2*>(o + (t * H + h) * kD + 4 * lane) = packed;
    }
    __syncwarp();  // every lane has read mref[R] and acc_l[R] before lane 0 rewrites them
    if (tok < prep_n) {
      const int64_t t = static_cast<int64_t>(prep_c0) + tok;
      const int h = prep_head0 + hh;
      const uint2 qa = *reinterpret_cast<const uint2*>(q + (t * H + h) * kD + 4 * lane);
      const uint2 ka = *reinterpret_cast<const uint2*>(k + (t * Hkv + prep_kvh) * kD + 4 * lane);
      const float2 q0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&qa.x));
      const float2 q1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&qa.y));
      const float2 k0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ka.x));
      const float2 k1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ka.y));
      float dot = q0.x * k0.x + q0.y * k0.y + q1.x * k1.x + q1.y * k1.y;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
      *a4 = make_float4(0.f, 0.f, 0.f, 0.f);  // all-zero bits: 0 in int32 too
      if (lane == 0) {
        mref[R] = dot * scale_log2;
        if constexpr (DET) reinterpret_cast<long long*>(acc_l)[R] = 0;
        else acc_l[R] = 0.f;
      }
    }
  }
}

// The deterministic form between its passes, one thread per row R = token * M + hh of the chunk:
// l = acc_l / fx_l (int64 sums of Form::det_sum), lse[h, t] = (mref + log2 l) ln 2, and the row's
// reference for Form::det_out becomes mref + log2 l (its P are then the normalised probabilities).
// overflow[t] = 1 where l < 2^-8: l's fixed-point quantum is 2^-30 at K = 16, so a row far below its
// reference (own block not selected) would lose digits long before 2^-64; with the own block l is
// ~1 or more. A NaN l (non-finite v: fx_l is then NaN) is flagged too.
template <int M>
__global__ void __launch_bounds__(256) kvw_det_mid_kernel(
    int c0, int n, int head0, int64_t T,
    float* __restrict__ mref,             // [C, M] in: diagonal reference; out: mref + log2 l
    const long long* __restrict__ acc_l,  // [C, M] int64
    float* __restrict__ lse,              // [H, T]
    int32_t* __restrict__ overflow,       // [T]
    const float* __restrict__ fx) {       // [2]: fx_o, fx_l
  const int rows = n * M;
  for (int R = blockIdx.x * blockDim.x + threadIdx.x; R < rows; R += gridDim.x * blockDim.x) {
    const float l = static_cast<float>(acc_l[R]) / __ldg(fx + 1);
    const float ref = mref[R] + log2f(l);
    const int64_t t = static_cast<int64_t>(c0) + R / M;
    mref[R] = ref;
    lse[static_cast<int64_t>(head0 + R % M) * T + t] = ref * kLn2;
    if (!(l >= 0x1p-8f)) overflow[t] = 1;
  }
}

// ---- the main kernel ---------------------------------------------------------------------------

template <int M, Form F>
__global__ void __launch_bounds__(kThreads, 1) kvw_fwd_kernel(
    const __grid_constant__ CUtensorMap q_map,  // q [T, H, 128] as head groups (make_bf16_head_group_map); m >= 8
    const __grid_constant__ CUtensorMap k_map,  // k [T, Hkv, 128], box {64 cols, 1, 128 rows}
    const __grid_constant__ CUtensorMap v_map,  // v [T, Hkv, 128], box {64 cols, 1, 128 rows}
    const bf16* __restrict__ q,                 // [T, H, 128]: the same q, read by cp.async at m = 4
    int H,
    const int4* __restrict__ items,             // [n] {first key row (packed), e0, e1, 0}
    const int32_t* __restrict__ n_items_ptr,    // [1] items of this (p, chunk)
    int32_t* __restrict__ counter,              // [1] zero before the launch; next item to take
    const int32_t* __restrict__ vals,           // [Hp*T*K] index entries t*K + slot
    const float* __restrict__ mref,             // [C, M] reference of each row (log2 units)
    float* __restrict__ acc_o,                  // [C, M, 128] permuted 8-element chunks: fp32 (det_out: int32)
    float* __restrict__ acc_l,                  // [C, M] fp32 (det_sum: int64; det_out: unused)
    int32_t* __restrict__ overflow,             // [T] set to 1 where a row overflows
    int K, int c0, int head0, int kvh, float scale_log2,
    const float* __restrict__ fx) {             // deterministic form: [2] fixed-point factors of acc_o, acc_l
  constexpr int kTok = kRows / M;  // tokens per tile
  static_assert(kTok <= 32, "the producer issues a tile's Q boxes one token per lane");
  static_assert(kRows % M == 0 && M % 4 == 0 && kMaxTiles * kTok <= kMaxItemTok, "group size");
  constexpr bool kWithV = F != Form::det_sum;  // det_sum: S and row sums only
  constexpr bool kCpAsyncQ = M == 4;           // Q tiles by cp.async from the producer warpgroup
  constexpr float kRowLimit = F == Form::det_sum ? kOverflowSumDet : kOverflowSum;  // see softmax
  extern __shared__ __align__(16) unsigned char kvw_smem_raw[];
  // Offset from the shared array (not an integer round trip), so the compiler keeps LDS/STS.
  unsigned char* smem = kvw_smem_raw + ((1024u - (smem_u32(kvw_smem_raw) & 1023u)) & 1023u);
  unsigned char* sK = smem + oK;                                  // [2 slabs][128][128 B]
  unsigned char* sV = smem + oV;                                  // [2 slabs][128][128 B]
  unsigned char* sQ = smem + oQ;                                  // [kStages][8 groups][2 slabs][8][128 B]
  float* sStg = reinterpret_cast<float*>(smem + oStg);            // [2 WG][64][128] fp32
  int32_t* sList = reinterpret_cast<int32_t*>(smem + oList);      // [2][kMaxItemTok] tokens
  int2* sInfo = reinterpret_cast<int2*>(smem + oInfo);            // [2] {first key row, tokens or -1}
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + oBar);      // [kFullBars] (see kFullBars)
  uint64_t* empty = full + kFullBars;                             // [kStages]
  // K (with the list and info) and V have separate barriers: a warpgroup releases K after its
  // last S of the item and V after its last PV, so the next item's K (and its first Q tiles)
  // load under the current item's last softmax / PV / staging; V follows once it is free.
  uint64_t* k_full = empty + kStages;                             // [1]
  uint64_t* k_empty = k_full + 1;                                 // [1]
  uint64_t* v_full = k_empty + 1;                                 // [1]
  uint64_t* v_empty = v_full + 1;                                 // [1]

  if (threadIdx.x == 0) {
    // TMA boxes: one arrival (lane 0's, with the bytes to expect); cp.async (m = 4): one .noinc
    // arrival per producer thread.
    for (int s = 0; s < kFullBars; ++s) ::cuda::ptx::mbarrier_init(full + s, kCpAsyncQ ? 128 : 1);
    for (int s = 0; s < kStages; ++s) ::cuda::ptx::mbarrier_init(empty + s, 128);  // the tile's warpgroup
    ::cuda::ptx::mbarrier_init(k_full, 32);              // every producer lane (its list writes)
    ::cuda::ptx::mbarrier_init(k_empty, kConsumerThreads);
    ::cuda::ptx::mbarrier_init(v_full, 1);
    ::cuda::ptx::mbarrier_init(v_empty, kConsumerThreads);
    ::cuda::ptx::fence_mbarrier_init(::cuda::ptx::sem_release, ::cuda::ptx::scope_cluster);
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    // ------------------------------------------------------------------ producer
    // Warp 0 takes the items, fills the token lists and loads K and V; the Q tiles come from
    // warp 0 (TMA boxes) or, at m = 4, from the whole warpgroup (cp.async).
    setmaxnreg_dec<40>();
    if (!kCpAsyncQ && threadIdx.x >= 32) return;
    const int lane = threadIdx.x & 31;
    const bool lead = threadIdx.x < 32;
    const int n_items = __ldg(n_items_ptr);
    int item = 0;
    if (lead) {
      item = lane == 0 ? atomicAdd(counter, 1) : 0;
      item = __shfl_sync(0xffffffffu, item, 0);
    }
    // m = 4 (a token's rows are half of an 8-row group, so TMA needs two boxes per token and its
    // unit, which also carries the bulk reduce-adds, left the consumers waiting for Q: 42% of
    // their stall samples at fm16k): a quad of threads copies each tile row (token slot row / 4,
    // head row % 4), every fourth 16-byte chunk each, into the swizzled slots a box would fill,
    // then each thread arrives (.noinc) on the tile's full barrier, rows or not. Rows of a partial
    // last tile are not loaded, as with the boxes.
    auto issue_q_cp_async = [&](const int32_t* list, int ntok, int tiles_before, int i) {
      const int tg = tiles_before + i, st = tg % kStages;
      if (tg >= kStages) mbarrier_wait(empty + st, ((tg / kStages) - 1) & 1);
      // Lane 4 qd + qi of warp w copies chunks 4 n + qi of rows ra = 16 w + qd and ra + 8 (the next
      // 8-row group, kQGroup on): 8 rows x 64 bytes per warp instruction (cp_async_row_quarter_swizzled).
      const int qd = (threadIdx.x & 31) >> 2, qi = threadIdx.x & 3, ra = (threadIdx.x >> 5) * 16 + qd;
      const int n = min(kTok, ntok - i * kTok);
      const uint32_t dst = smem_u32(sQ + st * kQTile + (ra >> 3) * kQGroup) + qd * 128 + ((qd ^ qi) << 4);
#pragma unroll 1
      for (int k = 0; k < 2; ++k) {
        const int r = ra + 8 * k;
        if ((r >> 2) < n) {
          const int64_t t = list[i * kTok + (r >> 2)];
          cp_async_row_quarter_swizzled<kQGroup / 2>(dst + k * kQGroup, q + (t * H + head0 + (r & 3)) * kD + 8 * qi,
                                                     true);
        }
      }
      cp_async_mbar_arrive_noinc(full + tg % kFullBars);
    };
    int tile_g = 0;  // tiles issued so far (ring position)
    for (int it = 0;; ++it) {
      const int buf = it & 1;
      int ntok = -1, krow = 0, e0 = 0, next = 0;
      // The list of item `it` goes to buffer it & 1, whose last reader (item it - 2) released it
      // (k_empty) before the previous iteration went on: filled while the consumers still work
      // on it - 1.
      int32_t* list = sList + buf * kMaxItemTok;
      if (lead) {
        if (item < n_items) {
          const int4 rec = __ldg(items + item);
          krow = rec.x;
          e0 = rec.y;
          ntok = rec.z - rec.y;
        }
        for (int i = lane; i < ntok; i += 32) list[i] = __ldg(vals + e0 + i) / K;
        if (lane == 0) sInfo[buf] = make_int2(krow, ntok);
        next = (lane == 0 && ntok >= 0) ? atomicAdd(counter, 1) : 0;
        next = __shfl_sync(0xffffffffu, next, 0);
      }
      if constexpr (kCpAsyncQ) {
        // The item's list and size to the other three warps. They have issued every tile of item
        // it - 1 (from the other buffer) before they arrive here, so warp 0 refills that buffer
        // (item it + 1) only after its last producer read.
        bar_sync(kBarProducer, 128);
        ntok = sInfo[buf].y;
        if (!lead) {
          if (ntok < 0) return;
          for (int i = 0, ntiles = (ntok + kTok - 1) / kTok; i < ntiles; ++i) issue_q_cp_async(list, ntok, tile_g, i);
          tile_g += (ntok + kTok - 1) / kTok;
          continue;
        }
      }
      __syncwarp();  // lane 0 reads the other lanes' list entries below
      if (it > 0) mbarrier_wait(k_empty, (it - 1) & 1);  // K and list of item it - 1 are free
      if (ntok < 0) {
        ::cuda::ptx::mbarrier_arrive(k_full);  // every lane: the consumers read ntok = -1 and stop
        return;
      }
      if (lane == 0) {
        ::cuda::ptx::mbarrier_arrive_expect_tx(::cuda::ptx::sem_release, ::cuda::ptx::scope_cta,
                                               ::cuda::ptx::space_shared, k_full, kKTile);
        for (int slab = 0; slab < 2; ++slab) tma_load_3d(sK + slab * kKSlab, &k_map, slab * 64, kvh, krow, k_full);
      } else {
        ::cuda::ptx::mbarrier_arrive(k_full);  // release: this lane's list entries
      }
      const int ntiles = (ntok + kTok - 1) / kTok;
      // Warp-wide: lane j issues token j's box (m = 8 / 16: kTok = 64 / M <= 8 tokens per tile):
      // the lanes' list reads and address math run in parallel, and only the TMA instructions
      // themselves serialise (ptxas loops over the active lanes: uniform operands). The __syncwarp puts
      // lane 0's expect_tx and arrival before every box (the phase could not complete early even
      // without it: lane 0's arrival is the one the barrier waits for).
      auto issue_q = [&](int i) {
        if constexpr (kCpAsyncQ) {
          issue_q_cp_async(list, ntok, tile_g, i);
          return;
        }
        const int tg = tile_g + i, st = tg % kStages;
        uint64_t* const fb = full + tg % kFullBars;
        if (tg >= kStages) mbarrier_wait(empty + st, ((tg / kStages) - 1) & 1);
        const int n = min(kTok, ntok - i * kTok);
        if (lane == 0)
          ::cuda::ptx::mbarrier_arrive_expect_tx(::cuda::ptx::sem_release, ::cuda::ptx::scope_cta,
                                                 ::cuda::ptx::space_shared, fb, n * M * kD * 2);
        __syncwarp();
        if (lane < n) {
          unsigned char* tile = sQ + st * kQTile;
          const int t = list[i * kTok + lane];
          // Token `lane`: rows lane * M .. + M - 1 = M / 8 whole groups, one box.
          tma_load_5d(tile + lane * (M / 8) * kQGroup, &q_map, 0, 0, 0, head0 / 8, t, fb);
        }
      };
      // Each warpgroup's first tile before V: their stages are freed by S products of earlier
      // items, which need nothing issued below. Not more: a warpgroup's later tiles wait for
      // stages it frees only after its first PV, which needs V.
      const int early = min(ntiles, 2);
      for (int i = 0; i < early; ++i) issue_q(i);
      if (kWithV && it > 0) mbarrier_wait(v_empty, (it - 1) & 1);  // V of item it - 1 is free
      if constexpr (kWithV) {
        if (lane == 0) {
          ::cuda::ptx::mbarrier_arrive_expect_tx(::cuda::ptx::sem_release, ::cuda::ptx::scope_cta,
                                                 ::cuda::ptx::space_shared, v_full, kKTile);
          for (int slab = 0; slab < 2; ++slab) tma_load_3d(sV + slab * kKSlab, &v_map, slab * 64, kvh, krow, v_full);
        }
      }
      for (int i = early; i < ntiles; ++i) issue_q(i);
      tile_g += ntiles;
      item = next;
    }
  }

  // -------------------------------------------------------------------- consumers
  setmaxnreg_inc<232>();
  const int cw = wg - 1;  // this warpgroup takes the tiles with (global tile index & 1) == cw
  const int ct = threadIdx.x & 127, w = ct >> 5, lane = ct & 31, g = lane >> 2, c = lane & 3;
  const int r0 = 16 * w + g, r1 = r0 + 8;  // this thread's two accumulator rows
  const int slot0 = r0 / M, slot1 = r1 / M, hh0 = r0 % M, hh1 = r1 % M;
  const int perm = r0 & 3;                 // = hh0 & 3 = hh1 & 3 (M is a multiple of 4)
  // A token's reduce-adds are issued by the thread holding its first row (head 0) in column
  // quad 0: it knows the token from its own row metadata, so no list read is left after the
  // last product of an item (K, V and the list can be released before the last staging), and
  // the issue is spread over the warps instead of serialised on one thread.
  const bool own0 = c == 0 && hh0 == 0, own1 = c == 0 && hh1 == 0;
  const bool issuer = own0 || own1;
  float* stg = sStg + cw * kRows * kD;
  const uint32_t stg_u32 = smem_u32(stg);
  const uint64_t k_desc = wgmma_desc_sw128(smem_u32(sK)), v_desc = wgmma_desc_sw128_mn(smem_u32(sV), kKSlab);
  const uint64_t q_desc0 = wgmma_desc_sw128(smem_u32(sQ), kQGroup);  // stage 0
  // Staging: column chunk j = 4a + b of a row goes to chunk 4a + (b ^ perm) (see the header), so
  // four per-thread bases (b = 0..3) and immediate offsets (a, the second row) cover every store.
  float* stg_base[4];
#pragma unroll
  for (int b = 0; b < 4; ++b) stg_base[b] = stg + r0 * kD + ((b ^ perm) << 3) + 2 * c;

  // Row metadata of one tile: tokens, references, mask limits (key column j is visible to a row
  // iff j <= lim: lim >= 127 everywhere but in the row token's own block), its Q stage.
  struct TileRows {
    int t0, t1, lim0, lim1, st;
    float mr0, mr1;
    bool ok0, ok1;
  };
  // Issues tile i's S = Q K^T into s (one commit group; the caller has waited for its Q stage,
  // full[tg % kFullBars]); then its rows' metadata, whose global mref loads run under the product
  // and whatever the warpgroup does before the softmax.
  auto start_tile = [&](float (&s)[64], const int32_t* list, int ntok, int krow, int i, int tg) {
    TileRows tr;
    tr.st = tg % kStages;
    wgmma_fence_operands(s);
    wgmma_fence();
    issue_qk(s, wgmma_desc_advance(q_desc0, tr.st * kQTile), k_desc);
    wgmma_commit();
    const int n = min(kTok, ntok - i * kTok);
    tr.ok0 = slot0 < n;
    tr.ok1 = slot1 < n;
    tr.t0 = tr.ok0 ? list[i * kTok + slot0] : 0;
    tr.t1 = tr.ok1 ? list[i * kTok + slot1] : 0;
    tr.mr0 = tr.ok0 ? __ldg(mref + (tr.t0 - c0) * M + hh0) : 0.f;
    tr.mr1 = tr.ok1 ? __ldg(mref + (tr.t1 - c0) * M + hh1) : 0.f;
    tr.lim0 = tr.ok0 ? tr.t0 - krow : kBlk - 1;
    tr.lim1 = tr.ok1 ? tr.t1 - krow : kBlk - 1;
    return tr;
  };

  // O (this thread's accumulator elements) and the row sums of a finished tile into the
  // warpgroup's staging tile, then each token's reduce-adds into the chunk accumulator.
  auto stage_reduce = [&](const float (&o)[64], const TileRows& tr, float l0, float l1) {
    // As late as possible: the previous tile's reduce-adds must have finished reading the staging.
    if (issuer) bulk_wait_group_read<0>();
    bar_sync(kBarStg + cw, 128);
    if constexpr (F == Form::det_sum) {
      long long* const stg_l64 = reinterpret_cast<long long*>(smem + oStgL64) + cw * kRows;
      if (c == 0) {
        const float fx_l = __ldg(fx + 1);
        stg_l64[r0] = __float2ll_rn(l0 * fx_l);
        stg_l64[r1] = __float2ll_rn(l1 * fx_l);
      }
      fence_proxy_async_shared();
      bar_sync(kBarStg + cw, 128);
      if (issuer) {
        long long* const acc_l64 = reinterpret_cast<long long*>(acc_l);
        const uint32_t src = smem_u32(stg_l64);
        // Token t's m sums start at staging row r.
        auto reduce_token = [&](int t, int r) {
          bulk_reduce_add_u64(acc_l64 + static_cast<int64_t>(t - c0) * M, src + r * 8, M * 8);
        };
        if (own0 && tr.ok0) reduce_token(tr.t0, r0);
        if (own1 && tr.ok1) reduce_token(tr.t1, r1);
        bulk_commit_group();
      }
      return;
    }
    // det_out: O as int32 of the normalised output (the staging holds the bits either way).
    const float fx_o = F == Form::det_out ? __ldg(fx) : 1.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      float* const at0 = stg_base[j & 3] + (j >> 2) * 32;  // row r0
      float* const at1 = at0 + 8 * kD;                     // row r1 = r0 + 8
      if constexpr (F == Form::det_out) {
        *reinterpret_cast<int2*>(at0) =
            make_int2(__float2int_rn(o[4 * j] * fx_o), __float2int_rn(o[4 * j + 1] * fx_o));
        *reinterpret_cast<int2*>(at1) =
            make_int2(__float2int_rn(o[4 * j + 2] * fx_o), __float2int_rn(o[4 * j + 3] * fx_o));
      } else {
        *reinterpret_cast<float2*>(at0) = make_float2(o[4 * j], o[4 * j + 1]);
        *reinterpret_cast<float2*>(at1) = make_float2(o[4 * j + 2], o[4 * j + 3]);
      }
    }
    if constexpr (F != Form::det_out) {
      // The row sums as plain reductions (4 bytes per row, a warp's 8 rows share a sector), not
      // bulk ops: the TMA unit, which carries the Q loads and O's bulk reduce-adds, then issues a
      // quarter fewer operations per tile.
      if (c == 0) {
        if (tr.ok0) atomicAdd(acc_l + static_cast<int64_t>(tr.t0 - c0) * M + hh0, l0);
        if (tr.ok1) atomicAdd(acc_l + static_cast<int64_t>(tr.t1 - c0) * M + hh1, l1);
      }
    }
    fence_proxy_async_shared();  // generic writes of the staging before the async-proxy reads
    bar_sync(kBarStg + cw, 128);
    if (issuer) {
      // Token t's m rows start at staging row r.
      auto reduce_token = [&](int t, int r) {
        const int64_t row = static_cast<int64_t>(t - c0) * M;
        if constexpr (F == Form::det_out) {
          bulk_reduce_add_s32(reinterpret_cast<int32_t*>(acc_o) + row * kD, stg_u32 + r * kD * 4, M * kD * 4);
        } else {
          bulk_reduce_add_f32(acc_o + row * kD, stg_u32 + r * kD * 4, M * kD * 4);
        }
      };
      if (own0 && tr.ok0) reduce_token(tr.t0, r0);
      if (own1 && tr.ok1) reduce_token(tr.t1, r1);
      bulk_commit_group();
    }
  };

  // Softmax of a finished S (this thread's two rows): causal mask in the own block,
  // P = 2^(S scale log2e - mref) into the bf16 A fragments of the PV product, row sums and the
  // overflow flags from them.
  // det_out: no flags and no sums (mref = the row's lse in log2 units: P <= 1; a row flagged by
  // det_sum is recomputed whatever it gets here); det_sum: no A fragments.
  auto softmax = [&](float (&s)[64], const TileRows& tr, uint32_t (&pf)[8][4], float& l0, float& l1) {
    if (tr.lim0 < kBlk - 1 || tr.lim1 < kBlk - 1) {
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = 8 * j + 2 * c + (e & 1);
          if (col > ((e & 2) ? tr.lim1 : tr.lim0)) s[4 * j + e] = -INFINITY;
        }
    }
    l0 = 0.f;
    l1 = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      s[4 * j + 0] = fast_exp2(fmaf(s[4 * j + 0], scale_log2, -tr.mr0));
      s[4 * j + 1] = fast_exp2(fmaf(s[4 * j + 1], scale_log2, -tr.mr0));
      s[4 * j + 2] = fast_exp2(fmaf(s[4 * j + 2], scale_log2, -tr.mr1));
      s[4 * j + 3] = fast_exp2(fmaf(s[4 * j + 3], scale_log2, -tr.mr1));
      if constexpr (F != Form::det_out) {
        l0 += s[4 * j] + s[4 * j + 1];
        l1 += s[4 * j + 2] + s[4 * j + 3];
      }
    }
    if constexpr (F != Form::det_out) {
      l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
      l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
      l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
      l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
      // Overflow from the row's sum over this block rather than its maximum (no 64-step max per
      // tile): any term above the limit puts the sum above it, ex2 of a huge exponent gives inf
      // and a NaN score (non-finite q or k) a NaN sum, all caught by one compare; a row whose
      // terms stay below the limit but sum above it (at most 128 of them) is flagged too, which
      // costs only its recompute. det_sum: fixed point would turn a non-finite sum into finite
      // garbage, so the query-major recompute carries it as the fast form does.
      if (tr.ok0 && !(l0 <= kRowLimit)) overflow[tr.t0] = 1;
      if (tr.ok1 && !(l1 <= kRowLimit)) overflow[tr.t1] = 1;
    }
    if constexpr (F != Form::det_sum) {
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) acc_to_a_frag(pf[kk], s + 8 * kk);
    }
  };
  auto start_pv = [&](float (&o)[64], const uint32_t (&pf)[8][4]) {
    if constexpr (!kWithV) return;  // det_sum: S only (its wait<1> below then waits for nothing)
    wgmma_fence_operands(o);
    wgmma_fence();  // pf was written by ordinary instructions
    issue_pv(o, pf, v_desc);
    wgmma_commit();
  };

  // Per warpgroup, software-pipelined over its tiles of an item: S(i+2) is issued right after
  // PV(i), so the tensor core works on it while this warpgroup waits for PV(i), stages O(i) and
  // issues its reduce-adds; only softmax(i+2) waits for S(i+2). Live at the peak: o and s (both
  // products in flight) and pf (read by PV(i)): 160 registers. The pipeline does not cross
  // items (one K/V buffer), but K is released after the item's last S and V after its last PV.
  // Shape for ptxas: the two products are issued back to back with no branch between them and
  // the loop exit sits before them; a branch between PV(i) and S(i+2), or a product inside a
  // branch, makes ptxas serialise every wgmma of the kernel (C7514 / C7518).
  // Tile tg's Q has landed. cp.async writes through the generic proxy: fenced before wgmma reads it.
  auto wait_q = [&](int tg) {
    mbarrier_wait(full + tg % kFullBars, (tg / kFullBars) & 1);
    if constexpr (kCpAsyncQ) fence_proxy_async_shared();
  };
  float s[64];
  float o[64];
  uint32_t pf[8][4];
  int tile_g = 0;
  for (int it = 0;; ++it) {
    const int buf = it & 1;
    mbarrier_wait(k_full, it & 1);
    const int2 info = sInfo[buf];
    const int krow = info.x, ntok = info.y;
    if (ntok < 0) break;
    const int32_t* list = sList + buf * kMaxItemTok;
    const int ntiles = (ntok + kTok - 1) / kTok;
    int i = (tile_g & 1) == cw ? 0 : 1;  // this warpgroup's first tile of the item
    if (i >= ntiles) {
      ::cuda::ptx::mbarrier_arrive(k_empty);  // nothing of this item for this warpgroup
      if constexpr (kWithV) {
        // V only once this item's V has landed: (1) the other warpgroup may still run its last PV
        // of the previous item (k_full of this item does not wait for the producer's v_empty wait),
        // and an arrival now would complete the PREVIOUS item's v_empty phase (256 arrivals, 128 of
        // them this warpgroup's second): V of this item would be loaded under that PV; (2) every
        // waiter must see every v_full phase (parity waits), or its next wait could return for the
        // previous item's V still in flight. V of this item is issued after the previous v_empty phase.
        mbarrier_wait(v_full, it & 1);
        ::cuda::ptx::mbarrier_arrive(v_empty);
      }
      tile_g += ntiles;
      continue;
    }
    wait_q(tile_g + i);
    TileRows cur = start_tile(s, list, ntok, krow, i, tile_g + i);
    float l0, l1;
    wgmma_wait<0>();
    wgmma_fence_operands(s);
    ::cuda::ptx::mbarrier_arrive(empty + cur.st);  // the Q stage is no longer read
    // K and the list are read by S products and start_tile only: free after the last S.
    if (i + 2 >= ntiles) ::cuda::ptx::mbarrier_arrive(k_empty);
    softmax(s, cur, pf, l0, l1);
    if constexpr (kWithV) mbarrier_wait(v_full, it & 1);  // V of this item, before its first PV
    for (;;) {
      const int inext = i + 2;
      if (inext >= ntiles) break;
      // The next tile's Q (usually long loaded: the ring runs ahead) before PV(i), so that the
      // two products go out back to back.
      wait_q(tile_g + inext);
      start_pv(o, pf);
      const TileRows nxt = start_tile(s, list, ntok, krow, inext, tile_g + inext);
      wgmma_wait<1>();  // PV(i); S(i + 2) may still run
      wgmma_fence_operands(o);
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) wgmma_fence_operands(pf[kk]);
      stage_reduce(o, cur, l0, l1);
      wgmma_wait<0>();  // S(i + 2)
      wgmma_fence_operands(s);
      ::cuda::ptx::mbarrier_arrive(empty + nxt.st);  // the Q stage is no longer read
      if (inext + 2 >= ntiles) ::cuda::ptx::mbarrier_arrive(k_empty);
      cur = nxt;
      i = inext;
      softmax(s, cur, pf, l0, l1);
    }
    // The item's last tile of this warpgroup.
    start_pv(o, pf);
    wgmma_wait<0>();
    wgmma_fence_operands(o);
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) wgmma_fence_operands(pf[kk]);
    // This thread's last read of V is behind it (the reduce-adds take their tokens from
    // registers): the producer may load the next item's V under this tile's staging.
    if constexpr (kWithV) ::cuda::ptx::mbarrier_arrive(v_empty);
    stage_reduce(o, cur, l0, l1);
    tile_g += ntiles;
  }
  if (issuer) bulk_wait_group<0>();  // no bulk op outlives the CTA's shared memory
}

// ---- host side ----------------------------------------------------------------------------------

// An integer knob of the environment in [lo, hi], read per call; unset, malformed or out of range
// gives `fallback`.
int env_int(const char* name, long lo, long hi, int fallback) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return fallback;
  char* end = nullptr;
  const long v = std::strtol(s, &end, 10);
  if (*end != '\0' || v < lo || v > hi) return fallback;
  return static_cast<int>(v);
}

// FLASHMSA_FWD_STREAMS (1 .. kMaxStreams): how many proxy groups run their (finprep, main)
// sequences concurrently, each on its own helper stream with its own accumulator. 1 keeps
// everything on the caller's stream (no events).
constexpr int kMaxStreams = kMaxHelperStreams;
constexpr int kDefaultStreams = 2;
int stream_count() { return env_int("FLASHMSA_FWD_STREAMS", 1, kMaxStreams, kDefaultStreams); }

// FLASHMSA_FWD_CHUNK (tokens per chunk and stream; a multiple of 128, >= 128); anything else gives
// the default: the S concurrent output accumulators (4 bytes per element in both forms) share
// kAccBudget, so that all of them stay in L2 together (2560 tokens at m = 16, S = 2). plan_kvw may
// shrink either (see there).
int chunk_tokens(int m, int streams) {
  const size_t per_token = static_cast<size_t>(m) * kD * 4 * static_cast<size_t>(streams);
  const int fallback = std::max(kBlk, static_cast<int>(kAccBudget / per_token / kBlk * kBlk));
  const int v = env_int("FLASHMSA_FWD_CHUNK", kBlk, 1L << 24, fallback);
  return v % kBlk == 0 ? v : fallback;
}

// FLASHMSA_FWD_ITEM_TILES (1 .. kMaxTiles): tiles per work item at most.
int item_tiles() { return env_int("FLASHMSA_FWD_ITEM_TILES", 1, kMaxTiles, kMaxTiles); }

struct KvwPlan {
  SelectionIndexPlan sel;
  Workspace ws;
  int m = 0, tok_per_tile = 0, C = 0, Ceff = 0, n_chunks = 0;
  int max_tiles = kMaxTiles;    // tiles per work item at most (FLASHMSA_FWD_ITEM_TILES)
  int S = 1;                    // concurrent group sequences (helper streams), <= Hp
  std::vector<int> c0, c1, g_lo, nb;
  std::vector<int64_t> off;     // per chunk: first item slot inside a group's region
  std::vector<int64_t> bound;   // per chunk: items at most
  int64_t items_per_group = 0;
  // items [Hp, items_per_group]; n_items and the item counters of each main launch (two in the
  // deterministic form) [Hp, chunks] each
  size_t o_items = 0, o_counts = 0;
  size_t o_acc = 0, acc_stride = 0;  // S chunk accumulators {acc_o, acc_l, mref}, acc_stride bytes apart
  size_t d_acc_l = 0, d_mref = 0;    // offsets of acc_l and mref inside one accumulator
  size_t o_fx = 0;                   // deterministic form: max|v| bits, fx_o, fx_l
  size_t index_bytes = 0;            // the selection index's share (independent of the chunk)
};

// Sizes and chunk ranges for S streams (1 .. Hp) and chunks of C tokens, from the host copy of
// cu_seqlens (O(B + chunks log B) host work).
KvwPlan plan_kvw_chunks(const MsaParams& p, int S, int C) {
  const bool det = p.deterministic;  // the two-pass fixed-point form
  KvwPlan pl;
  pl.sel = selection_index_sizes(p);
  reserve_selection_lists(pl.sel, p, pl.ws, nullptr);
  // The index's scratch (keys, values, cub's storage: 12 B per entry and more) lives in the caller's
  // o, which nothing writes before the first finalize, long after the index is built; o's bytes are
  // 64 m / (3 K) times the entries' 12 B (bf16, Dv = 128: 5.3 x at fm16k). Else in the workspace.
  const size_t o_bytes = static_cast<size_t>(p.T) * p.H * p.Dv * sizeof(bf16);
  if (!place_selection_scratch_outside(pl.sel, p.o, o_bytes)) place_selection_scratch(pl.sel, pl.ws);
  pl.index_bytes = pl.ws.size();
  pl.m = p.H / p.Hp;
  pl.tok_per_tile = kRows / pl.m;
  pl.S = S;
  pl.C = C;
  pl.max_tiles = item_tiles();
  pl.Ceff = static_cast<int>(std::min<int64_t>(pl.C, p.T));
  pl.n_chunks = static_cast<int>((p.T + pl.C - 1) / pl.C);
  const int32_t* cu = p.cu_seqlens_host;
  std::vector<int> blk_off(p.B + 1, 0);
  for (int b = 0; b < p.B; ++b) blk_off[b + 1] = blk_off[b] + (cu[b + 1] - cu[b] + kBlk - 1) / kBlk;
  // Last sequence b with cu[b] <= t: the (non-empty) sequence holding token t < T.
  auto seq_of = [&](int64_t t) {
    return static_cast<int>(std::upper_bound(cu, cu + p.B + 1, t) - cu) - 1;
  };
  for (int c = 0; c < pl.n_chunks; ++c) {
    const int64_t a = static_cast<int64_t>(c) * pl.C, z = std::min<int64_t>(p.T, a + pl.C);
    const int s_lo = seq_of(a), s_hi = seq_of(z - 1);
    // Blocks of the sequences the chunk touches, from the first of its first sequence (earlier
    // blocks of that sequence are visible to its tokens) to the one holding its last token.
    const int g_lo = blk_off[s_lo];
    const int g_hi = blk_off[s_hi] + static_cast<int>((z - 1 - cu[s_hi]) / kBlk);
    const int nb = g_hi - g_lo + 1;
    // Items: sum over blocks of ceil(tiles / max_tiles) <= nb + (sum of tiles) / max_tiles, and
    // sum of tiles <= entries / tok_per_tile + nb with entries <= tokens * K.
    const int64_t entries = (z - a) * p.top_k;
    const int64_t bound = nb + ((entries + pl.tok_per_tile - 1) / pl.tok_per_tile + nb) / pl.max_tiles + 1;
    pl.c0.push_back(static_cast<int>(a));
    pl.c1.push_back(static_cast<int>(z));
    pl.g_lo.push_back(g_lo);
    pl.nb.push_back(nb);
    pl.off.push_back(pl.items_per_group);
    pl.bound.push_back(bound);
    pl.items_per_group += bound;
  }
  pl.o_items = pl.ws.add(static_cast<size_t>(p.Hp) * pl.items_per_group * sizeof(int4));
  pl.o_counts = pl.ws.add((det ? 3 : 2) * static_cast<size_t>(p.Hp) * pl.n_chunks * sizeof(int32_t));
  // The S chunk accumulators reuse the index's unsorted keys, sorted keys and unsorted values
  // (contiguous, dead once the list offsets are built: dead_bytes, 0 when they are in o) when the
  // accumulators fit there.
  // acc_o fp32 or int32, acc_l fp32 or int64 (deterministic form), mref fp32 (in acc_l's size).
  const size_t acc_o = static_cast<size_t>(pl.Ceff) * pl.m * kD * 4,
               acc_row = static_cast<size_t>(pl.Ceff) * pl.m * (det ? 8 : 4);
  const size_t acc_o_padded = Workspace::padded(acc_o), acc_row_padded = Workspace::padded(acc_row);
  pl.acc_stride = acc_o_padded + 2 * acc_row_padded;
  pl.d_acc_l = acc_o_padded;
  pl.d_mref = acc_o_padded + acc_row_padded;
  const size_t need = pl.acc_stride * static_cast<size_t>(pl.S);
  if (need <= pl.sel.dead_bytes) {
    pl.o_acc = pl.sel.o_keys_in;
  } else {
    pl.o_acc = pl.ws.add(need);
  }
  if (det) pl.o_fx = pl.ws.add(3 * sizeof(float));
  return pl;
}

// performance.md's memory goal for the forward: size(q) / 2 (bf16 q, D = 128 here), less the
// caller's redo flags and list and a caller's selection index, live beside this workspace (the
// index, held from the forward to the backward, is counted as the step's memory, not as an output).
size_t kvw_workspace_goal(const MsaParams& p) {
  int64_t beside = redo_flag_ints(p.T);
  if (p.selection_index != nullptr) beside += selection_index_layout(p.T, p.B, p.Hp, p.top_k, kIndexBlk).size;
  return static_cast<size_t>(std::max<int64_t>(p.T * p.H * p.D - beside * int64_t{sizeof(int32_t)}, 0));
}

// The path's workspace limit: the goal, or 64 MiB: small problems (a few thousand tokens) would
// otherwise lose the path to the index's fixed costs.
size_t kvw_workspace_limit(const MsaParams& p) { return std::max<size_t>(kvw_workspace_goal(p), size_t{64} << 20); }

// The plan with the default (or FLASHMSA_FWD_CHUNK's) chunk C0, shrunk by eighths while the
// workspace exceeds the limit (a workspace over it costs the whole path: the caller then takes
// the query-major kernel, ~4x slower at fm16k), or exceeds the goal while the chunk is above
// C0 / 2: a smaller chunk costs a little speed (fm16k: none at 6144 of 10240 tokens, +4% at 4096,
// +26% at 2048), so below C0 / 2 the goal gives way to speed. The accumulators shrink with the
// chunk while the item lists grow a little; a small FLASHMSA_FWD_ITEM_TILES raises the item
// bound and can shrink the chunk too.
KvwPlan plan_kvw(const MsaParams& p, int streams) {
  const int S = std::max(1, std::min(streams, p.Hp));
  // A chunk past the sequence end changes nothing: start at most one block-rounded T.
  const int C0 = static_cast<int>(std::min<int64_t>(chunk_tokens(p.H / p.Hp, S), (p.T + kBlk - 1) / kBlk * kBlk));
  const size_t limit = kvw_workspace_limit(p), goal = kvw_workspace_goal(p);
  for (int C = C0;;) {
    KvwPlan pl = plan_kvw_chunks(p, S, C);
    const bool over = pl.ws.size() > limit || (pl.ws.size() > goal && 2 * C > C0);
    // No chunk fits when the index alone does not: no walk down to 128 tokens then.
    if (!over || C <= kBlk || pl.index_bytes >= limit) return pl;
    C = std::max(kBlk, C - std::max(kBlk, C / 8 / kBlk * kBlk));
  }
}

// The deterministic form's fixed-point factors (fx: [3] = max|v| as float bits, fx_o, fx_l):
// fx_l (int64) from l <= K blocks x kOverflowSumDet (det_sum flags a larger block sum);
// fx_o (int32) from |o| <= (sum of a row's bf16(P)) max|v| <= 2 max|v| (det_out's P are the
// normalised probabilities, each rounded to bf16). A non-finite v makes both factors NaN: every
// row's l is then NaN, kvw_det_mid_kernel flags it and the query-major kernel recomputes it,
// carrying the NaN exactly where the fast form would, instead of the finite garbage of integer
// sums over NaN terms (a slow path, taken only for such inputs). A non-finite q or k is caught per
// token by det_sum (its row sum).
__global__ void kvw_det_factors_kernel(int K, float* __restrict__ fx) {
  const float l_bound = static_cast<float>(K) * kOverflowSumDet;
  fx[1] = fixed_point_factor(2.f * fx[0], 30);  // fx[0]: non-negative float bits read as a float
  fx[2] = fixed_point_factor(l_bound);
  if (!isfinite(fx[0])) fx[1] = fx[2] = __int_as_float(0x7fc00000);
}

template <int M, bool DET>
void run_kvw(const MsaParams& p, int32_t* overflow, cudaStream_t stream) {
  // Lanes under a graph capture too: the helper streams are this thread's (helper_stream), and
  // usable_lanes keeps one lane where they are taken by another capture.
  int device = 0;
  FLASHMSA_CUDA_CHECK(cudaGetDevice(&device));
  KvwPlan pl = plan_kvw(p, usable_lanes(stream, device, std::min(stream_count(), p.Hp)));
  // Everything that can fail without side effects, before the workspace exists.
  // m = 4 reads q by cp.async (the kernel takes the map but never reads it).
  const CUtensorMap q_map = M >= 8 ? make_bf16_head_group_map(p.q, p.T, p.H, M / 8) : CUtensorMap{};
  const CUtensorMap k_map = make_bf16_row_map(p.k, p.T, p.Hkv, kD, kBlk);
  const CUtensorMap v_map = make_bf16_row_map(p.v, p.T, p.Hkv, kD, kBlk);
  constexpr Form kFirst = DET ? Form::det_sum : Form::fast;
  FLASHMSA_CUDA_CHECK(cudaFuncSetAttribute(kvw_fwd_kernel<M, kFirst>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  if constexpr (DET)
    FLASHMSA_CUDA_CHECK(
        cudaFuncSetAttribute(kvw_fwd_kernel<M, Form::det_out>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const int sms = sm_count(device);
  const float scale_log2 = p.scale * kLog2e;
  const int r = p.H / p.Hkv;
  const auto* q = static_cast<const bf16*>(p.q);
  const auto* k = static_cast<const bf16*>(p.k);
  auto* o = static_cast<bf16*>(p.o);

  Workspace& ws = pl.ws;
  ws.allocate(stream);
  {  // On an error the fork (below) joins its helpers at this block's end, then ~Workspace frees ws.
    build_selection_index(p, pl.sel, ws, stream);
    FLASHMSA_CUDA_CHECK(cudaMemsetAsync(overflow, 0, sizeof(int32_t) * p.T, stream));
    const float* fx = nullptr;  // DET: {fx_o, fx_l}
    if constexpr (DET) {
      float* f = ws.at<float>(pl.o_fx);
      FLASHMSA_CUDA_CHECK(cudaMemsetAsync(f, 0, 3 * sizeof(float), stream));
      const int64_t n8 = p.T * p.Hkv * kD / 8;
      absmax_kernel<<<grid_for(n8, 256, 4096), 256, 0, stream>>>(static_cast<const bf16*>(p.v), n8,
                                                                reinterpret_cast<unsigned int*>(f));
      FLASHMSA_CHECK_LAUNCH();
      kvw_det_factors_kernel<<<1, 1, 0, stream>>>(p.top_k, f);
      FLASHMSA_CHECK_LAUNCH();
      fx = f + 1;
    }
    const int slots = p.Hp * pl.n_chunks;
    int32_t* n_items = ws.at<int32_t>(pl.o_counts);  // [Hp, chunks]
    int32_t* counters = n_items + slots;             // [1 or 2 launches][Hp, chunks]
    FLASHMSA_CUDA_CHECK(cudaMemsetAsync(counters, 0, sizeof(int32_t) * slots * (DET ? 2 : 1), stream));
    int4* items = ws.at<int4>(pl.o_items);
    for (int cb = 0; cb < pl.n_chunks; cb += kPlanBatch) {
      PlanBatch pb;
      pb.n = std::min(kPlanBatch, pl.n_chunks - cb);
      for (int i = 0; i < pb.n; ++i) {
        pb.c0[i] = pl.c0[cb + i];
        pb.c1[i] = pl.c1[cb + i];
        pb.g_lo[i] = pl.g_lo[cb + i];
        pb.nb[i] = pl.nb[cb + i];
        pb.off[i] = pl.off[cb + i];
      }
      kvw_plan_kernel<<<dim3(pb.n, p.Hp), kPlanThreads, 0, stream>>>(
          pb, cb, pl.n_chunks, pl.sel.seg(ws), pl.sel.vals(ws), p.cu_seqlens,
          pl.sel.blk_off(ws), pl.sel.blk_seq(ws), pl.sel.NB, p.top_k, pl.tok_per_tile,
          pl.max_tiles, pl.items_per_group, items, n_items);
      FLASHMSA_CHECK_LAUNCH();
    }

    // Group g's (p, chunk) sequence runs on lane g % S with that lane's accumulator; the lanes
    // touch disjoint heads of o / lse, disjoint item counters and accumulators, and overflow only
    // with stores of 1, so they are independent. With one persistent CTA per SM, one lane's main
    // kernel fills the SMs another lane's launch leaves idle during its ramp and tail.
    // The fork comes after everything above (allocation, index, plan) on the caller's stream; the
    // join before the workspace is freed (the fork's destructor joins on the error path).
    StreamFork fork(stream, device, pl.S > 1 ? pl.S : 0);
    struct Lane {
      cudaStream_t st = nullptr;
      float* acc_o = nullptr;  // [Ceff, M, 128]
      float* acc_l = nullptr;  // [Ceff, M]
      float* mref = nullptr;   // [Ceff, M]
      int c_prev = -1, g_prev = 0;
    };
    std::vector<Lane> lane(static_cast<size_t>(pl.S));
    for (int l = 0; l < pl.S; ++l) {
      unsigned char* acc = ws.at<unsigned char>(pl.o_acc + pl.acc_stride * static_cast<size_t>(l));
      lane[l].st = pl.S > 1 ? fork[l] : stream;
      lane[l].acc_o = reinterpret_cast<float*>(acc);
      lane[l].acc_l = reinterpret_cast<float*>(acc + pl.d_acc_l);
      lane[l].mref = reinterpret_cast<float*>(acc + pl.d_mref);
    }
    // finprep on lane L: finalize (c_f, p_f) if any, prepare (c_n, p_n) if any.
    auto finprep = [&](const Lane& L, int c_f, int p_f, int c_n, int p_n) {
      const int fin_n = c_f >= 0 ? pl.c1[c_f] - pl.c0[c_f] : 0;
      const int prep_n = c_n >= 0 ? pl.c1[c_n] - pl.c0[c_n] : 0;
      const int64_t rows = static_cast<int64_t>(std::max(fin_n, prep_n)) * M;
      kvw_finprep_kernel<M, DET><<<grid_for(rows * 32, 256), 256, 0, L.st>>>(
          c_f >= 0 ? pl.c0[c_f] : 0, fin_n, p_f * M, c_n >= 0 ? pl.c0[c_n] : 0, prep_n, p_n * M, p_n * M / r, q,
          k, p.H, p.Hkv, p.T, scale_log2, L.mref, L.acc_o, L.acc_l, o, p.lse, overflow, fx);
      FLASHMSA_CHECK_LAUNCH();
    };
    // Each lane's (chunk, group) pairs chunk-major, groups l, l + S, ...; issued chunk by chunk across
    // the lanes (each lane's own order unchanged), so that a captured graph records the lanes' launches
    // interleaved as eager streams run them.
    for (int c = 0; c < pl.n_chunks; ++c) {
      for (int l = 0; l < pl.S; ++l) {
        Lane& L = lane[l];
        for (int g = l; g < p.Hp; g += pl.S) {
          finprep(L, L.c_prev, L.g_prev, c, g);
          const int slot = g * pl.n_chunks + c;
          const unsigned grid = static_cast<unsigned>(std::min<int64_t>(pl.bound[c], sms));
          const int4* its = items + g * pl.items_per_group + pl.off[c];
          const int32_t* vals = pl.sel.vals(ws);
          kvw_fwd_kernel<M, kFirst><<<grid, kThreads, kSmem, L.st>>>(
              q_map, k_map, v_map, q, p.H, its, n_items + slot, counters + slot, vals, L.mref, L.acc_o, L.acc_l, overflow,
              p.top_k, pl.c0[c], g * M, g * M / r, scale_log2, fx);
          FLASHMSA_CHECK_LAUNCH();
          if constexpr (DET) {
            const int n = pl.c1[c] - pl.c0[c];
            kvw_det_mid_kernel<M><<<grid_for(static_cast<int64_t>(n) * M, 256), 256, 0, L.st>>>(
                pl.c0[c], n, g * M, p.T, L.mref, reinterpret_cast<const long long*>(L.acc_l), p.lse, overflow, fx);
            FLASHMSA_CHECK_LAUNCH();
            kvw_fwd_kernel<M, Form::det_out><<<grid, kThreads, kSmem, L.st>>>(
                q_map, k_map, v_map, q, p.H, its, n_items + slot, counters + slots + slot, vals, L.mref, L.acc_o, L.acc_l,
                overflow, p.top_k, pl.c0[c], g * M, g * M / r, scale_log2, fx);
            FLASHMSA_CHECK_LAUNCH();
          }
          L.c_prev = c;
          L.g_prev = g;
        }
      }
    }
    for (const Lane& L : lane) finprep(L, L.c_prev, L.g_prev, -1, 0);
    fork.join();
  }
  ws.release();
}

// FLASHMSA_DET_FWD=query keeps deterministic mode's forward on the query-major kernel (A/B
// timing); read per call.
bool det_forward_forced_query() {
  const char* v = std::getenv("FLASHMSA_DET_FWD");
  return v != nullptr && std::strcmp(v, "query") == 0;
}

}  // namespace

bool kv_wgmma_forward_applies(const MsaParams& p) {
  if (p.T <= 0 || p.dtype != DType::bf16 || p.D != kD || p.Dv != kD || p.block_size != kBlk) return false;
  if (p.top_k < 1 || p.top_k > 32 || p.Hp <= 0 || p.Hkv <= 0 || p.H % p.Hp != 0 || p.H % p.Hkv != 0)
    return false;
  const int m = p.H / p.Hp;
  if (m != 4 && m != 8 && m != 16) return false;
  if (p.deterministic && det_forward_forced_query()) return false;
  if ((p.H / p.Hkv) % m != 0) return false;  // a group lies inside one kv head
  if (static_cast<int64_t>(p.Hp) * p.T * p.top_k >= INT32_MAX) return false;
  // The plan with one stream too: run_kvw falls back to one lane where its helper streams are taken
  // by another capture (usable_lanes). plan_kvw shrinks the chunk to fit where it can.
  const size_t limit = kvw_workspace_limit(p);
  return std::max(plan_kvw(p, stream_count()).ws.size(), plan_kvw(p, 1).ws.size()) <= limit;
}

void launch_kv_wgmma_forward(const MsaParams& p, int32_t* overflow, cudaStream_t stream) {
  const int m = p.H / p.Hp;
  if (p.deterministic) {
    switch (m) {
      case 4: run_kvw<4, true>(p, overflow, stream); break;
      case 8: run_kvw<8, true>(p, overflow, stream); break;
      default: run_kvw<16, true>(p, overflow, stream); break;
    }
    return;
  }
  switch (m) {
    case 4: run_kvw<4, false>(p, overflow, stream); break;
    case 8: run_kvw<8, false>(p, overflow, stream); break;
    default: run_kvw<16, false>(p, overflow, stream); break;
  }
}

}  // namespace flashmsa::cuda
