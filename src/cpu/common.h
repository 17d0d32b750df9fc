// Shared, ISA-neutral pieces of the CPU backend: dtype conversion, the worker team, the block
// layout of the packed sequences, and argument checks that need the data (block_idx contents).
//
// The compute itself lives in the isa_*.h bodies, compiled once per instruction set
// (backend_generic.cpp, backend_avx2.cpp) and picked at run time by dispatch.cpp.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#include "params.h"

namespace flashmsa {
namespace cpu {

// ---------------------------------------------------------------------------------------------
// bf16 / fp16 <-> fp32, round-to-nearest-even, NaN kept NaN.

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_f32(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  uint32_t u = bits_of(f);
  // A NaN must not round into infinity: keep the top bits and force a quiet mantissa bit.
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  // Zero or subnormal: man * 2^-24 is exact in fp32.
  if (exp == 0) return float_of(bits_of(static_cast<float>(man) * 5.9604644775390625e-8f) | sign);
  if (exp == 31) return float_of(sign | 0x7f800000u | (man << 13));
  return float_of(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t f32_to_f16(float f) {
  const uint32_t u = bits_of(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf (65520+)
  if (a >= 0x38800000u) {  // normal half: rebias the exponent, round the 13 dropped bits
    const uint32_t m = a - (112u << 23);
    return static_cast<uint16_t>(sign | ((m + 0xfffu + ((m >> 13) & 1u)) >> 13));
  }
  // Subnormal half (or zero): count units of 2^-24; nearbyint rounds half to even.
  const float units = std::nearbyint(float_of(a) * 16777216.0f);
  return static_cast<uint16_t>(sign | static_cast<uint16_t>(units));
}

// n elements of a tensor of dtype `dt`, starting at element `off`, into fp32 `dst`.
inline void load_f32(const void* base, DType dt, int64_t off, int64_t n, float* dst) {
  switch (dt) {
    case DType::fp32:
      std::memcpy(dst, static_cast<const float*>(base) + off, n * sizeof(float));
      break;
    case DType::bf16: {
      const uint16_t* s = static_cast<const uint16_t*>(base) + off;
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      break;
    }
    case DType::fp16: {
      const uint16_t* s = static_cast<const uint16_t*>(base) + off;
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      break;
    }
    default: break;
  }
}

// Like load_f32, then zero-fills dst[n .. npad): the padded lanes of every fp32 row.
inline void load_f32_padded(const void* base, DType dt, int64_t off, int64_t n, int64_t npad,
                            float* dst) {
  load_f32(base, dt, off, n, dst);
  for (int64_t i = n; i < npad; ++i) dst[i] = 0.f;
}

// n fp32 values into a tensor of dtype `dt` at element `off`, rounded to nearest even.
inline void store_f32(const float* src, int64_t n, void* base, DType dt, int64_t off) {
  switch (dt) {
    case DType::fp32:
      std::memcpy(static_cast<float*>(base) + off, src, n * sizeof(float));
      break;
    case DType::bf16: {
      uint16_t* d = static_cast<uint16_t*>(base) + off;
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
      break;
    }
    case DType::fp16: {
      uint16_t* d = static_cast<uint16_t*>(base) + off;
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
      break;
    }
    default: break;
  }
}

// ---------------------------------------------------------------------------------------------
// A fixed team of worker threads for one backend call. run() hands out items [0, n) one at a
// time from a shared counter and returns when all are done. Every item must write only what
// it owns, so results never depend on which thread ran which item.

class Team {
 public:
  explicit Team(int num_threads);
  ~Team();
  Team(const Team&) = delete;
  Team& operator=(const Team&) = delete;

  int size() const { return size_; }
  // fn(item, worker): worker in [0, size()) indexes per-worker scratch.
  void run(int64_t n_items, const std::function<void(int64_t, int)>& fn);

 private:
  void worker_loop(int worker);
  void drain(int worker);

  int size_ = 1;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  uint64_t generation_ = 0;
  int busy_ = 0;
  bool stop_ = false;
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t n_items_ = 0;
  std::atomic<int64_t> next_{0};
  std::exception_ptr error_;
};

// p.num_threads resolved: 0 means every hardware thread.
int resolve_threads(int requested);

// ---------------------------------------------------------------------------------------------
// Key blocks of the packed batch. Blocks are aligned to each sequence start, so a "global block"
// g names (sequence, block within it). Padded widths keep every GEMM column count a multiple of
// the vector tile; the per-block offsets keep the padded storage O(T + 16 * blocks), not
// O(blocks * BLK), when sequences are much shorter than a block.

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

constexpr int kColTile = 16;  // every GEMM N dimension is padded to a multiple of this

struct Layout {
  int64_t T = 0;
  int B = 0;
  int blk = 128;
  int64_t G = 0;                    // global blocks
  int64_t w_total = 0;              // sum of padded widths
  int64_t max_blocks = 0;           // blocks of the longest sequence
  std::vector<int32_t> seq_of;      // [T] sequence of each token
  std::vector<int64_t> seq_start;   // [B+1] = cu_seqlens
  std::vector<int64_t> blk_base;    // [B+1] first global block of each sequence
  std::vector<int32_t> blk_seq;     // [G] sequence of the block
  std::vector<int64_t> blk_start;   // [G] first token (global index)
  std::vector<int32_t> blk_len;     // [G] tokens in the block (<= blk)
  std::vector<int32_t> blk_w;       // [G] round_up(blk_len, kColTile)
  std::vector<int64_t> blk_woff;    // [G] prefix sum of blk_w: panel offset in key columns

  explicit Layout(const MsaParams& p);
  // Token t's block index within its sequence and its position inside the sequence.
  int64_t pos(int64_t t) const { return t - seq_start[seq_of[t]]; }
};

// The widest padded key block any sequence has: a block is never longer than its sequence.
inline int64_t max_block_width(const MsaParams& p, const Layout& lay) {
  return round_up(std::min<int64_t>(lay.blk, std::max<int64_t>(p.max_seqlen, 1)), kColTile);
}

// Work item `item` of a pass over (proxy head, query block) pairs. Later query blocks score or
// attend to more keys, so they are handed out first.
struct QueryBlockItem {
  int64_t gq;  // global query block
  int hp;      // proxy head
  int pk;      // its proxy key head
  int b;       // sequence of the block
  int64_t nq;  // block index within the sequence

  QueryBlockItem(const MsaParams& p, const Layout& lay, int64_t item)
      : gq(lay.G - 1 - item / p.Hp),
        hp(static_cast<int>(item % p.Hp)),
        pk(p.proxy_key_head(hp)),
        b(lay.blk_seq[gq]),
        nq(gq - lay.blk_base[b]) {}
};

// fp32 copies of a key-side tensor x [T, Hx, Dx] (any input dtype), built in parallel.
// Panels, the GEMM B operand for scores: [Hx][w_total * Dx]; the panel of (head c, block g) starts
// at c * w_total * Dx + blk_woff[g] * Dx and is [Dx][blk_w[g]] (transposed), zero past blk_len[g].
std::vector<float> build_panels(const void* x, DType dt, int Hx, int Dx, const Layout& lay,
                                Team& team);
// Head-major rows, the B operand for products with keys as rows: [Hx][T][Dxp], lanes Dx..Dxp
// zero.
std::vector<float> build_rows(const void* x, DType dt, int Hx, int Dx, int Dxp, const Layout& lay,
                              Team& team);

// block_idx holds user data in the forward and backward; indices out of range would read out of
// bounds. Rows must be strictly ascending indices in [0, n_loc] followed only by -1 padding.
// Throws flashmsa::Error naming block_idx otherwise (before anything is written).
void check_block_idx_contents(const MsaParams& p, const Layout& lay);

// Writes the kl value (fp32) from per-(p, t) KL terms summed in a fixed order.
void write_kl(const MsaParams& p, const std::vector<float>& kl_terms);

}  // namespace cpu
}  // namespace flashmsa
