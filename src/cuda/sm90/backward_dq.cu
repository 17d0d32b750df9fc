// dq of the main attention for the deterministic fused backward (top_k <= 32), query-major.
//
// The KV-major attn_bwd_kernel adds each (token, head) row of dq from the K CTAs of its
// selected blocks, so a bitwise reproducible dq there needs int64 fixed-point atomics and an
// int64 accumulator four times the size of q. Here one warp owns one token and one row group
// of the forward (up to 16 heads sharing the proxy head, so the selection, and one kv head:
// query_major.cuh) and walks the token's selected visible keys itself, in a fixed order (the
// selection's order, 32-key sub-tiles ascending, sub-tiles after the query skipped):
//   P = exp(scale <q, k_j> - lse),  dP = <dO, v_j>,  dS = P (dP - Di),  dq = scale sum_j dS k_j
// with dq in fp32 registers, written once as bf16. No atomics and a fixed summation order:
// bitwise reproducible by construction. Q and dO stay in registers as MMA A fragments; K and V
// stream through a cp.async double buffer as in the forward.
#include <cuda_bf16.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "common/bf16.cuh"
#include "common/check.cuh"
#include "common/metadata.cuh"
#include "common/mma.cuh"
#include "sm90/backward_dq.cuh"
#include "sm90/query_major.cuh"

namespace flashmsa::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kBlk = 128;  // BLK

struct DqArgs {
  const bf16* q;             // [T, H, D]
  const bf16* k;             // [T, Hkv, D]
  const bf16* v;             // [T, Hkv, D]
  const bf16* d_o;           // [T, H, D]
  const float* lse;          // [H, T] natural log
  const float* di;           // [T, H] rowsum(dO * O)
  const int32_t* cu;         // [B+1]
  const int32_t* block_idx;  // [Hp, T, K]
  bf16* dq;                  // [T, H, D]
  int64_t T;
  int B, H, Hkv, Hp, K;
  float scale;
};

// Where the walk over (selected visible block, 32-key sub-tile) pairs stands.
struct Walk {
  unsigned pending;  // lanes whose selection entry is a block not started yet
  int j0;            // first key (position in the sequence) of the current sub-tile; -1: done
};

// The first sub-tile of the next pending block. `pending` is a ballot, so this is warp-uniform.
__device__ __forceinline__ Walk walk_pop(unsigned pending, int sel_blk) {
  if (pending == 0) return {0u, -1};
  const int src = __ffs(pending) - 1;
  return {pending & (pending - 1), __shfl_sync(0xffffffffu, sel_blk, src) * kBlk};
}

__device__ __forceinline__ Walk walk_next(const Walk& w, int sel_blk, int tpos) {
  const int j1 = w.j0 + kSub;
  if (j1 % kBlk != 0 && j1 <= tpos) return {w.pending, j1};
  return walk_pop(w.pending, sel_blk);
}

template <int D>
__global__ void __launch_bounds__(32) dq_kernel(const DqArgs a, const HeadItems items) {
  constexpr int kRowBytes = D * 2;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* k_s = smem;                        // [2][32][D]
  unsigned char* v_s = k_s + 2 * kSub * kRowBytes;  // [2][32][D]
  // [16][D] each: Q and dO are read into registers before stage 1 of K and V is first filled.
  unsigned char* q_s = k_s + kSub * kRowBytes;
  unsigned char* do_s = v_s + kSub * kRowBytes;

  const int lane = threadIdx.x;
  const int64_t unit = blockIdx.x;
  const int item = static_cast<int>(unit / a.T);
  const int64_t t = unit - static_cast<int64_t>(item) * a.T;
  const int h0 = items.packed[item] & 0xffff, rows = items.packed[item] >> 16;
  const int p = h0 / (a.H / a.Hp), kvh = h0 / (a.H / a.Hkv);
  const int b = find_sequence(a.cu, a.B, t);
  const int64_t s0 = __ldg(a.cu + b);
  const int tpos = static_cast<int>(t - s0);
  const int n_loc = tpos / kBlk;

  load_rows<D>(q_s, a.q + (t * a.H + h0) * D, rows, lane);
  load_rows<D>(do_s, a.d_o + (t * a.H + h0) * D, rows, lane);
  int blk = -1;
  if (lane < a.K) blk = __ldg(a.block_idx + (p * a.T + t) * a.K + lane);
  Walk cur = walk_pop(__ballot_sync(0xffffffffu, blk >= 0 && blk <= n_loc), blk);
  if (cur.j0 >= 0) {
    load_sub_tile<D>(k_s, a.k, s0, a.Hkv, kvh, cur.j0, tpos, lane);
    load_sub_tile<D>(v_s, a.v, s0, a.Hkv, kvh, cur.j0, tpos, lane);
  }
  cp_async_commit();

  // Rows g and g + 8 of the group. A missing row gets lse = +inf: P = 0, so dS = 0.
  const int g = lane >> 2, c2 = 2 * (lane & 3);
  const bool ok_lo = g < rows, ok_hi = g + 8 < rows;
  const float nl_lo = ok_lo ? -__ldg(a.lse + (h0 + g) * a.T + t) * kLog2e : -INFINITY;
  const float nl_hi = ok_hi ? -__ldg(a.lse + (h0 + g + 8) * a.T + t) * kLog2e : -INFINITY;
  const float di_lo = ok_lo ? __ldg(a.di + t * a.H + h0 + g) : 0.f;
  const float di_hi = ok_hi ? __ldg(a.di + t * a.H + h0 + g + 8) : 0.f;
  const float scale2 = a.scale * kLog2e;

  cp_async_wait<0>();
  __syncwarp();
  uint32_t qf[D / 16][4], of[D / 16][4];
  load_a_frags<D>(qf, q_s, lane);
  load_a_frags<D>(of, do_s, lane);
  __syncwarp();  // the first prefetch below overwrites Q and dO

  float dq[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.f;

  int buf = 0;
  while (cur.j0 >= 0) {
    const Walk nxt = walk_next(cur, blk, tpos);
    if (nxt.j0 >= 0) {
      load_sub_tile<D>(k_s + (buf ^ 1) * kSub * kRowBytes, a.k, s0, a.Hkv, kvh, nxt.j0, tpos, lane);
      load_sub_tile<D>(v_s + (buf ^ 1) * kSub * kRowBytes, a.v, s0, a.Hkv, kvh, nxt.j0, tpos, lane);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncwarp();

    const unsigned char* kt = k_s + buf * kSub * kRowBytes;
    float s[kSub / 8][4], dp[kSub / 8][4];
    scores_16x32<D>(s, qf, kt, lane);
    scores_16x32<D>(dp, of, v_s + buf * kSub * kRowBytes, lane);
    // dS as bf16 A fragments (keys are the next product's k dimension), the forward's P layout.
    uint32_t dsf[kSub / 16][4];
#pragma unroll
    for (int j = 0; j < kSub / 8; ++j) {
      float ds[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool vis = cur.j0 + j * 8 + c2 + (e & 1) <= tpos;
        const float pr = vis ? exp2f(fmaf(s[j][e], scale2, e < 2 ? nl_lo : nl_hi)) : 0.f;
        ds[e] = pr * (dp[j][e] - (e < 2 ? di_lo : di_hi));
      }
      dsf[j / 2][(j & 1) * 2 + 0] = pack_bf16x2(ds[0], ds[1]);
      dsf[j / 2][(j & 1) * 2 + 1] = pack_bf16x2(ds[2], ds[3]);
    }
    rows_times_tile_16x32<D>(dq, dsf, kt, lane);
    __syncwarp();  // this buffer is refilled two steps on
    cur = nxt;
    buf ^= 1;
  }

  bf16* dq_lo = a.dq + (t * a.H + h0 + g) * D;
  bf16* dq_hi = dq_lo + 8 * D;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    if (ok_lo)
      *reinterpret_cast<uint32_t*>(dq_lo + j * 8 + c2) = pack_bf16x2(dq[j][0] * a.scale, dq[j][1] * a.scale);
    if (ok_hi)
      *reinterpret_cast<uint32_t*>(dq_hi + j * 8 + c2) = pack_bf16x2(dq[j][2] * a.scale, dq[j][3] * a.scale);
  }
}

template <int D>
void launch(const DqArgs& a, const HeadItems& items, cudaStream_t stream) {
  constexpr int smem = 4 * kSub * D * 2;  // K, V double buffers; at most 32 KB
  dq_kernel<D><<<static_cast<unsigned>(a.T * items.n), 32, smem, stream>>>(a, items);
  FLASHMSA_CHECK_LAUNCH();
}

}  // namespace

void launch_backward_dq(const MsaParams& p, const HeadItems& items, const float* di, cudaStream_t stream) {
  if (p.T * static_cast<int64_t>(items.n) > INT_MAX)  // one CTA per (token, row group)
    throw Error("flashmsa: fused_backward: argument 'q' has too many tokens x heads");
  DqArgs a;
  a.q = static_cast<const bf16*>(p.q);
  a.k = static_cast<const bf16*>(p.k);
  a.v = static_cast<const bf16*>(p.v);
  a.d_o = static_cast<const bf16*>(p.d_o);
  a.lse = p.lse;
  a.di = di;
  a.cu = p.cu_seqlens;
  a.block_idx = p.block_idx;
  a.dq = static_cast<bf16*>(p.dq);
  a.T = p.T;
  a.B = p.B;
  a.H = p.H;
  a.Hkv = p.Hkv;
  a.Hp = p.Hp;
  a.K = p.top_k;
  a.scale = p.scale;
  if (p.D == 64) launch<64>(a, items, stream);
  else launch<128>(a, items, stream);
}

}  // namespace flashmsa::cuda
