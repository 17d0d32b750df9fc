// KV-major block-sparse forward: o, lse (msa.md step 5) and the KL value (step 6).
//
// Why: the query-major kernel (sparse_forward.cu) streams 1 MB of K/V per (token, group) and is
// bound by L2->SM traffic (~275 GB at m3/64k). Here the selection is inverted: per (proxy head
// p, key block) the list of (token, slot) entries that selected it (cub stable radix sort, so
// each list is ascending in t). One CTA owns one (p, block): K, V and kp of the block are loaded
// into shared memory once and every listed token's m main-head rows are multiplied against them.
//
// Rows: a warp's 16 MMA rows are R = 16/m consecutive list entries x m heads (row r: entry r/m,
// head r%m), m in {2, 4, 8, 16} with the group on one kv head. At m = 16 a warp is one token;
// for smaller groups the query-major kernel would leave 16-m of its 16 rows idle, while here the
// rows stay full and the block is read once per CTA round of 8*R tokens. Rows of entries past the
// list end repeat the last live entry (finite softmax everywhere) and store nothing.
//
// The softmax of a token spans K blocks owned by different CTAs. Two passes per chunk of tokens:
//   pass 1: scores only -> per (t, h, slot) partial log-sum-exp of the main rows and per
//           (t, p, slot) of the proxy; a merge kernel turns them into lse (an output) and the
//           student's lse;
//   pass 2: with exact lse, P = exp(S - lse), O += P V into an fp32 chunk accumulator (vector
//           atomics), and the KL of the block's keys: teacher = mean of P over the m rows of one
//           token (a segmented reduce-scatter across the warp's row groups), student =
//           exp(sp - lse_s), summed into one float (atomics).
// The proxy rows of a round (one per token, 8*R of them) are multiplied in 16-row tiles shared
// by the 8 warps (warp w takes keys [16w, 16w+16)); only the KL needs them.
// Tokens are processed in chunks so that the fp32 accumulator and the partials stay within the
// forward's extra-memory goal (<= 0.45 x size of q with the index). The float atomics make o
// and kl non-bitwise-reproducible run to run, so deterministic mode never takes this kernel.
//
// Measured at m = 16 (H200, m3, B=1, median of 10): 14.3 / 25.0 / 46.6 ms without KL and
// 16.6 / 29.1 / 55.1 ms with it at S = 16k / 32k / 64k (query-major: 6.1 / 13.2 / 27.4 and
// 12.9 / 27.0 / 58.8), extra memory 0.45 x size of q; so m = 16 stays opt-in (routing in
// sparse_forward.cu). Breakdown at 64k without KL (a diagnostic build, since removed): index
// 0.7 ms, pass 1 12.1 ms (2.1 PFLOP, ~175 TFLOP/s), pass 2 31.8 ms of which ~13.5 ms are the
// fp32 O atomics (18.3 ms when they are skipped), convert 0.8 ms; one chunk instead of 7 changes
// nothing. Next steps: wgmma with 64-row warpgroup tiles (4 warps' rows) so K/V smem reads are
// amortised over 4x the rows; O partials without L2 read-modify-write (e.g. bf16 per-slot
// partials in small chunks, or merging 2-4 blocks per CTA).
#include "sm90/forward_kv.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "common/bf16.cuh"
#include "common/check.cuh"
#include "common/metadata.cuh"
#include "common/mma.cuh"
#include "common/reduce_scatter.cuh"
#include "common/selection_index.cuh"

namespace flashmsa::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kBlk = 128;      // BLK: keys per block
static_assert(kBlk == kIndexBlk, "the shared selection index is built for this block size");
constexpr int kD = 128;        // head dim (D = Dv = Dp)
constexpr int kRowBytes = kD * 2;
constexpr int kWarps = 8;      // warps per CTA (16 MMA rows each)
constexpr int kThreads = kWarps * 32;

// ---- the two KV-major passes ---------------------------------------------------------------------

struct KvArgs {
  const bf16* q;            // [T, H, D]
  const bf16* k;            // [T, Hkv, D]
  const bf16* v;            // [T, Hkv, D]
  const bf16* qp;           // [T, Hp, D]
  const bf16* kp;           // [T, Hpk, D]
  const int32_t* cu;        // [B+1]
  const int32_t* blk_off;   // [B+1] first global block of each sequence
  const int32_t* blk_seq;   // [NB] sequence of each global block
  const int32_t* seg;       // [Hp*NB+1] list offsets into vals
  const int32_t* vals;      // [Hp*T*K] sorted t*K + slot
  float* part;              // [Tc, H, K] pass 1: partial lse (log2 units) of the main rows
  float* part_s;            // [Tc, Hp, K] pass 1: partial lse (natural) of the proxy
  const float* lse;         // [H, T] pass 2 (merged, natural log)
  const float* lse_s;       // [Tc, Hp] pass 2: the student's lse
  float* o_acc;             // [Tc, H, D] pass 2
  float* kl_acc;            // [1] pass 2: sum of KL[p, t] over the processed rows
  int64_t T, c0, c1;        // tokens; this chunk is [c0, c1)
  int B, H, Hkv, Hp, Hpk, K, NB;
  float scale_log2;         // scale * log2(e)
  float proxy_scale;
  bool with_kl;
};

template <int BYTES>
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
  return swizzle_offset<BYTES>(row, chunk);
}

// 16 rows of A (16 x D) from a swizzled tile into mma fragments.
__device__ __forceinline__ void load_a(uint32_t (&f)[kD / 16][4], const unsigned char* src, int lane) {
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks)
    ldmatrix_x4(f[ks], smem_u32(src + swz<kRowBytes>(lane & 15, ks * 2 + (lane >> 4))));
}

// s (16 x 8*NT) = A * tile^T, tile = 8*NT consecutive key rows of a swizzled [rows][D] tile
// starting at row r0 (a multiple of 8).
template <int NT>
__device__ __forceinline__ void scores(float (&s)[NT][4], const uint32_t (&a)[kD / 16][4],
                                       const unsigned char* tile, int r0, int lane) {
#pragma unroll
  for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, smem_u32(tile + swz<kRowBytes>(r0 + np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                                    ks * 2 + ((lane >> 3) & 1))));
      mma_bf16_16816(s[2 * np], a[ks], b[0], b[1]);
      mma_bf16_16816(s[2 * np + 1], a[ks], b[2], b[3]);
    }
  }
}

__device__ __forceinline__ int lower_bound_vals(const int32_t* __restrict__ vals, int lo, int hi,
                                                int64_t x) {
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (vals[mid] < x) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// The round layout for a group of M heads: a warp's 16 rows are kR entries x M heads, a round
// is kRound entries (one proxy row each), multiplied in kPTiles 16-row proxy tiles (at M = 16
// one tile whose rows 8..15 are zero).
template <int M>
struct KvShape {
  static_assert(M == 2 || M == 4 || M == 8 || M == 16, "groups of 2, 4, 8 or 16 heads");
  static constexpr int kR = 16 / M;
  static constexpr int kRound = kWarps * kR;
  static constexpr int kPTiles = (kRound + 15) / 16;
};

template <int M, bool kPass2>
constexpr int kv_smem_bytes() {
  // k, kp, [v] tiles + 2 proxy-row buffers + per-warp Q rows + proxy scores of the round.
  using S = KvShape<M>;
  return (kPass2 ? 3 : 2) * kBlk * kRowBytes + 2 * S::kPTiles * 16 * kRowBytes + kWarps * 16 * kRowBytes +
         S::kRound * kBlk * 4;
}

// Pass 1 runs two CTAs per SM where their shared memory fits (228 KB per SM, 1 KB reserved per
// CTA): M = 16 and 8; M = 4 and 2 hold more proxy rows per round and run one.
template <int M>
constexpr int kv_pass1_ctas() {
  return 2 * (kv_smem_bytes<M, false>() + 1024) <= 228 * 1024 ? 2 : 1;
}

template <int M, bool kPass2>
__global__ void __launch_bounds__(kThreads, kPass2 ? 1 : kv_pass1_ctas<M>()) kv_pass_kernel(const KvArgs a) {
  constexpr int kR = KvShape<M>::kR, kRound = KvShape<M>::kRound, kPT = KvShape<M>::kPTiles;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* k_s = smem;                                     // [128][D]
  unsigned char* kp_s = k_s + kBlk * kRowBytes;                  // [128][D]
  unsigned char* qp_s = kp_s + kBlk * kRowBytes;                 // [2][kPT*16][D] rows >= kRound zero
  unsigned char* q_s = qp_s + 2 * kPT * 16 * kRowBytes;          // [kWarps][16][D]
  float* sp_s = reinterpret_cast<float*>(q_s + kWarps * 16 * kRowBytes);  // [kRound][128]
  unsigned char* v_s = reinterpret_cast<unsigned char*>(sp_s + kRound * kBlk);  // [128][D]

  // Heavy lists first: low block indices are selected by the most tokens.
  const int gblk = blockIdx.x / a.Hp;
  const int p = blockIdx.x - gblk * a.Hp;
  const int key = p * a.NB + gblk;
  const int lo = lower_bound_vals(a.vals, a.seg[key], a.seg[key + 1], a.c0 * a.K);
  const int hi = lower_bound_vals(a.vals, lo, a.seg[key + 1], a.c1 * a.K);
  if (lo >= hi) return;

  const int b = a.blk_seq[gblk];
  const int64_t s0 = a.cu[b];
  const int len = a.cu[b + 1] - static_cast<int>(s0);
  const int key0 = (gblk - a.blk_off[b]) * kBlk;  // first key position in the sequence
  const int h0 = p * M;
  const int kvh = h0 / (a.H / a.Hkv);
  const int pk = p / (a.Hp / a.Hpk);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c2 = 2 * (lane & 3);

  // The block's tiles; key rows past the sequence end are zero (never visible anyway).
  for (int c = tid; c < kBlk * 16; c += kThreads) {
    const int r = c >> 4, ch = c & 15;
    const bool ok = key0 + r < len;
    const int64_t row = s0 + key0 + (ok ? r : 0);
    cp_async_16(smem_u32(k_s + swz<kRowBytes>(r, ch)), a.k + (row * a.Hkv + kvh) * kD + ch * 8, ok);
    cp_async_16(smem_u32(kp_s + swz<kRowBytes>(r, ch)), a.kp + (row * a.Hpk + pk) * kD + ch * 8, ok);
    if (kPass2)
      cp_async_16(smem_u32(v_s + swz<kRowBytes>(r, ch)), a.v + (row * a.Hkv + kvh) * kD + ch * 8, ok);
  }

  // Round loads: warp w's 16 Q rows (entries base + w*kR ..) into its own buffer; the round's
  // proxy query rows into qp buffer `buf`.
  auto issue_round = [&](int base, int buf) {
    const int e0 = base + warp * kR;
    const bool act = e0 < hi;
    unsigned char* qd = q_s + warp * 16 * kRowBytes;
    if constexpr (M == 16) {
      const int64_t t = act ? a.vals[e0] / a.K : 0;
#pragma unroll
      for (int i = 0; i < 16 * 16 / 32; ++i) {
        const int c = i * 32 + lane, r = c >> 4, ch = c & 15;
        cp_async_16(smem_u32(qd + swz<kRowBytes>(r, ch)), a.q + (t * a.H + h0 + r) * kD + ch * 8, act);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16 * 16 / 32; ++i) {
        const int c = i * 32 + lane, r = c >> 4, ch = c & 15;
        const int64_t t = act ? a.vals[min(e0 + r / M, hi - 1)] / a.K : 0;  // tail rows: last entry
        cp_async_16(smem_u32(qd + swz<kRowBytes>(r, ch)), a.q + (t * a.H + h0 + r % M) * kD + ch * 8, act);
      }
    }
#pragma unroll
    for (int i = 0; i < kPT * 16 * 16 / kThreads; ++i) {
      const int c = i * kThreads + tid, r = c >> 4, ch = c & 15;
      const bool pact = r < kRound && base + r < hi;
      const int64_t tr = pact ? a.vals[base + r] / a.K : 0;
      cp_async_16(smem_u32(qp_s + buf * kPT * 16 * kRowBytes + swz<kRowBytes>(r, ch)),
                  a.qp + (tr * a.Hp + p) * kD + ch * 8, pact);
    }
  };

  issue_round(lo, 0);
  cp_async_commit();
  float kl_sum = 0.f;
  int buf = 0;
  for (int base = lo; base < hi; base += kRound, buf ^= 1) {
    cp_async_wait<0>();
    __syncthreads();  // round data (and the tiles) landed; last round's sp_s reads are done

    // Proxy scores of the round's tokens (rows) against the block's keys: warp w takes keys
    // [16w, 16w+16) so the 8 warps share each 16-row product. Only the KL needs them.
    if (a.with_kl) {
#pragma unroll
      for (int pt = 0; pt < kPT; ++pt) {
        uint32_t af[kD / 16][4];
        load_a(af, qp_s + (buf * kPT + pt) * 16 * kRowBytes, lane);
        float sp[2][4];
        scores<2>(sp, af, kp_s, warp * 16, lane);
#pragma unroll
        for (int half = 0; half < (kRound >= 16 ? 2 : 1); ++half) {
          const int r = pt * 16 + half * 8 + g;
          const int e = base + r;
          if (e < hi) {
            const int tpos = static_cast<int>(a.vals[e] / a.K - s0);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
#pragma unroll
              for (int x = 0; x < 2; ++x) {
                const int col = warp * 16 + j * 8 + c2 + x;
                sp_s[r * kBlk + col] = key0 + col <= tpos ? sp[j][2 * half + x] * a.proxy_scale : -INFINITY;
              }
            }
          }
        }
      }
    }
    const int e0 = base + warp * kR;
    const bool act = e0 < hi;
    uint32_t qf[kD / 16][4];
    if (act) load_a(qf, q_s + warp * 16 * kRowBytes, lane);
    __syncwarp();
    __syncthreads();  // sp_s complete; qp buffer `buf` fully read
    if (base + kRound < hi) issue_round(base + kRound, buf ^ 1);
    cp_async_commit();
    if (!act) continue;

    // The lane's two accumulator rows: g (lo) and g + 8 (hi). Entries past the list end read the
    // last live entry (act_* false: nothing of theirs is stored).
    int tk_lo, tk_hi;
    bool act_lo = true, act_hi = true;
    if constexpr (M == 16) {
      tk_lo = tk_hi = a.vals[e0];
    } else {
      const int e_lo = e0 + g / M, e_hi = e0 + (g + 8) / M;
      act_lo = e_lo < hi;
      act_hi = e_hi < hi;
      tk_lo = a.vals[min(e_lo, hi - 1)];
      tk_hi = a.vals[min(e_hi, hi - 1)];
    }
    const int64_t t_lo = tk_lo / a.K, t_hi = tk_hi / a.K;
    const int slot_lo = tk_lo - static_cast<int>(t_lo) * a.K, slot_hi = tk_hi - static_cast<int>(t_hi) * a.K;
    const int tpos_lo = static_cast<int>(t_lo - s0), tpos_hi = static_cast<int>(t_hi - s0);
    const int64_t tc_lo = t_lo - a.c0, tc_hi = t_hi - a.c0;
    const int head_lo = M == 16 ? g : g % M, head_hi = M == 16 ? g + 8 : (g + 8) % M;
    // Lists ascend in t, so the warp's last live entry sees the most keys.
    const int tpos_max =
        M == 16 ? tpos_lo : static_cast<int>(a.vals[min(e0 + kR - 1, hi - 1)] / a.K - s0);

    if (!kPass2) {
      float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;
#pragma unroll
      for (int sub = 0; sub < kBlk / 32; ++sub) {
        if (key0 + sub * 32 > tpos_max) break;
        float s[4][4];
        scores<4>(s, qf, k_s, sub * 32, lane);
        float mx_lo = m_lo, mx_hi = m_hi;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int x = 0; x < 2; ++x) {
            const int col = key0 + sub * 32 + j * 8 + c2 + x;
            s[j][x] = col <= tpos_lo ? s[j][x] * a.scale_log2 : -INFINITY;
            s[j][2 + x] = col <= tpos_hi ? s[j][2 + x] * a.scale_log2 : -INFINITY;
            mx_lo = fmaxf(mx_lo, s[j][x]);
            mx_hi = fmaxf(mx_hi, s[j][2 + x]);
          }
        }
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
        // Every row sees key 0 of the block (it selected a visible block), so the maxima are
        // finite from sub-tile 0 on, even for rows whose token ends before this sub-tile.
        float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          sum_lo += exp2f(s[j][0] - mx_lo) + exp2f(s[j][1] - mx_lo);
          sum_hi += exp2f(s[j][2] - mx_hi) + exp2f(s[j][3] - mx_hi);
        }
        l_lo = l_lo * exp2f(m_lo - mx_lo) + sum_lo;
        l_hi = l_hi * exp2f(m_hi - mx_hi) + sum_hi;
        m_lo = mx_lo;
        m_hi = mx_hi;
      }
      l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
      l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
      l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
      l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
      if ((lane & 3) == 0) {
        if (act_lo) a.part[(tc_lo * a.H + h0 + head_lo) * a.K + slot_lo] = m_lo + log2f(l_lo);
        if (act_hi) a.part[(tc_hi * a.H + h0 + head_hi) * a.K + slot_hi] = m_hi + log2f(l_hi);
      }
      // The warp's proxy rows (one per live entry): 128 scores, 4 per lane.
      if (!a.with_kl) continue;
#pragma unroll
      for (int i = 0; i < kR; ++i) {
        if (e0 + i >= hi) break;
        const float4 sv = reinterpret_cast<const float4*>(sp_s + (warp * kR + i) * kBlk)[lane];
        float mx = fmaxf(fmaxf(sv.x, sv.y), fmaxf(sv.z, sv.w));
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        float se = __expf(sv.x - mx) + __expf(sv.y - mx) + __expf(sv.z - mx) + __expf(sv.w - mx);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) se += __shfl_xor_sync(0xffffffffu, se, off);
        if (lane == 0) {
          const int tk = kR == 1 ? tk_lo : a.vals[e0 + i];
          const int64_t t = tk / a.K;
          a.part_s[((t - a.c0) * a.Hp + p) * a.K + (tk - static_cast<int>(t) * a.K)] = mx + __logf(se);
        }
      }
    } else {
      const float lse2_lo = a.lse[(h0 + head_lo) * a.T + t_lo] * kLog2e;
      const float lse2_hi = a.lse[(h0 + head_hi) * a.T + t_hi] * kLog2e;
      // The token whose teacher columns this lane holds after the KL reduction below: at M = 16
      // the warp's one token; else entry kl_r of the warp (see the reduce-scatter).
      int kl_r = 0, tpos_k = tpos_lo;
      int64_t tc_k = tc_lo;
      bool act_k = true;
      if constexpr (M < 16) {
        kl_r = (8 * (g & 1) + (g & ~(M - 1))) / M;
        act_k = e0 + kl_r < hi;
        const int tk = a.vals[min(e0 + kl_r, hi - 1)];
        const int64_t t = tk / a.K;
        tpos_k = static_cast<int>(t - s0);
        tc_k = t - a.c0;
      }
      const float lse_s = a.with_kl ? a.lse_s[tc_k * a.Hp + p] : 0.f;
      const float* sp_row = sp_s + (warp * kR + kl_r) * kBlk;
      float o[kD / 8][4];
#pragma unroll
      for (int j = 0; j < kD / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
#pragma unroll
      for (int sub = 0; sub < kBlk / 32; ++sub) {
        if (key0 + sub * 32 > tpos_max) break;
        float s[4][4];
        scores<4>(s, qf, k_s, sub * 32, lane);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
          for (int x = 0; x < 2; ++x) {
            const int col = key0 + sub * 32 + j * 8 + c2 + x;
            s[j][x] = col <= tpos_lo ? exp2f(s[j][x] * a.scale_log2 - lse2_lo) : 0.f;
            s[j][2 + x] = col <= tpos_hi ? exp2f(s[j][2 + x] * a.scale_log2 - lse2_hi) : 0.f;
          }
        }
        if (a.with_kl) {
          if constexpr (M == 16) {
            // Teacher column sums by a reduce-scatter over the 8 row groups: afterwards lane
            // (g, c) holds the 16-row sum of column (g >> 1) * 8 + 2c + (g & 1).
            float vv[8];
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) vv[kk] = s[kk >> 1][kk & 1] + s[kk >> 1][2 + (kk & 1)];
            const float colsum = reduce_scatter_rows8(vv, g);
            const int col = sub * 32 + (g >> 1) * 8 + c2 + (g & 1);
            if (key0 + col <= tpos_lo) {
              const float tch = colsum * (1.f / M);
              if (tch > 0.f) kl_sum += tch * (__logf(tch) - (sp_row[col] - lse_s));
            }
          } else {
            // Segmented teacher sums: the M rows of one token are the row groups g that differ
            // in their low log2(M) bits, within one half (lo or hi). Value i = half*8 + 2j + x
            // (column 8j + 2c + x); level l adds the partner g ^ (1 << l) and keeps the half of
            // the values picked by bit l of g, so lane g ends with 16 >> L sums, values
            // f | hb(g), all of one token: half = g & 1, entry kl_r.
            constexpr int kL = M == 8 ? 3 : M == 4 ? 2 : 1;
            float v16[16], v8[8], v4[4], v2[2];
#pragma unroll
            for (int i = 0; i < 16; ++i) v16[i] = s[(i & 7) >> 1][(i >> 3) * 2 + (i & 1)];
            reduce_scatter_level(v16, v8, g & 1, 4);
            if constexpr (kL >= 2) reduce_scatter_level(v8, v4, (g >> 1) & 1, 8);
            if constexpr (kL >= 3) reduce_scatter_level(v4, v2, (g >> 2) & 1, 16);
            int hb = (g & 1) << 3;
            if constexpr (kL >= 2) hb |= ((g >> 1) & 1) << 2;
            if constexpr (kL >= 3) hb |= ((g >> 2) & 1) << 1;
#pragma unroll
            for (int f = 0; f < (16 >> kL); ++f) {
              const float sum = kL == 1 ? v8[f] : kL == 2 ? v4[f & 3] : v2[f & 1];
              const int i = f | hb;
              const int col = sub * 32 + ((i >> 1) & 3) * 8 + c2 + (i & 1);
              if (act_k && key0 + col <= tpos_k) {
                const float tch = sum * (1.f / M);
                if (tch > 0.f) kl_sum += tch * (__logf(tch) - (sp_row[col] - lse_s));
              }
            }
          }
        }
        uint32_t pf[2][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          pf[j / 2][(j & 1) * 2 + 0] = pack_bf16x2(s[j][0], s[j][1]);
          pf[j / 2][(j & 1) * 2 + 1] = pack_bf16x2(s[j][2], s[j][3]);
        }
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
#pragma unroll
          for (int dp = 0; dp < kD / 16; ++dp) {
            uint32_t bfr[4];
            ldmatrix_x4_trans(bfr, smem_u32(v_s + swz<kRowBytes>(sub * 32 + kk * 16 + (lane & 7) +
                                                                     ((lane >> 3) & 1) * 8,
                                                                 dp * 2 + (lane >> 4))));
            mma_bf16_16816(o[2 * dp], pf[kk], bfr[0], bfr[1]);
            mma_bf16_16816(o[2 * dp + 1], pf[kk], bfr[2], bfr[3]);
          }
        }
      }
      // Partner lanes (c, c^1) swap halves so each issues one 16-byte atomic per 8 columns:
      // the even lane takes row g, columns 2c..2c+3; the odd lane row g+8, columns 2c-2..2c+1.
      const bool odd = lane & 1;
      if constexpr (M == 16) {
        float* dst = a.o_acc + (tc_lo * a.H + h0) * kD;
#pragma unroll
        for (int j = 0; j < kD / 8; ++j) {
          const float r0 = __shfl_xor_sync(0xffffffffu, odd ? o[j][0] : o[j][2], 1);
          const float r1 = __shfl_xor_sync(0xffffffffu, odd ? o[j][1] : o[j][3], 1);
          if (!odd)
            atomicAdd(reinterpret_cast<float4*>(dst + g * kD + j * 8 + c2), make_float4(o[j][0], o[j][1], r0, r1));
          else
            atomicAdd(reinterpret_cast<float4*>(dst + (g + 8) * kD + j * 8 + c2 - 2),
                      make_float4(r0, r1, o[j][2], o[j][3]));
        }
      } else {
        const bool act_w = odd ? act_hi : act_lo;
        float* dst = a.o_acc + ((odd ? tc_hi : tc_lo) * a.H + h0 + (odd ? head_hi : head_lo)) * kD + c2 -
                     (odd ? 2 : 0);
#pragma unroll
        for (int j = 0; j < kD / 8; ++j) {
          const float r0 = __shfl_xor_sync(0xffffffffu, odd ? o[j][0] : o[j][2], 1);
          const float r1 = __shfl_xor_sync(0xffffffffu, odd ? o[j][1] : o[j][3], 1);
          if (act_w)
            atomicAdd(reinterpret_cast<float4*>(dst + j * 8),
                      odd ? make_float4(r0, r1, o[j][2], o[j][3]) : make_float4(o[j][0], o[j][1], r0, r1));
        }
      }
    }
  }
  if (kPass2 && a.with_kl) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) kl_sum += __shfl_xor_sync(0xffffffffu, kl_sum, off);
    if (lane == 0 && kl_sum != 0.f) atomicAdd(a.kl_acc, kl_sum);
  }
}


// lse[h, t] and the student's lse[tc, p] from the per-slot partials of pass 1, over the slots
// the token really selected (the others were never written).
__global__ void kv_merge_kernel(const int32_t* __restrict__ block_idx,  // [Hp, T, K]
                                const int32_t* __restrict__ cu, int B, int64_t T, int K, int H, int Hp,
                                int64_t c0, int64_t n,  // n = Tc * (H + Hp)
                                bool with_proxy,
                                const float* __restrict__ part,    // [Tc, H, K] log2 units
                                const float* __restrict__ part_s,  // [Tc, Hp, K] natural
                                float* __restrict__ lse,           // [H, T]
                                float* __restrict__ lse_s) {       // [Tc, Hp]
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int64_t tc = i / (H + Hp);
  const int r = static_cast<int>(i - tc * (H + Hp));
  const int64_t t = c0 + tc;
  const bool main_row = r < H;
  if (!main_row && !with_proxy) return;
  const int p = main_row ? r / (H / Hp) : r - H;
  const int seq = find_sequence(cu, B, t);
  const int nloc = static_cast<int>((t - cu[seq]) / kBlk);
  const int32_t* sel = block_idx + (p * T + t) * K;
  const float* src = main_row ? part + (tc * H + r) * K : part_s + (tc * Hp + p) * K;
  float mx = -INFINITY;
  for (int s = 0; s < K; ++s) {
    const int blk = sel[s];
    if (blk >= 0 && blk <= nloc) mx = fmaxf(mx, src[s]);
  }
  float sum = 0.f;
  for (int s = 0; s < K; ++s) {
    const int blk = sel[s];
    if (blk >= 0 && blk <= nloc) sum += main_row ? exp2f(src[s] - mx) : __expf(src[s] - mx);
  }
  if (main_row) lse[r * T + t] = sum > 0.f ? (mx + log2f(sum)) * kLn2 : -INFINITY;
  else lse_s[tc * Hp + p] = sum > 0.f ? mx + __logf(sum) : -INFINITY;
}

__global__ void kv_convert_kernel(const float4* __restrict__ acc,  // [n4]
                                  int64_t n4, uint2* __restrict__ out) {  // [n4] of 4 bf16
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 x = acc[i];
    out[i] = make_uint2(pack_bf16x2(x.x, x.y), pack_bf16x2(x.z, x.w));
  }
}

__global__ void kv_kl_final_kernel(const float* __restrict__ acc, float factor, float* __restrict__ kl) {
  kl[0] = acc[0] * factor;
}

// The two passes of one group size, with their shared-memory sizes.
struct PassKernels {
  void (*pass1)(KvArgs);
  void (*pass2)(KvArgs);
  int smem1, smem2;
};

template <int M>
PassKernels pass_kernels() {
  return {kv_pass_kernel<M, false>, kv_pass_kernel<M, true>, kv_smem_bytes<M, false>(), kv_smem_bytes<M, true>()};
}

PassKernels pass_kernels_for(int m) {
  switch (m) {
    case 2: return pass_kernels<2>();
    case 4: return pass_kernels<4>();
    case 8: return pass_kernels<8>();
    default: return pass_kernels<16>();
  }
}

}  // namespace

bool kv_forward_applies(const MsaParams& p) {
  if (p.deterministic) return false;
  if (p.D != kD || p.Dv != kD || p.Dp != kD || p.block_size != kBlk) return false;
  const int m = p.H / p.Hp;
  if (m != 2 && m != 4 && m != 8 && m != 16) return false;
  if ((p.H / p.Hkv) % m != 0) return false;  // a group's m heads share one kv head
  if (p.top_k > 32) return false;  // as the selector; longer lists are untested here
  if (static_cast<int64_t>(p.Hp) * p.T * p.top_k >= INT32_MAX) return false;
  if (static_cast<int64_t>(p.T) * p.H * kD >= (int64_t{1} << 40)) return false;
  return p.T > 0;
}

void launch_kv_forward(const MsaParams& p, cudaStream_t stream) {
  const int64_t T = p.T;
  const int K = p.top_k;
  SelectionIndexPlan sel = selection_index_sizes(p);
  const int NB = sel.NB;
  const int64_t nkeys = sel.nkeys;  // also the sentinel key
  if (nkeys + 1 >= INT32_MAX)
    throw Error("flashmsa: sparse_attention_forward: argument 'q' has too many blocks");

  Workspace ws;
  reserve_selection_index(sel, p, ws, stream);
  const size_t o_kl = ws.add(sizeof(float));

  // Chunk of tokens: the per-token buffers below plus the index stay within 0.45 x size of q
  // (at least 1024 tokens per chunk, so small problems do not pay many launches).
  const double q_bytes = static_cast<double>(T) * p.H * kD * 2;
  const double per_token = static_cast<double>(p.H) * K * 4 + static_cast<double>(p.Hp) * (K + 1) * 4 +
                           static_cast<double>(p.H) * kD * 4 + 4 * 256.0 / 1024;
  const double budget = 0.45 * q_bytes - static_cast<double>(ws.size());
  int64_t Tc = static_cast<int64_t>(std::max(0.0, budget / per_token));
  Tc = std::min<int64_t>(T, std::max<int64_t>(std::min<int64_t>(T, 1024), Tc));
  const size_t o_part = ws.add(Tc * p.H * K * sizeof(float));
  const size_t o_part_s = ws.add(Tc * p.Hp * K * sizeof(float));
  const size_t o_lse_s = ws.add(Tc * p.Hp * sizeof(float));
  const size_t o_acc = ws.add(Tc * p.H * kD * sizeof(float));
  ws.allocate(stream);

  // ---- the inverted index ----
  build_selection_index(p, sel, ws, stream);

  KvArgs a;
  a.q = static_cast<const bf16*>(p.q);
  a.k = static_cast<const bf16*>(p.k);
  a.v = static_cast<const bf16*>(p.v);
  a.qp = static_cast<const bf16*>(p.qp);
  a.kp = static_cast<const bf16*>(p.kp);
  a.cu = p.cu_seqlens;
  a.blk_off = sel.blk_off(ws);
  a.blk_seq = sel.blk_seq(ws);
  a.seg = sel.seg(ws);
  a.vals = sel.vals(ws);
  a.part = ws.at<float>(o_part);
  a.part_s = ws.at<float>(o_part_s);
  a.lse = p.lse;
  a.lse_s = ws.at<float>(o_lse_s);
  a.o_acc = ws.at<float>(o_acc);
  a.kl_acc = ws.at<float>(o_kl);
  a.T = T;
  a.B = p.B;
  a.H = p.H;
  a.Hkv = p.Hkv;
  a.Hp = p.Hp;
  a.Hpk = p.Hpk;
  a.K = K;
  a.NB = NB;
  a.scale_log2 = p.scale * kLog2e;
  a.proxy_scale = p.proxy_scale;
  a.with_kl = p.kl != nullptr;

  const PassKernels kern = pass_kernels_for(p.H / p.Hp);
  FLASHMSA_CUDA_CHECK(cudaFuncSetAttribute(kern.pass1, cudaFuncAttributeMaxDynamicSharedMemorySize, kern.smem1));
  FLASHMSA_CUDA_CHECK(cudaFuncSetAttribute(kern.pass2, cudaFuncAttributeMaxDynamicSharedMemorySize, kern.smem2));
  FLASHMSA_CUDA_CHECK(cudaMemsetAsync(a.kl_acc, 0, sizeof(float), stream));
  const unsigned grid = static_cast<unsigned>(nkeys);
  auto* o_out = static_cast<uint2*>(p.o);
  for (int64_t c0 = 0; c0 < T; c0 += Tc) {
    const int64_t c1 = std::min(T, c0 + Tc), tc = c1 - c0;
    a.c0 = c0;
    a.c1 = c1;
    FLASHMSA_CUDA_CHECK(cudaMemsetAsync(a.o_acc, 0, tc * p.H * kD * sizeof(float), stream));
    if (grid > 0) {
      kern.pass1<<<grid, kThreads, kern.smem1, stream>>>(a);
      FLASHMSA_CHECK_LAUNCH();
    }
    const int64_t nm = tc * (p.H + p.Hp);
    kv_merge_kernel<<<grid_for(nm, 256, INT_MAX), 256, 0, stream>>>(
        p.block_idx, p.cu_seqlens, p.B, T, K, p.H, p.Hp, c0, nm, a.with_kl, a.part, a.part_s, p.lse, ws.at<float>(o_lse_s));
    FLASHMSA_CHECK_LAUNCH();
    if (grid > 0) {
      kern.pass2<<<grid, kThreads, kern.smem2, stream>>>(a);
      FLASHMSA_CHECK_LAUNCH();
    }
    const int64_t n4 = tc * p.H * kD / 4;
    kv_convert_kernel<<<grid_for(n4, 256), 256, 0, stream>>>(reinterpret_cast<const float4*>(a.o_acc), n4,
                                                             o_out + c0 * p.H * kD / 4);
    FLASHMSA_CHECK_LAUNCH();
  }
  if (p.kl) {
    kv_kl_final_kernel<<<1, 1, 0, stream>>>(a.kl_acc, static_cast<float>(p.kl_coeff / (static_cast<double>(p.Hp) * T)),
                                            p.kl);
    FLASHMSA_CHECK_LAUNCH();
  }
  ws.release();
}

}  // namespace flashmsa::cuda
