// The fp64 oracle: MiniMax Sparse Attention written straight from shared/spec/msa.md, one
// (proxy head, query token) at a time, with every attention row materialised. Small problems
// only (cost ~ H * T * max_seqlen * D). Independent of src/ on purpose: it shares no code with
// any backend, only the layout conventions of include/flashmsa/flashmsa.h.
//
// Layouts (row-major, packed varlen, T = cu_seqlens.back()):
//   q [T, H, D]  k [T, Hkv, D]  v [T, Hkv, Dv]  qp [T, Hp, Dp]  kp [T, Hpk, Dp]
//   o [T, H, Dv]  lse [H, T]  block_idx [Hp, T, K] (ascending, -1 padding last)
#pragma once

#include <cstdint>
#include <vector>

namespace oracle {

struct Config {
  int H = 1, Hkv = 1, Hp = 1, Hpk = 1;
  int D = 1, Dv = 1, Dp = 1;
  std::vector<int32_t> cu_seqlens{0};  // [B+1], cu[0] = 0, non-decreasing
  int block_size = 128;
  int top_k = 16;
  int local_blocks = 1;
  double scale = 0;        // <= 0: D^-0.5
  double proxy_scale = 0;  // <= 0: Dp^-0.5
  double kl_coeff = 1;

  int64_t T() const { return cu_seqlens.back(); }
  double resolved_scale() const;
  double resolved_proxy_scale() const;
  // Most blocks any sequence has (width of Selection::scores).
  int max_blocks() const;
};

struct Inputs {
  std::vector<double> q;   // [T, H, D]
  std::vector<double> k;   // [T, Hkv, D]
  std::vector<double> v;   // [T, Hkv, Dv]
  std::vector<double> qp;  // [T, Hp, Dp]
  std::vector<double> kp;  // [T, Hpk, Dp]
};

struct Selection {
  std::vector<int32_t> block_idx;  // [Hp, T, K]
  // [Hp, T, max_blocks]: the block score bs of msa.md steps 2-3 (+inf for local blocks),
  // -inf for blocks that are not visible to the query.
  std::vector<double> scores;
  int max_blocks = 0;
};

struct ForwardResult {
  std::vector<double> o;    // [T, H, Dv]
  std::vector<double> lse;  // [H, T]
  double kl_loss = 0;       // kl_coeff * mean over (p, t) of KL[p, t]
};

struct BackwardResult {
  std::vector<double> dq;   // [T, H, D]
  std::vector<double> dk;   // [T, Hkv, D]
  std::vector<double> dv;   // [T, Hkv, Dv]
  std::vector<double> dqp;  // [T, Hp, Dp]
  std::vector<double> dkp;  // [T, Hpk, Dp]
  double kl_loss = 0;
};

// msa.md forward steps 1-4 in fp64.
Selection select_blocks(const Config& cfg, const Inputs& in);

// msa.md steps 5-6 with the given selection. block_idx == nullptr means the dense warm-up mode
// (every causal key of the sequence). Entries of block_idx that are -1 are skipped; the key set
// is {j <= t : block(j) in the row}, exactly as msa.md defines J.
ForwardResult forward(const Config& cfg, const Inputs& in, const std::vector<int32_t>* block_idx);

// The backward of msa.md with upstream gradient d_o [T, H, Dv] and g = d kl_loss.
BackwardResult backward(const Config& cfg, const Inputs& in, const std::vector<int32_t>* block_idx,
                        const std::vector<double>& d_o, double g);

}  // namespace oracle
