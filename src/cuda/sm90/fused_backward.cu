// The fused MSA backward on sm_90a: dq, dk, dv of the block-sparse main attention and dqp, dkp
// of the proxy's KL, plus the KL value, from the cached block indices. Linear in T.
//
// Steps (all on `stream`, no host synchronisation):
//   1. metadata: first global block of each sequence, the sequence of each global block;
//   2. inverted selection index: (p, t, slot) entries keyed by (p, global block), stable radix
//      sort (so each block's token list is ascending in t, the same every run), list offsets by
//      binary search;
//   3. Di = rowsum(dO * O) per (t, h); the student's lse per (p, t) from per-slot partials
//      (KV-major pre-pass, then a merge);
//   4. attn_bwd_kernel (dq, dk, dv) and kl_bwd_kernel (dqp, dkp, KL), KV-major; when every proxy
//      group lies inside one kv head, one attn_bwd_kernel (FOLD = true) does both (see the kernels);
//      when D = 128 (and groups of m >= 2 heads), the wgmma version of that folded kernel does
//      (backward_wgmma.cuh; FLASHMSA_BACKWARD_PATH=mma forces the old one), in deterministic mode
//      only with top_k <= 32 (its DET form computes dq as int32 fixed point, or with
//      FLASHMSA_DET_DQ=query runs beside the query-major dq); with G > 1 groups per kv head its
//      SHARED_KV form adds dk/dv into the same accumulators as the mma kernel;
//   5. accumulators -> bf16, the KL sum -> kl.
// launch_kl_value (the forward's KL value, kl_value.cuh) runs steps 2, 3 (student lse only) and
// the wgmma kernel's KL_ONLY form, then the same KL sum.
// Deterministic mode swaps the fp32 atomics for int64 fixed-point ones (see backward_tiles.cuh),
// with per-tensor power-of-two factors derived on the device from bounds on each gradient. With
// top_k <= 32 it computes dq instead with the query-major, atomic-free dq_kernel
// (backward_dq.cu) and attn_bwd_kernel (or the wgmma kernel's per-head DET form) skips dq: dq's
// int64 accumulator, 4x the size of q and the largest one, is not allocated; on the wgmma shapes
// (unless FLASHMSA_DET_DQ=query) the wgmma DET form computes dq KV-major instead, as int32 fixed
// point (at most top_k <= 32 adds per element: 30 bits under the bound leave room for their
// roundings) through the fast form's bulk reduce-adds, in an accumulator of its size; dqp likewise.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "backward_chunk_rule.h"
#include "list_pieces.h"
#include "common/check.cuh"
#include "common/fixed_order_sum.cuh"
#include "common/fixed_point.cuh"
#include "common/metadata.cuh"
#include "common/selection_index.cuh"
#include "common/stream_fork.h"
#include "launchers.h"
#include "sm90/backward_dq.cuh"
#include "sm90/backward_kernels.cuh"
#include "sm90/backward_wgmma.cuh"
#include "sm90/kl_value.cuh"
#include "sm90/query_major.cuh"

namespace flashmsa::cuda {
namespace {

using bwd::bf16;
using bwd::kBlk;
static_assert(kBlk == kIndexBlk, "the shared selection index is built for the backward's block size");

// ---- small per-row kernels ------------------------------------------------------------------

// Di[t, h] = sum_d dO * O, half a warp per row. With row_fx (the token-row DET form's int32 dq):
// also the row's fixed-point factor, a power of two F with B F < 2^30 for the row's own bound
// B = scale A_k (||dO||_1 A_v + |Di|) on |dq| (fixed_point_kernel's derivation with the row's dO
// and Di instead of the tensor's maxima): a per-tensor bound would leave rows far below the
// largest one (outlier key channels, uneven dO) too little resolution in 30 bits.
__global__ void di_kernel(const bf16* __restrict__ o,    // [rows, Dv]
                          const bf16* __restrict__ d_o,  // [rows, Dv]
                          int64_t rows, int Dv,
                          float* __restrict__ di,        // [rows]
                          const unsigned int* __restrict__ amax_bits = nullptr,  // [7] (k at 1, v at 2)
                          float scale = 0.f,
                          float* __restrict__ row_fx = nullptr,  // [rows] or null
                          const float* __restrict__ fx = nullptr) {  // fixed_point_kernel's, with row_fx
  // Half a warp per row, 16-byte loads (8 values; Dv % 8 == 0, rows 16-byte aligned): a row of 128
  // is one load per lane and tensor, so more bytes are in flight per warp than with 4-byte loads.
  const int64_t row = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) >> 4;
  const int lane = threadIdx.x & 15;
  if (row >= rows) return;  // both halves of a warp: rows is the same for all, whole halves leave
  const uint4* o8 = reinterpret_cast<const uint4*>(o + row * Dv);
  const uint4* d8 = reinterpret_cast<const uint4*>(d_o + row * Dv);
  float sum = 0.f, l1 = 0.f;
  for (int i = lane; i < Dv / 8; i += 16) {
    const uint4 a4 = o8[i], b4 = d8[i];
    const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&a4);
    const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&b4);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 x = __bfloat1622float2(a[j]), y = __bfloat1622float2(b[j]);
      sum += x.x * y.x + x.y * y.y;
      l1 += fabsf(y.x) + fabsf(y.y);
    }
  }
  // The half's 16 lanes (the other half holds the next row; rows >= `rows` returned as whole halves).
  const unsigned half = 0xffffu << (threadIdx.x & 16);
  for (int off = 8; off > 0; off >>= 1) {
    sum += __shfl_xor_sync(half, sum, off);
    l1 += __shfl_xor_sync(half, l1, off);
  }
  if (lane == 0) {
    di[row] = sum;
    if (row_fx) {
      const float a_k = __uint_as_float(amax_bits[1]), a_v = __uint_as_float(amax_bits[2]);
      // fx[5] is NaN when any input was non-finite (fixed_point_kernel): every row's factor then too,
      // as a non-finite q or k can leave this row's dO and o finite. (lse is not checked: a NaN or
      // +inf lse with finite inputs still gives finite values here.)
      row_fx[row] = isnan(fx[5]) ? fx[5] : fixed_point_factor(scale * a_k * (l1 * a_v + fabsf(sum)), 30);
    }
  }
}

// The student's lse per (p, t) from the per-slot partials of proxy_lse_kernel.
__global__ void merge_student_lse_kernel(const int32_t* __restrict__ block_idx,  // [Hp, T, K]
                                         const int32_t* __restrict__ cu, int B, int64_t T, int K,
                                         int64_t n,  // Hp*T
                                         const float* __restrict__ part_max,  // [Hp, T, K]
                                         const float* __restrict__ part_sum,  // [Hp, T, K]
                                         float* __restrict__ lse_s) {         // [Hp, T]
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int64_t t = i % T;
  float mx = -INFINITY;
  for (int s = 0; s < K; ++s) {
    int seq;
    if (entry_block(cu, B, t, block_idx[i * K + s], seq) >= 0) mx = fmaxf(mx, part_max[i * K + s]);
  }
  float sum = 0.f;
  for (int s = 0; s < K; ++s) {
    int seq;
    if (entry_block(cu, B, t, block_idx[i * K + s], seq) >= 0)
      sum += part_sum[i * K + s] * __expf(part_max[i * K + s] - mx);
  }
  lse_s[i] = mx + __logf(sum);
}

// ---- deterministic mode: fixed-point factors --------------------------------------------------

// Bounds, with A_x = max|x|: a row's softmax weights P_j sum to 1, dS_j = P_j (dP_j - D_i) with
// |dP_j| = |dO_i . v_j| <= Dv A_dO A_v and |D_i| = |dO_i . o_i| <= Dv A_dO A_o, so
//   sum_j |dS_main| <= Dv*A_dO*(A_v + A_o);  sum_j |dS_proxy| = |c| sum_j |Qs_j - Tch_j| <= 2|c|;
// dq = scale dS K then has |dq| <= scale A_k sum_j |dS|, and so on for the other gradients (dk, dv
// summed over at most T r rows). Every partial sum of a gradient element obeys its bound too.
__global__ void fixed_point_kernel(const unsigned int* __restrict__ amax_bits,  // [7]: q k v o dO qp kp
                                   float scale, float scale_p, int Dv, float T, float r,
                                   float hp_per_pk, float c_base, const float* __restrict__ kl_grad,
                                   float* __restrict__ fx) {  // [7]: dq dk dv dqp dkp, poison, dqp as int32
  float a[7];
  bool finite = true;  // every input whose maximum was taken (the others read 0)
  for (int i = 0; i < 7; ++i) {
    a[i] = __uint_as_float(amax_bits[i]);
    finite = finite && isfinite(a[i]);
  }
  const float c = fabsf(c_base * (kl_grad ? *kl_grad : 1.f));
  const float ds_sum = Dv * a[4] * (a[2] + a[3]);
  fx[0] = fixed_point_factor(scale * a[1] * ds_sum);
  fx[1] = fixed_point_factor(scale * a[0] * ds_sum * T * r);
  fx[2] = fixed_point_factor(a[4] * T * r);
  fx[3] = fixed_point_factor(2.f * c * scale_p * a[6]);
  fx[4] = fixed_point_factor(2.f * c * scale_p * a[5] * T * hp_per_pk);
  // The token-row DET form's int32 dqp: at most top_k <= 32 adds per element (one per selected
  // block), so their roundings (<= 1/2 each) stay far inside 2^31 - 2^30. (Its int32 dq takes a
  // factor per row: di_kernel.)
  fx[6] = fixed_point_factor(2.f * c * scale_p * a[6], 30);
  // A non-finite input (or kl_grad) makes every fixed-point gradient NaN, not only those whose
  // bound it enters: q or k non-finite poisons P and the teacher, hence dqp and dkp too.
  // fx[5]: 0, or NaN as that marker (di_kernel reads it for the int32 dq's per-row factors).
  fx[5] = 0.f;
  if (!finite || !isfinite(c))
    for (int i = 0; i < 7; ++i) fx[i] = __int_as_float(0x7fc00000);
}

// ---- outputs ----------------------------------------------------------------------------------

// permuted: acc is [T, H, 128] with H % 8 == 0 (so head & 7 == row & 7), and the wgmma
// backward's token-row staging (RM > 0) stored each row's 32-byte column group j of either
// 64-column half at j ^ (head & 7). int32: the token-row DET form's int32 fixed-point dq, dqp.
__global__ void convert_acc_kernel(const void* __restrict__ acc,  // [n] fp32, or int64 / int32 when fx
                                   int64_t n, const float* __restrict__ fx,  // factor or null
                                   bf16* __restrict__ out,                    // [n]
                                   bool permuted = false, bool int32 = false,
                                   const float* __restrict__ row_fx = nullptr) {  // [n / 128]: per row
  // Eight consecutive outputs per thread, one 16-byte store (n: rows of D = 64 or 128; the outputs
  // and accumulators are 16-byte aligned: api.cpp's rule for dq, whose buffer may hold accumulators).
  // A group of 8 columns stays contiguous under the permutation: its 8 values are two (four with
  // int64) 16-byte loads.
  for (int64_t gi = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; gi < (n >> 3);
       gi += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = gi << 3;
    int64_t at = i;
    if (permuted) {
      const int c = static_cast<int>(i & 127), h7 = static_cast<int>((i >> 7) & 7);
      at = (i & ~int64_t{127}) + (c & 64) + ((((c >> 3) & 7) ^ h7) << 3);
    }
    float x[8];
    if (!fx) {
      const float4* a = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(acc) + at);
      const float4 lo = a[0], hi = a[1];
      x[0] = lo.x, x[1] = lo.y, x[2] = lo.z, x[3] = lo.w, x[4] = hi.x, x[5] = hi.y, x[6] = hi.z, x[7] = hi.w;
    } else {
      const double f = static_cast<double>(row_fx ? row_fx[i >> 7] : *fx);
      if (int32) {
        const int4* a = reinterpret_cast<const int4*>(reinterpret_cast<const int*>(acc) + at);
        const int4 lo = a[0], hi = a[1];
        const int v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] = static_cast<float>(static_cast<double>(v[j]) / f);
      } else {
        const longlong2* a = reinterpret_cast<const longlong2*>(reinterpret_cast<const long long*>(acc) + at);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const longlong2 v = a[j];
          x[2 * j] = static_cast<float>(static_cast<double>(v.x) / f);
          x[2 * j + 1] = static_cast<float>(static_cast<double>(v.y) / f);
        }
      }
    }
    uint4 packed;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(x[2 * j], x[2 * j + 1]);
    *reinterpret_cast<uint4*>(out + i) = packed;
  }
}

// out [rows, D] (bf16) = the sum over j = 0 .. R - 1, in that order, of acc [rows, R, D] (fp32): the
// deterministic form's per-proxy-head dkp partials (FoldArgs::dkp_per_head), R = Hp / Hpk.
__global__ void sum_partials_kernel(const float* __restrict__ acc, int64_t n, int D, int R,
                                    bf16* __restrict__ out) {  // n = rows * D
  for (int64_t gi = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; gi < (n >> 3);
       gi += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = gi << 3, row = i / D, col = i % D;
    float x[8] = {};
    for (int j = 0; j < R; ++j) {
      const float4* a = reinterpret_cast<const float4*>(acc + (row * R + j) * D + col);
      const float4 lo = a[0], hi = a[1];
      x[0] += lo.x, x[1] += lo.y, x[2] += lo.z, x[3] += lo.w, x[4] += hi.x, x[5] += hi.y, x[6] += hi.z, x[7] += hi.w;
    }
    uint4 packed;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(x[2 * j], x[2 * j + 1]);
    *reinterpret_cast<uint4*>(out + i) = packed;
  }
}

// ---- host side --------------------------------------------------------------------------------

template <typename Kernel>
void set_smem(Kernel kernel, int bytes) {
  FLASHMSA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

// CTAs of `kernel` resident at once on the current device (1 per SM for the wgmma backward): the
// dense warm-up's wave size (FoldArgs::wave_ctas). After set_smem, which the occupancy query needs.
template <typename Kernel>
int resident_ctas(Kernel kernel, int threads, int smem) {
  int device = 0, per_sm = 0;
  FLASHMSA_CUDA_CHECK(cudaGetDevice(&device));
  FLASHMSA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  return std::max(1, sm_count(device) * per_sm);
}

// Whether environment variable `name` holds exactly `value` (the knobs below are read per call).
bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}

// FLASHMSA_BWD_ORDER: how many proxy groups the wgmma backward's CTAs sweep the key blocks with at a
// time (FoldArgs::sweep_groups) where each kv head holds one group (G = 1): "block" Hp (block-major,
// proxy group fastest, the order the SHARED_KV form needs: a key block's G groups share its K / V in
// L2), "group" one, a number n dividing Hp n; unset (or anything else): two where Hp is even (m3/64k
// backward 40.0 vs 40.5 ms block-major, 32k 19.2 vs 19.6; perf-notes), else Hp. Read per call.
int sweep_groups(int Hp) {
  const int fallback = Hp % 2 == 0 ? 2 : Hp;
  const char* v = std::getenv("FLASHMSA_BWD_ORDER");
  if (v == nullptr) return fallback;
  if (std::strcmp(v, "block") == 0) return Hp;
  if (std::strcmp(v, "group") == 0) return 1;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return *v != '\0' && *end == '\0' && n >= 1 && n <= Hp && Hp % n == 0 ? static_cast<int>(n) : fallback;
}

// Whether the wgmma backward alternates its list walk per wave (FoldArgs::wave_ctas): the dense
// warm-up always (its lists all end at the sequence end); FLASHMSA_BWD_WAVES=1 also for sparse
// lists (A/B timing), =0 never; read per call.
bool alternate_waves(const MsaParams& p) {
  if (env_is("FLASHMSA_BWD_WAVES", "1")) return true;
  if (env_is("FLASHMSA_BWD_WAVES", "0")) return false;
  return p.all_blocks;
}

// Tokens per chunk of the token-row wgmma backward's lists (FoldArgs::n_chunks; 0: whole lists).
// Fast mode's default follows the card's DRAM bandwidth. Smaller chunks pay more dK / dV partial adds
// and per-CTA starts, and (the likely reason, not profiled) keep more of the dQ rows' read-modify-writes
// in L2, which weighs more on a slower DRAM.
//  - below 4.2 TB/s (H100: 3.35): T / 16 from 32k tokens, T / 8 from 16k (the range measured; H100 with
//    the own-block pass, forty-eighth session, bench/results/h100_bwd_chunk_counts_ab.log: backward m3/64k
//    41.8 -> 38.4-38.5 ms against T / 4, 32k 18.3-18.4 -> 17.4 against T / 5; 2048-token chunks at 64k
//    41.0; fiftieth, h100_chunks16k_sweep_ab.log: m3/16k 11.0 -> 8.0 against none);
//  - else (H200): T / 8 from 16k to 32k tokens, T / 5 above, T / 4 from 64k, none below 16k. Swept with
//    the own-block pass (fifty-third session, bench/results/h200_bwd_chunks_sweep53_*.log): T / 8 against
//    the older rule's none / T / 5 at m3 16k / 20k / 24k / 32k: backward 8.98 -> 7.80, 10.31 -> 9.93,
//    12.41 -> 12.08, 16.57 -> 16.47-16.58 ms; from 40k T / 4 .. T / 5 stay best (T / 8 +0.1..+0.4 ms at
//    40k / 48k / 64k / 128k, T / 16 +1.5 at 64k: the H100 rule loses here); below 16k not swept.
// Shapes off the token-row form (fm16k: Hp != Hkv) take no chunks whatever the count.
// Deterministic mode: none by default (its int64 partial adds and the extra o / dO maxima cost more than
// the chunks gain: +1.0 ms at m3/64k on the H200). FLASHMSA_BWD_CHUNK: tokens (0: none),
// FLASHMSA_BWD_CHUNKS: a count, either mode; FLASHMSA_BWD_CHUNK_GROUPS: the proxy groups swept
// together inside a chunk (a divisor of Hp, default 1). Read per call.
int backward_chunk_tokens(int64_t T, bool det) {
  if (const char* v = std::getenv("FLASHMSA_BWD_CHUNK")) return std::max(0, std::atoi(v));
  if (const char* n = std::getenv("FLASHMSA_BWD_CHUNKS")) {
    const int count = std::atoi(n);
    return count > 0 ? static_cast<int>((T + count - 1) / count) : 0;
  }
  int device = 0;
  FLASHMSA_CUDA_CHECK(cudaGetDevice(&device));
  // 0 where the driver does not say (the H200 rule); on an H100 under CUDA 13 it gives the H100 rule (the
  // default's chunk-bound workspace matched 16 chunks' at 64k and 32k: h100_default_chunks_ab.log).
  const int64_t count = default_backward_chunk_count(T, det, dram_peak_bytes_per_s(device));
  return count > 0 ? static_cast<int>((T + count - 1) / count) : 0;
}
// Tokens per list piece of the wgmma backward and of its KL-only form (FoldArgs::pieces; 0: none, the
// grid's own (chunk, block) CTAs). FLASHMSA_BWD_PIECE sets it (read per call; set > 0, it makes a problem
// the pieces do not apply to an error: how tests prove they ran; set to 0, none). Unset: the fast backward
// takes default_piece_tokens where its dK / dV already go through accumulators (token chunks, or
// groups sharing a kv head), so that the default changes neither its workspace nor its dK / dV path.
// Without chunks that is kDefaultPieceTokens: 8192 tokens cut no list of N(0, 1) selections at fm16k, m3/32k or m3/64k and an attention sink's list
// of every token into T / 8192 pieces: on an H100 (bench/results/h100_f561bec_new), fm16k backward
// N(0, 1) 3.166 -> 3.167 ms, with a sink block 6.296 -> 3.703; m3/64k N(0, 1) 38.31 -> 38.28. The
// deterministic backward keeps none (its pieces put dkp in int64: fm16k +6-9%), nor does the KL-only
// form (fm16k's KL value +3.5% at 8192 in the first form; the overflow form not yet timed there).
// With token chunks a part holds at most a chunk, and a sink's part is the whole chunk: the default cap
// is then half a chunk (512 to 8192 tokens), so that the sink's parts run as two pieces each among the
// first CTAs of the group's range. Host model (scripts/model_list_pieces.py --front, token-row tiles):
// a sink at m3/64k costs the H200 (T / 4 chunks) +42% without pieces, +0.4% at 8192; the H100 (T / 16)
// +9% without, +0.4% at 2048; m3/32k on the H200 (T / 8) +20% without, +1.2% at 2048; N(0, 1) selections
// +0.1-0.7% from the cuts. Measured on an H100 (bench/results/h100_b54c15a_sinks2, m3/64k's 4096-token
// chunks, cap 2048): N(0, 1) 37.70 ms against 37.77 with the own CTA keeping the first piece, a sink
// 44.63 against 46.50; fm16k (8192, no chunks) 3.17 both, sink 3.63 against 3.66.
constexpr int kDefaultPieceTokens = 8192;
int default_piece_tokens(int n_chunks, int chunk_tokens) {
  return n_chunks > 0 ? std::clamp(chunk_tokens / 2, 512, kDefaultPieceTokens) : kDefaultPieceTokens;
}
struct PieceSetting {
  int tokens = 0;
  bool set = false;  // FLASHMSA_BWD_PIECE present
  bool forced() const { return set && tokens > 0; }
};
PieceSetting backward_piece_tokens() {
  PieceSetting s;
  if (const char* v = std::getenv("FLASHMSA_BWD_PIECE")) {
    s.tokens = std::max(0, std::atoi(v));
    s.set = true;
  }
  return s;
}

int chunk_groups(int Hp) {
  const char* v = std::getenv("FLASHMSA_BWD_CHUNK_GROUPS");
  const int n = v ? std::atoi(v) : 1;
  return n >= 1 && n <= Hp && Hp % n == 0 ? n : 1;
}

// The first position in vals[lo, hi) (one list: ascending) whose value t K + slot is >= key.
__device__ __forceinline__ int first_entry_from(const int32_t* __restrict__ vals, int lo, int hi, int64_t key) {
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (vals[mid] < key) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// bounds[(list) (nc + 1) + c] = the first entry of list (p NB + g) whose token is >= c chunk
// (lower bound: val = t K + slot); c = nc: the list's end.
__global__ void chunk_bounds_kernel(const int32_t* __restrict__ seg_start,  // [n_lists + 1]
                                    const int32_t* __restrict__ vals, int64_t n_lists, int nc,
                                    int64_t chunk_vals,  // chunk tokens x K
                                    int32_t* __restrict__ bounds) {  // [n_lists, nc + 1]
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n_lists * (nc + 1)) return;
  const int64_t list = i / (nc + 1);
  bounds[i] = first_entry_from(vals, seg_start[list], seg_start[list + 1], (i % (nc + 1)) * chunk_vals);
}

// own_end[list] = the end of list (p NB + g)'s own entries: the first whose token lies past block g
// (the list is ascending in t and holds no token before the block).
__global__ void own_bounds_kernel(bwd::Index ix, int64_t n_lists, int32_t* __restrict__ own_end) {  // [n_lists]
  const int64_t list = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (list >= n_lists) return;
  const bwd::BlockCtx bc = bwd::block_ctx(ix, static_cast<int>(list / ix.NB), static_cast<int>(list % ix.NB));
  own_end[list] = first_entry_from(ix.vals, bc.begin, bc.end, (bc.seq_start + bc.key0 + bwd::kBlk) * ix.K);
}

// The overflow pieces of proxy group p = blockIdx.x (FoldArgs::pieces): its lists' parts in the
// grid's order (chunk, key block g), each part [b, e) (chunk_bounds, past own_end with the own-block
// pass; the whole list without chunks) longer than cap cut into ceil((e - b) / cap) near-equal pieces,
// all listed in the table (the part's own CTA exits: list_piece_overflow). One CTA per group: a running
// block-wide scan of the overflow counts over its NB x max(nc, 1) parts (a few thousand at m3/64k)
// places each part's pieces; the slots past the last get empty records, so a CTA learns from its
// record alone whether it has work.
__global__ void __launch_bounds__(1024) build_list_pieces_kernel(bwd::Index ix, int nc,
                                                                 const int32_t* __restrict__ chunk_bounds,  // [Hp, NB, nc + 1] or null
                                                                 const int32_t* __restrict__ own_end,  // [Hp, NB] or null
                                                                 int cap, int stride,
                                                                 int4* __restrict__ pieces) {  // [Hp, stride]
  using Scan = cub::BlockScan<int, 1024>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int running;
  const int p = blockIdx.x, parts = ix.NB * max(nc, 1);
  int4* group = pieces + static_cast<int64_t>(p) * stride;
  if (threadIdx.x == 0) running = 0;
  __syncthreads();
  for (int r0 = 0; r0 < parts; r0 += 1024) {
    const int r = r0 + threadIdx.x;
    int b = 0, e = 0, g = 0;
    if (r < parts) {
      const int c = nc > 0 ? r / ix.NB : 0;
      g = r - c * ix.NB;
      const int64_t list = static_cast<int64_t>(p) * ix.NB + g;
      if (nc > 0) {
        b = chunk_bounds[list * (nc + 1) + c];
        e = chunk_bounds[list * (nc + 1) + c + 1];
        if (own_end) b = max(b, own_end[list]);
      } else {
        b = ix.seg_start[list];
        e = ix.seg_start[list + 1];
      }
    }
    const int len = max(e - b, 0), count = list_piece_count(len, cap), extra = list_piece_overflow(len, cap);
    int first = 0, total = 0;
    Scan(scan).ExclusiveSum(extra, first, total);
    first += running;
    for (int j = 0; j < extra; ++j)
      group[first + j] = make_int4(g, list_piece_begin(b, len, count, j), list_piece_begin(b, len, count, j + 1), 0);
    __syncthreads();  // every thread has read `running` and the scan storage
    if (threadIdx.x == 0) running += total;
    __syncthreads();
  }
  for (int i = running + threadIdx.x; i < stride; i += 1024) group[i] = make_int4(0, 0, 0, 0);
}

// Where list pieces go in a workspace: the overflow table (a record a slot) and its slots per group
// (piece_stride: max_overflow_pieces over list parts of <= T K entries in all, at least one).
// main_per_group: the usual CTAs per group beside them (NB x max(n_chunks, 1)), for the grid's bound.
struct ListPiecePlan {
  int tokens = 0, stride = 0;  // tokens = 0: no pieces
  size_t o_pieces = 0;
};
ListPiecePlan plan_list_pieces(const MsaParams& p, int tokens, int64_t main_per_group, Workspace& ws) {
  ListPiecePlan lp;
  if (tokens <= 0) return lp;
  const int64_t stride = std::max<int64_t>(max_overflow_pieces(p.T * p.top_k, tokens), 1);
  if ((stride + main_per_group) * p.Hp > INT_MAX)
    throw Error("flashmsa: list pieces: argument 'q': too many for one launch (raise FLASHMSA_BWD_PIECE)");
  lp.tokens = tokens;
  lp.stride = static_cast<int>(stride);
  lp.o_pieces = ws.add(p.Hp * stride * sizeof(int4));
  return lp;
}
void launch_build_list_pieces(const MsaParams& p, const bwd::Index& ix, int nc, const int32_t* chunk_bounds,
                              const int32_t* own_end, const ListPiecePlan& lp, Workspace& ws, cudaStream_t stream) {
  build_list_pieces_kernel<<<p.Hp, 1024, 0, stream>>>(ix, nc, chunk_bounds, own_end, lp.tokens, lp.stride,
                                                      ws.at<int4>(lp.o_pieces));
  FLASHMSA_CHECK_LAUNCH();
}

// The own-block pass stores the dq / dqp rows of every token in its own block's list; the rows of a
// token whose selection (row (p, t) of block_idx) leaves its own block out get no store and are
// zeroed here instead. One thread per (p, t); such rows are rare (select_blocks always keeps the own
// block), so their zeroing is a plain loop.
__global__ void zero_rows_without_own_block_kernel(const int32_t* __restrict__ block_idx,  // [Hp, T, K]
                                                   const int32_t* __restrict__ cu, int B, int64_t T, int Hp,
                                                   int K, int H, int D,
                                                   float* __restrict__ dq_acc,    // [T, H, D]
                                                   float* __restrict__ dqp_acc) { // [T, Hp, D]
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= Hp * T) return;
  const int p = static_cast<int>(i / T);
  const int64_t t = i % T;
  int lo = 0, hi = B;  // the last sequence b with cu[b] <= t
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (__ldg(cu + mid) <= t) lo = mid;
    else hi = mid;
  }
  const int own = static_cast<int>(t - __ldg(cu + lo)) / bwd::kBlk;
  const int32_t* row = block_idx + i * K;
  bool found = false;
  for (int k = 0; k < K; ++k) found |= __ldg(row + k) == own;
  if (found) return;
  const int m = H / Hp;
  float4* q4 = reinterpret_cast<float4*>(dq_acc + (t * H + static_cast<int64_t>(p) * m) * D);
  for (int j = 0; j < m * D / 4; ++j) q4[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  float4* p4 = reinterpret_cast<float4*>(dqp_acc + (t * Hp + p) * D);
  for (int j = 0; j < D / 4; ++j) p4[j] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// FLASHMSA_BACKWARD_PATH=mma keeps the mma.sync attn_bwd_kernel for the shapes that otherwise
// take the wgmma kernel (A/B timing, and a fallback); =wgmma makes it an error when the wgmma
// kernel does not take the problem (tests); read per call. Any other value, or none: the default
// routing.
bool backward_path_forces_mma() { return env_is("FLASHMSA_BACKWARD_PATH", "mma"); }
// FLASHMSA_BWD_ROWS=0 keeps the fast wgmma backward's per-head 64-token tiles for groups of 8
// or 16 heads (A/B timing); otherwise they take the token-row tiles (RM, backward_wgmma.cuh).
// =1 makes it an error when the token-row tiles do not take a problem (tests). Read per call.
bool backward_rows_env(const char* value) { return env_is("FLASHMSA_BWD_ROWS", value); }
// FLASHMSA_DET_DQ=query: deterministic mode's dq from the query-major kernel (beside the per-head
// DET form) where the wgmma backward would compute dq and dqp as int32 fixed point (the token-row
// DET form, or the per-head one's DQ_ROWS); =kv makes it an error where the wgmma backward's int32
// dq does not take the problem (tests). Read per call.
bool det_dq_env(const char* value) { return env_is("FLASHMSA_DET_DQ", value); }

// kl_coeff / (Hp*T): the KL value's factor on its sum of terms, and dS_proxy's before g.
float kl_c_base(const MsaParams& p) {
  return static_cast<float>(static_cast<double>(p.kl_coeff) / (static_cast<double>(p.Hp) * p.T));
}

// The kernels' view of the inverted index in `ws` (build_selection_index fills it).
bwd::Index make_index(const MsaParams& p, const SelectionIndexPlan& sel, const Workspace& ws) {
  bwd::Index ix;
  ix.cu = p.cu_seqlens;
  ix.blk_off = sel.blk_off(ws);
  ix.blk_seq = sel.blk_seq(ws);
  ix.seg_start = sel.seg(ws);
  ix.vals = sel.vals(ws);
  ix.B = p.B;
  ix.NB = sel.NB;
  ix.set_top_k(p.top_k);
  ix.T = p.T;
  return ix;
}

// The student's lse per (p, t) into lse_s: per-slot partials (KV-major), then a merge. Over the
// dense warm-up's all-blocks selection the student is the proxy's dense causal softmax, whose lse
// the dense attention kernel (dense_forward.cu, tensor-core pipelined) gives at a fraction of the
// partials' cost (its o, over v = kp, goes to a scratch buffer and is dropped).
template <int D>
void launch_student_lse(const MsaParams& p, cudaStream_t stream, const bwd::Index& ix,
                        float* part_max,  // [Hp, T, K]
                        float* part_sum,  // [Hp, T, K]
                        float* lse_s) {   // [Hp, T]
  if (p.all_blocks && p.Dp == 128) {
    MsaParams proxy = p;
    proxy.q = p.qp;
    proxy.k = p.kp;
    proxy.v = p.kp;
    proxy.H = p.Hp;
    proxy.Hkv = p.Hpk;
    proxy.D = proxy.Dv = p.Dp;
    proxy.scale = p.proxy_scale;
    proxy.lse = lse_s;
    proxy.kl = nullptr;
    const StreamAllocation<bf16> o_scratch(static_cast<size_t>(p.T) * p.Hp * p.Dp, stream);  // [T, Hp, Dp]
    proxy.o = o_scratch.get();
    launch_dense_attention_forward(proxy, stream);
    return;
  }
  const int64_t nrow = static_cast<int64_t>(p.Hp) * p.T;
  auto partials = [&](auto kernel, int smem) {
    set_smem(kernel, smem);
    // Equal pieces of the lists laid end to end, about four per resident CTA: the pieces end
    // together, and each is long enough that its Kp load and list search stay small next to its
    // tiles (at least 8 tiles). `entries` bounds the lists' total (padding is left out of them).
    const int64_t entries = static_cast<int64_t>(p.Hp) * p.T * p.top_k;
    const int64_t slots = 4 * static_cast<int64_t>(resident_ctas(kernel, 128, smem));
    const int range = static_cast<int>(std::max<int64_t>(8 * bwd::kTileTok, (entries + slots - 1) / slots));
    kernel<<<static_cast<unsigned>((entries + range - 1) / range), 128, smem, stream>>>(
        static_cast<const bf16*>(p.qp), static_cast<const bf16*>(p.kp), ix, p.Hp, p.Hpk, p.proxy_scale, range,
        part_max, part_sum);
    FLASHMSA_CHECK_LAUNCH();
  };
  // D = 128 on warpgroup MMA unless FLASHMSA_PROXY_LSE=mma (A/B timing; read per call).
  if constexpr (D == 128) {
    if (!env_is("FLASHMSA_PROXY_LSE", "mma"))
      partials(bwd::proxy_lse_kernel<128, true>, bwd::proxy_lse_smem_bytes<128, true>());
    else
      partials(bwd::proxy_lse_kernel<128>, bwd::proxy_lse_smem_bytes<128, false>());
  } else {
    partials(bwd::proxy_lse_kernel<D>, bwd::proxy_lse_smem_bytes<D, false>());
  }
  merge_student_lse_kernel<<<grid_for(nrow, 256, INT_MAX), 256, 0, stream>>>(
      p.block_idx, p.cu_seqlens, p.B, p.T, p.top_k, nrow, part_max, part_sum, lse_s);
  FLASHMSA_CHECK_LAUNCH();
}

// kl = kl_c_base * the sum of the per-(p, block) shares, in a fixed order.
void launch_kl_final(const MsaParams& p, cudaStream_t stream, const float* kl_part, int64_t nkeys) {
  fixed_order_sum_kernel<256><<<1, 256, 0, stream>>>(kl_part, nkeys, kl_c_base(p), 1.f, p.kl);
  FLASHMSA_CHECK_LAUNCH();
}

template <int D>
void run_kernels(const MsaParams& p, cudaStream_t stream, const bwd::Index& ix, const float* di,
                 const float* lse_s, void* dq_acc, void* dqp_acc,
                 void* dk_acc, void* dv_acc, void* dkp_acc, const float* fx, const float* row_fx,
                 float* kl_part, bool main_owned, bool kl_owned, int nseg, bool fold, int token_rows,
                 int n_chunks, const int32_t* chunk_bounds, bool dkp_per_head, const int32_t* own_end,
                 const int4* pieces, int piece_cap, int piece_stride, int64_t kl_slot0) {
  if (dkp_per_head && !fold)
    throw Error("flashmsa: fused_backward: internal error: per-head dkp partials planned without the folded kernel");
  const auto* q = static_cast<const bf16*>(p.q);
  const auto* k = static_cast<const bf16*>(p.k);
  const auto* v = static_cast<const bf16*>(p.v);
  const auto* qp = static_cast<const bf16*>(p.qp);
  const auto* kp = static_cast<const bf16*>(p.kp);

  const float c_base = kl_c_base(p);
  const unsigned attn_grid = static_cast<unsigned>(ix.NB) * nseg;
  // dq_acc == null: dq is computed query-major (launch_backward_dq), the kernel skips it.
  auto launch_attn = [&](auto kernel, int smem, const bwd::FoldArgs& fa) {
    set_smem(kernel, smem);
    kernel<<<attn_grid, 256, smem, stream>>>(
        q, k, v, static_cast<const bf16*>(p.d_o), p.lse, di, ix, p.H, p.Hkv, p.Hp, nseg, p.scale, dq_acc, fx,
        main_owned ? 1 : 0, static_cast<bf16*>(p.dk), static_cast<bf16*>(p.dv), dk_acc, dv_acc, fa);
    FLASHMSA_CHECK_LAUNCH();
  };
  if (fold) {
    bwd::FoldArgs fa{};
    fa.qp = qp;
    fa.kp = kp;
    fa.lse_s = lse_s;
    fa.kl_grad = p.kl_grad;
    fa.dqp_acc = dqp_acc;
    fa.dkp_acc = dkp_acc;
    fa.kl_part = kl_part;
    fa.Hpk = p.Hpk;
    fa.scale_p = p.proxy_scale;
    fa.c_base = c_base;
    fa.row_fx = row_fx;
    fa.dkp_per_head = dkp_per_head;
    // The wgmma kernel (backward_wgmma.cuh) takes D = 128 (= Dv = Dp, check_supported) and
    // G = Hp/Hkv >= 1 whole proxy groups per kv head (wgmma_kv_applies). G = 1: dk/dv owned
    // (main_owned), stored as bf16. G > 1: its SHARED_KV form adds them into dk_acc / dv_acc, the
    // accumulators planned for the non-owned case (fp32, or int64 with fx), converted below.
    // Fast mode: fp32 atomics (fx == nullptr, dq_acc exists). Deterministic mode when dq is
    // query-major (top_k <= 32, dq_acc == nullptr): its DET form has no dQ and takes dqp (and
    // SHARED_KV's dk / dv) in int64 fixed point, dkp as per-proxy-head fp32 partials
    // (fa.dkp_per_head) or int64; or with token rows, where the DET form also
    // stages dq and dqp as int32 fixed point (laid out as the fast form's fp32); with a dq
    // accumulator otherwise (K > 32) the mma.sync kernel keeps dq.
    if constexpr (D == 128) {
      // det: no dq here (query-major), or the int32 dq (token rows; per-head tiles with row_fx: DQ_ROWS).
      const bool fast = fx == nullptr && dq_acc != nullptr,
                 det = fx != nullptr && (dq_acc == nullptr || token_rows > 0 || row_fx != nullptr);
      if (wgmma_kv_applies(p) && (fast || det)) {
        const bool shared_kv = p.Hp > p.Hkv;  // G > 1: dk_acc / dv_acc exist (!main_owned)
        // Token rows: each head step's Q and dO rows come as one TMA box per token.
        const CUtensorMap q_rows_map =
            token_rows > 0 && !shared_kv ? make_bf16_head_group_map(q, p.T, p.H, token_rows / 8) : CUtensorMap{};
        const CUtensorMap do_rows_map =
            token_rows > 0 && !shared_kv ? make_bf16_head_group_map(p.d_o, p.T, p.H, token_rows / 8) : CUtensorMap{};
        auto launch_wgmma = [&](auto kernel) {
          constexpr int smem = bwd::WgBwd::kSmem;
          set_smem(kernel, smem);
          bwd::FoldArgs fw = fa;
          if (alternate_waves(p)) fw.wave_ctas = resident_ctas(kernel, bwd::WgBwd::kThreads, smem);
          // The wave alternation counts waves along blockIdx.x: block-major order (one grid row) there.
          fw.sweep_groups = shared_kv || fw.wave_ctas > 0 ? p.Hp : n_chunks > 0 ? chunk_groups(p.Hp) : sweep_groups(p.Hp);
          fw.n_chunks = n_chunks;
          fw.chunk_bounds = chunk_bounds;
          fw.own_end = own_end;
          // x_per_group: the grid's CTAs per proxy group along x before the sweep.
          auto go = [&](int64_t x_per_group) {
            const dim3 grid(static_cast<unsigned>(x_per_group * fw.sweep_groups), p.Hp / fw.sweep_groups);
            kernel<<<grid, bwd::WgBwd::kThreads, smem, stream>>>(
                q, k, v, static_cast<const bf16*>(p.d_o), p.lse, di, ix, p.H, p.Hkv, p.Hp, p.scale,
                static_cast<float*>(dq_acc), static_cast<bf16*>(p.dk), static_cast<bf16*>(p.dv), fw, fx, dk_acc,
                dv_acc, q_rows_map, do_rows_map);
            FLASHMSA_CHECK_LAUNCH();
          };
          if (own_end && (shared_kv || det || token_rows == 0))
            throw Error("flashmsa: fused_backward: internal error: the own-block pass planned for a form without it");
          if (own_end) {  // the own-block pass first (stream order puts its stores before every add)
            fw.own_pass = 1;
            go(ix.NB);
            fw.own_pass = 0;
          }
          if (pieces) {  // the overflow slots, then the usual CTAs
            fw.pieces = pieces;
            fw.piece_cap = piece_cap;
            fw.piece_stride = piece_stride;
            fw.kl_slot0 = kl_slot0;
          }
          go((pieces ? piece_stride : 0) + static_cast<int64_t>(ix.NB) * std::max(n_chunks, 1));
        };
        if (shared_kv) {
          if (det && row_fx) launch_wgmma(bwd::attn_bwd_wgmma_kernel<false, true, true, 0, true>);
          else if (det) launch_wgmma(bwd::attn_bwd_wgmma_kernel<false, true, true>);
          else launch_wgmma(bwd::attn_bwd_wgmma_kernel<false, false, true>);
        } else {
          if (det && token_rows == 16) launch_wgmma(bwd::attn_bwd_wgmma_kernel<false, true, false, 16>);
          else if (det && token_rows == 8) launch_wgmma(bwd::attn_bwd_wgmma_kernel<false, true, false, 8>);
          else if (det && row_fx) launch_wgmma(bwd::attn_bwd_wgmma_kernel<false, true, false, 0, true>);
          else if (det) launch_wgmma(bwd::attn_bwd_wgmma_kernel<false, true>);
          else if (token_rows == 16) launch_wgmma(bwd::attn_bwd_wgmma_kernel<false, false, false, 16>);
          else if (token_rows == 8) launch_wgmma(bwd::attn_bwd_wgmma_kernel<false, false, false, 8>);
          else launch_wgmma(bwd::attn_bwd_wgmma_kernel<false, false>);
        }
        return;
      }
    }
    // The token-row accumulators (permuted fp32, or int32 with DET) and the per-head int32 dq (row_fx)
    // exist for the wgmma kernel only; wgmma_kv_applies reads FLASHMSA_BACKWARD_PATH again above, so
    // the plan is checked, not assumed.
    if (token_rows > 0 || row_fx || dkp_per_head || own_end || pieces)
      throw Error("flashmsa: fused_backward: internal error: token-row, int32 dq or per-head dkp accumulators, the "
                  "own-block pass or list pieces planned for the wgmma kernel, which did not run");
    constexpr int smem = bwd::attn_smem_bytes<D>() + bwd::fold_smem_bytes<D>();
    static_assert(smem <= 227 * 1024, "the folded backward must fit in one SM's shared memory");
    if (dq_acc) launch_attn(bwd::attn_bwd_kernel<D, true, true>, smem, fa);
    else launch_attn(bwd::attn_bwd_kernel<D, true, false>, smem, fa);
    return;
  }
  constexpr int attn_smem = bwd::attn_smem_bytes<D>();
  if (dq_acc) launch_attn(bwd::attn_bwd_kernel<D, false, true>, attn_smem, bwd::FoldArgs{});
  else launch_attn(bwd::attn_bwd_kernel<D, false, false>, attn_smem, bwd::FoldArgs{});

  constexpr int kl_smem = bwd::kl_smem_bytes<D>();
  set_smem(bwd::kl_bwd_kernel<D>, kl_smem);
  bwd::kl_bwd_kernel<D><<<static_cast<unsigned>(ix.NB) * p.Hp, 256, kl_smem, stream>>>(
      q, k, qp, kp, p.lse, lse_s, ix, p.H, p.Hkv, p.Hp, p.Hpk, p.scale, p.proxy_scale, c_base, p.kl_grad,
      dqp_acc, fx, kl_owned ? 1 : 0, static_cast<bf16*>(p.dkp), dkp_acc, kl_part);
  FLASHMSA_CHECK_LAUNCH();
}

// launch_kl_value's workspace: the inverted index, then lse_s and the per-(p, block) shares (with
// list pieces: then one per (p, overflow slot), and the overflow table). The student's partials reuse the index's
// unsorted keys and values, dead once the sort is done (their own buffers with a caller's prebuilt
// index).
struct KlValuePlan {
  SelectionIndexPlan sel;
  Workspace ws;
  size_t o_part_max = 0, o_part_sum = 0, o_lse_s = 0, o_kl_part = 0;
  ListPiecePlan pieces;
  int64_t n_kl_part = 0;
};

KlValuePlan plan_kl_value(const MsaParams& p, cudaStream_t stream) {
  KlValuePlan kp;
  kp.sel = selection_index_sizes(p);
  reserve_selection_index(kp.sel, p, kp.ws, stream);
  static_assert(sizeof(float) == sizeof(uint32_t) && sizeof(float) == sizeof(int32_t),
                "part_max / part_sum alias keys_in / vals_in, one 4-byte element per entry");
  const bool own = kp.sel.prebuilt;
  kp.o_part_max = own ? kp.ws.add(kp.sel.n_entries * sizeof(float)) : kp.sel.o_keys_in;
  kp.o_part_sum = own ? kp.ws.add(kp.sel.n_entries * sizeof(float)) : kp.sel.o_vals_in;
  kp.o_lse_s = kp.ws.add(static_cast<size_t>(p.Hp) * p.T * sizeof(float));
  // List pieces as in the backward (FLASHMSA_BWD_PIECE): a key block's list longer than the cap goes in
  // pieces to overflow CTAs, so that an attention sink's list does not hold one CTA for the whole sequence. Not with the
  // alternating waves of the dense warm-up (fa.wave_ctas counts waves along the grid's CTAs, which
  // the pieces would reorder); there the variable is ignored rather than refused, so that the check
  // cannot fail after the forward has run.
  const int tokens = alternate_waves(p) ? 0 : backward_piece_tokens().tokens;
  kp.pieces = plan_list_pieces(p, tokens, kp.sel.nkeys / std::max(p.Hp, 1), kp.ws);
  kp.n_kl_part = kp.sel.nkeys + static_cast<int64_t>(p.Hp) * kp.pieces.stride;
  kp.o_kl_part = kp.ws.add(std::max<int64_t>(kp.n_kl_part, 1) * sizeof(float));
  return kp;
}

}  // namespace

bool backward_path_requires_wgmma() { return env_is("FLASHMSA_BACKWARD_PATH", "wgmma"); }

bool wgmma_kv_applies(const MsaParams& p) {
  // Groups of m = H/Hp >= 2 heads, whole groups per kv head: (H/Hkv) % m == 0, i.e. G = Hp/Hkv
  // is an integer >= 1 (the folded kernel's condition, `fold` in launch_fused_backward).
  const int m = p.H / p.Hp, r = p.H / p.Hkv;
  return p.D == 128 && p.Dv == 128 && p.Dp == 128 && m >= 2 && r % m == 0 && !backward_path_forces_mma();
}

bool kl_value_applies(const MsaParams& p) {
  if (!wgmma_kv_applies(p) || p.T <= 0 || p.top_k > 32) return false;
  const size_t q_bytes = static_cast<size_t>(p.T) * p.H * p.D * 2;
  return plan_kl_value(p, nullptr).ws.size() <= q_bytes / 2;
}

void launch_kl_value(const MsaParams& p, cudaStream_t stream) {
  KlValuePlan kp = plan_kl_value(p, stream);
  Workspace& ws = kp.ws;
  ws.allocate(stream);
  const bwd::Index ix = make_index(p, kp.sel, ws);
  build_selection_index(p, kp.sel, ws, stream);
  launch_student_lse<128>(p, stream, ix, ws.at<float>(kp.o_part_max), ws.at<float>(kp.o_part_sum),
                          ws.at<float>(kp.o_lse_s));

  // KL_ONLY reads qp, kp, lse_s, scale_p, Hpk and kl_grad (null here: g only scales the proxy's
  // dS, not the KL value) and writes kl_part; nothing else of FoldArgs.
  bwd::FoldArgs fa{};
  fa.qp = static_cast<const bf16*>(p.qp);
  fa.kp = static_cast<const bf16*>(p.kp);
  fa.lse_s = ws.at<float>(kp.o_lse_s);
  fa.kl_part = ws.at<float>(kp.o_kl_part);
  fa.Hpk = p.Hpk;
  fa.scale_p = p.proxy_scale;
  unsigned grid = static_cast<unsigned>(ix.NB) * p.Hp;
  if (kp.pieces.tokens > 0) {
    launch_build_list_pieces(p, ix, 0, nullptr, nullptr, kp.pieces, ws, stream);
    FLASHMSA_CUDA_CHECK(cudaMemsetAsync(fa.kl_part, 0, kp.n_kl_part * sizeof(float), stream));  // unused slots
    fa.pieces = ws.at<int4>(kp.pieces.o_pieces);
    fa.piece_cap = kp.pieces.tokens;
    fa.piece_stride = kp.pieces.stride;
    fa.kl_slot0 = kp.sel.nkeys;
    grid += static_cast<unsigned>(kp.pieces.stride) * p.Hp;  // the overflow slots first
  }
  constexpr int smem = bwd::WgKl::kSmem;
  set_smem(bwd::attn_bwd_wgmma_kernel<true>, smem);
  if (alternate_waves(p)) fa.wave_ctas = resident_ctas(bwd::attn_bwd_wgmma_kernel<true>, bwd::WgKl::kThreads, smem);
  bwd::attn_bwd_wgmma_kernel<true><<<grid, bwd::WgKl::kThreads, smem, stream>>>(
      static_cast<const bf16*>(p.q), static_cast<const bf16*>(p.k), nullptr, nullptr, p.lse, nullptr, ix, p.H,
      p.Hkv, p.Hp, p.scale, nullptr, nullptr, nullptr, fa, nullptr, nullptr, nullptr, CUtensorMap{}, CUtensorMap{});
  FLASHMSA_CHECK_LAUNCH();
  launch_kl_final(p, stream, ws.at<float>(kp.o_kl_part), kp.n_kl_part);
  ws.release();
}

namespace {
// Where an accumulator lives: `offset` bytes into the caller's dq buffer, or into the workspace.
struct AccAt {
  bool in_dq = false;
  size_t offset = 0;
};
}  // namespace

void launch_fused_backward(const MsaParams& p, cudaStream_t stream) {
  // ---- everything that can fail on arguments, before any launch ----
  if (p.T * static_cast<int64_t>(p.top_k) * p.Hp >= INT32_MAX)
    throw Error("flashmsa: fused_backward: argument 'block_idx' has Hp*T*K >= 2^31 entries");
  if (p.T == 0) {
    if (p.kl) FLASHMSA_CUDA_CHECK(cudaMemsetAsync(p.kl, 0, sizeof(float), stream));
    return;
  }

  const int64_t T = p.T;
  const int K = p.top_k;
  SelectionIndexPlan sel = selection_index_sizes(p);
  const int64_t n_entries = sel.n_entries;
  const int64_t nkeys = sel.nkeys;  // also the sentinel key

  const int m = p.H / p.Hp, r = p.H / p.Hkv;
  int nseg = 0;
  for (int h = 0; h < p.H; ++h) nseg += (h % m == 0 || h % r == 0) ? 1 : 0;
  const bool main_owned = m % r == 0;  // every kv head lies inside one proxy group
  const bool kl_owned = p.Hp == p.Hpk;
  // Fold the proxy's KL into the main kernel when each head segment is a whole proxy group
  // (groups inside one kv head) of at least 2 heads (the proxy part's Qp loads with a tile's
  // second head). The folded kernel accumulates dkp per token tile, so dkp always goes through
  // an accumulator there.
  const bool fold = r % m == 0 && m >= 2;
  const bool dkp_in_acc = !kl_owned || fold;
  const bool det = p.deterministic;
  const size_t acc_elem = det ? 8 : 4;
  // The token-row tiles (RM, backward_wgmma.cuh): the wgmma backward with groups of 8 or 16 heads,
  // one group per kv head (G = 1).
  const bool rows_shape =
      fold && p.D == 128 && wgmma_kv_applies(p) && p.Hp == p.Hkv && (m == 8 || m == 16) && !backward_rows_env("0");
  // Deterministic mode's dq: on those tiles the DET form computes it KV-major as int32 fixed point
  // (bulk .add.s32 of staged rows, order-independent) with a factor per row (di_kernel: from the
  // row's ||dO||_1, Di and max|k|, max|v|; a per-tensor bound left rows far below the largest one
  // too little resolution), dqp likewise with its per-tensor factor fx[6], in accumulators of the
  // fast form's size (2 x size(q)); with FLASHMSA_DET_DQ=query, or outside the wgmma shapes, the
  // query-major dq_kernel (reads a token's selection one entry per lane: K <= 32). The dense warm-up's
  // all-blocks index (K > 32) keeps dq on the int64 fixed-point atomics. The other wgmma shapes
  // (per-head tiles: groups of 4 heads, fm16k's two groups per kv head) take the same int32 dq
  // (DQ_ROWS: the per-head DET form computing dQ as the fast one does). fm16k deterministic backward on
  // an H100: 10.58 ms with the query-major dq, 3.90 with this one (fast 3.17; bench/results/
  // h100_f561bec_new/dq), for 35 MB more workspace there (216 MB = 3.2 x size(q) against 182 = 2.7 x:
  // dq's int32 rows in the workspace, the int64 dk / dv beside them).
  const bool wgmma_shape = fold && p.D == 128 && wgmma_kv_applies(p);
  const bool dq_kv_int32 = det && K <= 32 && wgmma_shape && !det_dq_env("query");
  if (det_dq_env("kv") && det && !dq_kv_int32)
    throw Error("flashmsa: fused_backward: FLASHMSA_DET_DQ=kv, but the wgmma backward's int32 dq does not take "
                "this problem (argument 'q': D = Dv = Dp = 128, whole proxy groups of >= 2 heads per kv head, "
                "top_k <= 32)");
  const bool dq_query_major = det && K <= 32 && !dq_kv_int32;
  // FLASHMSA_BACKWARD_PATH=wgmma: an error (before anything is allocated or written) unless the
  // wgmma kernel takes this problem -- how tests prove which kernel ran, since on small grids
  // both kernels can give the same bits.
  const bool takes_wgmma = wgmma_shape && (!det || dq_query_major || dq_kv_int32);
  // The wgmma kernel's dk/dv form follows G = Hp/Hkv; the plan's ownership must agree with it.
  if (takes_wgmma && (p.Hp > p.Hkv) == main_owned)
    throw Error("flashmsa: fused_backward: internal error: wgmma dk/dv ownership does not match the plan");
  if (backward_path_requires_wgmma() && !takes_wgmma)
    throw Error("flashmsa: fused_backward: FLASHMSA_BACKWARD_PATH=wgmma, but the wgmma kernel does not take "
                "this problem (argument 'q': D = Dv = Dp = 128, whole proxy groups of >= 2 heads per kv head, "
                "top_k <= 32 in deterministic mode)");
  const HeadItems dq_items = dq_query_major ? make_items(p, "fused_backward") : HeadItems{};
  // The fast and deterministic wgmma forms with token-row tiles: their dq accumulator rows come
  // permuted (convert_acc_kernel's `permuted`). Deterministic mode takes them only with the int32
  // dq (not with FLASHMSA_DET_DQ=query: the per-head DET form and the query-major dq).
  const int token_rows = takes_wgmma && rows_shape && (!det || dq_kv_int32) ? m : 0;
  // Token chunks (backward_chunk_tokens): the token-row forms only (fast, and DET when asked for);
  // dk / dv through accumulators (DET: int64 fixed point).
  const int chunk_tokens = backward_chunk_tokens(T, det);
  const int n_chunks = token_rows > 0 && !alternate_waves(p) && chunk_tokens > 0 && chunk_tokens < T
                           ? static_cast<int>((T + chunk_tokens - 1) / chunk_tokens)
                           : 0;
  // List pieces (FoldArgs::pieces): every form of the wgmma kernel, fast and deterministic, not the
  // dense warm-up (its alternating waves); dk / dv then go through the accumulators (deterministic:
  // int64 fixed point, as with token chunks).
  PieceSetting piece_setting = backward_piece_tokens();
  if (!piece_setting.set && !det && (!main_owned || n_chunks > 0))
    piece_setting.tokens = default_piece_tokens(n_chunks, chunk_tokens);
  const bool use_pieces = piece_setting.tokens > 0 && takes_wgmma && !alternate_waves(p);
  if (piece_setting.forced() && !use_pieces)
    throw Error("flashmsa: fused_backward: FLASHMSA_BWD_PIECE is set, but list pieces do not apply (argument 'q': "
                "the wgmma backward, not the dense warm-up)");
  const bool dkv_in_acc = !main_owned || n_chunks > 0 || use_pieces;
  // The own-block pass (FoldArgs::own_pass; fast mode with token chunks): the first contribution to
  // each dq / dqp row is stored, so those 2.1 + 0.13 GB at m3/64k are not zeroed first.
  // FLASHMSA_BWD_OWN_PASS=0: zeroed and reduce-added as before (A/B timing); =1: an error when the
  // pass does not apply (how tests prove it ran). Read per call.
  const bool own_split = n_chunks > 0 && !det && p.block_idx != nullptr && !p.all_blocks &&
                         !env_is("FLASHMSA_BWD_OWN_PASS", "0");
  if (env_is("FLASHMSA_BWD_OWN_PASS", "1") && !own_split)
    throw Error("flashmsa: fused_backward: FLASHMSA_BWD_OWN_PASS=1, but the own-block pass does not apply (argument "
                "'deterministic': fast mode only; argument 'block_idx': a block selection, not the dense warm-up; "
                "and token chunks: the token-row backward with more tokens than FLASHMSA_BWD_CHUNK)");
  // Deterministic dkp on the wgmma kernel without token chunks or list pieces: one fp32 partial per proxy head
  // ([T, Hp, Dp]; every row added by one CTA, in a fixed order: FoldArgs::dkp_per_head), summed over
  // the R = Hp / Hpk heads of a key head at the end, instead of int64 fixed-point REDs into [T, Hpk, Dp]:
  // 16-byte fp32 REDs instead of four 8-byte ones per lane (the int64 REDs cost 6.6 ms of the
  // deterministic backward at m3/64k, the fast form's 2.1: timing probes, h200_dkp_red_probes_ab41.log).
  // R <= 4 (m3: 4): the partials then take at most twice the int64 accumulator's bytes.
  // FLASHMSA_DET_DKP=int64 keeps the fixed point, =partials makes it an error when the partials do not
  // apply (tests; read per call). In fast mode the partials measured slower than the shared fp32
  // accumulator (m3/64k backward +0.1 ms, fm16k +0.06: perf-notes), so it keeps that.
  const bool det_partials_apply = det && takes_wgmma && n_chunks == 0 && !use_pieces && p.Hp <= 4 * p.Hpk;
  if (det && env_is("FLASHMSA_DET_DKP", "partials") && !det_partials_apply)
    throw Error("flashmsa: fused_backward: FLASHMSA_DET_DKP=partials, but the per-proxy-head dkp partials do not "
                "apply (argument 'qp': the wgmma backward, no token chunks or list pieces, Hp <= 4 Hpk)");
  const bool dkp_per_head = det_partials_apply && !env_is("FLASHMSA_DET_DKP", "int64");
  const int64_t dkp_rows = dkp_per_head ? p.Hp : p.Hpk;
  const size_t dkp_elem = dkp_per_head ? 4 : acc_elem;
  if (backward_rows_env("1") && token_rows == 0)
    throw Error("flashmsa: fused_backward: FLASHMSA_BWD_ROWS=1, but the token-row backward does not take this "
                "problem (argument 'q': the wgmma backward with groups of 8 or 16 heads, one group per kv head; in "
                "deterministic mode also top_k <= 32 and not FLASHMSA_DET_DQ=query)");

  Workspace ws;
  reserve_selection_lists(sel, p, ws, stream);  // its scratch: over the accumulators, below
  const size_t o_di = ws.add(T * p.H * sizeof(float));
  const size_t o_lse_s = ws.add(static_cast<size_t>(p.Hp) * T * sizeof(float));
  const int64_t nb = nkeys / p.Hp;
  const ListPiecePlan pieces =
      plan_list_pieces(p, use_pieces ? piece_setting.tokens : 0, nb * std::max(n_chunks, 1), ws);
  const int64_t kl_slot0 = std::max<int64_t>(nkeys, 1) * (std::max(n_chunks, 1) + (own_split ? 1 : 0));
  const int64_t n_kl_part = kl_slot0 + static_cast<int64_t>(p.Hp) * pieces.stride;
  const size_t o_kl_part = ws.add(n_kl_part * sizeof(float));
  const size_t o_chunk_bounds = n_chunks > 0 ? ws.add(nkeys * (n_chunks + 1) * sizeof(int32_t)) : 0;
  const size_t o_own_end = own_split ? ws.add(nkeys * sizeof(int32_t)) : 0;
  const int64_t n_dq = T * p.H * p.D, n_dqp = T * p.Hp * p.Dp;
  const int64_t n_dk = T * p.Hkv * p.D, n_dkp = T * p.Hpk * p.Dp, n_dkp_acc = T * dkp_rows * p.Dp;
  // The side accumulators (dqp, the non-owned dk / dv, dkp) go into the caller's dq buffer while
  // they fit, in that order: dq is written only by the last convert, after theirs have been read
  // (not so with the query-major dq, which writes it first). Their bytes then leave the workspace
  // (fm16k: 3.3 -> 2.33 x size(q); the API rejects gradients that overlap each other or an input).
  // The rest are zeroed together with the dq accumulator: keep them contiguous.
  auto pad = [](int64_t bytes) { return Workspace::padded(static_cast<size_t>(bytes)); };
  const size_t dq_bytes = static_cast<size_t>(n_dq) * (p.dtype == DType::fp32 ? 4 : 2);
  const size_t b_dq = dq_query_major ? 0 : pad(n_dq * (dq_kv_int32 ? 4 : acc_elem));
  const size_t b_dqp = pad(n_dqp * (dq_kv_int32 ? 4 : acc_elem)), b_dk = dkv_in_acc ? pad(n_dk * acc_elem) : 0;
  const size_t b_dkp = dkp_in_acc ? pad(n_dkp_acc * dkp_elem) : 0;
  // The index's scratch lives in the workspace's accumulator region when it fits there (below):
  // where moving the side accumulators out would push it into a workspace buffer of its own that
  // is larger than what they free (the warm-up's all-blocks index with few heads), they stay.
  bool side_in_dq = !dq_query_major;
  {
    size_t moved = 0, kept = 0;
    for (size_t b : {b_dqp, b_dk, b_dk, b_dkp}) (moved + b <= dq_bytes ? moved : kept) += b;
    const size_t scratch = selection_scratch_bytes(sel);
    if (scratch > b_dq + kept && scratch <= b_dq + kept + moved && scratch > moved) side_in_dq = false;
  }
  size_t dq_used = 0;
  const size_t o_acc_begin = ws.add(0);
  // An offset into dq (AccAt::in_dq) or into the workspace.
  auto place = [&](int64_t bytes, bool may_use_dq) {
    if (may_use_dq && !dq_query_major && dq_used + pad(bytes) <= dq_bytes) {
      dq_used += pad(bytes);
      return AccAt{true, dq_used - pad(bytes)};
    }
    return AccAt{false, ws.add(static_cast<size_t>(bytes))};
  };
  const size_t o_dq = dq_query_major ? 0 : ws.add(n_dq * (dq_kv_int32 ? 4 : acc_elem));
  const AccAt at_dqp = place(n_dqp * (dq_kv_int32 ? 4 : acc_elem), side_in_dq);
  const AccAt at_dk = dkv_in_acc ? place(n_dk * acc_elem, side_in_dq) : AccAt{};
  const AccAt at_dv = dkv_in_acc ? place(n_dk * acc_elem, side_in_dq) : AccAt{};
  const AccAt at_dkp = dkp_in_acc ? place(n_dkp_acc * dkp_elem, side_in_dq) : AccAt{};
  const size_t o_acc_end = ws.add(0), side_bytes = dq_used;  // the part of dq to zero
  // The student lse's per-entry partials (read only until lse_s is formed, before the main kernel)
  // go there too, past the accumulators, where they fit: the warm-up's all-blocks index makes
  // them 0.25 x size(q) at m3.
  const AccAt at_pmax = place(n_entries * static_cast<int64_t>(sizeof(float)), true);
  const AccAt at_psum = place(n_entries * static_cast<int64_t>(sizeof(float)), true);
  // The accumulators are zeroed after the index is built: its scratch can live there.
  place_selection_scratch(sel, ws, o_acc_begin, o_acc_end - o_acc_begin);
  const size_t o_amax = det ? ws.add(8 * sizeof(unsigned int)) : 0;
  const size_t o_fx = det ? ws.add(8 * sizeof(float)) : 0;
  const size_t o_row_fx = dq_kv_int32 ? ws.add(T * p.H * sizeof(float)) : 0;
  ws.allocate(stream);

  // ---- metadata and the inverted index ----
  const bwd::Index ix = make_index(p, sel, ws);
  build_selection_index(p, sel, ws, stream);
  if (n_chunks > 0) {
    const int64_t n = nkeys * (n_chunks + 1);
    chunk_bounds_kernel<<<grid_for(n, 256), 256, 0, stream>>>(ix.seg_start, ix.vals, nkeys, n_chunks,
                                                               static_cast<int64_t>(chunk_tokens) * K,
                                                               ws.at<int32_t>(o_chunk_bounds));
    FLASHMSA_CHECK_LAUNCH();
    if (own_split) {
      own_bounds_kernel<<<grid_for(nkeys, 256), 256, 0, stream>>>(ix, nkeys, ws.at<int32_t>(o_own_end));
      FLASHMSA_CHECK_LAUNCH();
    }
  }
  if (use_pieces) {
    if (nb != ix.NB) throw Error("flashmsa: fused_backward: internal error: list pieces planned for another index");
    launch_build_list_pieces(p, ix, n_chunks, n_chunks > 0 ? ws.at<int32_t>(o_chunk_bounds) : nullptr,
                             own_split ? ws.at<int32_t>(o_own_end) : nullptr, pieces, ws, stream);
  }
  // Empty chunks and the pieces' unused slots write no KL share.
  if (n_chunks > 0 || use_pieces)
    FLASHMSA_CUDA_CHECK(cudaMemsetAsync(ws.at<float>(o_kl_part), 0, n_kl_part * sizeof(float), stream));

  // The accumulators' zeroing, the deterministic factors and the per-row terms (HBM-bound) run on
  // a helper stream beside the student lse (latency-bound, three CTAs per SM with room left for
  // them) on the caller's; both are joined before the main kernel. FLASHMSA_BWD_SIDE_STREAM=0
  // keeps them on the caller's stream (A/B timing; read per call).
  int device = 0;
  FLASHMSA_CUDA_CHECK(cudaGetDevice(&device));
  const bool fork_side = !env_is("FLASHMSA_BWD_SIDE_STREAM", "0") && helpers_usable(stream, device, 1);
  StreamFork fork(stream, device, fork_side ? 1 : 0);
  const cudaStream_t side = fork_side ? fork[0] : stream;
  auto acc_ptr = [&](const AccAt& a) -> void* {
    return a.in_dq ? static_cast<void*>(static_cast<unsigned char*>(p.dq) + a.offset) : ws.at<void>(a.offset);
  };
  if (own_split) {  // every accumulator but dq's and dqp's (the own-block pass writes those first)
    if (dkv_in_acc) {
      FLASHMSA_CUDA_CHECK(cudaMemsetAsync(acc_ptr(at_dk), 0, n_dk * acc_elem, side));
      FLASHMSA_CUDA_CHECK(cudaMemsetAsync(acc_ptr(at_dv), 0, n_dk * acc_elem, side));
    }
    if (dkp_in_acc) FLASHMSA_CUDA_CHECK(cudaMemsetAsync(acc_ptr(at_dkp), 0, n_dkp_acc * dkp_elem, side));
    zero_rows_without_own_block_kernel<<<grid_for(p.Hp * T, 256, INT_MAX), 256, 0, side>>>(
        p.block_idx, p.cu_seqlens, p.B, T, p.Hp, K, p.H, p.D, ws.at<float>(o_dq), static_cast<float*>(acc_ptr(at_dqp)));
    FLASHMSA_CHECK_LAUNCH();
  } else {
    FLASHMSA_CUDA_CHECK(cudaMemsetAsync(ws.at<void>(o_acc_begin), 0, o_acc_end - o_acc_begin, side));
    if (side_bytes > 0) FLASHMSA_CUDA_CHECK(cudaMemsetAsync(p.dq, 0, side_bytes, side));
  }
  const float* fx = nullptr;
  unsigned int* amax = det ? ws.at<unsigned int>(o_amax) : nullptr;
  if (det) {
    FLASHMSA_CUDA_CHECK(cudaMemsetAsync(amax, 0, 8 * sizeof(unsigned int), side));
    const void* tensors[7] = {p.q, p.k, p.v, p.o, p.d_o, p.qp, p.kp};
    const int64_t sizes[7] = {T * p.H * p.D, T * p.Hkv * p.D, T * p.Hkv * p.Dv, T * p.H * p.Dv,
                              T * p.H * p.Dv, T * p.Hp * p.Dp, T * p.Hpk * p.Dp};
    // The bounds of the accumulators that exist (fixed_point_kernel): an int64 dq needs k, v, o, dO;
    // the int32 dq's per-row factors (di_kernel) k and v; dk/dv accumulators (non-owned, or token
    // chunks) q, v, o, dO; dqp and dkp
    // kp and qp. q, k, v, qp and kp are always read, so that a non-finite one poisons the factors
    // (q: ~0.35 ms at m3/64k); o and dO (~0.7 ms) only when a bound needs them: a non-finite value
    // there reaches the gradients through D / dP, which the int32 dq's per-row factors and the
    // float paths carry.
    const bool dq_int64 = !dq_query_major && !dq_kv_int32;
    const bool main_bounds = dq_int64 || dkv_in_acc;
    const bool needed[7] = {true, true, true, main_bounds, main_bounds, true, true};
    for (int i = 0; i < 7; ++i) {
      if (!needed[i]) continue;  // its amax stays 0: the factors that use it are never read
      absmax_kernel<<<grid_for(sizes[i] / 8, 256, 4096), 256, 0, side>>>(
          static_cast<const bf16*>(tensors[i]), sizes[i] / 8, amax + i);
      FLASHMSA_CHECK_LAUNCH();
    }
    fixed_point_kernel<<<1, 1, 0, side>>>(amax, p.scale, p.proxy_scale, p.Dv, static_cast<float>(T),
                                            static_cast<float>(r), static_cast<float>(p.Hp / p.Hpk),
                                            kl_c_base(p), p.kl_grad, ws.at<float>(o_fx));
    FLASHMSA_CHECK_LAUNCH();
    fx = ws.at<float>(o_fx);
  }

  // ---- per-row terms (after the maxima: the int32 dq's per-row factors use max|k|, max|v|) ----
  const int64_t rows = T * p.H;
  float* row_fx = dq_kv_int32 ? ws.at<float>(o_row_fx) : nullptr;
  di_kernel<<<grid_for(rows * 16, 256, INT_MAX), 256, 0, side>>>(
      static_cast<const bf16*>(p.o), static_cast<const bf16*>(p.d_o), rows, p.Dv, ws.at<float>(o_di), amax,
      p.scale, row_fx, fx);
  FLASHMSA_CHECK_LAUNCH();

  if (p.D == 64)
    launch_student_lse<64>(p, stream, ix, static_cast<float*>(acc_ptr(at_pmax)), static_cast<float*>(acc_ptr(at_psum)),
                           ws.at<float>(o_lse_s));
  else
    launch_student_lse<128>(p, stream, ix, static_cast<float*>(acc_ptr(at_pmax)),
                            static_cast<float*>(acc_ptr(at_psum)), ws.at<float>(o_lse_s));
  fork.join();

  if (dq_query_major) launch_backward_dq(p, dq_items, ws.at<float>(o_di), stream);
  void* dq_acc = dq_query_major ? nullptr : ws.at<void>(o_dq);
  void* dqp_acc = acc_ptr(at_dqp);
  void* dk_acc = dkv_in_acc ? acc_ptr(at_dk) : nullptr;
  void* dv_acc = dkv_in_acc ? acc_ptr(at_dv) : nullptr;
  void* dkp_acc = dkp_in_acc ? acc_ptr(at_dkp) : nullptr;
  auto run = [&](auto tag) {
    constexpr int D = decltype(tag)::value;
    run_kernels<D>(p, stream, ix, ws.at<float>(o_di), ws.at<float>(o_lse_s), dq_acc, dqp_acc, dk_acc, dv_acc,
                   dkp_acc, fx, row_fx, ws.at<float>(o_kl_part), main_owned, kl_owned, nseg, fold, token_rows,
                   n_chunks, n_chunks > 0 ? ws.at<int32_t>(o_chunk_bounds) : nullptr, dkp_per_head,
                   own_split ? ws.at<int32_t>(o_own_end) : nullptr, use_pieces ? ws.at<int4>(pieces.o_pieces) : nullptr,
                   pieces.tokens, pieces.stride, kl_slot0);
  };
  if (p.D == 64) run(std::integral_constant<int, 64>{});
  else run(std::integral_constant<int, 128>{});

  // ---- outputs ----
  auto convert = [&](const void* acc, int64_t n, int fx_index, void* out, bool permuted = false,
                     bool int32 = false, const float* per_row = nullptr) {
    convert_acc_kernel<<<grid_for(n / 8, 256), 256, 0, stream>>>(acc, n, fx ? fx + fx_index : nullptr,
                                                             static_cast<bf16*>(out), permuted, int32, per_row);
    FLASHMSA_CHECK_LAUNCH();
  };
  convert(dqp_acc, n_dqp, dq_kv_int32 ? 6 : 3, p.dqp, false, dq_kv_int32);
  if (dkv_in_acc) {
    convert(dk_acc, n_dk, 1, p.dk);
    convert(dv_acc, n_dk, 2, p.dv);
  }
  if (dkp_per_head) {
    sum_partials_kernel<<<grid_for(n_dkp / 8, 256), 256, 0, stream>>>(static_cast<const float*>(dkp_acc), n_dkp,
                                                                      p.Dp, p.Hp / p.Hpk, static_cast<bf16*>(p.dkp));
    FLASHMSA_CHECK_LAUNCH();
  } else if (dkp_in_acc) {
    convert(dkp_acc, n_dkp, 4, p.dkp);
  }
  // Last: it overwrites the side accumulators that live in dq.
  if (!dq_query_major) convert(dq_acc, n_dq, 0, p.dq, token_rows > 0, dq_kv_int32, row_fx);
  if (p.kl) launch_kl_final(p, stream, ws.at<float>(o_kl_part), n_kl_part);
  ws.release();
}

}  // namespace flashmsa::cuda
