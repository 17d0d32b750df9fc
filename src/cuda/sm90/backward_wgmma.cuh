// The folded fused backward on warpgroup MMA (wgmma), FlashAttention-3 style and transposed so
// that the block's KEYS are the MMA's M dimension. It computes exactly what
// attn_bwd_kernel<128, FOLD = true, DQ = true> computes (same accumulators, same outputs) for the
// case fused_backward.cu routes here: D = Dv = Dp = 128, every kv head holds G = Hp/Hkv >= 1
// whole proxy groups of m = H/Hp >= 2 heads ((H/Hkv) % m == 0). G = 1 (m3, gqa8): dk/dv owned by
// the CTA, stored as bf16 (with token chunks or list pieces: partial sums added like SHARED_KV's).
// G > 1 (SHARED_KV, fm16k: G = 2): the G groups' CTAs of a key block add into the same dk/dv rows,
// through fp32 accumulators (int64 fixed point with DET) that fused_backward.cu converts to bf16
// afterwards.
//
// Why: the mma.sync kernel has 8 warps that each re-read the whole Q and dO tiles with ldmatrix
// and is bound by shared-memory bandwidth and latency; wgmma reads a shared operand once per
// 64-row warpgroup and runs asynchronously, so the softmax work overlaps the tensor cores.
//
// CTA = (proxy group p, global key block g), 3 warpgroups:
//   WG0 (producer): K, V, Kp of the block once, then per step a gathered tile of 64 tokens into a
//     2-stage ring (cp.async with zero fill, completion signalled on the stage's `full` mbarrier
//     with cp.async.mbarrier.arrive.noinc; with token rows a head step's Q and dO come as one TMA
//     box per token instead, its bytes expected on the same barrier). Steps are (tile, head h of
//     the group) for the m heads, then one proxy step per tile that loads Qp into the same Q slot.
//   WG1, WG2 (consumers): WG w owns keys 64w..64w+63. Head step: S^T = K_w Q^T and
//     dP^T = V_w dO^T (SS), P^T and dS^T in registers, teacher sum += P^T (thread-private fp32
//     slots in shared memory), dV_w += P^T dO and dK_w += dS^T Q (RS, fp32 for the whole CTA in
//     registers), dS^T to a shared [128 keys][64 tok] tile, dQ[:, 64w..] = dS K (SS) -> staged
//     in the consumed stage's Q / dO slot, one bulk reduce-add (256 bytes) per token row.
//     Proxy step: S_p^T = Kp_w Qp^T, KL terms, dS_p^T = c (Qs - Tch), dkp share = dS_p^T Qp (RS,
//     two 64-column halves -> staged per WG and bulk reduce-added per key row in the fast form,
//     REDs in the deterministic ones), dqp = dS_p Kp via the shared dS tile -> staged as dQ.
//     Software pipelined by one product: step s+1's S^T (or S_p^T) is issued right behind step
//     s's dQ (dqp) and runs under step s's staging; the stage is released (empty) once the bulk
//     reduce-adds have read the staged rows (the per-head DET form, which stages nothing: as soon
//     as dV/dK (dkp) are done; KL_ONLY: as soon as the step's one product is done).
//   End: dK (times scale), dV to bf16 in dk/dv (SHARED_KV: added into dk_acc / dv_acc with 16-byte
//   fp32 REDs, or int64 fixed-point ones with DET); the block's KL share into kl_part in a fixed order.
// KL_ONLY (the forward's KL value, launch_kl_value in fused_backward.cu): only S^T, P^T, the
// teacher sum and the KL terms of the above, K, Kp and Q / Qp loaded, no atomics at all.
// DET (deterministic mode with top_k <= 32), per-head tiles: no dQ at all (the query-major
// dq_kernel computes it without atomics), so a head step neither writes the dS tile nor joins its
// two barriers; with token rows, or per-head with DQ_ROWS: dQ and dqp staged as int32 fixed point
// (see below the kernel's template comment). dqp (per-head form without DQ_ROWS) goes out as int64
// fixed-point atomics (integer adds commute: the sums do not depend on the atomics' order), dkp as
// fp32 partials with one writer per row (FoldArgs::dkp_per_head; int64 fixed point with token chunks
// or list pieces). dK, dV (owned) and the KL shares have a fixed order already; SHARED_KV's dK, dV
// (and every form's with chunks or pieces) go out as fixed point too (factors fx[1], fx[2]).
//
// Operand orientation (every tile bf16, 128-byte swizzle; key tiles are 64-column slabs of R rows x
// 128 B, token tiles [8-row group][slab][8 rows] as WgLayout says):
//   S^T, dP^T, S_p^T : A = K/V/Kp rows 64w.. (K-major), B = Q/dO/Qp (K-major)
//   dV, dK, dkp      : A = registers (P^T / dS^T), B = dO/Q/Qp [tok][D] (MN-major)
//   dQ, dqp          : A = dS^T tile [keys][tok] (MN-major), B = K/Kp [keys][D] columns 64w.. (MN-major)
#pragma once

#include <cuda/ptx>

#include "common/tma.cuh"
#include "common/wgmma.cuh"
#include "list_pieces.h"
#include "sm90/backward_kernels.cuh"

namespace flashmsa::cuda::bwd {

// Shared-memory plan. KL_ONLY (the forward's KL value, launch_kl_value): no V, dO, dS tile or
// teacher slots (its teacher sums live in registers), and the freed space goes to a deeper ring
// of token tiles: one step there is a single 64 x 64 x 128 product plus the softmax, too short
// to hide a gathered tile's load behind one step of lead. KL_ONLY = false is the plan the full
// backward always had (same offsets).
template <bool KL_ONLY>
struct WgLayout {
  static constexpr int kD = 128;
  static constexpr int kThreads = 384;        // producer WG + 2 consumer WGs
  static constexpr int kConsumers = 256;
  static constexpr int kStageLog = KL_ONLY ? 3 : 1;
  static constexpr int kStages = 1 << kStageLog;        // ring of token tiles (a power of two)
  static constexpr int kKeyTile = kBlk * kD * 2;        // [128][128] bf16: K, V, Kp
  static constexpr int kTokTile = kTileTok * kD * 2;    // [64][128] bf16: Q, dO, Qp
  static constexpr int kKeySlab = kBlk * 128;           // one 64-column slab of a key tile
  // A token tile is [8 groups][2 slabs][8 rows][128 B] (the KV-major forward's layout): 8 rows of
  // both 64-column slabs together, so that one TMA box brings a token's RM rows whole (token rows,
  // make_bf16_head_group_map). K-major: SBO = kTokGroup, slab 1 at + kTokSlabOff; MN-major: LBO =
  // kTokSlabOff, SBO = kTokGroup.
  static constexpr int kTokGroup = 2 * 8 * 128;         // from one 8-row group to the next
  static constexpr int kTokSlabOff = 8 * 128;           // from slab 0 to slab 1 of a group
  static constexpr int kDsTile = kBlk * kTileTok * 2;   // dS^T [128 keys][64 tok] bf16, one slab
  static constexpr int kTchBytes = kConsumers * 32 * 4; // 32 fp32 teacher sums per consumer thread
  // Byte offsets from the 1024-aligned base.
  static constexpr int oK = 0;
  static constexpr int oV = oK + kKeyTile;
  static constexpr int oKp = oV + (KL_ONLY ? 0 : kKeyTile);
  static constexpr int oQ = oKp + kKeyTile;            // kStages stages (Q, or Qp at a proxy step)
  static constexpr int odO = oQ + kStages * kTokTile;  // kStages stages
  static constexpr int odS = odO + (KL_ONLY ? 0 : kStages * kTokTile);
  static constexpr int oTch = odS + (KL_ONLY ? 0 : kDsTile);
  static constexpr int oMeta = oTch + (KL_ONLY ? 0 : kTchBytes);  // kStages x TokMeta
  static constexpr int oRed = oMeta + kStages * static_cast<int>(sizeof(TokMeta));  // [8] fp32 (64 B)
  static constexpr int oBar = oRed + 64;               // full[kStages], empty[kStages], kv_full
  // dQ / dqp staging of the full kernel (not KL_ONLY): a warpgroup's 64 token rows x 64 fp32
  // columns at a pitch of 272 bytes (a 256-byte pitch would put the 8 rows of a warp's float2
  // stores on the same 8 banks; 16 bytes of padding spread them over all 32, and every row start
  // stays 16-byte aligned, as the bulk reduce-add needs). Rows 0..59 lie in the consumed stage's
  // Q slot (WG 0) or dO slot (WG 1), rows 60..63 here.
  static constexpr int kStgPitch = 272;
  static constexpr int kStgInSlot = kTokTile / kStgPitch;  // 60
  static constexpr int kStgSpare = (kTileTok - kStgInSlot) * kStgPitch;
  static constexpr int oStgSpare = (oBar + (2 * kStages + 1) * 8 + 15) / 16 * 16;  // [2][4][272]
  // The int32 dq DET forms' per-row factors of each stage's rows ([kStages][64] fp32),
  // loaded with the stage (read by the full kernel's DET form only; last, so that the other
  // regions keep their offsets).
  static constexpr int oRowFx = oStgSpare + (KL_ONLY ? 0 : 2 * kStgSpare);
  static constexpr int kBytes = oRowFx + (KL_ONLY ? 0 : kStages * kTileTok * 4);
  static constexpr int kSmem = kBytes + 1024;          // + alignment slack of the dynamic base
};
using WgBwd = WgLayout<false>;
using WgKl = WgLayout<true>;
static_assert(WgBwd::kSmem <= 227 * 1024, "the wgmma backward must fit in one SM's shared memory");
static_assert(WgKl::kSmem <= 227 * 1024, "the KL-only kernel must fit in one SM's shared memory");
// The producer forms a row's swizzled 16-byte slots with XORs (cp_async_row_quarter_swizzled): every
// token row starts 128-byte aligned, given the kernel's 1024-aligned base (wb_smem_raw rounded up).
static_assert(WgBwd::oQ % 1024 == 0 && WgBwd::odO % 1024 == 0 && WgBwd::kTokTile % 1024 == 0 &&
                  WgKl::oQ % 1024 == 0 && WgKl::kTokTile % 1024 == 0,
              "token tiles must be 1024-byte aligned (the swizzle pattern of their TMA boxes and descriptors)");

// Named barriers of the two consumer warpgroups (0 is __syncthreads; the producer never joins).
constexpr int kBarDsFree = 1;   // both WGs finished the MMA that read the previous dS tile
constexpr int kBarDsReady = 2;  // both halves of the current dS tile are written and fenced
constexpr int kBarKl = 3;       // per-warp KL partials are in shared memory
constexpr int kBarStageDead = 4;  // both WGs' products that read the stage's Q / dO are done
constexpr int kBarStaged = 5;     // + cw: this WG's dQ rows are in its staging (128 threads); with
                                  // token rows: 5 both WGs' token regions, 6 + cw per-WG rows

template <int N>
__device__ __forceinline__ void wb_zero(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) d[i] = 0.f;
}

// acc_add_tile's fp32 path without its even/odd branches: the two lanes of a pair swap half
// their values (one shuffle each way), then every lane issues ONE predicated 16-byte RED
// (relaxed, gpu scope: what atomicAdd on a float4 compiles to) at a selected address. The
// branchy form diverges the warp into two passes per tile, and even a plain `if` around
// atomicAdd becomes a BSSY/BRA/BSYNC region; the predicate keeps the warp converged. Same
// atomics, same addresses, same values.
__device__ __forceinline__ void wb_red_tile(float* base, int64_t at_lo, int64_t at_hi, bool ok_lo, bool ok_hi,
                                            float x0, float x1, float y0, float y1, int c4) {
  const bool even = (c4 & 1) == 0;
  const float r0 = __shfl_xor_sync(0xffffffffu, even ? y0 : x0, 1);
  const float r1 = __shfl_xor_sync(0xffffffffu, even ? y1 : x1, 1);
  const float v0 = even ? x0 : r0, v1 = even ? x1 : r1, v2 = even ? r0 : y0, v3 = even ? r1 : y1;
  const float* dst = base + (even ? at_lo : at_hi - 2);
  const int ok = (even ? ok_lo : ok_hi) ? 1 : 0;
  asm volatile(
      "{\n.reg .pred q;\nsetp.ne.b32 q, %5, 0;\n"
      "@q red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n}\n" ::"l"(dst),
      "f"(v0), "f"(v1), "f"(v2), "f"(v3), "r"(ok)
      : "memory");
}

// wb_red_tile's deterministic form, acc_add_tile's fixed-point path: each value times fx (a
// power of two, fixed_point_kernel) rounded to int64 and added with a 64-bit integer RED, which
// is associative. 64-bit REDs have no vector form, so four per lane; predicated, as above, so the
// warp stays converged.
__device__ __forceinline__ void wb_fx_tile(void* base,  // int64 accumulator (as unsigned 64-bit)
                                           int64_t at_lo, int64_t at_hi, bool ok_lo, bool ok_hi, float x0,
                                           float x1, float y0, float y1, float fx) {
  unsigned long long* b = static_cast<unsigned long long*>(base);
  const long long v0 = __float2ll_rn(x0 * fx), v1 = __float2ll_rn(x1 * fx);
  const long long v2 = __float2ll_rn(y0 * fx), v3 = __float2ll_rn(y1 * fx);
  asm volatile(
      "{\n.reg .pred lo, hi;\nsetp.ne.b32 lo, %6, 0;\nsetp.ne.b32 hi, %7, 0;\n"
      "@lo red.relaxed.gpu.global.add.u64 [%0], %2;\n"
      "@lo red.relaxed.gpu.global.add.u64 [%0+8], %3;\n"
      "@hi red.relaxed.gpu.global.add.u64 [%1], %4;\n"
      "@hi red.relaxed.gpu.global.add.u64 [%1+8], %5;\n}\n" ::"l"(b + at_lo),
      "l"(b + at_hi), "l"(v0), "l"(v1), "l"(v2), "l"(v3), "r"(ok_lo ? 1 : 0), "r"(ok_hi ? 1 : 0)
      : "memory");
}

// One staged row (64 fp32 = 256 bytes) bulk reduce-added into dst when ok; a predicated
// instruction rather than a branch (see the call sites).
__device__ __forceinline__ void wb_bulk_reduce_if(bool ok, float* dst, uint32_t src_smem) {
  const uint64_t gaddr = static_cast<uint64_t>(__cvta_generic_to_global(dst));
  asm volatile(
      "{\n.reg .pred q;\nsetp.ne.b32 q, %2, 0;\n"
      "@q cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], 256;\n}\n" ::"l"(gaddr),
      "r"(src_smem), "r"(ok ? 1 : 0)
      : "memory");
}
// The same for a staged run of `bytes` (a multiple of 16) known only at run time.
__device__ __forceinline__ void wb_bulk_reduce_if(bool ok, float* dst, uint32_t src_smem, uint32_t bytes) {
  const uint64_t gaddr = static_cast<uint64_t>(__cvta_generic_to_global(dst));
  asm volatile(
      "{\n.reg .pred q;\nsetp.ne.b32 q, %2, 0;\n"
      "@q cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %3;\n}\n" ::"l"(gaddr),
      "r"(src_smem), "r"(ok ? 1 : 0), "r"(bytes)
      : "memory");
}

// The same, or (store) a plain bulk copy that overwrites dst: the own-block pass's first write of
// its rows (FoldArgs::own_pass). Two predicates, no branch (see wb_bulk_reduce_if's call sites).
__device__ __forceinline__ void wb_bulk_reduce_or_store_if(bool ok, bool store, float* dst, uint32_t src_smem,
                                                           uint32_t bytes) {
  const uint64_t gaddr = static_cast<uint64_t>(__cvta_generic_to_global(dst));
  asm volatile(
      "{\n.reg .pred q, w, a;\nsetp.ne.b32 q, %2, 0;\n"
      "setp.eq.and.b32 a, %3, 0, q;\nsetp.ne.and.b32 w, %3, 0, q;\n"
      "@a cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %4;\n"
      "@w cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %4;\n}\n" ::"l"(gaddr),
      "r"(src_smem), "r"(ok ? 1 : 0), "r"(store ? 1 : 0), "r"(bytes)
      : "memory");
}

// The same for int32 fixed-point rows (the token-row DET form's dq, dqp): integer adds commute, so
// the deterministic form's sums do not depend on the order.
__device__ __forceinline__ void wb_bulk_reduce_s32_if(bool ok, int* dst, uint32_t src_smem, uint32_t bytes) {
  const uint64_t gaddr = static_cast<uint64_t>(__cvta_generic_to_global(dst));
  asm volatile(
      "{\n.reg .pred q;\nsetp.ne.b32 q, %2, 0;\n"
      "@q cp.reduce.async.bulk.global.shared::cta.bulk_group.add.s32 [%0], [%1], %3;\n}\n" ::"l"(gaddr),
      "r"(src_smem), "r"(ok ? 1 : 0), "r"(bytes)
      : "memory");
}

// Token-row layout (RM > 0, see the kernel): a head step's 64 rows are 64/RM tokens x their RM
// heads, so the RM heads of a token are RM columns of S^T / P^T. The teacher sum of each (key,
// token) is complete within the step: this thread's partial sums over its columns, reduced over
// the quad's 4 lanes (reduce-scatter by shuffles: lane c4 ends with the tokens k = c4 mod 4), are
// stored into the [128 keys][64 tokens] fp32 teacher tile at column col0 + k, the column's bits 2..4
// XORed with the key row's low 3 bits (conflict-free stores of the 8 key rows of a warp).
__device__ __forceinline__ int teacher_col(int key, int col) { return col ^ ((key & 7) << 2); }

template <int RM>
__device__ __forceinline__ void store_token_teacher(float* tile, const float (&p)[32], int kr, int c4, int col0) {
  constexpr int NT = 64 / RM;  // tokens in this step
  float part[NT][2];
#pragma unroll
  for (int k = 0; k < NT; ++k) {
    part[k][0] = part[k][1] = 0.f;
#pragma unroll
    for (int j = k * RM / 8; j < (k + 1) * RM / 8; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r) part[k][r] += p[4 * j + 2 * r] + p[4 * j + 2 * r + 1];
  }
  const bool b1 = (c4 & 2) != 0, b0 = (c4 & 1) != 0;
  float kept[NT / 2][2];  // tokens with bit 1 = b1, as (4q + i) -> kept[2q + i]
#pragma unroll
  for (int q = 0; q < NT / 4; ++q)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float lo = part[4 * q + i][r], hi = part[4 * q + 2 + i][r];
        kept[2 * q + i][r] = (b1 ? hi : lo) + __shfl_xor_sync(0xffffffffu, b1 ? lo : hi, 2);
      }
#pragma unroll
  for (int q = 0; q < NT / 4; ++q)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float lo = kept[2 * q][r], hi = kept[2 * q + 1][r];
      const float sum = (b0 ? hi : lo) + __shfl_xor_sync(0xffffffffu, b0 ? lo : hi, 1);
      const int key = kr + 8 * r, col = col0 + 4 * q + c4;  // token 4q + c4 of the step
      tile[key * 64 + teacher_col(key, col)] = sum;
    }
}

// Stores a 64-key x 64-token dS^T accumulator (as its bf16 A fragments, a[kk] = columns
// 16kk..16kk+15) into rows r0.. of the shared [128][64] dS^T tile.
__device__ __forceinline__ void store_ds_frags(unsigned char* ds, const uint32_t (&a)[4][4], int r0, int c4) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int col = 8 * j + 2 * c4;
    *reinterpret_cast<uint32_t*>(ds + sw128_offset(r0, col, kBlk)) = a[j >> 1][(j & 1) * 2];
    *reinterpret_cast<uint32_t*>(ds + sw128_offset(r0 + 8, col, kBlk)) = a[j >> 1][(j & 1) * 2 + 1];
  }
}

// 64 x 64 (x K = 128) SS product with both operands K-major: acc = A rows . B rows^T.
// a_addr: the first of A's 64 rows in a tile of a_rows rows; b_addr: a 64-row token tile.
__device__ __forceinline__ void ss_kmajor_64x64(float (&acc)[32], uint32_t a_addr, int a_rows, uint32_t b_addr) {
#pragma unroll
  for (int ks = 0; ks < 8; ++ks)
    wgmma_ss_bf16<64, 0, 0>(acc, wgmma_desc_sw128(a_addr + (ks >> 2) * a_rows * 128 + (ks & 3) * 32),
                            wgmma_desc_sw128(b_addr + (ks >> 2) * WgBwd::kTokSlabOff + (ks & 3) * 32, WgBwd::kTokGroup),
                            ks > 0);
}

// 64 tokens x 64 columns (x K = 128 keys) = dS (the shared dS^T tile read MN-major) . the key
// tile's 64-column slab `slab` (MN-major).
__device__ __forceinline__ void ss_tokens_by_keys(float (&acc)[32], uint32_t ds_addr, uint32_t key_addr, int slab) {
#pragma unroll
  for (int ks = 0; ks < 8; ++ks)
    wgmma_ss_bf16<64, 1, 1>(acc, wgmma_desc_sw128_mn(ds_addr + ks * 16 * 128, WgBwd::kKeySlab),
                            wgmma_desc_sw128_mn(key_addr + slab * WgBwd::kKeySlab + ks * 16 * 128, WgBwd::kKeySlab),
                            ks > 0);
}

// KL_ONLY = false: the full backward described at the top. KL_ONLY = true: the forward's KL
// value alone (launch_kl_value): per head step only S^T and the teacher sum, per proxy step only
// the KL terms, then the block's share into kl_part; v, d_o, di, dq_acc, dk, dv and fa's dqp_acc,
// dkp_acc are not read (kl_grad and c_base only feed a dS that is discarded; launch_kl_value
// passes kl_grad = null). Its teacher sums stay in registers (no dK, dV there), its 8-stage
// ring covers the gathered loads, and it has a loop of its own: steps in pairs on two
// accumulators, each step's softmax under the next step's product, and no barrier between the
// two consumer warpgroups. The full kernel's loop is not entered (`!KL_ONLY &&` in its
// condition) and compiles to the same PTX as before the KL_ONLY loop existed (helpers factored
// out of that loop did not: inlining renumbered its registers).
// DET = true (deterministic mode, top_k <= 32), per-head tiles (RM = 0, without DQ_ROWS): the full
// backward without dQ (dq_acc is not read; the query-major dq_kernel writes dq), dqp as int64 fixed
// point (factor fx[3]), dkp as fp32 partials (fa.dkp_per_head) or int64 (fx[4]). Its head step retires dV / dK,
// releases the stage and issues the next step's S^T at the same single call site as the full
// kernel, with nothing to wait for behind it.
// DQ_ROWS (DET, RM = 0 only; the per-head shapes' default, not with FLASHMSA_DET_DQ=query): the
// per-head DET form computes dQ and dqp as the token-row DET form below does, in the per-head tiles'
// staging.
// DET with token rows (RM > 0) computes dQ and dqp as the fast form does, times int32 fixed-point
// factors (dQ: each row's own, fa.row_fx, loaded with the stage; dqp: fx[6]), and stages them as
// int32 in the fast form's layout (each token's RM dQ rows one bulk reduce-add, .add.s32, dqp per
// row) into dq_acc / dqp_acc read as int32: the fast form's bytes.
// SHARED_KV = true (G = Hp/Hkv > 1 groups per kv head): the same loop; the epilogue adds dK, dV
// into dk_acc / dv_acc instead of storing them. A template flag, not a runtime branch: the G = 1
// instantiations run at the 240-register limit and must compile exactly as before. KL_ONLY needs
// no flag (it writes no dk/dv; only the kv head it loads K from depends on G).
template <bool KL_ONLY, bool DET = false, bool SHARED_KV = false, int RM = 0, bool DQ_ROWS = false>
__global__ void __launch_bounds__(WgBwd::kThreads, 1) attn_bwd_wgmma_kernel(
    const bf16* __restrict__ q,    // [T, H, 128]
    const bf16* __restrict__ k,    // [T, Hkv, 128]
    const bf16* __restrict__ v,    // [T, Hkv, 128]
    const bf16* __restrict__ d_o,  // [T, H, 128]
    const float* __restrict__ lse, // [H, T]
    const float* __restrict__ di,  // [T, H] rowsum(dO * O)
    Index ix, int H, int Hkv, int Hp, float scale,
    float* __restrict__ dq_acc,    // [T, H, 128] fp32; DET: int32 (same layout) with RM > 0 or DQ_ROWS, else unused
    bf16* __restrict__ dk,         // [T, Hkv, 128] (owned: the CTA is its rows' only writer; else dk_acc)
    bf16* __restrict__ dv,         // [T, Hkv, 128]
    FoldArgs fa,                   // with DET, dqp_acc is int64 (RM > 0, DQ_ROWS: int32), dkp_acc int64 or fp32 partials
    const float* __restrict__ fx,  // [7] fixed-point factors (fixed_point_kernel), read only with DET
    void* __restrict__ dk_acc,     // [T, Hkv, 128] fp32 (int64 with DET): SHARED_KV, token chunks, list pieces
    void* __restrict__ dv_acc,     // [T, Hkv, 128] fp32 (int64 with DET): as dk_acc
    // RM > 0: q and d_o as make_bf16_head_group_map(.., RM / 8) (a box = one token's RM rows of
    // the group); unused otherwise.
    const __grid_constant__ CUtensorMap q_rows_map, const __grid_constant__ CUtensorMap do_rows_map) {
  static_assert(!(KL_ONLY && DET), "the KL value has no gradients to make deterministic");
  static_assert(!(KL_ONLY && SHARED_KV), "the KL value writes no dk/dv: one KL_ONLY form serves every G");
  static_assert(RM == 0 || (!KL_ONLY && !SHARED_KV && (RM == 8 || RM == 16)),
                "token rows: the G = 1 forms (fast, DET), groups of 8 or 16 heads (H / Hp == RM)");
  static_assert(!DQ_ROWS || (DET && RM == 0), "DQ_ROWS: the per-head DET form with the int32 dQ");
  // The DET forms that compute dQ here (int32 fixed point, staged as the fast form's rows): token
  // rows, and the per-head form with DQ_ROWS. The per-head DET form without it leaves dQ to the
  // query-major dq_kernel and sends dqp out as int64 atomics.
  constexpr bool kDetNoDq = DET && RM == 0 && !DQ_ROWS;
  using L = WgLayout<KL_ONLY>;
  constexpr int D = L::kD;
  extern __shared__ __align__(16) unsigned char wb_smem_raw[];
  // The 128-byte swizzle and the wgmma descriptors need 1024-byte aligned tiles. The base is
  // moved by an offset from the shared array (not rebuilt from an integer), so the compiler
  // still knows every pointer below is shared memory and emits LDS/STS: through a uintptr_t
  // round trip it used generic LD/ST with 64-bit addresses for the teacher sums, the metadata
  // and the dS tile (slower, and two registers per address).
  unsigned char* smem = wb_smem_raw + ((1024u - (smem_u32(wb_smem_raw) & 1023u)) & 1023u);
  unsigned char* sK = smem + L::oK;     // [128][128] slab layout
  unsigned char* sV = smem + L::oV;     // [128][128] (not with KL_ONLY)
  unsigned char* sKp = smem + L::oKp;   // [128][128]
  unsigned char* sQ = smem + L::oQ;     // kStages x [64][128]: Q of the step's head, or Qp
  unsigned char* sdO = smem + L::odO;   // 2 x [64][128] (not with KL_ONLY, as the two below)
  unsigned char* sdS = smem + L::odS;   // [128 keys][64 tok] dS^T (or dS_p^T)
  float4* sTch = reinterpret_cast<float4*>(smem + L::oTch);     // [8][256] float4 teacher sums
  TokMeta* meta = reinterpret_cast<TokMeta*>(smem + L::oMeta);  // kStages; lse = student lse at proxy steps
  float* row_fx_s = reinterpret_cast<float*>(smem + L::oRowFx);  // DET with RM > 0 or DQ_ROWS: [kStages][64]
  float* sRed = reinterpret_cast<float*>(smem + L::oRed);       // [8]
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::oBar);  // [kStages]
  uint64_t* empty = full + L::kStages;                           // [kStages]
  uint64_t* kv_full = full + 2 * L::kStages;                     // [1]

  // Same grid order as attn_bwd_kernel: proxy group fastest (here one segment = one group), so
  // the G groups of one kv head and key block (SHARED_KV) are neighbours in the grid.
  // The G = 1 forms sweep the key blocks S = fa.sweep_groups proxy groups at a time (FoldArgs):
  // blockIdx.x = g S + p % S, blockIdx.y = p / S; S = Hp (one row) is block-major, the only order
  // of the SHARED_KV and KL_ONLY forms. One division, by S as before by Hp. (The sweep builds'
  // 1.0-1.5 ms loss in block-major order came from the producer's chain, not from this mapping: on
  // the lean producer this form in block-major order runs as fast as without it; perf-notes.) The
  // waves of fa.wave_ctas count along x: the host keeps block-major order (one row) when it sets them.
  constexpr bool kSweep = !SHARED_KV && !KL_ONLY;
  // Token chunks (the token-row forms, fa.n_chunks > 0): the grid's key-block index runs over
  // (chunk, block) pairs, chunk slower, and the CTA takes the part of its block's list whose tokens
  // lie in the chunk (fa.chunk_bounds); dK / dV then leave as partial sums (dk_acc / dv_acc: fp32,
  // int64 fixed point with DET).
  constexpr bool kChunkable = kSweep && RM > 0;
  const int S = kSweep ? fa.sweep_groups : Hp;
  const int gx = blockIdx.x / S, p = (kSweep ? static_cast<int>(blockIdx.y) * S : 0) + blockIdx.x % S;
  // List pieces (FoldArgs::pieces, a cap of fa.piece_cap tokens), every form: the first
  // fa.piece_stride CTAs of each group's grid range take the overflow table's pieces (every piece of
  // the parts longer than the cap); the others are the usual (chunk, block) CTAs, which take their
  // part when it is not cut. The overflow record is addressed from %ctaid through an opaque move each
  // time: the producer loads its range again after its register drop rather than carry it from here
  // (on 24 registers, carried, it spilled in four forms).
  const bool pieces = fa.pieces != nullptr;
  auto overflow_record = [&]() -> const int* {  // null: a main CTA
    unsigned cx, cy;
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(cx));
    asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(cy));
    const int s_ = kSweep ? fa.sweep_groups : Hp;
    const int p_ = (kSweep ? static_cast<int>(cy) * s_ : 0) + static_cast<int>(cx % s_);
    const int r_ = static_cast<int>(cx / s_);
    return r_ < fa.piece_stride
               ? reinterpret_cast<const int*>(fa.pieces + static_cast<int64_t>(p_) * fa.piece_stride + r_)
               : nullptr;
  };
  const bool over = pieces && gx < fa.piece_stride;
  int4 piece = make_int4(0, 0, 0, 0);  // {g, begin, end}
  if (over) {
    const int* at = overflow_record();
    piece = make_int4(__ldg(at), __ldg(at + 1), __ldg(at + 2), 0);
    if (piece.y >= piece.z) return;  // CTA-uniform: a slot past the group's overflow pieces
  }
  const int gm = gx - (pieces ? fa.piece_stride : 0);  // the main CTAs' index
  const int chunk = kChunkable && fa.n_chunks > 0 && !over ? gm / ix.NB : 0;
  // g_grid: the grid's key block (a function of the CTA index, free to recompute after the loop).
  const int g_grid = gm - chunk * ix.NB, g = over ? piece.x : g_grid;
  const int m = H / Hp;
  if (RM > 0 && m != RM) __trap();  // token rows assume groups of exactly RM heads (host-checked)
  // Group p's heads p*m.. lie in kv head p*m / (H/Hkv) = p / G. The G = 1 backward keeps the
  // literal p (its code unchanged). The producer's copy only: the consumers of SHARED_KV work it
  // out again after their loop.
  const int kvh = (KL_ONLY || SHARED_KV) ? p / (Hp / Hkv) : p;
  const int pk = p / (Hp / fa.Hpk);
  BlockCtx bc = block_ctx(ix, p, g);
  if (over) {
    bc.begin = piece.y;
    bc.end = piece.z;
  } else if constexpr (kChunkable) {
    if (fa.n_chunks > 0) {
      const int64_t list = static_cast<int64_t>(p) * ix.NB + g;
      if (fa.own_pass) {
        bc.end = __ldg(fa.own_end + list);  // the list's own entries (grid x without chunks: chunk 0)
      } else {
        const int32_t* cb = fa.chunk_bounds + list * (fa.n_chunks + 1) + chunk;
        bc.begin = __ldg(cb);
        bc.end = __ldg(cb + 1);
        if (fa.own_end) bc.begin = max(bc.begin, __ldg(fa.own_end + list));  // the own pass took those
      }
      if (bc.begin >= bc.end) return;  // CTA-uniform; the accumulators are zeroed, kl_part too
    }
  }
  // A main CTA whose part the pieces cut leaves all of it to the overflow CTAs (CTA-uniform; its KL share
  // slot is zeroed, dK / dV go through the accumulators with pieces).
  if (pieces && !over && list_part_cut(bc.end - bc.begin, fa.piece_cap)) return;
  const int ntiles = (bc.end - bc.begin + kTileTok - 1) / kTileTok;
  const int steps = ntiles * (m + 1);

  if (threadIdx.x == 0) {
    // full: 128 cp.async arrivals (noinc) + 128 plain arrivals that release the st.shared
    // metadata; empty: every consumer thread.
    for (int s = 0; s < L::kStages; ++s) {
      ::cuda::ptx::mbarrier_init(full + s, 256);
      ::cuda::ptx::mbarrier_init(empty + s, L::kConsumers);
    }
    ::cuda::ptx::mbarrier_init(kv_full, 128);
    ::cuda::ptx::fence_mbarrier_init(::cuda::ptx::sem_release, ::cuda::ptx::scope_cluster);
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    // ------------------------------------------------------------------ producer
    setmaxnreg_dec<24>();
    if (steps == 0) return;
    if (pieces) {
      if (const int* at = overflow_record()) {
        bc.begin = __ldg(at + 1);
        bc.end = __ldg(at + 2);
      }
    }
    const int pt = threadIdx.x;
    // Keys past the sequence end are zero-filled (they belong to another sequence or lie past T).
    {
      const int c = pt & 15;  // chunk c of rows pt/16, pt/16 + 8, ... of each key tile
      for (int rr = pt >> 4; rr < kBlk; rr += 8) {
        const int key = bc.key0 + rr;
        const bool ok = key < bc.seq_len;
        const int64_t row = ok ? bc.seq_start + key : 0;
        const uint32_t off = rr * 128 + (c >> 3) * L::kKeySlab + (((c & 7) ^ (rr & 7)) << 4);
        // The heads as unsigned: no sign word to keep beside them in the 24 registers.
        const int64_t at_k = (row * Hkv + static_cast<uint32_t>(kvh)) * D + 8 * c;
        cp_async_16(smem_u32(sK + off), k + at_k, ok);
        if constexpr (!KL_ONLY) cp_async_16(smem_u32(sV + off), v + at_k, ok);
        cp_async_16(smem_u32(sKp + off), fa.kp + (row * fa.Hpk + static_cast<uint32_t>(pk)) * D + 8 * c, ok);
      }
    }
    cp_async_mbar_arrive_noinc(kv_full);

    // Each token row has an OWNER pair of threads, row = pt / 2 (its token, lse / aux / tok / tpos),
    // and is COPIED by a quad: lane 4 qd + qi of warp w copies chunks 4 n + qi of rows
    // ra = 16 w + qd and ra + 8 (cp_async_row_quarter_swizzled, both slabs), whose tokens come from
    // their owners, lanes 2 qd and 2 qd + 16, by shuffles. Kept lean: the producer runs on 24
    // registers (setmaxnreg), so the tile and head are counted rather than divided out, and the
    // token index is read once per tile (token rows: once per step, each step has other tokens).
    const int row = pt >> 1, sub = pt & 1;
    const int qd = (pt & 31) >> 2, qi = pt & 3;
    const int ra = (pt >> 5) * 16 + qd;  // and ra + 8: both rows have swizzle key qd
    // Row ra = 16 w + qd lies in group 2 w, row ra + 8 in group 2 w + 1 (kTokGroup on).
    const uint32_t q_dst = smem_u32(sQ) + (ra >> 3) * L::kTokGroup + (ra & 7) * 128 + ((qd ^ qi) << 4);
    constexpr uint32_t kDoOff = L::odO - L::oQ;                        // dO's rows, a multiple of 128 on
    int t = -1, i0 = bc.begin, hi = 0;
    // Token rows: head step hi holds tokens i0 + hi * 64/RM + (row / RM), all RM heads each; the
    // group's proxy step its 64 tokens, one per row. Each step has other tokens, so the next
    // step's index is loaded while this thread waits for the stage (t_next).
    constexpr int kR = RM > 0 ? RM : 1;
    // The list is walked from its end (descending t). In the dense warm-up every list ends at the
    // sequence end, so the CTAs of a wave start on the same token tiles and move down together:
    // their Q / dO gathers and dQ rows are shared in L2 (ncu, m3/16k: DRAM 70 -> 44 GB, -1.2 ms).
    // The next wave's CTAs start one by one as that front passes their predecessors' list starts
    // (128 g): walked ASCENDING from their own start 128 g', they all sit on one rising front
    // (a CTA started when the front was at 128 (w - k) begins at 128 (w + 1 + k): position = time
    // + a constant, the same for all), and they end together at the sequence end, so the wave
    // after starts at once and descends again. fa.wave_ctas = 0 (sparse lists): descending.
    // One register for either direction (the producer runs on 24): entry |flip - li| is li
    // ascending (flip 0) and bc.begin + bc.end - 1 - li descending.
    const int flip = fa.wave_ctas > 0 && (blockIdx.x / fa.wave_ctas) % 2 == 1 ? 0 : bc.begin + bc.end - 1;
    auto list_token = [&](int li) { return ix.token_of(__ldg(ix.vals + abs(flip - li))); };
    auto token_of_step = [&](int hi_, int i0_) {
      const int li = hi_ < m ? i0_ + hi_ * (kTileTok / kR) + row / kR : i0_ + row;
      return li < bc.end ? list_token(li) : -1;
    };
    int t_next = RM > 0 ? token_of_step(0, i0) : -1;
    // Token rows: before a proxy step's wait, the copy rows' tokens are shuffled from their owners,
    // so that little more than the address math and the copies follow the wait (the consumers wait
    // on this chain).
    auto quad_tokens = [&](int t_, int& ta_, int& tb_) {
      ta_ = __shfl_sync(0xffffffffu, t_, 2 * qd);
      tb_ = __shfl_sync(0xffffffffu, t_, 2 * qd + 16);
    };
    // Element offset of copy row r's (token t_) first chunk at step hi_ (RM > 0: head p m + r % RM).
    auto quad_offset = [&](int t_, int hi_, int r) {
      const int64_t tt_ = t_ >= 0 ? t_ : 0;
      return (hi_ < m ? tt_ * H + p * m + (RM > 0 ? r % kR : hi_) : tt_ * Hp + p) * D + 8 * qi;
    };
    int ta = -1, tb = -1;  // token rows: set before each proxy step only (head steps use TMA boxes)
    for (int s = 0; s < steps; ++s) {
      const int st = s & (L::kStages - 1);
      if (s >= L::kStages) mbarrier_wait(empty + st, ((s >> L::kStageLog) - 1) & 1);
      if constexpr (RM > 0) {
        t = t_next;
      } else {
        if (hi == 0) {
          t = row < min(kTileTok, bc.end - i0) ? list_token(i0 + row) : -1;
          quad_tokens(t, ta, tb);
        }
      }
      const bool ok = t >= 0;
      const int64_t tt = ok ? t : 0;
      TokMeta& tm = meta[st];
      // The stages and slabs are multiples of 128 bytes from the 1024-aligned base, so the swizzled
      // slots of the thread's chunks follow from its first by XORs (cp_async_row_quarter_swizzled),
      // and dO's rows lie kDoOff on (the same XORs hold there).
      const uint32_t qs = q_dst + st * L::kTokTile;
      // Row ra's copies, then row ra + 8's: one source offset live at a time (24 registers).
      if (hi < m) {
        const int h = p * m + (RM > 0 ? row % kR : hi);
        if constexpr (RM > 0) {
          // Token rows: the owner of a token's first row brings the token's RM rows of Q and of dO,
          // one TMA box each (rows row .. row + RM - 1 = RM / 8 whole groups, RM * 256 bytes); a
          // row past the list's end reads token T, past the map: zeros, as the copies' zero fill.
          if (sub == 0 && row % kR == 0) {
            const int tc = ok ? t : static_cast<int>(ix.T);
            // Expected bytes without an arrival: this thread arrives below, as the count expects.
            ::cuda::ptx::mbarrier_expect_tx(::cuda::ptx::sem_relaxed, ::cuda::ptx::scope_cta, ::cuda::ptx::space_shared,
                                            full + st, 2 * kR * D * 2);
            unsigned char* const dst = sQ + st * L::kTokTile + row * 256;  // dO's rows kDoOff on
            tma_load_5d(dst, &q_rows_map, 0, 0, 0, p * kR / 8, tc, full + st);
            tma_load_5d(dst + kDoOff, &do_rows_map, 0, 0, 0, p * kR / 8, tc, full + st);
          }
        } else {
          const int64_t at_a = quad_offset(ta, hi, ra);
          cp_async_row_quarter_swizzled<L::kTokSlabOff>(qs, q + at_a, ta >= 0);
          if constexpr (!KL_ONLY) cp_async_row_quarter_swizzled<L::kTokSlabOff>(qs + kDoOff, d_o + at_a, ta >= 0);
          const int64_t at_b = quad_offset(tb, hi, ra + 8);
          cp_async_row_quarter_swizzled<L::kTokSlabOff>(qs + L::kTokGroup, q + at_b, tb >= 0);
          if constexpr (!KL_ONLY) cp_async_row_quarter_swizzled<L::kTokSlabOff>(qs + kDoOff + L::kTokGroup, d_o + at_b, tb >= 0);
        }
        if (sub == 0) cp_async_4(smem_u32(&tm.lse[row]), lse + static_cast<int64_t>(h) * ix.T + tt, ok);
        else if constexpr (!KL_ONLY) cp_async_4(smem_u32(&tm.aux[row]), di + tt * H + h, ok);
        if constexpr (DET && !kDetNoDq) {
          if (sub == 1) cp_async_4(smem_u32(row_fx_s + st * kTileTok + row), fa.row_fx + tt * H + h, ok);
        }
      } else {
        cp_async_row_quarter_swizzled<L::kTokSlabOff>(qs, fa.qp + quad_offset(ta, hi, ra), ta >= 0);
        cp_async_row_quarter_swizzled<L::kTokSlabOff>(qs + L::kTokGroup, fa.qp + quad_offset(tb, hi, ra + 8), tb >= 0);
        if (sub == 0) cp_async_4(smem_u32(&tm.lse[row]), fa.lse_s + static_cast<int64_t>(p) * ix.T + tt, ok);
      }
      if (sub == 0) {
        tm.tok[row] = t;
        tm.tpos[row] = ok ? static_cast<int>(t - bc.seq_start) : -1;
      }
      cp_async_mbar_arrive_noinc(full + st);
      ::cuda::ptx::mbarrier_arrive(full + st);  // release: the st.shared metadata above
      if (++hi == m + 1) {
        hi = 0;
        i0 += kTileTok;
      }
      if constexpr (RM > 0) {
        t_next = s + 1 < steps ? token_of_step(hi, i0) : -1;
        // Only a proxy step copies by quads. hi is warp-uniform, so the shuffles stay full-warp;
        // at head steps the index load then overlaps the empty wait instead of stalling a shuffle.
        if (hi == m) quad_tokens(t_next, ta, tb);
      }
    }
    // The copies arrive on full / kv_full, which the consumers wait for before the CTA can exit,
    // so nothing depends on this wait; by the PTX rules it waits for no copy (the producer commits
    // no cp.async group). Kept as it is, since it was tested so (removing it changes the SASS).
    cp_async_wait<0>();
    return;
  }

  // -------------------------------------------------------------------- consumers
  setmaxnreg_inc<240>();
  const int ct = threadIdx.x - 128;               // 0..255
  const int cw = wg - 1;                          // this WG's keys: 64cw..64cw+63
  const int wi = (ct >> 5) & 3, lane = ct & 31, g4 = lane >> 2, c4 = lane & 3;
  const int kr = 64 * cw + 16 * wi + g4;          // this thread's key rows kr, kr + 8 (in the block)
  const float scale2 = scale * kLog2e;
  const float c_kl = fa.c_base * (fa.kl_grad ? __ldg(fa.kl_grad) : 1.f);
  const float inv_m = 1.f / static_cast<float>(m);
  // True when every row of a step's tile sees every key of the block, so the causal mask can be
  // skipped: no padding row (tpos -1) and no token inside the block. A tile's rows are
  // consecutive list entries, so their positions are monotonic in the row (walked either way)
  // and the first and last rows bound them. Warp-uniform; true for most steps (only the own
  // block's tiles and the lists' partial last tiles are masked).
  auto all_keys_visible = [&](const TokMeta& tm_) {
    return min(tm_.tpos[0], tm_.tpos[kTileTok - 1]) >= bc.key0 + kBlk - 1;
  };
  const uint32_t k_base = smem_u32(sK), v_base = smem_u32(sV), kp_base = smem_u32(sKp);
  const uint32_t ds_base = smem_u32(sdS);

  float dK[64], dV[64];
  wb_zero(dK);
  wb_zero(dV);
  float kl = 0.f;
  float4* slots = sTch + ct;  // thread-private: slot j at slots[j * 256]
  float* const tch_tile = reinterpret_cast<float*>(sTch);  // RM > 0: [128 keys][64 tokens], teacher_col
  if constexpr (!KL_ONLY && RM == 0) {
#pragma unroll
    for (int j = 0; j < 8; ++j) slots[j * L::kConsumers] = make_float4(0.f, 0.f, 0.f, 0.f);
  }

  // The first product of step s (S^T = K_w Q^T at a head step, S_p^T = Kp_w Qp^T at a proxy
  // step: the same 64 x 64 x 128 SS shape on the stage's token tile) into s1. Issued at the END
  // of step s-1, right after its dQ / dqp product: it then runs on the tensor cores under step
  // s-1's atomics (both warpgroups reach that phase together, so without it the tensor cores
  // idle through every atomics phase). One call site in the loop, unconditional (a first
  // version with a conditional copy in each branch got s1 two register sets and ptxas
  // serialised every wgmma of the kernel, C7515): after the last step it runs once on a stale
  // stage (nothing writes it any more) and the result is dropped; only the barrier wait is
  // skipped there. Check `-Xptxas -v` for C75xx "wgmma ... serialized" after any change here.
  float s1[32];
  auto wait_full = [&](int s) {
    if (s < steps) mbarrier_wait(full + (s & (L::kStages - 1)), (s >> L::kStageLog) & 1);
    fence_proxy_async_shared();  // the stage was written by cp.async (generic proxy); wgmma reads it
  };
  // head_step: s % (m + 1) < m (a runtime division; the main loop passes its step counter's).
  auto issue_as = [&](float (&acc)[32], int s, bool head_step) {
    const int st = s & (L::kStages - 1);
    wgmma_fence();
    ss_kmajor_64x64(acc, (head_step ? k_base : kp_base) + 64 * cw * 128, kBlk, smem_u32(sQ + st * L::kTokTile));
    wgmma_commit();
  };
  auto issue_into = [&](float (&acc)[32], int s) { issue_as(acc, s, s % (m + 1) < m); };

  if (steps > 0) {
    mbarrier_wait(kv_full, 0);
    fence_proxy_async_shared();
    wait_full(0);
    issue_into(s1, 0);
  }

  if constexpr (KL_ONLY) {
    // The forward's KL value: per head step S^T, P^T and the teacher sum (in registers), per
    // proxy step the KL terms; no barrier between the warpgroups. Steps go in pairs on two
    // accumulators (s1: step s, issued before the loop or at the end of the previous iteration
    // and retired by the wait<0>; s2: step s + 1), so each step's softmax runs under the next
    // step's product, and a step's stage goes back to the producer as soon as its product is
    // done (its metadata kept in registers). Measured against the single-product loop (H200, one
    // call, perf-notes): forward + KL value -0.1 to -0.26 ms at m3/64k (24.7-24.8 ms); the pairs
    // without the early release, or the early release without the pairs, were ~1 ms slower.
    // Both issue sites are unconditional (stale stages past the last step, results dropped): a
    // conditional copy got ptxas to serialise the wgmmas elsewhere in this kernel (C7515).
    float tch[32];  // the teacher sums of the tile's keys x tokens, over its m head steps
    wb_zero(tch);
    float s2[32];
    // A step's metadata (key limits, lse) in registers; its stage is released with it.
    struct StepMeta {
      int tpos[16];
      float ls[16];
    };
    auto take_stage = [&](StepMeta& sm, int s) {
      const TokMeta& tm = meta[s & (L::kStages - 1)];  // its full barrier was waited for before the product
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = 8 * j + 2 * c4;
        const int2 tp = *reinterpret_cast<const int2*>(&tm.tpos[col]);
        const float2 ls = *reinterpret_cast<const float2*>(&tm.lse[col]);
        sm.tpos[2 * j] = tp.x;
        sm.tpos[2 * j + 1] = tp.y;
        sm.ls[2 * j] = ls.x;
        sm.ls[2 * j + 1] = ls.y;
      }
      if (s < steps) ::cuda::ptx::mbarrier_arrive(empty + (s & (L::kStages - 1)));
    };
    auto kl_step = [&](float (&acc)[32], const StepMeta& sm, int s) {
      if (s % (m + 1) < m) {
        // Head step: the teacher sum += P^T of this head (lse: the main attention's).
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = bc.key0 + kr + 8 * (e >> 1);
            if (key <= sm.tpos[2 * j + (e & 1)])
              tch[4 * j + e] += fast_exp2(fmaf(acc[4 * j + e], scale2, -sm.ls[2 * j + (e & 1)] * kLog2e));
          }
      } else {
        // Proxy step: KL terms Tch (log Tch - log Qs) over the tile's visible keys (lse: the
        // student's), then the sums restart for the next tile.
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = bc.key0 + kr + 8 * (e >> 1);
            const float te = tch[4 * j + e] * inv_m;
            if (key <= sm.tpos[2 * j + (e & 1)] && te > 0.f)
              kl += te * (__logf(te) - (acc[4 * j + e] * fa.scale_p - sm.ls[2 * j + (e & 1)]));
            tch[4 * j + e] = 0.f;
          }
      }
    };
    StepMeta ma, mb;
    for (int s = 0; s < steps; s += 2) {
      wgmma_wait<0>();
      wgmma_fence_operands(s1);
      take_stage(ma, s);
      wait_full(s + 1);
      issue_into(s2, s + 1);
      kl_step(s1, ma, s);
      wait_full(s + 2);
      issue_into(s1, s + 2);
      wgmma_wait<1>();
      wgmma_fence_operands(s2);
      take_stage(mb, s + 1);
      if (s + 1 < steps) kl_step(s2, mb, s + 1);
    }
  }
  // hi = s % (m + 1), counted rather than divided (a runtime m: ~2.5% of the consumers' stall
  // samples sat on the division at fm16k, bench/results/h200_f5a6881_fm16k_bwd_regions.md).
  for (int s = 0, hi = 0; !KL_ONLY && s < steps; ++s, hi = hi == m ? 0 : hi + 1) {
    const int st = s & (L::kStages - 1);
    const bool head = hi < m;
    const TokMeta& tm = meta[st];  // the full barrier of stage st was waited in wait_full(s)
    const uint32_t q_st = smem_u32(sQ + st * L::kTokTile);
    const int trow = 16 * wi + g4;  // this thread's token rows of dQ / dqp: trow, trow + 8
    int t_lo = -1, t_hi = -1;  // per-head DET form: this thread's dqp rows (proxy steps)

    if (head) {
      // ---------------------------------------------------------- head step
      const uint32_t do_st = smem_u32(sdO + st * L::kTokTile);
      // S^T (issued under the previous step's atomics, normally finished by now) is retired
      // BEFORE dP^T is issued: a wait<1> here, with S^T's group coming in over the loop's back
      // edge, is more than ptxas can track, and it then serialises every wgmma (C7514).
      wgmma_wait<0>();
      wgmma_fence_operands(s1);
      float dpT[32];
      wgmma_fence();
      ss_kmajor_64x64(dpT, v_base + 64 * cw * 128, kBlk, do_st);
      wgmma_commit();
      // P^T while dP^T is still on the tensor cores; the mask's loads and selects only where
      // a key may be hidden.
      auto p_from_s = [&](auto masked) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int col = 8 * j + 2 * c4;
          const float2 ls = *reinterpret_cast<const float2*>(&tm.lse[col]);
          const float nl[2] = {-ls.x * kLog2e, -ls.y * kLog2e};
          int tpv[2] = {0, 0};
          if constexpr (decltype(masked)::value) {
            const int2 tp = *reinterpret_cast<const int2*>(&tm.tpos[col]);
            tpv[0] = tp.x;
            tpv[1] = tp.y;
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float pe = fast_exp2(fmaf(s1[4 * j + e], scale2, nl[e & 1]));
            if constexpr (decltype(masked)::value) {
              const int key = bc.key0 + kr + 8 * (e >> 1);
              s1[4 * j + e] = key <= tpv[e & 1] ? pe : 0.f;
            } else {
              s1[4 * j + e] = pe;
            }
          }
        }
      };
      if (all_keys_visible(tm)) p_from_s(std::false_type{});
      else p_from_s(std::true_type{});
      // Teacher sums (thread-private, no barrier), zeroed by the tile's proxy step. Shared memory,
      // not registers: 32 more live registers here (dK, dV, P^T, dP^T in flight) spill (KL_ONLY,
      // which has none of those, keeps them in registers).
      if constexpr (RM > 0) {
        // Token rows: this step's tokens' teacher sums are complete (all RM heads are columns
        // here); written once into the group's teacher tile, read by its proxy step.
        store_token_teacher<RM>(tch_tile, s1, kr, c4, hi * (kTileTok / RM));
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          float4 a = slots[j * L::kConsumers];
          a.x += s1[4 * j];
          a.y += s1[4 * j + 1];
          a.z += s1[4 * j + 2];
          a.w += s1[4 * j + 3];
          slots[j * L::kConsumers] = a;
        }
      }
      wgmma_wait<0>();
      wgmma_fence_operands(dpT);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 ax = *reinterpret_cast<const float2*>(&tm.aux[8 * j + 2 * c4]);
        const float axv[2] = {ax.x, ax.y};
#pragma unroll
        for (int e = 0; e < 4; ++e) dpT[4 * j + e] = s1[4 * j + e] * (dpT[4 * j + e] - axv[e & 1]);
      }
      // Packed only now: P^T and dS^T in fp32 and bf16 at once would cost 32 more registers.
      uint32_t pa[4][4], da[4][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        acc_to_a_frag(pa[kk], s1 + 8 * kk);
        acc_to_a_frag(da[kk], dpT + 8 * kk);
      }

      // dV_w += P^T dO, dK_w += dS^T Q (k = the tile's 64 tokens).
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_rs_bf16<128, 1>(dV, pa[kk], wgmma_desc_sw128_mn(do_st + kk * 2 * L::kTokGroup, L::kTokSlabOff, L::kTokGroup), 1);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_rs_bf16<128, 1>(dK, da[kk], wgmma_desc_sw128_mn(q_st + kk * 2 * L::kTokGroup, L::kTokSlabOff, L::kTokGroup), 1);
      wgmma_commit();

      if constexpr (!kDetNoDq) {
        // dS^T into the shared tile for dQ, which needs all 128 keys (both WGs' halves). DsFree:
        // each WG waited for its previous dQ / dqp product before staging its rows.
        bar_sync(kBarDsFree, L::kConsumers);
        store_ds_frags(sdS, da, kr, c4);
        fence_proxy_async_shared();
        bar_sync(kBarDsReady, L::kConsumers);
      }
      // dV, dK done before dQ is issued: then P^T / dS^T (their register A operands) are free
      // while dQ and the next step's S^T are in flight (all of them at once would not fit in
      // 240 registers). They were issued before the two barriers, so this rarely waits long.
      // DET: here too, before the next step's S^T (dV / dK kept in flight under it instead,
      // retired in the loop's tail, made ptxas serialise the wgmmas: C7515).
      wgmma_wait<0>();
      wgmma_fence_operands(dK);
      wgmma_fence_operands(dV);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        wgmma_fence_operands(pa[kk]);
        wgmma_fence_operands(da[kk]);
      }
    } else {
      // ---------------------------------------------------------- proxy step (Qp in the Q slot)
      wgmma_wait<0>();  // S_p^T (issued by the previous step)
      wgmma_fence_operands(s1);
      auto kl_terms = [&](auto masked) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int col = 8 * j + 2 * c4;
          int tpv[2] = {0, 0};
          if constexpr (decltype(masked)::value) {
            const int2 tp = *reinterpret_cast<const int2*>(&tm.tpos[col]);
            tpv[0] = tp.x;
            tpv[1] = tp.y;
          }
          const float2 ls = *reinterpret_cast<const float2*>(&tm.lse[col]);  // the student's lse
          const float lsv[2] = {ls.x, ls.y};
          float4 t4;
          if constexpr (RM > 0) {  // the group's teacher tile (every column written by its head steps)
            const float2 a = *reinterpret_cast<const float2*>(tch_tile + kr * 64 + teacher_col(kr, col));
            const float2 b = *reinterpret_cast<const float2*>(tch_tile + (kr + 8) * 64 + teacher_col(kr + 8, col));
            t4 = make_float4(a.x, a.y, b.x, b.y);
          } else {
            t4 = slots[j * L::kConsumers];
            slots[j * L::kConsumers] = make_float4(0.f, 0.f, 0.f, 0.f);  // the next tile starts from zero
          }
          const float tsum[4] = {t4.x, t4.y, t4.z, t4.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = bc.key0 + kr + 8 * (e >> 1);
            float ds = 0.f;
            if (!decltype(masked)::value || key <= tpv[e & 1]) {
              const float log_qs = s1[4 * j + e] * fa.scale_p - lsv[e & 1];
              const float te = tsum[e] * inv_m;
              if (te > 0.f) kl += te * (__logf(te) - log_qs);
              ds = c_kl * (__expf(log_qs) - te);
            }
            s1[4 * j + e] = ds;
          }
        }
      };
      if (all_keys_visible(tm)) kl_terms(std::false_type{});
      else kl_terms(std::true_type{});
      uint32_t da[4][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) acc_to_a_frag(da[kk], s1 + 8 * kk);

      // dkp share of this tile, rows = this WG's keys, in two 64-column halves (32 registers each):
      // staged and bulk reduce-added into the shared [T, Hpk, D] accumulator (fast form, below), or
      // fp32 REDs into partial p of [T, Hp, D] (fa.dkp_per_head). DET with the partials: rows (key, p)
      // get adds from this CTA only (one CTA per (p, key block) without token chunks or list pieces),
      // each element always from the same lane, and one thread's
      // REDs to one address apply in program order (PTX memory model: program order is part of
      // causality order, which coherence order follows; a vector RED is one RED per element), so the
      // sums do not depend on timing; the Hp / Hpk partials of a key head are summed in a fixed order
      // at the end (sum_partials_kernel). DET otherwise: int64 fixed point into [T, Hpk, D].
      const int key_lo = bc.key0 + kr;
      const int dkp_rows = fa.dkp_per_head ? Hp : fa.Hpk, dkp_row = fa.dkp_per_head ? p : pk;
      const int64_t kat_lo = ((bc.seq_start + key_lo) * dkp_rows + dkp_row) * D + 2 * c4;
      const int64_t kat_hi = kat_lo + static_cast<int64_t>(8) * dkp_rows * D;
      const float fx_kp = DET ? __ldg(fx + 4) : 0.f;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float acc[32];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_rs_bf16<64, 1>(acc, da[kk],
                                  wgmma_desc_sw128_mn(q_st + half * L::kTokSlabOff + kk * 2 * L::kTokGroup,
                                                      L::kTokSlabOff, L::kTokGroup),
                                  kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(acc);
        if (DET && !fa.dkp_per_head) {
#pragma unroll
          for (int j = 0; j < 8; ++j)
            wb_fx_tile(fa.dkp_acc, kat_lo + 64 * half + 8 * j, kat_hi + 64 * half + 8 * j, key_lo < bc.seq_len,
                       key_lo + 8 < bc.seq_len, acc[4 * j] * fa.scale_p, acc[4 * j + 1] * fa.scale_p,
                       acc[4 * j + 2] * fa.scale_p, acc[4 * j + 3] * fa.scale_p, fx_kp);
        } else if (DET) {
#pragma unroll
          for (int j = 0; j < 8; ++j)
            wb_red_tile(static_cast<float*>(fa.dkp_acc), kat_lo + 64 * half + 8 * j, kat_hi + 64 * half + 8 * j,
                        key_lo < bc.seq_len, key_lo + 8 < bc.seq_len, acc[4 * j] * fa.scale_p,
                        acc[4 * j + 1] * fa.scale_p, acc[4 * j + 2] * fa.scale_p, acc[4 * j + 3] * fa.scale_p,
                        c4);
        } else {
          // Fast form: the WG's 64 key rows x 64 columns staged and bulk reduce-added, one 256-byte row
          // per thread of the WG's warps 0, 1, as dQ leaves (below), instead of 8 float4 REDs per thread
          // (H100 m3/64k backward -0.5 ms; without any dkp adds -3.7: the rest is the L2's fp32 adds
          // themselves, which the bulk form does as well). Staging: WG 0 in the dS tile (free:
          // both WGs' dQ products that read it ended before StageDead, and WG 1 rewrites it only after
          // DsFree, below, which WG 0's issuing threads reach once their reads are done), WG 1 in the
          // stage's dO slot (a proxy step loads none; the dqp staging takes it after StageDead), rows
          // 60..63 in the WG's spare rows. The first barrier: the WG's issuing threads have finished
          // reading the spare rows (the previous step's dQ) or this buffer (half 0).
          unsigned char* const stg = cw == 0 ? sdS : sdO + st * L::kTokTile;
          unsigned char* const spare = smem + L::oStgSpare + cw * L::kStgSpare - L::kStgInSlot * L::kStgPitch;
          auto row_at = [&](int r) { return (r < L::kStgInSlot ? stg : spare) + r * L::kStgPitch; };
          const int wg_bar = (RM > 0 ? kBarStaged + 1 : kBarStaged) + cw;
          bar_sync(wg_bar, 128);
          const int lr = 16 * wi + g4;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            *reinterpret_cast<float2*>(row_at(lr) + 32 * j + 8 * c4) =
                make_float2(acc[4 * j] * fa.scale_p, acc[4 * j + 1] * fa.scale_p);
            *reinterpret_cast<float2*>(row_at(lr + 8) + 32 * j + 8 * c4) =
                make_float2(acc[4 * j + 2] * fa.scale_p, acc[4 * j + 3] * fa.scale_p);
          }
          fence_proxy_async_shared();  // generic stores of the staging before the async-proxy reads
          bar_sync(wg_bar, 128);
          const int r = ct & (kTileTok - 1), key = bc.key0 + 64 * cw + r;
          float* const dst = static_cast<float*>(fa.dkp_acc) +
                             ((bc.seq_start + min(key, bc.seq_len - 1)) * dkp_rows + dkp_row) * D + 64 * half;
          wb_bulk_reduce_if((ct & 127) < kTileTok && key < bc.seq_len, dst, smem_u32(row_at(r)));
          bulk_commit_group();
          bulk_wait_group_read<0>();
        }
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_fence_operands(da[kk]);  // A operand of the dkp products

      // dqp = dS_p Kp through the shared dS tile, as dQ (below).
      bar_sync(kBarDsFree, L::kConsumers);
      store_ds_frags(sdS, da, kr, c4);
      fence_proxy_async_shared();
      bar_sync(kBarDsReady, L::kConsumers);
      if constexpr (kDetNoDq) {  // the other forms stage dqp instead
        t_lo = tm.tok[trow];
        t_hi = tm.tok[trow + 8];
      }
    }
    // The stage (Q / Qp, dO, metadata) is no longer read: dQ / dqp read the dS tile and K / Kp.
    // The fast full kernel releases it later: its dQ / dqp rows are staged in it.
    if constexpr (kDetNoDq) ::cuda::ptx::mbarrier_arrive(empty + st);

    // dQ[:, 64cw..] = dS K (head step) or dqp[:, 64cw..] = dS_p Kp (proxy step), then the next
    // step's first product, then the atomics under it.
    // DET, per-head tiles: dqp at proxy steps only, and its fixed-point atomics run BEFORE the
    // next step's S^T is issued: the int64 conversions need more registers than the fp32 REDs,
    // and with S^T's accumulator in flight ptxas spilled and serialised the wgmmas (C7512). One
    // S^T per tile loses its overlap. With token rows, dQ and dqp leave as int32 fixed point
    // through the fast form's staging instead.
    float dq[32];
    if (!kDetNoDq || !head) {
      wgmma_fence();
      ss_tokens_by_keys(dq, ds_base, head ? k_base : kp_base, cw);
      wgmma_commit();
    }
    // dqp's fixed-point atomics (the per-head DET form), before the next S^T is issued.
    auto dqp_fixed_point = [&]() {
      const float fx_qp = __ldg(fx + 3);
      const int64_t at_lo = (static_cast<int64_t>(t_lo < 0 ? 0 : t_lo) * Hp + p) * D + 64 * cw + 2 * c4;
      const int64_t at_hi = (static_cast<int64_t>(t_hi < 0 ? 0 : t_hi) * Hp + p) * D + 64 * cw + 2 * c4;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        wb_fx_tile(fa.dqp_acc, at_lo + 8 * j, at_hi + 8 * j, t_lo >= 0, t_hi >= 0, dq[4 * j] * fa.scale_p,
                   dq[4 * j + 1] * fa.scale_p, dq[4 * j + 2] * fa.scale_p, dq[4 * j + 3] * fa.scale_p, fx_qp);
    };
    if constexpr (kDetNoDq) {
      if (!head) {
        wgmma_wait<0>();  // dqp done
        wgmma_fence_operands(dq);
        dqp_fixed_point();
      }
    }
    wait_full(s + 1);
    issue_as(s1, s + 1, hi == m || hi + 1 < m);  // step s + 1's S^T: head unless hi + 1 == m
    if constexpr (kDetNoDq) continue;  // S^T of step s+1 stays in flight into the next step
    wgmma_wait<1>();  // dQ / dqp done
    wgmma_fence_operands(dq);
    // dQ / dqp leave through the stage they were computed from: each WG's 64 x 64 fp32 block is
    // stored to shared memory and every token row (256 bytes) bulk reduce-added into the fp32
    // accumulator by one thread (cp.reduce.async.bulk), instead of 8 per-thread 16-byte REDs
    // whose register operands the load/store unit held for thousands of cycles per step (ncu:
    // ~40% of the consumers' stall samples). The stage's Q and dO are dead once BOTH WGs have
    // retired the products that read them (dK / dV, or dkp): StageDead.
    bar_sync(kBarStageDead, L::kConsumers);
    {
      const float f = head ? scale : fa.scale_p;
      // Token rows (RM > 0) at a head step: row (token k, head h) of both WGs at
      // region(k) + h * 512 + 256 cw, where region(k) is token k's RM x 512 bytes (its dq rows, which
      // are contiguous in dq_acc: one bulk reduce-add per token): tokens 0 .. 32/RM - 1 in the Q
      // slot, the rest in the dO slot. The 32-byte column groups j of a row are stored at j ^ (h & 7)
      // (the 8 rows of a warp's float2 stores then spread over the banks; a 512-byte pitch has no
      // room for padding); convert_acc_kernel undoes it. Otherwise (and at proxy steps): per-WG
      // rows of 256 bytes at the padded pitch, one bulk reduce-add per row.
      const bool rows_step = RM > 0 && head;
      constexpr int kRm = RM > 0 ? RM : 1;
      unsigned char* const stg = smem + (cw == 0 ? L::oQ : L::odO) + st * L::kTokTile;
      unsigned char* const spare = smem + L::oStgSpare + cw * L::kStgSpare - L::kStgInSlot * L::kStgPitch;
      auto stg_row = [&](int r) { return (r < L::kStgInSlot ? stg : spare) + r * L::kStgPitch; };
      auto token_region = [&](int k) {
        return smem + (k < 32 / kRm ? L::oQ + k * kRm * 512 : L::odO + (k - 32 / kRm) * kRm * 512) + st * L::kTokTile;
      };
      const int perm = rows_step ? (trow % kRm) & 7 : 0;
      unsigned char* const row_lo =
          (rows_step ? token_region(trow / kRm) + (trow % kRm) * 512 + 256 * cw : stg_row(trow)) + 8 * c4;
      unsigned char* const row_hi =
          (rows_step ? token_region((trow + 8) / kRm) + ((trow + 8) % kRm) * 512 + 256 * cw : stg_row(trow + 8)) + 8 * c4;
      if constexpr (DET) {
        // Token rows: dQ (dqp) times scale (scale_p) and its int32 fixed-point factor: the row's own
        // (di_kernel, loaded with the stage) at a head step, fx[6] at a proxy step; in the fast
        // form's layout, added as .s32 below. (x * f) * F: F alone may be up to 2^127.
        const float fx_p = __ldg(fx + 6);
        const float fx_lo = head ? row_fx_s[st * kTileTok + trow] : fx_p;
        const float fx_hi = head ? row_fx_s[st * kTileTok + trow + 8] : fx_p;
        auto fixed = [&](float x, float fxr) { return __float2int_rn(x * f * fxr); };
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          *reinterpret_cast<int2*>(row_lo + 32 * (j ^ perm)) =
              make_int2(fixed(dq[4 * j], fx_lo), fixed(dq[4 * j + 1], fx_lo));
          *reinterpret_cast<int2*>(row_hi + 32 * (j ^ perm)) =
              make_int2(fixed(dq[4 * j + 2], fx_hi), fixed(dq[4 * j + 3], fx_hi));
        }
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          *reinterpret_cast<float2*>(row_lo + 32 * (j ^ perm)) = make_float2(dq[4 * j] * f, dq[4 * j + 1] * f);
          *reinterpret_cast<float2*>(row_hi + 32 * (j ^ perm)) = make_float2(dq[4 * j + 2] * f, dq[4 * j + 3] * f);
        }
      }
      fence_proxy_async_shared();  // generic stores of the staging before the async-proxy reads
      // Token regions span both WGs (256 threads); per-WG rows need only the WG (ids 6, 7 with RM).
      if constexpr (RM > 0) bar_sync(rows_step ? kBarStaged : kBarStaged + 1 + cw, rows_step ? L::kConsumers : 128);
      else bar_sync(kBarStaged + cw, 128);
      // Per-WG rows: warps 0, 1 of the WG issue one token row each. Token rows: threads 0 ..
      // 64/RM - 1 one token each. Predicated, not branched around: a branch here made ptxas wait
      // for the next step's S^T in flight (C7517).
      const int r = ct & (kTileTok - 1);
      const int t = tm.tok[rows_step ? (r % (kTileTok / kRm)) * kRm : r];
      float* const red_base = head ? dq_acc : static_cast<float*>(fa.dqp_acc);
      const int rows = head ? H : Hp, hr = head ? p * m + (RM > 0 ? 0 : hi) : p;  // [T, rows, 128], row hr
      const bool issues = rows_step ? ct < kTileTok / kRm : (ct & 127) < kTileTok;
      float* const dst = red_base + (static_cast<int64_t>(max(t, 0)) * rows + hr) * D + (rows_step ? 0 : 64 * cw);
      if constexpr (DET)
        wb_bulk_reduce_s32_if(issues && t >= 0, reinterpret_cast<int*>(dst),
                              smem_u32(rows_step ? token_region(r % (kTileTok / kRm)) : stg_row(r)),
                              rows_step ? kRm * 512 : 64 * 4);
      else if constexpr (RM > 0)
        wb_bulk_reduce_or_store_if(issues && t >= 0, fa.own_pass != 0, dst,
                                   smem_u32(rows_step ? token_region(r % (kTileTok / kRm)) : stg_row(r)),
                                   rows_step ? kRm * 512 : 64 * 4);
      else
        wb_bulk_reduce_if(issues && t >= 0, dst, smem_u32(stg_row(r)));
      bulk_commit_group();
      bulk_wait_group_read<0>();  // the staging (= the stage) is free again
    }
    ::cuda::ptx::mbarrier_arrive(empty + st);
  }
  wgmma_wait<0>();  // the dropped product after the last step: no wgmma outlives the loop
  wgmma_fence_operands(s1);
  if constexpr (!KL_ONLY && !kDetNoDq) bulk_wait_group<0>();  // every dQ reduce-add has landed

  // dK (times scale), dV of this thread's rows of kv head kv_head added into dk_acc / dv_acc (fp32;
  // int64 fixed point with DET): SHARED_KV's group share and the token chunks' partial sums. Rows
  // past the sequence end belong to another sequence: predicated off.
  auto red_dkv = [&](int kv_head) {
    const int key_lo = bc.key0 + kr;
    const bool ok_lo = key_lo < bc.seq_len, ok_hi = key_lo + 8 < bc.seq_len;
    const int64_t at_lo = ((bc.seq_start + key_lo) * Hkv + kv_head) * D + 2 * c4;
    const int64_t at_hi = at_lo + static_cast<int64_t>(8) * Hkv * D;
    if constexpr (DET) {
      const float fx_k = __ldg(fx + 1), fx_v = __ldg(fx + 2);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        wb_fx_tile(dk_acc, at_lo + 8 * j, at_hi + 8 * j, ok_lo, ok_hi, dK[4 * j] * scale, dK[4 * j + 1] * scale,
                   dK[4 * j + 2] * scale, dK[4 * j + 3] * scale, fx_k);
        wb_fx_tile(dv_acc, at_lo + 8 * j, at_hi + 8 * j, ok_lo, ok_hi, dV[4 * j], dV[4 * j + 1], dV[4 * j + 2],
                   dV[4 * j + 3], fx_v);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        wb_red_tile(static_cast<float*>(dk_acc), at_lo + 8 * j, at_hi + 8 * j, ok_lo, ok_hi, dK[4 * j] * scale,
                    dK[4 * j + 1] * scale, dK[4 * j + 2] * scale, dK[4 * j + 3] * scale, c4);
        wb_red_tile(static_cast<float*>(dv_acc), at_lo + 8 * j, at_hi + 8 * j, ok_lo, ok_hi, dV[4 * j],
                    dV[4 * j + 1], dV[4 * j + 2], dV[4 * j + 3], c4);
      }
    }
  };
  if constexpr (SHARED_KV) {
    // This group's share of dk, dv. Also run by a CTA without tokens (adding zeros): an
    // `if (steps > 0)` here made ptxas inject a warpgroup.wait (C7517). p read again from %ctaid
    // through an opaque move: with kvh (or p itself) held through the loop, one register spilled.
    unsigned cta;
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(cta));
    red_dkv(static_cast<int>(cta % static_cast<unsigned>(Hp)) / (Hp / Hkv));
  } else if constexpr (!KL_ONLY) {
    bool partial = pieces;
    if constexpr (kChunkable) partial = partial || fa.n_chunks > 0;
    if (partial) {
      red_dkv(kvh);  // a chunk's share of dk, dv
    } else {
      // dk, dv rows of this thread's keys; rows past the sequence end belong to another sequence.
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int key = bc.key0 + kr + 8 * half;
        if (key >= bc.seq_len) continue;
        const int64_t at = ((bc.seq_start + key) * Hkv + kvh) * D + 2 * c4;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          *reinterpret_cast<uint32_t*>(dk + at + 8 * j) =
              pack_bf16x2(dK[4 * j + 2 * half] * scale, dK[4 * j + 2 * half + 1] * scale);
          *reinterpret_cast<uint32_t*>(dv + at + 8 * j) = pack_bf16x2(dV[4 * j + 2 * half], dV[4 * j + 2 * half + 1]);
        }
      }
    }
  }

  // The block's KL share, reduced in a fixed order.
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) kl += __shfl_xor_sync(0xffffffffu, kl, off);
  if (lane == 0) sRed[ct >> 5] = kl;
  bar_sync(kBarKl, L::kConsumers);
  if (ct == 0) {
    float total = 0.f;
    for (int w = 0; w < 8; ++w) total += sRed[w];
    // With token chunks: one slot per (chunk, p, g), [n_chunks (+ 1: the own pass)][Hp][NB]; an
    // overflow piece's at kl_slot0 + one per (p, overflow slot).
    const int slot = fa.own_pass ? fa.n_chunks : chunk;
    fa.kl_part[over ? fa.kl_slot0 + static_cast<int64_t>(p) * fa.piece_stride + gx
                    : (static_cast<int64_t>(slot) * Hp + p) * ix.NB + g_grid] = total;
  }
}

}  // namespace flashmsa::cuda::bwd
