// The three tensor-core kernels of the fused backward, all KV-major: one CTA per (proxy head
// or head segment, global key block) walks the list of query tokens that selected the block,
// 64 tokens at a time, with the block's keys resident in shared memory.
//   proxy_lse_kernel : the student's partial (max, sum) over one selected block per (p, t, slot)
//   attn_bwd_kernel  : dq, dk, dv of the main attention (FlashAttention-2 style, transposed:
//                      warp w owns keys 16w..16w+15, so dK and dV never leave registers)
//   kl_bwd_kernel    : the teacher (mean of the group's m softmaxes, rebuilt from q, k, lse),
//                      the KL value, dqp and dkp
// When every proxy group lies inside one kv head (H/Hkv a multiple of m = H/Hp, m >= 2: the m3
// shape), attn_bwd_kernel with FOLD = true also does kl_bwd_kernel's work: its head segment is
// the whole group, so the softmaxes the teacher needs are already in registers at each head
// step; they are summed in shared memory and the proxy part runs once per token tile, after the
// group's last head. That removes the teacher's second computation of S (m products per tile).
#pragma once

#include <type_traits>

#include "common/wgmma.cuh"
#include "sm90/backward_tiles.cuh"

namespace flashmsa::cuda::bwd {

// ---------------------------------------------------------------------------------------------
// Student log-sum-exp pieces: for each selected (p, t, slot) the max and the sum of exp over the
// block's visible keys of s = scale_p <qp[t,p], kp[j,pk]>. 4 warps, warp w owns tokens
// 16w..16w+15 of the tile, all 128 keys (rows = tokens here, so the reduction is within quads).
// Max and sum of exp of a quad's row (half 0: fragment rows g, half 1: g + 8) of scale_p s over
// 128 keys; with MASKED only the keys 8 nt + e <= last (the quad lane's own columns: key - key0 -
// 2 c4). The max is taken on the raw scores (scale_p > 0) and folded into one FFMA per exp.
template <bool MASKED>
__device__ __forceinline__ float2 row_max_sum(const float (&s)[16][4], int half, int last, float scale_p) {
  float mx = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < 16; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e)
      if (!MASKED || 8 * nt + e <= last) mx = fmaxf(mx, s[nt][2 * half + e]);
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float c = scale_p * kLog2e, base = mx * c;
  float sum = 0.f;
#pragma unroll
  for (int nt = 0; nt < 16; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e)
      if (!MASKED || 8 * nt + e <= last) sum += fast_exp2(fmaf(s[nt][2 * half + e], c, -base));
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  return make_float2(mx * scale_p, sum);
}

// A scored tile's per-row maximum and sum (S in the mma.sync C layout: 16 column chunks of this
// warp's rows g4 and g4 + 8) stored as the (p, t, slot) partials. The list ascends in t, so when the
// tile's first token lies past the block's last key every row sees all 128 keys (padding rows are
// never stored): only a list's first tiles, the block's own tokens, take the causal mask.
__device__ __forceinline__ void store_row_partials(const float (&s)[16][4], const int32_t* vals, const Index& ix,
                                                   const BlockCtx& bc, int p, int64_t TK, float scale_p,
                                                   float* __restrict__ part_max, float* __restrict__ part_sum) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g4 = lane >> 2, c4 = lane & 3;
  const int t0 = vals[0] >= 0 ? static_cast<int>(ix.token_of(vals[0]) - bc.seq_start) : -1;
  const bool all_visible = t0 >= bc.key0 + kBlk - 1;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = 16 * warp + g4 + 8 * half;
    const int v = vals[row];
    const int tpos = v >= 0 ? static_cast<int>(ix.token_of(v) - bc.seq_start) : -1;
    const float2 ms = all_visible ? row_max_sum<false>(s, half, 0, scale_p)
                                  : row_max_sum<true>(s, half, tpos - bc.key0 - 2 * c4, scale_p);
    if (c4 == 0 && v >= 0) {
      const int64_t at = static_cast<int64_t>(p) * TK + v;  // (p, t, slot)
      part_max[at] = ms.x;
      part_sum[at] = ms.y;
    }
  }
}

// WG (D = 128): S (64 tokens x 128 keys) = Qp tile . Kp^T as eight m64n128k16 SS products on
// warpgroup MMA, both operands K-major in the wgmma backward's 128-byte swizzle layout ([2 slabs]
// [rows][128 B], 16-byte chunk c of row r at slab c >> 3, position (c & 7) ^ (r & 7); smem 1024-byte
// aligned). Its accumulator is the mma.sync C layout repeated over 16 column chunks
// (common/wgmma.cuh), so row_max_sum reads it as s[16][4] unchanged. The mma.sync form (WG = false)
// issues an ldmatrix and 16 MMAs per k-step and warp (ncu: issue-bound, 0.44 IPC per scheduler).
template <int ROWS, typename Src>
__device__ __forceinline__ void load_rows_sw128(uint32_t base, const bf16* any, Src src) {
  for (int i = threadIdx.x; i < ROWS * 16; i += 128) {
    const int r = i >> 4, c = i & 15;
    const bf16* row = src(r);
    cp_async_16(base + (c >> 3) * (ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4),
                row != nullptr ? row + c * 8 : any, row != nullptr);
  }
}

// One piece [bc.begin, bc.end) of the list of (proxy head p, key block): Kp, then its token tiles.
template <int D, bool WG>
__device__ __forceinline__ void proxy_lse_piece(const bf16* __restrict__ qp, const bf16* __restrict__ kp,
                                                const Index& ix, const BlockCtx& bc, int p, int pk, int Hp,
                                                int Hpk, float scale_p, unsigned char* smem,
                                                float* __restrict__ part_max, float* __restrict__ part_sum) {
  static_assert(!WG || D == 128, "the wgmma student lse takes D = 128");
  constexpr int RB = D * 2;
  unsigned char* sKp = smem;                         // [128][D] (WG: [2 slabs][128][128 B])
  unsigned char* sQp = sKp + kBlk * RB;              // [2][64][D]: double buffer of token tiles
  int32_t* sVal = reinterpret_cast<int32_t*>(sQp + 2 * kTileTok * RB);  // [2][64] list entries
  const uint32_t kp_base = smem_u32(sKp), qp_base = smem_u32(sQp);
  auto load_rows = [&](uint32_t base, auto rows, const bf16* any, auto src) {
    if constexpr (WG) load_rows_sw128<decltype(rows)::value>(base, any, src);
    else load_rows_async<D, 128>(base, decltype(rows)::value, any, src);
  };

  load_rows(kp_base, std::integral_constant<int, kBlk>{}, kp, [&](int r) -> const bf16* {
    return bc.key0 + r < bc.seq_len ? kp + ((bc.seq_start + bc.key0 + r) * Hpk + pk) * D : nullptr;
  });
  const int64_t TK = ix.T * ix.K;
  // The gathered rows of tile i + 1 load while tile i is scored: one commit group per tile (the
  // first one also carries Kp). A single buffer left the SM waiting for each gather (ncu:
  // ~45 TFLOP/s at fm16k, 17% of its backward).
  auto load_tile = [&](int i0, int buf) {
    const int n = min(kTileTok, bc.end - i0);
    if (threadIdx.x < kTileTok) sVal[buf * kTileTok + threadIdx.x] = threadIdx.x < n ? ix.vals[i0 + threadIdx.x] : -1;
    load_rows(qp_base + buf * kTileTok * RB, std::integral_constant<int, kTileTok>{}, qp, [&](int r) -> const bf16* {
      return r < n ? qp + (static_cast<int64_t>(ix.token_of(ix.vals[i0 + r])) * Hp + p) * D : nullptr;
    });
    cp_async_commit();
  };
  load_tile(bc.begin, 0);

  for (int i0 = bc.begin, buf = 0; i0 < bc.end; i0 += kTileTok, buf ^= 1) {
    // The other buffer was last read in the previous iteration, before its closing barrier.
    if (i0 + kTileTok < bc.end) {
      load_tile(i0 + kTileTok, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    if constexpr (WG) fence_proxy_async_shared();  // this thread's cp.async rows, for the wgmma reads
    __syncthreads();
    const uint32_t q_base = qp_base + buf * kTileTok * RB;
    const int32_t* vals = sVal + buf * kTileTok;

    if constexpr (WG) {
      float d[64];
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 8; ++ks)
        wgmma_ss_bf16<128, 0, 0>(d, wgmma_desc_sw128(q_base + (ks >> 2) * kTileTok * 128 + (ks & 3) * 32),
                                 wgmma_desc_sw128(kp_base + (ks >> 2) * kBlk * 128 + (ks & 3) * 32), ks > 0);
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operands(d);
      store_row_partials(*reinterpret_cast<const float(*)[16][4]>(d), vals, ix, bc, p, TK, scale_p, part_max,
                         part_sum);
    } else {
      const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
      float s[16][4];
#pragma unroll
      for (int i = 0; i < 16; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
      for (int k0 = 0; k0 < D; k0 += 16) {
        uint32_t a[4];
        load_a_mk<RB>(a, q_base, 16 * warp, k0, lane);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          uint32_t b[4];
          load_b_nk<RB>(b, kp_base, 16 * j, k0, lane);
          mma_bf16_16816(s[2 * j], a, b[0], b[1]);
          mma_bf16_16816(s[2 * j + 1], a, b[2], b[3]);
        }
      }
      store_row_partials(s, vals, ix, bc, p, TK, scale_p, part_max, part_sum);
    }
    __syncthreads();  // the next iteration refills this buffer
  }
}

// Dynamic shared memory of proxy_lse_kernel<D, WG>: Kp, two token tiles and their list entries
// (+ 1024 bytes to align the wgmma form's tiles).
template <int D, bool WG>
constexpr int proxy_lse_smem_bytes() {
  return (kBlk + 2 * kTileTok) * D * 2 + 2 * kTileTok * 4 + (WG ? 1024 : 0);
}

// CTA c takes the entries [c range, (c + 1) range) of the lists laid end to end (Index::vals): a
// piece of one list or pieces of a few, instead of one whole list per CTA. A key block's list holds
// every token that selected it, so early blocks have several times the mean (~6000 tokens against
// ~1900 at fm16k): with one CTA per list the launch waited for them.
template <int D, bool WG = false>
__global__ void __launch_bounds__(128) proxy_lse_kernel(
    const bf16* __restrict__ qp,  // [T, Hp, D]
    const bf16* __restrict__ kp,  // [T, Hpk, D]
    Index ix, int Hp, int Hpk, float scale_p,
    int range,                      // entries per CTA
    float* __restrict__ part_max,   // [Hp, T, K]
    float* __restrict__ part_sum) { // [Hp, T, K]
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* base = WG ? smem + ((1024u - (smem_u32(smem) & 1023u)) & 1023u) : smem;  // WG: 1024-aligned
  const int nlists = Hp * ix.NB;
  const int total = ix.seg_start[nlists];
  const int64_t first = static_cast<int64_t>(blockIdx.x) * range;
  if (first >= total) return;
  const int r0 = static_cast<int>(first), r1 = r0 + min(range, total - r0);
  // The list holding entry r0: the last one with seg_start <= r0 (seg_start[0] = 0 <= r0 <
  // seg_start[nlists] = total).
  int list = 0;
  for (int hi = nlists; hi - list > 1;) {
    const int mid = (list + hi) / 2;
    if (ix.seg_start[mid] <= r0) list = mid;
    else hi = mid;
  }
  for (int a = r0; a < r1; a = ix.seg_start[++list]) {
    const int p = list / ix.NB;
    BlockCtx bc = block_ctx(ix, p, list % ix.NB);
    if (bc.end == a) continue;  // an empty list
    bc.begin = a;
    bc.end = min(bc.end, r1);
    // Every thread passed the previous piece's last barrier: its Kp and tiles are no longer read.
    proxy_lse_piece<D, WG>(qp, kp, ix, bc, p, p / (Hp / Hpk), Hp, Hpk, scale_p, base, part_max, part_sum);
  }
}

// ---------------------------------------------------------------------------------------------
// Per-tile token metadata shared by the two 8-warp kernels.
struct TokMeta {
  int32_t tok[kTileTok];   // packed token index, -1 for padding
  int32_t tpos[kTileTok];  // position inside the sequence, -1 for padding (masks every key)
  float lse[kTileTok];     // lse of the current head (natural log)
  float aux[kTileTok];     // Di (main) or the student's lse (KL)
};

// S^T (keys 16w.. x 64 tokens) = Ktile[16w..] . Qtile^T, fp32 accumulators.
template <int D>
__device__ __forceinline__ void keys_times_tokens(float (&acc)[8][4], uint32_t k_base, uint32_t q_base,
                                                  int warp, int lane) {
  constexpr int RB = D * 2;
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
  for (int k0 = 0; k0 < D; k0 += 16) {
    uint32_t a[4];
    load_a_mk<RB>(a, k_base, 16 * warp, k0, lane);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t b[4];
      load_b_nk<RB>(b, q_base, 16 * j, k0, lane);
      mma_bf16_16816(acc[2 * j], a, b[0], b[1]);
      mma_bf16_16816(acc[2 * j + 1], a, b[2], b[3]);
    }
  }
}

// acc (keys 16w.. x D) += X^T (keys x 64 tokens, in registers) . Ytile (64 tokens x D).
template <int D>
__device__ __forceinline__ void accumulate_key_side(float (&acc)[D / 8][4], const float (&x)[8][4],
                                                    uint32_t y_base, int lane) {
  constexpr int RB = D * 2;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t a[4];
    acc_to_a(a, x[2 * kk], x[2 * kk + 1]);
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      uint32_t b[4];
      load_b_kn<RB>(b, y_base, 16 * j, 16 * kk, lane);
      mma_bf16_16816(acc[2 * j], a, b[0], b[1]);
      mma_bf16_16816(acc[2 * j + 1], a, b[2], b[3]);
    }
  }
}

// out (tokens 16(w%4).. x columns (w/4)*D/2 ..) = dS (64 tokens x 128 keys, stored as dS^T) .
// Ktile (128 keys x D).
template <int D>
__device__ __forceinline__ void tokens_times_keys(float (&out)[D / 16][4], uint32_t ds_base, uint32_t k_base,
                                                  int warp, int lane) {
  constexpr int RB = D * 2;
  const int m0 = 16 * (warp & 3), n_base = (warp >> 2) * (D / 2);
#pragma unroll
  for (int i = 0; i < D / 16; ++i) out[i][0] = out[i][1] = out[i][2] = out[i][3] = 0.f;
#pragma unroll
  for (int k0 = 0; k0 < kBlk; k0 += 16) {
    uint32_t a[4];
    load_a_km<128>(a, ds_base, m0, k0, lane);
#pragma unroll
    for (int j = 0; j < D / 32; ++j) {
      uint32_t b[4];
      load_b_kn<RB>(b, k_base, n_base + 16 * j, k0, lane);
      mma_bf16_16816(out[2 * j], a, b[0], b[1]);
      mma_bf16_16816(out[2 * j + 1], a, b[2], b[3]);
    }
  }
}

// acc (keys 16w.. x NC columns from c0) += X^T (keys x 64 tokens, in registers) . Ytile[:, c0..].
// A column slice of accumulate_key_side, so a transient accumulator needs only NC/2 registers.
// X arrives already packed as bf16 A fragments (xa[kk] = acc_to_a of n-tiles 2kk, 2kk+1).
template <int D, int NC>
__device__ __forceinline__ void accumulate_key_side_cols(float (&acc)[NC / 8][4], const uint32_t (&xa)[4][4],
                                                         uint32_t y_base, int c0, int lane) {
  constexpr int RB = D * 2;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
    for (int j = 0; j < NC / 16; ++j) {
      uint32_t b[4];
      load_b_kn<RB>(b, y_base, c0 + 16 * j, 16 * kk, lane);
      mma_bf16_16816(acc[2 * j], xa[kk], b[0], b[1]);
      mma_bf16_16816(acc[2 * j + 1], xa[kk], b[2], b[3]);
    }
  }
}

// Adds one accumulator n-tile (row lo: x0, x1; row hi = lo + 8: y0, y1; columns 2c..2c+1) into a
// shared global buffer. at_lo / at_hi: element index of (row, column 2c); ok_*: the row exists.
// fp32 mode: lanes c and c^1 swap half their values so that each lane holds 4 consecutive
// columns of one row, and one 16-byte atomic replaces two 8-byte ones (half the L2 atomic
// operations). Needs the whole warp, 16-byte aligned rows. Fixed-point mode: element atomics.
__device__ __forceinline__ void acc_add_tile(void* base, int64_t at_lo, int64_t at_hi, bool ok_lo, bool ok_hi,
                                             float x0, float x1, float y0, float y1, float fx, int c4) {
  if (fx != 0.f) {  // the fixed-point path (a NaN fx too: see acc_add)
    if (ok_lo) acc_add2(base, at_lo, x0, x1, fx);
    if (ok_hi) acc_add2(base, at_hi, y0, y1, fx);
    return;
  }
  const bool even = (c4 & 1) == 0;
  const float r0 = __shfl_xor_sync(0xffffffffu, even ? y0 : x0, 1);
  const float r1 = __shfl_xor_sync(0xffffffffu, even ? y1 : x1, 1);
  float* f = reinterpret_cast<float*>(base);
  if (even) {
    if (ok_lo) atomicAdd(reinterpret_cast<float4*>(f + at_lo), make_float4(x0, x1, r0, r1));
  } else {
    if (ok_hi) atomicAdd(reinterpret_cast<float4*>(f + at_hi - 2), make_float4(r0, r1, y0, y1));
  }
}

// The head segment s: a maximal run of heads sharing both the proxy head and the kv head.
// Segments are cut at multiples of m = H/Hp and of r = H/Hkv.
__device__ __forceinline__ void find_segment(int s, int H, int m, int r, int& h0, int& h1) {
  int count = -1;
  h0 = 0;
  h1 = H;
  for (int h = 0; h < H; ++h) {
    if (h % m == 0 || h % r == 0) {
      ++count;
      if (count == s) h0 = h;
      if (count == s + 1) {
        h1 = h;
        break;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Main attention backward over one (head segment, key block). Gathered rows are (token, head)
// pairs of the segment; dq goes out through acc_add_tile, dk/dv stay in registers until the end.
// The (tile, head) steps are flattened into one sequence (tile-major) and the next step's Q, dO
// and metadata are fetched (cp.async, second buffer) while the current step computes.
template <int D>
constexpr int attn_smem_bytes() {
  // K, V [128][D]; two stages of Q, dO [64][D]; dS^T [128][64]; two stages of metadata
  return 2 * kBlk * D * 2 + 4 * kTileTok * D * 2 + kBlk * kTileTok * 2 + 2 * static_cast<int>(sizeof(TokMeta));
}

// The fold's extra shared memory, after attn_smem_bytes: the teacher sum (fp32, one slot per
// thread and accumulator element) [32][256], Kp [128][D], Qp [64][D], the student lse [64],
// the KL reduction [8] (padded).
template <int D>
constexpr int fold_smem_bytes() {
  return kBlk * kTileTok * 4 + kBlk * D * 2 + kTileTok * D * 2 + kTileTok * 4 + 128;
}

// What the folded proxy part needs (attn_bwd_kernel with FOLD = true only).
struct FoldArgs {
  const bf16* qp = nullptr;        // [T, Hp, D]
  const bf16* kp = nullptr;        // [T, Hpk, D]
  const float* lse_s = nullptr;    // [Hp, T] the student's lse over its selected keys
  const float* kl_grad = nullptr;  // [1] or null (g = 1)
  void* dqp_acc = nullptr;         // [T, Hp, D] fp32 or int64
  void* dkp_acc = nullptr;         // [T, Hpk, D] fp32 or int64, or [T, Hp, D] fp32 (dkp_per_head)
  float* kl_part = nullptr;        // [Hp, NB] sum of KL terms of each (p, block)
  int Hpk = 1;
  float scale_p = 1.f;
  float c_base = 0.f;    // kl_coeff / (Hp*T); times g gives the dS factor
  const float* row_fx = nullptr;  // [T, H] the token-row DET form's per-row int32 dq factors, or null
  // > 0 (dense warm-up): CTAs per wave (one per SM); the wgmma kernel's odd waves walk their lists
  // ascending, the even ones descending (see attn_bwd_wgmma_kernel).
  int wave_ctas = 0;
  // The G = 1 wgmma kernel's CTA order: the key blocks swept sweep_groups proxy groups at a time
  // (Hp: block-major; 1: one group's blocks after the other's; grid (NB sweep_groups, Hp /
  // sweep_groups); FLASHMSA_BWD_ORDER, see fused_backward.cu). A divisor of Hp, set by the host
  // for every G = 1 launch (the SHARED_KV and KL_ONLY forms are always block-major).
  int sweep_groups = 0;
  // > 0: the token-row wgmma forms' token chunks (fused_backward.cu): grid x runs over
  // (chunk, key block, group in the sweep), and a CTA takes the entries chunk_bounds[(p NB + g)
  // (n_chunks + 1) + c] .. [.. + c + 1] of its block's list; dk / dv go into dk_acc / dv_acc.
  int n_chunks = 0;
  const int32_t* chunk_bounds = nullptr;  // [Hp, NB, n_chunks + 1]
  // With token chunks in fast mode (fused_backward.cu: the own-block pass): own_end[p NB + g] is the
  // end of list (p, g)'s OWN entries, the tokens inside block g (the head of the ascending list).
  // own_pass = 1: a launch of its own before the main one, grid x over (key block, group in the
  // sweep), each CTA takes its list's own entries and STORES their dq / dqp rows (every token's own
  // block is in its selection, so each row gets exactly one store; rows of tokens without it are
  // zeroed beforehand), so the dq and dqp accumulators need no zeroing; its KL share goes to slot
  // n_chunks. own_pass = 0 with own_end: the chunk CTAs skip the own entries and reduce-add.
  const int32_t* own_end = nullptr;  // [Hp, NB]
  int own_pass = 0;
  // The wgmma kernel (fused_backward.cu: its DET forms without token chunks or list pieces):
  // dkp_acc is [T, Hp, D] fp32, one partial per proxy head, instead of the shared [T, Hpk, D].
  bool dkp_per_head = false;
  // List pieces (fused_backward.cu, build_list_pieces_kernel): the wgmma kernel's main launch, fast
  // and deterministic (not the own-block pass), and its KL_ONLY form (launch_kl_value: no chunks,
  // kl_slot0 = nkeys). A list holds every token that selected its block: an attention sink's holds
  // every token of the sequence, and in one CTA it outlasted the launch. So each list part (its
  // token chunk's, with chunks) longer than piece_cap tokens is cut into near-equal pieces of at most
  // that, all of which (the overflow pieces) go to piece_stride CTAs per group placed FIRST in the
  // group's grid range, and the part's own (chunk, block) CTA exits: the longest lists' pieces start
  // early (where the own CTA kept the first piece, the last chunk's came late and set the launch's
  // tail). With no part over the cap the slots only read an empty record. Grid x runs over
  // (slot, group in the sweep): slot r < piece_stride takes record pieces[p piece_stride + r]
  // (begin = end: nothing, it returns) and writes its KL share to kl_part[kl_slot0 + p piece_stride
  // + r]; slot r >= piece_stride is the usual CTA of (chunk, block) r - piece_stride. Every CTA then
  // adds its dk / dv into dk_acc / dv_acc. p stays a function of the CTA index, as before: held
  // through the loop it would cost spills.
  const int4* pieces = nullptr;  // [Hp, piece_stride] {key block g, begin, end, 0}
  int piece_cap = 0;
  int piece_stride = 0;
  int64_t kl_slot0 = 0;
};

// DQ = false: no dq here (the deterministic mode's query-major dq, backward_dq.cu). A template
// flag rather than a runtime branch: the kernel runs at the register limit, and the DQ = true
// code must compile exactly as before.
template <int D, bool FOLD, bool DQ>
__global__ void __launch_bounds__(256, 1) attn_bwd_kernel(
    const bf16* __restrict__ q,    // [T, H, D]
    const bf16* __restrict__ k,    // [T, Hkv, D]
    const bf16* __restrict__ v,    // [T, Hkv, D]
    const bf16* __restrict__ d_o,  // [T, H, D]
    const float* __restrict__ lse, // [H, T]
    const float* __restrict__ di,  // [T, H] rowsum(dO * O)
    Index ix, int H, int Hkv, int Hp, int nseg, float scale,
    void* __restrict__ dq_acc,     // [T, H, D] fp32 or int64 (DQ), unused otherwise
    const float* __restrict__ fx,  // [5] fixed-point factors, or null (fp32 atomics)
    int owned,                     // 1: this CTA is the only writer of its dk/dv rows
    bf16* __restrict__ dk,         // [T, Hkv, D] (owned)
    bf16* __restrict__ dv,         // [T, Hkv, D] (owned)
    void* __restrict__ dk_acc,     // [T, Hkv, D] (not owned)
    void* __restrict__ dv_acc,     // [T, Hkv, D] (not owned)
    FoldArgs fa) {
  constexpr int RB = D * 2;
  constexpr int kTileBytes = kTileTok * RB;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* sK = smem;                      // [128][D]
  unsigned char* sV = sK + kBlk * RB;            // [128][D]
  unsigned char* sQ = sV + kBlk * RB;            // 2 x [64][D]
  unsigned char* sdO = sQ + 2 * kTileBytes;      // 2 x [64][D]
  unsigned char* sdS = sdO + 2 * kTileBytes;     // [128][64] dS^T
  TokMeta* tms = reinterpret_cast<TokMeta*>(sdS + kBlk * kTileTok * 2);  // 2 stages
  // Fold only (beyond attn_smem_bytes):
  float* sTch = reinterpret_cast<float*>(smem + attn_smem_bytes<D>());  // [8][256][4] teacher sums
  unsigned char* sKp = reinterpret_cast<unsigned char*>(sTch + kBlk * kTileTok);  // [128][D]
  unsigned char* sQp = sKp + kBlk * RB;                                           // [64][D]
  float* sLseS = reinterpret_cast<float*>(sQp + kTileBytes);                      // [64]
  float* sRed = sLseS + kTileTok;                                                 // [8]
  const uint32_t k_base = smem_u32(sK), v_base = smem_u32(sV), ds_base = smem_u32(sdS);

  // 1-D grid, segment fastest: the heavy early blocks of every segment start first.
  const int g = blockIdx.x / nseg;
  const int m = H / Hp, r = H / Hkv;
  int h0, h1;
  find_segment(blockIdx.x % nseg, H, m, r, h0, h1);
  const int p = h0 / m, kvh = h0 / r;
  const BlockCtx bc = block_ctx(ix, p, g);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g4 = lane >> 2, c4 = lane & 3;
  const float fx_q = fx ? fx[0] : 0.f;
  const float scale2 = scale * kLog2e;
  const int nh = h1 - h0;  // with FOLD: the whole group, m >= 2 heads
  const int steps = (bc.end - bc.begin + kTileTok - 1) / kTileTok * nh;
  const int pk = FOLD ? p / (Hp / fa.Hpk) : 0;

  float dK[D / 8][4], dV[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dK[i][e] = dV[i][e] = 0.f;
  float kl = 0.f;
  if constexpr (FOLD) {
    float4* slots = reinterpret_cast<float4*>(sTch) + threadIdx.x;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) slots[nt * 256] = make_float4(0.f, 0.f, 0.f, 0.f);
  }

  if (steps > 0) {
    auto key_row = [&](const bf16* base, int heads, int head, int rr) -> const bf16* {
      return bc.key0 + rr < bc.seq_len ? base + ((bc.seq_start + bc.key0 + rr) * heads + head) * D : nullptr;
    };
    load_rows_async<D, 256>(k_base, kBlk, k, [&](int rr) { return key_row(k, Hkv, kvh, rr); });
    load_rows_async<D, 256>(v_base, kBlk, v, [&](int rr) { return key_row(v, Hkv, kvh, rr); });
    if constexpr (FOLD)
      load_rows_async<D, 256>(smem_u32(sKp), kBlk, fa.kp, [&](int rr) { return key_row(fa.kp, fa.Hpk, pk, rr); });
  }

  // Issues the loads of step `it` into stage `st` and commits them as one group. Thread
  // 4*row + part copies a quarter of row `row` of Q and dO; part 0/1/2 also fill the row's
  // token, lse and Di, so nothing here waits on a global load except the token index.
  // Fold: the tile's Qp and student lse ride with its second head's step, which is issued
  // after the previous tile's proxy part (at its last head) has finished with sQp.
  auto issue = [&](int it, int st) {
    const int i0 = bc.begin + (it / nh) * kTileTok, h = h0 + it % nh;
    const int n = min(kTileTok, bc.end - i0);
    const int row = threadIdx.x >> 2, part = threadIdx.x & 3;
    const int t = row < n ? ix.token_of(__ldg(ix.vals + i0 + row)) : -1;
    const bool ok = t >= 0;
    const int64_t at = (static_cast<int64_t>(ok ? t : 0) * H + h) * D;
    const uint32_t qs = smem_u32(sQ + st * kTileBytes), os = smem_u32(sdO + st * kTileBytes);
    constexpr int kPer = D / 32;  // 16-byte chunks per thread and tile
#pragma unroll
    for (int c = part * kPer; c < (part + 1) * kPer; ++c) {
      cp_async_16(qs + swizzle_offset<RB>(row, c), q + at + c * 8, ok);
      cp_async_16(os + swizzle_offset<RB>(row, c), d_o + at + c * 8, ok);
    }
    TokMeta& tm = tms[st];
    if (part == 0) {
      tm.tok[row] = t;
      tm.tpos[row] = ok ? static_cast<int>(t - bc.seq_start) : -1;
    } else if (part == 1) {
      cp_async_4(smem_u32(&tm.lse[row]), lse + static_cast<int64_t>(h) * ix.T + (ok ? t : 0), ok);
    } else if (part == 2) {
      cp_async_4(smem_u32(&tm.aux[row]), di + static_cast<int64_t>(ok ? t : 0) * H + h, ok);
    }
    if constexpr (FOLD) {
      if (it % nh == 1) {
        const int64_t atp = (static_cast<int64_t>(ok ? t : 0) * Hp + p) * D;
        const uint32_t qps = smem_u32(sQp);
#pragma unroll
        for (int c = part * kPer; c < (part + 1) * kPer; ++c)
          cp_async_16(qps + swizzle_offset<RB>(row, c), fa.qp + atp + c * 8, ok);
        if (part == 3)
          cp_async_4(smem_u32(&sLseS[row]), fa.lse_s + static_cast<int64_t>(p) * ix.T + (ok ? t : 0), ok);
      }
    }
    cp_async_commit();
  };
  if (steps > 0) issue(0, 0);

  for (int it = 0; it < steps; ++it) {
    const int st = it & 1;
    const int h = h0 + it % nh;
    if (it + 1 < steps) {
      issue(it + 1, st ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const TokMeta& tm = tms[st];
    const uint32_t q_base = smem_u32(sQ + st * kTileBytes), do_base = smem_u32(sdO + st * kTileBytes);

    float sT[8][4], dpT[8][4];
    keys_times_tokens<D>(sT, k_base, q_base, warp, lane);
    keys_times_tokens<D>(dpT, v_base, do_base, warp, lane);
    // A lane's columns come in pairs (2c, 2c+1): one 8-byte load per array and pair.
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int col = 8 * nt + 2 * c4;
      const int2 tp = *reinterpret_cast<const int2*>(&tm.tpos[col]);
      const float2 ls = *reinterpret_cast<const float2*>(&tm.lse[col]);
      const float2 ax = *reinterpret_cast<const float2*>(&tm.aux[col]);
      const int tpv[2] = {tp.x, tp.y};
      const float nl[2] = {-ls.x * kLog2e, -ls.y * kLog2e}, axv[2] = {ax.x, ax.y};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = bc.key0 + 16 * warp + g4 + 8 * (e >> 1);
        const float pr = key <= tpv[e & 1] ? exp2f(fmaf(sT[nt][e], scale2, nl[e & 1])) : 0.f;
        sT[nt][e] = pr;
        dpT[nt][e] = pr * (dpT[nt][e] - axv[e & 1]);
      }
    }
    if constexpr (FOLD) {
      // Teacher sums: thread-private float4 slots (so no barrier), zero at each tile's start.
      // Kept out of the loop above: stores there would order every metadata load after them.
      float4* slots = reinterpret_cast<float4*>(sTch) + threadIdx.x;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        float4 a = slots[nt * 256];
        a.x += sT[nt][0];
        a.y += sT[nt][1];
        a.z += sT[nt][2];
        a.w += sT[nt][3];
        slots[nt * 256] = a;
      }
    }
    accumulate_key_side<D>(dV, sT, do_base, lane);
    accumulate_key_side<D>(dK, dpT, q_base, lane);
    const int n_base = (warp >> 2) * (D / 2);
    if constexpr (DQ) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int row = 16 * warp + g4, col = 8 * nt + 2 * c4;
        store_pair_64(sdS, row, col, dpT[nt][0], dpT[nt][1]);
        store_pair_64(sdS, row + 8, col, dpT[nt][2], dpT[nt][3]);
      }
      __syncthreads();
      float dq[D / 16][4];
      tokens_times_keys<D>(dq, ds_base, k_base, warp, lane);
      const int row = 16 * (warp & 3) + g4;
      const int t_lo = tm.tok[row], t_hi = tm.tok[row + 8];
      const int64_t at_lo = (static_cast<int64_t>(t_lo < 0 ? 0 : t_lo) * H + h) * D + n_base + 2 * c4;
      const int64_t at_hi = (static_cast<int64_t>(t_hi < 0 ? 0 : t_hi) * H + h) * D + n_base + 2 * c4;
#pragma unroll
      for (int nt = 0; nt < D / 16; ++nt)
        acc_add_tile(dq_acc, at_lo + 8 * nt, at_hi + 8 * nt, t_lo >= 0, t_hi >= 0, dq[nt][0] * scale,
                     dq[nt][1] * scale, dq[nt][2] * scale, dq[nt][3] * scale, fx_q, c4);
    }
    __syncthreads();  // this stage and sdS are rewritten by the next steps

    if constexpr (FOLD) {
      if (it % nh == nh - 1) {
        // The proxy part of this tile: student scores, KL terms, dS = c (Qs - Tch), dkp, dqp.
        const uint32_t qp_base = smem_u32(sQp), kp_base = smem_u32(sKp);
        const float c = fa.c_base * (fa.kl_grad ? __ldg(fa.kl_grad) : 1.f);
        const float inv_m = 1.f / static_cast<float>(nh);
        float s[8][4];
        keys_times_tokens<D>(s, kp_base, qp_base, warp, lane);
        float4* slots = reinterpret_cast<float4*>(sTch) + threadIdx.x;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const float4 t4 = slots[nt * 256];
          slots[nt * 256] = make_float4(0.f, 0.f, 0.f, 0.f);  // the next tile starts from zero
          const float tsum[4] = {t4.x, t4.y, t4.z, t4.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = bc.key0 + 16 * warp + g4 + 8 * (e >> 1);
            const int col = 8 * nt + 2 * c4 + (e & 1);
            float ds = 0.f;
            if (key <= tm.tpos[col]) {
              const float log_qs = s[nt][e] * fa.scale_p - sLseS[col];
              const float te = tsum[e] * inv_m;
              if (te > 0.f) kl += te * (__logf(te) - log_qs);
              ds = c * (__expf(log_qs) - te);
            }
            s[nt][e] = ds;
          }
        }
        // dS^T as bf16 A fragments: feeds dkp from registers and is the sdS content for dqp.
        uint32_t dsa[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) acc_to_a(dsa[kk], s[2 * kk], s[2 * kk + 1]);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const int row = 16 * warp + g4, col = 8 * nt + 2 * c4;
          *reinterpret_cast<uint32_t*>(sdS + swizzle_offset<128>(row, col >> 3) + (col & 7) * 2) =
              dsa[nt >> 1][(nt & 1) * 2];
          *reinterpret_cast<uint32_t*>(sdS + swizzle_offset<128>(row + 8, col >> 3) + (col & 7) * 2) =
              dsa[nt >> 1][(nt & 1) * 2 + 1];
        }
        // dkp rows of this warp's keys, this tile's share, in two column halves.
        const float fx_kp = fx ? fx[4] : 0.f;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float acc[D / 16][4];
#pragma unroll
          for (int i = 0; i < D / 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
          accumulate_key_side_cols<D, D / 2>(acc, dsa, qp_base, half * (D / 2), lane);
          const int key = bc.key0 + 16 * warp + g4;
          const int64_t at_lo =
              ((bc.seq_start + key) * fa.Hpk + pk) * D + half * (D / 2) + 2 * c4;
          const int64_t at_hi = at_lo + static_cast<int64_t>(8) * fa.Hpk * D;
#pragma unroll
          for (int nt = 0; nt < D / 16; ++nt)
            acc_add_tile(fa.dkp_acc, at_lo + 8 * nt, at_hi + 8 * nt, key < bc.seq_len, key + 8 < bc.seq_len,
                         acc[nt][0] * fa.scale_p, acc[nt][1] * fa.scale_p, acc[nt][2] * fa.scale_p,
                         acc[nt][3] * fa.scale_p, fx_kp, c4);
        }
        __syncthreads();
        float dqp[D / 16][4];
        tokens_times_keys<D>(dqp, ds_base, kp_base, warp, lane);
        const float fx_qp = fx ? fx[3] : 0.f;
        const int row = 16 * (warp & 3) + g4;
        const int t_lo = tm.tok[row], t_hi = tm.tok[row + 8];
        const int64_t at_lo = (static_cast<int64_t>(t_lo < 0 ? 0 : t_lo) * Hp + p) * D + n_base + 2 * c4;
        const int64_t at_hi = (static_cast<int64_t>(t_hi < 0 ? 0 : t_hi) * Hp + p) * D + n_base + 2 * c4;
#pragma unroll
        for (int nt = 0; nt < D / 16; ++nt)
          acc_add_tile(fa.dqp_acc, at_lo + 8 * nt, at_hi + 8 * nt, t_lo >= 0, t_hi >= 0,
                       dqp[nt][0] * fa.scale_p, dqp[nt][1] * fa.scale_p, dqp[nt][2] * fa.scale_p,
                       dqp[nt][3] * fa.scale_p, fx_qp, c4);
        __syncthreads();  // sdS, sQp and the stage metadata are rewritten next
      }
    }
  }

  // dk, dv rows of this warp's keys; rows past the sequence end belong to another sequence.
  const float fx_k = fx ? fx[1] : 0.f, fx_v = fx ? fx[2] : 0.f;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = bc.key0 + 16 * warp + g4 + 8 * half;
    if (key >= bc.seq_len) continue;
    const int64_t at = ((bc.seq_start + key) * Hkv + kvh) * D + 2 * c4;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      const float k0v = dK[nt][2 * half] * scale, k1v = dK[nt][2 * half + 1] * scale;
      const float v0v = dV[nt][2 * half], v1v = dV[nt][2 * half + 1];
      if (owned) {
        *reinterpret_cast<uint32_t*>(dk + at + 8 * nt) = pack_bf16x2(k0v, k1v);
        *reinterpret_cast<uint32_t*>(dv + at + 8 * nt) = pack_bf16x2(v0v, v1v);
      } else {
        acc_add2(dk_acc, at + 8 * nt, k0v, k1v, fx_k);
        acc_add2(dv_acc, at + 8 * nt, v0v, v1v, fx_v);
      }
    }
  }

  if constexpr (FOLD) {
    // The block's KL share, reduced in a fixed order (deterministic in every mode).
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) kl += __shfl_xor_sync(0xffffffffu, kl, off);
    if (lane == 0) sRed[warp] = kl;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.f;
      for (int w = 0; w < 8; ++w) total += sRed[w];
      fa.kl_part[static_cast<int64_t>(p) * ix.NB + g] = total;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The proxy's KL over one (proxy head p, key block): teacher from the group's m heads, student
// from the proxy scores and the merged student lse, dS = c (Qs - Tch), dqp (atomics), dkp
// (registers), and the block's share of sum KL[p, t]. Steps are (tile, head of the group);
// the next step's Q (and, at a tile's first head, its qp and metadata) load while the current
// step computes. A step whose kv head differs from the previous one (groups spanning kv heads)
// is loaded only after the current step, since it replaces the resident K.
template <int D>
constexpr int kl_smem_bytes() {
  // K, Kp [128][D]; two stages of Q and of Qp [64][D]; dS^T [128][64]; metadata
  return 2 * kBlk * D * 2 + 4 * kTileTok * D * 2 + kBlk * kTileTok * 2 +
         2 * static_cast<int>(sizeof(TokMeta)) + 2 * kTileTok * 4 + 64;
}

template <int D>
__global__ void __launch_bounds__(256, 1) kl_bwd_kernel(
    const bf16* __restrict__ q,      // [T, H, D]
    const bf16* __restrict__ k,      // [T, Hkv, D]
    const bf16* __restrict__ qp,     // [T, Hp, D]
    const bf16* __restrict__ kp,     // [T, Hpk, D]
    const float* __restrict__ lse,   // [H, T]
    const float* __restrict__ lse_s, // [Hp, T] the student's lse over its selected keys
    Index ix, int H, int Hkv, int Hp, int Hpk, float scale, float scale_p,
    float c_base,                    // kl_coeff / (Hp*T); times g gives the dS factor
    const float* __restrict__ kl_grad,  // [1] or null (g = 1)
    void* __restrict__ dqp_acc,      // [T, Hp, D] fp32 or int64
    const float* __restrict__ fx,    // [5] or null
    int owned,                       // 1: Hp == Hpk, this CTA is the only writer of its dkp rows
    bf16* __restrict__ dkp,          // [T, Hpk, D] (owned)
    void* __restrict__ dkp_acc,      // [T, Hpk, D] (not owned)
    float* __restrict__ kl_part) {   // [Hp, NB] sum of KL terms of this block
  constexpr int RB = D * 2;
  constexpr int kTileBytes = kTileTok * RB;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* sK = smem;                      // [128][D] main keys of the current kv head
  unsigned char* sKp = sK + kBlk * RB;           // [128][D] proxy keys
  unsigned char* sQ = sKp + kBlk * RB;           // 2 x [64][D] main queries (per step)
  unsigned char* sQp = sQ + 2 * kTileBytes;      // 2 x [64][D] proxy queries (per tile)
  unsigned char* sdS = sQp + 2 * kTileBytes;     // [128][64] dS^T
  TokMeta* tms = reinterpret_cast<TokMeta*>(sdS + kBlk * kTileTok * 2);  // per tile parity
  float* lses = reinterpret_cast<float*>(tms + 2);                     // [2][64] per step parity
  float* red = lses + 2 * kTileTok;                                    // [8]
  const uint32_t k_base = smem_u32(sK), kp_base = smem_u32(sKp), ds_base = smem_u32(sdS);

  const int g = blockIdx.x / Hp, p = blockIdx.x % Hp;  // proxy head fastest (see attn_bwd_kernel)
  const int m = H / Hp, r = H / Hkv, pk = p / (Hp / Hpk);
  const BlockCtx bc = block_ctx(ix, p, g);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g4 = lane >> 2, c4 = lane & 3;
  const float fx_qp = fx ? fx[3] : 0.f;
  const float scale2 = scale * kLog2e;
  const float c = c_base * (kl_grad ? *kl_grad : 1.f);
  const float inv_m = 1.f / static_cast<float>(m);
  const int steps = (bc.end - bc.begin + kTileTok - 1) / kTileTok * m;

  float dKp[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dKp[i][0] = dKp[i][1] = dKp[i][2] = dKp[i][3] = 0.f;
  float kl = 0.f;

  auto key_row = [&](const bf16* base, int heads, int head, int rr) -> const bf16* {
    return bc.key0 + rr < bc.seq_len ? base + ((bc.seq_start + bc.key0 + rr) * heads + head) * D : nullptr;
  };
  auto kv_of = [&](int it) { return (p * m + it % m) / r; };
  if (steps > 0)
    load_rows_async<D, 256>(kp_base, kBlk, kp, [&](int rr) { return key_row(kp, Hpk, pk, rr); });

  // Same split as attn_bwd_kernel: thread 4*row + part copies a quarter of row `row`.
  auto issue = [&](int it) {
    const int tile = it / m, h = p * m + it % m, st = it & 1, tst = tile & 1;
    const int i0 = bc.begin + tile * kTileTok;
    const int n = min(kTileTok, bc.end - i0);
    if (it == 0 || kv_of(it) != kv_of(it - 1)) {
      const int kvh = kv_of(it);
      load_rows_async<D, 256>(k_base, kBlk, k, [&](int rr) { return key_row(k, Hkv, kvh, rr); });
    }
    const int row = threadIdx.x >> 2, part = threadIdx.x & 3;
    const int t = row < n ? ix.token_of(__ldg(ix.vals + i0 + row)) : -1;
    const bool ok = t >= 0;
    const int64_t tt = ok ? t : 0;
    constexpr int kPer = D / 32;
    const uint32_t qs = smem_u32(sQ + st * kTileBytes), qps = smem_u32(sQp + tst * kTileBytes);
    const bool first = it % m == 0;
#pragma unroll
    for (int c = part * kPer; c < (part + 1) * kPer; ++c) {
      cp_async_16(qs + swizzle_offset<RB>(row, c), q + (tt * H + h) * D + c * 8, ok);
      if (first) cp_async_16(qps + swizzle_offset<RB>(row, c), qp + (tt * Hp + p) * D + c * 8, ok);
    }
    if (part == 1) cp_async_4(smem_u32(&lses[st * kTileTok + row]), lse + static_cast<int64_t>(h) * ix.T + tt, ok);
    if (first) {
      TokMeta& tm = tms[tst];
      if (part == 0) {
        tm.tok[row] = t;
        tm.tpos[row] = ok ? static_cast<int>(t - bc.seq_start) : -1;
      } else if (part == 2) {
        cp_async_4(smem_u32(&tm.aux[row]), lse_s + static_cast<int64_t>(p) * ix.T + tt, ok);
      }
    }
    cp_async_commit();
  };
  if (steps > 0) issue(0);

  float tch[8][4];
  for (int it = 0; it < steps; ++it) {
    const int st = it & 1, tile = it / m, tst = tile & 1;
    const bool has_next = it + 1 < steps;
    const bool deferred = has_next && kv_of(it + 1) != kv_of(it);
    if (has_next && !deferred) {
      issue(it + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const TokMeta& tm = tms[tst];

    // Teacher: Tch^T = (1/m) sum over the group's heads of P^T.
    if (it % m == 0) {
#pragma unroll
      for (int i = 0; i < 8; ++i) tch[i][0] = tch[i][1] = tch[i][2] = tch[i][3] = 0.f;
    }
    {
      float sT[8][4];
      keys_times_tokens<D>(sT, k_base, smem_u32(sQ + st * kTileBytes), warp, lane);
      const float* lse_h = lses + st * kTileTok;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = bc.key0 + 16 * warp + g4 + 8 * (e >> 1);
          const int col = 8 * nt + 2 * c4 + (e & 1);
          if (key <= tm.tpos[col]) tch[nt][e] += exp2f(fmaf(sT[nt][e], scale2, -lse_h[col] * kLog2e));
        }
    }

    if (it % m == m - 1) {
      // Student and the KL gradient for this tile.
      const uint32_t qp_base = smem_u32(sQp + tst * kTileBytes);
      float s[8][4];
      keys_times_tokens<D>(s, kp_base, qp_base, warp, lane);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = bc.key0 + 16 * warp + g4 + 8 * (e >> 1);
          const int col = 8 * nt + 2 * c4 + (e & 1);
          float ds = 0.f;
          if (key <= tm.tpos[col]) {
            const float log_qs = s[nt][e] * scale_p - tm.aux[col];
            const float te = tch[nt][e] * inv_m;
            if (te > 0.f) kl += te * (__logf(te) - log_qs);
            ds = c * (__expf(log_qs) - te);
          }
          s[nt][e] = ds;
        }
      accumulate_key_side<D>(dKp, s, qp_base, lane);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int row = 16 * warp + g4, col = 8 * nt + 2 * c4;
        store_pair_64(sdS, row, col, s[nt][0], s[nt][1]);
        store_pair_64(sdS, row + 8, col, s[nt][2], s[nt][3]);
      }
      __syncthreads();
      float dq[D / 16][4];
      tokens_times_keys<D>(dq, ds_base, kp_base, warp, lane);
      const int n_base = (warp >> 2) * (D / 2);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = 16 * (warp & 3) + g4 + 8 * half;
        const int t = tm.tok[row];
        if (t < 0) continue;
        const int64_t at = (static_cast<int64_t>(t) * Hp + p) * D + n_base + 2 * c4;
#pragma unroll
        for (int nt = 0; nt < D / 16; ++nt) {
          acc_add2(dqp_acc, at + 8 * nt, dq[nt][2 * half] * scale_p, dq[nt][2 * half + 1] * scale_p, fx_qp);
        }
      }
    }
    __syncthreads();  // stages, sdS and (for a deferred step) sK are rewritten next
    if (deferred) issue(it + 1);
  }

  const float fx_kp = fx ? fx[4] : 0.f;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = bc.key0 + 16 * warp + g4 + 8 * half;
    if (key >= bc.seq_len) continue;
    const int64_t at = ((bc.seq_start + key) * Hpk + pk) * D + 2 * c4;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      const float x0 = dKp[nt][2 * half] * scale_p, x1 = dKp[nt][2 * half + 1] * scale_p;
      if (owned) {
        *reinterpret_cast<uint32_t*>(dkp + at + 8 * nt) = pack_bf16x2(x0, x1);
      } else {
        acc_add2(dkp_acc, at + 8 * nt, x0, x1, fx_kp);
      }
    }
  }

  // The block's KL share, reduced in a fixed order (deterministic in every mode).
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) kl += __shfl_xor_sync(0xffffffffu, kl, off);
  if (lane == 0) red[warp] = kl;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int w = 0; w < 8; ++w) total += red[w];
    kl_part[static_cast<int64_t>(p) * ix.NB + g] = total;
  }
}

}  // namespace flashmsa::cuda::bwd
