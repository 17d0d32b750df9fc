// An independent fp64 check of MSA on a slice of tokens, cheap enough for any problem size.
//
// The full fp64 oracle (tests/reference) materialises T x T and is for small problems only. The
// main job instead re-derives, per sampled query token, its selection, o, lse, dq and dqp straight
// from msa.md, and per sampled key token its dk, dv and dkp (using the backend's lse and o for the
// other tokens' softmax normalisers, which are themselves checked on the sampled rows).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace flashmsa::app {

// Host copies (fp32 values of the inputs as the backend saw them, i.e. after bf16 rounding).
struct HostProblem {
  int64_t T = 0;
  int H = 0, Hkv = 0, Hp = 0, Hpk = 0, D = 0, Dv = 0, Dp = 0;
  int block_size = 128, top_k = 16, local_blocks = 1;
  double scale = 0, proxy_scale = 0, kl_coeff = 1;
  std::vector<int32_t> cu_seqlens;                // [B+1]
  std::vector<float> q, k, v, qp, kp, d_o;        // [T, heads, dim]
  // Backend results.
  std::vector<int32_t> block_idx;                 // [Hp, T, K]
  std::vector<float> o, lse;                      // [T, H, Dv], [H, T]
  std::vector<float> dq, dk, dv, dqp, dkp;        // like the inputs
  double kl = 0;                                  // kl_loss from the backward
  bool have_backward = false;
};

struct SliceReport {
  double sel_violation = 0;   // worst (K-th best score - selected score), > tol means wrong
  int sel_rows_bad = 0;       // rows with a structural error (missing local block, order, padding)
  double err_o = 0, err_lse = 0, err_dq = 0, err_dqp = 0;  // rel L2 (lse: max abs)
  double err_dk = 0, err_dv = 0, err_dkp = 0;
  int tokens_checked = 0, keys_checked = 0;
  bool pass = false;
  std::string summary() const;
};

// Checks `n_tokens` query tokens and `n_keys` key tokens spread over the problem.
SliceReport check_slice(const HostProblem& p, int n_tokens, int n_keys, uint64_t seed,
                        double tol_rel);

}  // namespace flashmsa::app
