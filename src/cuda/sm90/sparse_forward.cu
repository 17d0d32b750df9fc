// Block-sparse main attention forward (msa.md step 5) and the proxy distillation loss (step 6):
// the routing between the three forward kernels (launch_sparse_attention_forward, below) and the
// query-major kernel itself.
//
// Routing: the wgmma KV-major kernel (forward_kv_wgmma.cu: D = 128, groups of 4/8/16 heads inside
// one kv head, top_k <= 32; in deterministic mode its two-pass fixed-point form) where
// the KL value, if asked for, can follow KV-major (kl_value.cuh); tokens it flags (its fixed
// softmax reference overflowed, or a row had nothing to sum) are recomputed here by
// redo_forward_kernel. Else the mma.sync KV-major kernel
// (forward_kv.cu) for groups of fewer than 16 heads; else the query-major kernel.
//
// Query-major: one warp (= one CTA) owns one token and up to 16 main heads that share its proxy
// head (hence its selection) and one kv head: those heads are the 16 MMA rows. The warp streams
// its selected blocks as 32-key sub-tiles of K and V with a cp.async double buffer and keeps an
// FA2-style online softmax in registers. Sub-tiles that start after the query are skipped, so
// the partial own block costs only what it needs. Exact, bitwise reproducible, no extra memory:
// deterministic mode (outside the int64 KV-major form's groups of 8 / 16), D = 64 and top_k > 32 (the
// dense warm-up's index) take it.
//
// The KL value needs the teacher (the group's mean P over the selected keys), which needs every
// head's lse first; a second kernel recomputes the scores of one (proxy head, token) with the
// stored lse, accumulates the teacher per key in shared memory in a fixed order, scores the
// same keys with the proxy, and writes KL[p, t]; a one-CTA reduction then forms kl_loss. All
// reductions have a fixed order, so the KL value is bitwise reproducible. When one warp's rows
// are the whole group (m <= 16 on one kv head, the M3 shape) that second pass runs inside the
// forward kernel instead, from registers, with no per-key storage. Where the KV-major KL kernel
// applies (kl_value_applies) neither pass runs: the KL value is computed after the forward
// (11 ms instead of ~28 ms at m3/64k).
//
// Measured on an H200 (m3 shape, B=1, median of 10): forward 6.2 / 13.1 / 27.5 / 58.6 ms at
// S = 16k / 32k / 64k / 128k (~150 TFLOP/s); each (token, group) streams ~1 MB of K/V (16 blocks
// x 128 keys x 512 B) for ~17 MFLOP: ~9 TB/s of L2->SM traffic at 64k, i.e. this design is bound
// by L2 bandwidth, not by the tensor cores (the wgmma KV-major kernel: 15.3 ms at 64k).
//
// top_k > 32 (the dense warm-up's all-visible-blocks index has K = blocks of the longest
// sequence) takes separate kWide instantiations: the row is read in windows of 32 entries, one
// per lane, refilled when a window runs out, and the KL kernel folds each window's per-key
// sums into running totals instead of staging all K*128 keys. K <= 32 compiles the original
// code unchanged (kWide = false), so the sparse-training path keeps its registers and speed.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "common/bf16.cuh"
#include "common/check.cuh"
#include "common/fixed_order_sum.cuh"
#include "common/metadata.cuh"
#include "common/mma.cuh"
#include "common/reduce_scatter.cuh"
#include "launchers.h"
#include "sm90/forward_kv.cuh"
#include "sm90/forward_kv_wgmma.cuh"
#include "sm90/kl_value.cuh"
#include "sm90/query_major.cuh"

namespace flashmsa::cuda {
namespace {

constexpr int kBlk = 128;   // BLK

struct FwdArgs {
  const __nv_bfloat16* q;   // [T, H, D]
  const __nv_bfloat16* k;   // [T, Hkv, D]
  const __nv_bfloat16* v;   // [T, Hkv, D]
  const __nv_bfloat16* qp;  // [T, Hp, D]
  const __nv_bfloat16* kp;  // [T, Hpk, D]
  const int32_t* cu;        // [B+1]
  const int32_t* block_idx; // [Hp, T, K]
  __nv_bfloat16* o;         // [T, H, D]
  float* lse;               // [H, T]
  float* kl_rows;           // [Hp, T] KL[p, t] before the mean
  int64_t T;
  int B, H, Hkv, Hp, Hpk, K;
  float scale_log2;         // scale * log2(e)
  float proxy_scale;
  bool fuse_kl;             // the KL pass runs inside the forward (each group is one warp's rows)
};

// The query's selected blocks that are visible (0 <= n <= n_loc), as a lane mask over the K
// entries read by lanes 0..K-1 (K <= 32); `blk` holds lane i's entry.
template <bool kWide>
struct Selection {
  unsigned mask;
  int blk;
};

// K > 32: lane i holds entry base + i of the row; the cursor moves to the next window when this
// one is used up, so the window state travels with the selection.
template <>
struct Selection<true> {
  unsigned mask;
  int blk;
  int base;
  int K, n_loc;
  const int32_t* row;  // [K] the entries of this (p, t)
};

__device__ __forceinline__ Selection<false> read_selection(const FwdArgs& a, int p, int64_t t, int n_loc,
                                                           int lane) {
  int blk = -1;
  if (lane < a.K) blk = __ldg(a.block_idx + (p * a.T + t) * a.K + lane);
  const bool ok = blk >= 0 && blk <= n_loc;
  return {__ballot_sync(0xffffffffu, ok), blk};
}

// Entries base .. base+31 of the row (those < K) as a K <= 32 selection: one window.
__device__ __forceinline__ Selection<false> read_window(const FwdArgs& a, int p, int64_t t, int n_loc,
                                                        int base, int lane) {
  int blk = -1;
  if (base + lane < a.K) blk = __ldg(a.block_idx + (p * a.T + t) * a.K + base + lane);
  const bool ok = blk >= 0 && blk <= n_loc;
  return {__ballot_sync(0xffffffffu, ok), blk};
}

__device__ __forceinline__ void load_window(Selection<true>& s, int base) {
  const int lane = threadIdx.x & 31;
  s.base = base;
  s.blk = base + lane < s.K ? __ldg(s.row + base + lane) : -1;
  s.mask = __ballot_sync(0xffffffffu, s.blk >= 0 && s.blk <= s.n_loc);
}

__device__ __forceinline__ Selection<true> read_selection_wide(const FwdArgs& a, int p, int64_t t,
                                                               int n_loc) {
  Selection<true> s;
  s.K = a.K;
  s.n_loc = n_loc;
  s.row = a.block_idx + (p * a.T + t) * a.K;
  load_window(s, 0);
  return s;
}

template <bool kWide>
__device__ __forceinline__ Selection<kWide> read_selection_any(const FwdArgs& a, int p, int64_t t,
                                                               int n_loc, int lane) {
  if constexpr (kWide) return read_selection_wide(a, p, t, n_loc);
  else return read_selection(a, p, t, n_loc, lane);
}

// Walks (selected block, 32-key chunk) pairs in order, skipping chunks that start after tpos.
struct Cursor {
  unsigned mask;  // selected blocks not yet started
  int blk, chunk, slot;  // slot = ordinal of blk among the visible selected blocks
  bool done;
};

__device__ __forceinline__ Cursor cursor_pop(const Selection<false>& sel, Cursor c) {
  if (c.mask == 0) {
    c.done = true;
    return c;
  }
  const int lane_src = __ffs(c.mask) - 1;
  c.mask &= c.mask - 1;
  c.blk = __shfl_sync(0xffffffffu, sel.blk, lane_src);
  c.chunk = 0;
  c.slot += 1;
  return c;
}

// The cursor keeps only the chosen block, so moving `sel` to a later window here is safe. The
// loop is warp-uniform (ballot masks); windows with nothing visible (padding) are passed over.
__device__ __forceinline__ Cursor cursor_pop(Selection<true>& sel, Cursor c) {
  while (c.mask == 0) {
    if (sel.base + 32 >= sel.K) {
      c.done = true;
      return c;
    }
    load_window(sel, sel.base + 32);
    c.mask = sel.mask;
  }
  const int lane_src = __ffs(c.mask) - 1;
  c.mask &= c.mask - 1;
  c.blk = __shfl_sync(0xffffffffu, sel.blk, lane_src);
  c.chunk = 0;
  c.slot += 1;
  return c;
}

template <typename Sel>
__device__ __forceinline__ Cursor cursor_next(Sel& sel, Cursor c, int tpos) {
  if (c.chunk + 1 < kBlk / kSub && c.blk * kBlk + (c.chunk + 1) * kSub <= tpos) {
    c.chunk += 1;
    return c;
  }
  return cursor_pop(sel, c);
}

// A cursor at the row's first visible block (a second walk over the row rewinds to window 0).
__device__ __forceinline__ Cursor cursor_begin(const Selection<false>& sel) {
  return cursor_pop(sel, {sel.mask, 0, 0, -1, false});
}
__device__ __forceinline__ Cursor cursor_begin(Selection<true>& sel) {
  if (sel.base != 0) load_window(sel, 0);
  return cursor_pop(sel, {sel.mask, 0, 0, -1, false});
}

// One (item, token) unit = unit / T, unit % T: a token's rows of one head item, and (with
// fuse_kl) the token's KL row.
template <int D, bool kWide>
__device__ __forceinline__ void forward_unit(const FwdArgs& a, const HeadItems& items, const int64_t unit) {
  constexpr int kRowBytes = D * 2;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* k_s = smem;                         // [2][32][D]
  unsigned char* v_s = k_s + 2 * kSub * kRowBytes;   // [2][32][D]
  // [16][D]: Q is read into registers before stage 1 of K is first filled, so it lives there.
  unsigned char* q_s = k_s + kSub * kRowBytes;

  const int lane = threadIdx.x;
  const int item = static_cast<int>(unit / a.T);
  const int64_t t = unit - static_cast<int64_t>(item) * a.T;
  const int h0 = items.packed[item] & 0xffff, rows = items.packed[item] >> 16;
  const int m = a.H / a.Hp;
  const int p = h0 / m, kvh = h0 / (a.H / a.Hkv);
  const int b = find_sequence(a.cu, a.B, t);
  const int64_t s0 = __ldg(a.cu + b);
  const int tpos = static_cast<int>(t - s0);
  const int n_loc = tpos / kBlk;

  load_rows<D>(q_s, a.q + (t * a.H + h0) * D, rows, lane);
  // Only the wide selection changes as the cursor advances (window refills).
  std::conditional_t<kWide, Selection<true>, const Selection<false>> sel =
      read_selection_any<kWide>(a, p, t, n_loc, lane);
  Cursor cur = cursor_begin(sel);
  if (!cur.done) {
    load_sub_tile<D>(k_s, a.k, s0, a.Hkv, kvh, cur.blk * kBlk, tpos, lane);
    load_sub_tile<D>(v_s, a.v, s0, a.Hkv, kvh, cur.blk * kBlk, tpos, lane);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncwarp();
  uint32_t qf[D / 16][4];
  load_a_frags<D>(qf, q_s, lane);
  __syncwarp();  // the first prefetch below overwrites the query rows (in stage 1 of K)

  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;

  int buf = 0;
  while (!cur.done) {
    const Cursor nxt = cursor_next(sel, cur, tpos);
    if (!nxt.done) {
      const int j0 = nxt.blk * kBlk + nxt.chunk * kSub;
      load_sub_tile<D>(k_s + (buf ^ 1) * kSub * kRowBytes, a.k, s0, a.Hkv, kvh, j0, tpos, lane);
      load_sub_tile<D>(v_s + (buf ^ 1) * kSub * kRowBytes, a.v, s0, a.Hkv, kvh, j0, tpos, lane);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncwarp();

    float s[kSub / 8][4];
    scores_16x32<D>(s, qf, k_s + buf * kSub * kRowBytes, lane);
    const int j0 = cur.blk * kBlk + cur.chunk * kSub;
    const int col0 = j0 + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < kSub / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool vis = col0 + j * 8 + e <= tpos;
        s[j][e] = vis ? s[j][e] * a.scale_log2 : -INFINITY;
        s[j][2 + e] = vis ? s[j][2 + e] * a.scale_log2 : -INFINITY;
      }
    }
    float mx_lo = m_lo, mx_hi = m_hi;
#pragma unroll
    for (int j = 0; j < kSub / 8; ++j) {
      mx_lo = fmaxf(mx_lo, fmaxf(s[j][0], s[j][1]));
      mx_hi = fmaxf(mx_hi, fmaxf(s[j][2], s[j][3]));
    }
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
    // Every processed sub-tile holds key j0 <= tpos, so the new maxima are finite.
    const float al_lo = exp2f(m_lo - mx_lo), al_hi = exp2f(m_hi - mx_hi);
    m_lo = mx_lo;
    m_hi = mx_hi;
    float sum_lo = 0.f, sum_hi = 0.f;
    uint32_t pf[kSub / 16][4];
#pragma unroll
    for (int j = 0; j < kSub / 8; ++j) {
      const float p0 = exp2f(s[j][0] - m_lo), p1 = exp2f(s[j][1] - m_lo);
      const float p2 = exp2f(s[j][2] - m_hi), p3 = exp2f(s[j][3] - m_hi);
      sum_lo += p0 + p1;
      sum_hi += p2 + p3;
      pf[j / 2][(j & 1) * 2 + 0] = pack_bf16x2(p0, p1);
      pf[j / 2][(j & 1) * 2 + 1] = pack_bf16x2(p2, p3);
    }
    l_lo = l_lo * al_lo + sum_lo;
    l_hi = l_hi * al_hi + sum_hi;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      o[j][0] *= al_lo;
      o[j][1] *= al_lo;
      o[j][2] *= al_hi;
      o[j][3] *= al_hi;
    }
    rows_times_tile_16x32<D>(o, pf, v_s + buf * kSub * kRowBytes, lane);
    __syncwarp();  // this buffer is refilled two steps on
    cur = nxt;
    buf ^= 1;
  }

  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
  const float inv_lo = l_lo > 0.f ? 1.f / l_lo : 0.f, inv_hi = l_hi > 0.f ? 1.f / l_hi : 0.f;
  const int g = lane >> 2, c2 = 2 * (lane & 3);
  const bool ok_lo = g < rows, ok_hi = g + 8 < rows;
  __nv_bfloat16* o_lo = a.o + (t * a.H + h0 + g) * D;
  __nv_bfloat16* o_hi = o_lo + 8 * D;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    if (ok_lo)
      *reinterpret_cast<uint32_t*>(o_lo + j * 8 + c2) = pack_bf16x2(o[j][0] * inv_lo, o[j][1] * inv_lo);
    if (ok_hi)
      *reinterpret_cast<uint32_t*>(o_hi + j * 8 + c2) = pack_bf16x2(o[j][2] * inv_hi, o[j][3] * inv_hi);
  }
  if ((lane & 3) == 0) {
    if (ok_lo) a.lse[(h0 + g) * a.T + t] = l_lo > 0.f ? (m_lo + log2f(l_lo)) * kLn2 : -INFINITY;
    if (ok_hi) a.lse[(h0 + g + 8) * a.T + t] = l_hi > 0.f ? (m_hi + log2f(l_hi)) * kLn2 : -INFINITY;
  }
  if (!a.fuse_kl) return;

  // KL pass (msa.md step 6) while Q is still in registers and the group's lse is known: this
  // warp's rows are the whole group, so the teacher of a key is the column mean of P. With
  // KL = sum T log T - sum T s + lse_s * sum T, three running sums and an online logsumexp of
  // the proxy scores suffice: nothing per key is stored.
  const float lse2_lo = ok_lo && l_lo > 0.f ? m_lo + log2f(l_lo) : INFINITY;
  const float lse2_hi = ok_hi && l_hi > 0.f ? m_hi + log2f(l_hi) : INFINITY;
  const int pk = p / (a.Hp / a.Hpk);
  __syncwarp();
  load_rows<D, true>(q_s, a.qp + (t * a.Hp + p) * D, 16, lane);
  cur = cursor_begin(sel);
  if (!cur.done) {
    load_sub_tile<D>(k_s, a.k, s0, a.Hkv, kvh, cur.blk * kBlk, tpos, lane);
    load_sub_tile<D>(v_s, a.kp, s0, a.Hpk, pk, cur.blk * kBlk, tpos, lane);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncwarp();
  uint32_t pq[D / 16][4];  // the proxy query repeated in all 16 rows
  load_a_frags<D>(pq, q_s, lane);
  __syncwarp();  // the first prefetch below overwrites the query rows (in stage 1 of K)
  const float inv_m = 1.f / static_cast<float>(m);
  float ent = 0.f, cross = 0.f, tsum = 0.f, smax = -INFINITY, ssum = 0.f;
  buf = 0;
  while (!cur.done) {
    const Cursor nxt = cursor_next(sel, cur, tpos);
    if (!nxt.done) {
      const int j0 = nxt.blk * kBlk + nxt.chunk * kSub;
      load_sub_tile<D>(k_s + (buf ^ 1) * kSub * kRowBytes, a.k, s0, a.Hkv, kvh, j0, tpos, lane);
      load_sub_tile<D>(v_s + (buf ^ 1) * kSub * kRowBytes, a.kp, s0, a.Hpk, pk, j0, tpos, lane);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncwarp();
    float s[kSub / 8][4], sp[kSub / 8][4];
    scores_16x32<D>(s, qf, k_s + buf * kSub * kRowBytes, lane);
    scores_16x32<D>(sp, pq, v_s + buf * kSub * kRowBytes, lane);
    // Teacher column sums by a reduce-scatter over the 8 row groups g (7 shuffles instead of
    // 24): afterwards lane (g, c) holds the sum of column k = g, i.e. key j*8 + 2c + e with
    // j = g >> 1, e = g & 1, and takes that one column's share of the KL sums.
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k)
      v[k] = exp2f(s[k >> 1][k & 1] * a.scale_log2 - lse2_lo) +
             exp2f(s[k >> 1][2 + (k & 1)] * a.scale_log2 - lse2_hi);
    const float colsum = reduce_scatter_rows8(v, g);
    // Every row of the proxy product holds the same scores (the proxy query fills all rows).
    float sv = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (k == g) sv = sp[k >> 1][k & 1];
    sv *= a.proxy_scale;
    const int col = cur.blk * kBlk + cur.chunk * kSub + (g >> 1) * 8 + c2 + (g & 1);
    if (col <= tpos) {
      const float tch = colsum * inv_m;
      if (tch > 0.f) {
        ent += tch * __logf(tch);
        cross += tch * sv;
        tsum += tch;
      }
      const float nm = fmaxf(smax, sv);
      ssum = ssum * __expf(smax - nm) + __expf(sv - nm);
      smax = nm;
    }
    __syncwarp();
    cur = nxt;
    buf ^= 1;
  }
  // Merge the per-lane sums and online logsumexps over the warp (fixed order).
  float mx = smax;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  ssum = smax == -INFINITY ? 0.f : ssum * __expf(smax - mx);
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    ent += __shfl_xor_sync(0xffffffffu, ent, off);
    cross += __shfl_xor_sync(0xffffffffu, cross, off);
    tsum += __shfl_xor_sync(0xffffffffu, tsum, off);
    ssum += __shfl_xor_sync(0xffffffffu, ssum, off);
  }
  if (lane == 0) a.kl_rows[p * a.T + t] = ent - cross + (mx + __logf(ssum)) * tsum;
}

template <int D, bool kWide>
__global__ void __launch_bounds__(32)
    sparse_forward_kernel(const FwdArgs a, const HeadItems items) {
  forward_unit<D, kWide>(a, items, blockIdx.x);
}

// The tokens the wgmma KV-major forward flagged (its fixed softmax reference overflowed), each
// with all its head items: list[0 .. *count), any order (each token is recomputed on its own).
// A small grid loops over them, so the common case (no token flagged) costs one short launch.
template <int D>
__global__ void __launch_bounds__(32)
    redo_forward_kernel(const FwdArgs a, const HeadItems items, const int32_t* __restrict__ list,  // [T]
                        const int32_t* __restrict__ count) {                                     // [1]
  const int64_t n = static_cast<int64_t>(*count) * items.n;
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int item = static_cast<int>(i % items.n);
    forward_unit<D, false>(a, items, item * a.T + list[i / items.n]);
    __syncwarp();  // the next unit refills shared memory
  }
}

// redo[T] (0/1 per token) -> list[0 .. *count) of the flagged tokens; *count zeroed by the caller.
__global__ void compact_redo_kernel(const int32_t* __restrict__ redo, int64_t T,
                                    int32_t* __restrict__ list,     // [T]
                                    int32_t* __restrict__ count) {  // [1]
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < T;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x)
    if (redo[t] != 0) list[atomicAdd(count, 1)] = static_cast<int32_t>(t);
}

// Teacher sums (per key, over the group's heads) and proxy scores of the visible keys of one
// selection (K <= 32 entries, or one window of 32) into teach / sprox [32 or K][128], indexed
// by the block's ordinal among the selection's visible blocks.
template <int D>
__device__ __forceinline__ void kl_stage_keys(const FwdArgs& a, const HeadItems& items,
                                              const Selection<false>& sel, int p, int64_t t, int64_t s0,
                                              int tpos, int pk, unsigned char* k_s, unsigned char* q_s,
                                              float* teach, float* sprox, int lane) {
  constexpr int kRowBytes = D * 2;
  const int g = lane >> 2, c2 = 2 * (lane & 3);

  // pass(0..n_items-1): teacher sums of one head item; pass == n_items: proxy scores.
  const int it0 = items.p_begin[p], it1 = items.p_begin[p + 1];
  for (int it = it0; it <= it1; ++it) {
    const bool proxy = it == it1;
    int h0 = 0, rows = 1, kvh = 0;
    if (!proxy) {
      h0 = items.packed[it] & 0xffff;
      rows = items.packed[it] >> 16;
      kvh = h0 / (a.H / a.Hkv);
    }
    float lse_lo = INFINITY, lse_hi = INFINITY;  // +inf makes padded rows contribute 0
    if (!proxy) {
      if (g < rows) lse_lo = __ldg(a.lse + (h0 + g) * a.T + t) * kLog2e;
      if (g + 8 < rows) lse_hi = __ldg(a.lse + (h0 + g + 8) * a.T + t) * kLog2e;
    }
    __syncwarp();
    if (proxy) load_rows<D>(q_s, a.qp + (t * a.Hp + p) * D, 1, lane);
    else load_rows<D>(q_s, a.q + (t * a.H + h0) * D, rows, lane);
    Cursor cur = cursor_pop(sel, {sel.mask, 0, 0, -1, false});
    const __nv_bfloat16* kbase = proxy ? a.kp : a.k;
    const int kheads = proxy ? a.Hpk : a.Hkv, khead = proxy ? pk : kvh;
    if (!cur.done) load_sub_tile<D>(k_s, kbase, s0, kheads, khead, cur.blk * kBlk, tpos, lane);
    cp_async_commit();
    cp_async_wait<0>();
    __syncwarp();
    uint32_t qf[D / 16][4];
    load_a_frags<D>(qf, q_s, lane);
    __syncwarp();  // the first prefetch below overwrites the query rows (in stage 1 of K)
    int buf = 0;
    while (!cur.done) {
      const Cursor nxt = cursor_next(sel, cur, tpos);
      if (!nxt.done) {
        load_sub_tile<D>(k_s + (buf ^ 1) * kSub * kRowBytes, kbase, s0, kheads, khead,
                         nxt.blk * kBlk + nxt.chunk * kSub, tpos, lane);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncwarp();
      float s[kSub / 8][4];
      scores_16x32<D>(s, qf, k_s + buf * kSub * kRowBytes, lane);
      const int j0 = cur.blk * kBlk + cur.chunk * kSub;
      float* tslot = teach + cur.slot * kBlk + cur.chunk * kSub;
      float* sslot = sprox + cur.slot * kBlk + cur.chunk * kSub;
#pragma unroll
      for (int j = 0; j < kSub / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = j * 8 + c2 + e;
          const bool vis = j0 + col <= tpos;
          if (proxy) {
            if (g == 0 && vis) sslot[col] = s[j][e] * a.proxy_scale;
          } else {
            float pr = vis ? exp2f(s[j][e] * a.scale_log2 - lse_lo) +
                                 exp2f(s[j][2 + e] * a.scale_log2 - lse_hi)
                           : 0.f;
            pr += __shfl_xor_sync(0xffffffffu, pr, 4);
            pr += __shfl_xor_sync(0xffffffffu, pr, 8);
            pr += __shfl_xor_sync(0xffffffffu, pr, 16);
            if (g == 0) tslot[col] += pr;
          }
        }
      }
      __syncwarp();
      cur = nxt;
      buf ^= 1;
    }
    __syncwarp();
  }
}

// KL[p, t] of msa.md step 6 for one (proxy head, token) per warp, after the forward wrote lse.
// Shared memory: per-key teacher sums and proxy scores for the K selected blocks (K <= 32), or
// for one window of 32 entries at a time (kWide), folded into running sums after each window:
// KL = sum T log T - sum T s + lse_s * sum T with an online logsumexp of the proxy scores.
template <int D, bool kWide>
__global__ void __launch_bounds__(32) kl_rows_kernel(const FwdArgs a, const HeadItems items) {
  constexpr int kRowBytes = D * 2;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* k_s = smem;                                   // [2][32][D]
  unsigned char* q_s = k_s + kSub * kRowBytes;                 // [16][D] in stage 1 (see forward)
  const int n_keys = (kWide ? 32 : a.K) * kBlk;
  float* teach = reinterpret_cast<float*>(k_s + 2 * kSub * kRowBytes);  // [K or 32][128]
  float* sprox = teach + n_keys;                                       // [K or 32][128]

  const int lane = threadIdx.x;
  const int64_t unit = blockIdx.x;
  const int p = static_cast<int>(unit / a.T);
  const int64_t t = unit - static_cast<int64_t>(p) * a.T;
  const int m = a.H / a.Hp;
  const int pk = p / (a.Hp / a.Hpk);
  const int b = find_sequence(a.cu, a.B, t);
  const int64_t s0 = __ldg(a.cu + b);
  const int tpos = static_cast<int>(t - s0);
  const int n_loc = tpos / kBlk;
  if constexpr (!kWide) {
    const Selection<false> sel = read_selection(a, p, t, n_loc, lane);
    for (int i = lane; i < a.K * kBlk; i += 32) {
      teach[i] = 0.f;
      sprox[i] = -INFINITY;
    }
    kl_stage_keys<D>(a, items, sel, p, t, s0, tpos, pk, k_s, q_s, teach, sprox, lane);

    // KL = sum_j Tch (log Tch - log Qs), log Qs = s - logsumexp(s) over the same keys.
    float mx = -INFINITY;
    for (int i = lane; i < a.K * kBlk; i += 32) mx = fmaxf(mx, sprox[i]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float se = 0.f;
    for (int i = lane; i < a.K * kBlk; i += 32) se += sprox[i] == -INFINITY ? 0.f : __expf(sprox[i] - mx);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) se += __shfl_xor_sync(0xffffffffu, se, off);
    const float lse_s = mx + logf(se);
    const float inv_m = 1.f / static_cast<float>(m);
    float kl = 0.f;
    for (int i = lane; i < a.K * kBlk; i += 32) {
      const float tch = teach[i] * inv_m;
      if (tch > 0.f && sprox[i] != -INFINITY) kl += tch * (logf(tch) - (sprox[i] - lse_s));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) kl += __shfl_xor_sync(0xffffffffu, kl, off);
    if (lane == 0) a.kl_rows[p * a.T + t] = kl;
  } else {
    const float inv_m = 1.f / static_cast<float>(m);
    float ent = 0.f, cross = 0.f, tsum = 0.f, smax = -INFINITY, ssum = 0.f;
    for (int base = 0; base < a.K; base += 32) {
      const Selection<false> sel = read_window(a, p, t, n_loc, base, lane);
      if (sel.mask == 0) continue;  // warp-uniform: nothing visible in this window
      __syncwarp();
      for (int i = lane; i < n_keys; i += 32) {
        teach[i] = 0.f;
        sprox[i] = -INFINITY;
      }
      kl_stage_keys<D>(a, items, sel, p, t, s0, tpos, pk, k_s, q_s, teach, sprox, lane);
      // Each lane folds the keys i = lane (mod 32): one rescale of its running sum per window.
      float wmx = -INFINITY;
      for (int i = lane; i < n_keys; i += 32) wmx = fmaxf(wmx, sprox[i]);
      if (wmx != -INFINITY) {
        const float nm = fmaxf(smax, wmx);
        ssum *= expf(smax - nm);
        for (int i = lane; i < n_keys; i += 32) {
          const float sv = sprox[i];
          if (sv == -INFINITY) continue;
          ssum += expf(sv - nm);
          const float tch = teach[i] * inv_m;
          if (tch > 0.f) {
            ent += tch * logf(tch);
            cross += tch * sv;
            tsum += tch;
          }
        }
        smax = nm;
      }
    }
    // Merge the lanes' sums and logsumexps (fixed order).
    float mx = smax;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    ssum = smax == -INFINITY ? 0.f : ssum * expf(smax - mx);
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      ent += __shfl_xor_sync(0xffffffffu, ent, off);
      cross += __shfl_xor_sync(0xffffffffu, cross, off);
      tsum += __shfl_xor_sync(0xffffffffu, tsum, off);
      ssum += __shfl_xor_sync(0xffffffffu, ssum, off);
    }
    if (lane == 0) a.kl_rows[p * a.T + t] = tsum > 0.f ? ent - cross + (mx + logf(ssum)) * tsum : 0.f;
  }
}

// KL[p, t] of every (proxy head, token) into a.kl_rows from the lse already written.
template <int D, bool kWide>
void launch_kl_rows(const FwdArgs& a, const HeadItems& items, cudaStream_t stream) {
  const size_t kl_smem = 2 * kSub * D * 2 + 2 * sizeof(float) * (kWide ? 32 : a.K) * kBlk;
  auto klk = kl_rows_kernel<D, kWide>;
  FLASHMSA_CUDA_CHECK(cudaFuncSetAttribute(klk, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kl_smem));
  klk<<<static_cast<unsigned>(a.T * a.Hp), 32, kl_smem, stream>>>(a, items);
  FLASHMSA_CHECK_LAUNCH();
}

template <int D, bool kWide>
void launch_forward(const FwdArgs& a, const HeadItems& items, bool with_kl, cudaStream_t stream) {
  const size_t fwd_smem = 4 * kSub * D * 2;
  auto fwd = sparse_forward_kernel<D, kWide>;
  FLASHMSA_CUDA_CHECK(cudaFuncSetAttribute(fwd, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)fwd_smem));
  const int64_t units = a.T * items.n;
  fwd<<<static_cast<unsigned>(units), 32, fwd_smem, stream>>>(a, items);
  FLASHMSA_CHECK_LAUNCH();
  if (with_kl && !a.fuse_kl) launch_kl_rows<D, kWide>(a, items, stream);
}

}  // namespace

void launch_sparse_attention_forward(const MsaParams& p, cudaStream_t stream) {
  // Path choice, read on every call (so a benchmark can flip it between runs):
  // FLASHMSA_FORWARD_PATH=query forces this kernel, =kv the mma.sync KV-major one (forward_kv.cu)
  // where it applies, =wgmma the wgmma KV-major one (forward_kv_wgmma.cu; an error where it does
  // not apply, so tests know which kernel ran: its fast form's sums are not bitwise reproducible).
  // Unset: wgmma KV-major where it applies and the KL value (if asked for) can be formed KV-major after it
  // (launch_kl_value); else mma KV-major for groups of fewer than 16 heads; else this kernel.
  // m < 16: this kernel fills only m of its 16 MMA rows and streams a token's 16 blocks (1 MB) per
  // (token, group) whatever m is; the mma KV-major kernel keeps 16 real rows per warp (16/m tokens)
  // and reads each block once per CTA round. Measured (H200, commit 7007bf4, forward with KL):
  // fm16k (m=4) S=16k 12.7 -> 7.2 ms; gqa8 (m=8) S=64k 54.9 -> 33.1 ms; m3 (m=16) 64k 55.1 vs 55.6 ms.
  const char* path = std::getenv("FLASHMSA_FORWARD_PATH");
  const bool force_query = path && std::strcmp(path, "query") == 0;
  const bool force_kv = path && std::strcmp(path, "kv") == 0;
  const bool force_wgmma = path && std::strcmp(path, "wgmma") == 0;
  const bool kl_after = p.kl == nullptr || kl_value_applies(p);
  const bool use_wgmma =
      p.T > 0 && !force_query && !force_kv && kv_wgmma_forward_applies(p) && (force_wgmma || kl_after);
  if (force_wgmma && p.T > 0 && !use_wgmma)
    throw Error("flashmsa: sparse_attention_forward: FLASHMSA_FORWARD_PATH=wgmma, but the wgmma KV-major "
                "forward does not take this problem (argument 'q': D = Dv = 128, groups of 4, 8 or 16 heads "
                "inside one kv head, top_k <= 32)");
  // FLASHMSA_BACKWARD_PATH=wgmma (tests): an error unless the KL value, if asked for, comes from
  // the wgmma backward's KV-major kernel (launch_kl_value below).
  const bool kl_kv_required = p.kl != nullptr && p.T > 0 && backward_path_requires_wgmma();
  auto kl_route_error = [] {
    return Error("flashmsa: sparse_attention_forward: FLASHMSA_BACKWARD_PATH=wgmma, but the KV-major KL value "
                 "does not take this problem (argument 'q': D = Dv = Dp = 128, whole proxy groups of >= 2 heads "
                 "inside one kv head, top_k <= 32)");
  };
  if (!use_wgmma && p.T > 0 && !force_query && kv_forward_applies(p) && (force_kv || p.H / p.Hp < 16)) {
    if (kl_kv_required) throw kl_route_error();  // that kernel forms the KL value itself
    launch_kv_forward(p, stream);
    return;
  }
  const HeadItems items = make_items(p, "sparse_attention_forward");
  if (p.T == 0) {
    if (p.kl != nullptr) FLASHMSA_CUDA_CHECK(cudaMemsetAsync(p.kl, 0, sizeof(float), stream));
    return;
  }
  if (p.T * std::max(items.n, p.Hp) > INT_MAX)
    throw Error("flashmsa: sparse_attention_forward: argument 'q' has too many tokens x heads");

  FwdArgs a;
  a.q = static_cast<const __nv_bfloat16*>(p.q);
  a.k = static_cast<const __nv_bfloat16*>(p.k);
  a.v = static_cast<const __nv_bfloat16*>(p.v);
  a.qp = static_cast<const __nv_bfloat16*>(p.qp);
  a.kp = static_cast<const __nv_bfloat16*>(p.kp);
  a.cu = p.cu_seqlens;
  a.block_idx = p.block_idx;
  a.o = static_cast<__nv_bfloat16*>(p.o);
  a.lse = p.lse;
  a.kl_rows = nullptr;
  a.T = p.T;
  a.B = p.B;
  a.H = p.H;
  a.Hkv = p.Hkv;
  a.Hp = p.Hp;
  a.Hpk = p.Hpk;
  a.K = p.top_k;
  a.scale_log2 = p.scale * kLog2e;
  a.proxy_scale = p.proxy_scale;
  // The KL value KV-major after this kernel (launch_kl_value, on the wgmma backward's shapes)
  // rather than by this kernel's second pass, which re-streams K and kp per (token, group):
  // ~28 ms of the 56 ms at m3/64k. FLASHMSA_BACKWARD_PATH=mma keeps the pass here.
  const bool kl_kv = p.kl != nullptr && kl_value_applies(p);
  if (kl_kv_required && !kl_kv) throw kl_route_error();
  const bool with_kl = p.kl != nullptr && !kl_kv;  // this file's KL passes
  a.fuse_kl = with_kl && items.n == p.Hp && !use_wgmma;
  const StreamAllocation<float> kl_rows(with_kl ? p.T * p.Hp : 0, stream);  // [Hp, T]
  a.kl_rows = kl_rows.get();
  if (use_wgmma) {
    // The wgmma KV-major kernel softmaxes every row against a fixed reference (its diagonal
    // score); the tokens where a row's best score lies too far above it are flagged, and
    // redo_forward_kernel recomputes exactly those with this file's exact online softmax.
    const StreamAllocation<int32_t> flags(redo_flag_ints(p.T), stream);  // [T] flags, then [T] list, then the count
    int32_t* redo = flags.get();
    int32_t* list = redo + p.T;
    int32_t* count = list + p.T;
    launch_kv_wgmma_forward(p, redo, stream);
    FLASHMSA_CUDA_CHECK(cudaMemsetAsync(count, 0, sizeof(int32_t), stream));
    compact_redo_kernel<<<static_cast<unsigned>(std::min<int64_t>(4096, (p.T + 255) / 256)), 256, 0, stream>>>(
        redo, p.T, list, count);
    FLASHMSA_CHECK_LAUNCH();
    const size_t smem = 4 * kSub * 128 * 2;
    auto redo_kernel = redo_forward_kernel<128>;
    FLASHMSA_CUDA_CHECK(cudaFuncSetAttribute(redo_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    redo_kernel<<<1024, 32, smem, stream>>>(a, items, list, count);
    FLASHMSA_CHECK_LAUNCH();
    if (with_kl) launch_kl_rows<128, false>(a, items, stream);  // forced path, KL not KV-major
  } else if (p.D == 64) {
    // K <= 32 keeps the single-window kernels (the sparse-training path); wider rows (the dense
    // warm-up) take the windowed ones.
    if (a.K <= 32) launch_forward<64, false>(a, items, with_kl, stream);
    else launch_forward<64, true>(a, items, with_kl, stream);
  } else {
    if (a.K <= 32) launch_forward<128, false>(a, items, with_kl, stream);
    else launch_forward<128, true>(a, items, with_kl, stream);
  }
  if (with_kl) {
    // kl_loss = coeff * mean of the KL rows, in a fixed order.
    fixed_order_sum_kernel<1024><<<1, 1024, 0, stream>>>(a.kl_rows, p.T * p.Hp, p.kl_coeff,
                                                         static_cast<float>(p.T * p.Hp), p.kl);
    FLASHMSA_CHECK_LAUNCH();
  }
  if (kl_kv) launch_kl_value(p, stream);  // reads the lse written above
}

}  // namespace flashmsa::cuda
