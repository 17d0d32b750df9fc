// The backend-vs-oracle harness declared at the bottom of test_util.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "test_util.h"

namespace msatest {

using flashmsa::DType;
using flashmsa::Mode;

Tolerance default_tolerance(DType dtype) {
  switch (dtype) {
    // fp32 errors measured at ~4e-7 (T = 300); 2e-5 leaves margin yet catches a few wrong rows.
    case DType::fp32: return {2e-5, 2e-5, 2e-5};
    case DType::bf16: return {1e-2, 1e-3, 1e-2};
    case DType::fp16: return {5e-3, 1e-3, 5e-3};
    default: return {};
  }
}

flashmsa::AttentionInputs Problem::views() {
  flashmsa::AttentionInputs in;
  in.q = q.view();
  in.k = k.view();
  in.v = v.view();
  in.qp = qp.view();
  in.kp = kp.view();
  in.cu_seqlens = cu.view();
  return in;
}

Problem make_problem(const Case& c) {
  Problem pr;
  oracle::Config& cfg = pr.cfg;
  const Heads& hd = c.heads;
  cfg.H = hd.H; cfg.Hkv = hd.Hkv; cfg.Hp = hd.Hp; cfg.Hpk = hd.Hpk;
  cfg.D = hd.D; cfg.Dv = hd.Dv; cfg.Dp = hd.Dp;
  cfg.cu_seqlens = cu_from_lengths(c.lengths);
  cfg.block_size = c.opt.block_size;
  cfg.top_k = c.opt.top_k;
  cfg.local_blocks = c.opt.local_blocks;
  // The backend receives float options; the oracle uses exactly those values.
  cfg.scale = c.opt.scale > 0 ? double(c.opt.scale) : 0.0;
  cfg.proxy_scale = c.opt.proxy_scale > 0 ? double(c.opt.proxy_scale) : 0.0;
  cfg.kl_coeff = double(c.opt.kl_coeff);

  const int64_t T = cfg.T();
  const size_t t = static_cast<size_t>(T);
  std::mt19937_64 rng(c.seed);
  pr.in.q = rounded(c.dtype, random_normal(t * hd.H * hd.D, rng));
  pr.in.k = rounded(c.dtype, random_normal(t * hd.Hkv * hd.D, rng));
  pr.in.v = rounded(c.dtype, random_normal(t * hd.Hkv * hd.Dv, rng));
  if (c.integer_proxy) {
    // Small integers make every fp32 proxy score exact whatever the summation order, so
    // ties are real ties for the backend too and the tie rule can be checked exactly.
    std::uniform_int_distribution<int> dist(-2, 2);
    pr.in.qp.resize(t * hd.Hp * hd.Dp);
    pr.in.kp.resize(t * hd.Hpk * hd.Dp);
    for (double& e : pr.in.qp) e = dist(rng);
    for (double& e : pr.in.kp) e = dist(rng);
  } else {
    pr.in.qp = rounded(c.dtype, random_normal(t * hd.Hp * hd.Dp, rng, c.proxy_std));
    pr.in.kp = rounded(c.dtype, random_normal(t * hd.Hpk * hd.Dp, rng, c.proxy_std));
  }
  pr.d_o = rounded(c.dtype, random_normal(t * hd.H * hd.Dv, rng));

  pr.q = HostTensor(c.dtype, {T, hd.H, hd.D});
  pr.k = HostTensor(c.dtype, {T, hd.Hkv, hd.D});
  pr.v = HostTensor(c.dtype, {T, hd.Hkv, hd.Dv});
  pr.qp = HostTensor(c.dtype, {T, hd.Hp, hd.Dp});
  pr.kp = HostTensor(c.dtype, {T, hd.Hpk, hd.Dp});
  pr.d_o_t = HostTensor(c.dtype, {T, hd.H, hd.Dv});
  pr.q.from_doubles(pr.in.q);
  pr.k.from_doubles(pr.in.k);
  pr.v.from_doubles(pr.in.v);
  pr.qp.from_doubles(pr.in.qp);
  pr.kp.from_doubles(pr.in.kp);
  pr.d_o_t.from_doubles(pr.d_o);
  pr.cu = HostTensor(DType::int32, {static_cast<int64_t>(cfg.cu_seqlens.size())});
  for (size_t i = 0; i < cfg.cu_seqlens.size(); ++i) pr.cu.set(static_cast<int64_t>(i), cfg.cu_seqlens[i]);
  pr.kl_grad = HostTensor(DType::fp32, {1});
  pr.kl_grad.set(0, c.kl_grad);
  return pr;
}

BackendOutputs run_backend(Problem& pr, const Case& c) {
  const oracle::Config& cfg = pr.cfg;
  const int64_t T = cfg.T();
  BackendOutputs out;
  out.block_idx = HostTensor(DType::int32, {cfg.Hp, T, cfg.top_k});
  out.o = HostTensor(c.dtype, {T, cfg.H, cfg.Dv});
  out.lse = HostTensor(DType::fp32, {cfg.H, T});
  out.kl_fwd = HostTensor(DType::fp32, {1});
  out.dq = HostTensor(c.dtype, {T, cfg.H, cfg.D});
  out.dk = HostTensor(c.dtype, {T, cfg.Hkv, cfg.D});
  out.dv = HostTensor(c.dtype, {T, cfg.Hkv, cfg.Dv});
  out.dqp = HostTensor(c.dtype, {T, cfg.Hp, cfg.Dp});
  out.dkp = HostTensor(c.dtype, {T, cfg.Hpk, cfg.Dp});
  out.kl_bwd = HostTensor(DType::fp32, {1});
  for (HostTensor* t : {&out.block_idx, &out.o, &out.lse, &out.kl_fwd, &out.dq, &out.dk, &out.dv,
                        &out.dqp, &out.dkp, &out.kl_bwd})
    t->poison();

  const flashmsa::AttentionInputs in = pr.views();
  const flashmsa::TensorView kl_f = c.request_kl ? out.kl_fwd.view() : flashmsa::TensorView();
  const flashmsa::TensorView kl_b = c.request_kl ? out.kl_bwd.view() : flashmsa::TensorView();
  const flashmsa::TensorView kl_grad = c.pass_kl_grad ? pr.kl_grad.view() : flashmsa::TensorView();
  const flashmsa::Gradients grads{out.dq.view(), out.dk.view(), out.dv.view(), out.dqp.view(),
                                  out.dkp.view()};
  const bool warmup = c.opt.mode == Mode::warmup;
  if (c.use_msa_entry) {
    // Warm-up mode may leave block_idx undefined; pass nothing to prove it.
    const flashmsa::TensorView idx = warmup ? flashmsa::TensorView() : out.block_idx.view();
    flashmsa::msa_forward(in, c.opt, idx, out.o.view(), out.lse.view(), kl_f);
    flashmsa::msa_backward(in, idx, out.o.view(), out.lse.view(), pr.d_o_t.view(), kl_grad, c.opt,
                           grads, kl_b);
  } else if (warmup) {
    flashmsa::dense_warmup_forward(in, c.opt, out.o.view(), out.lse.view(), kl_f);
    flashmsa::dense_warmup_backward(in, out.o.view(), out.lse.view(), pr.d_o_t.view(), kl_grad,
                                    c.opt, grads, kl_b);
  } else {
    flashmsa::select_blocks(in, c.opt, out.block_idx.view());
    flashmsa::sparse_attention_forward(in, out.block_idx.view(), c.opt, out.o.view(),
                                       out.lse.view(), kl_f);
    flashmsa::fused_backward(in, out.block_idx.view(), out.o.view(), out.lse.view(),
                             pr.d_o_t.view(), kl_grad, c.opt, grads, kl_b);
  }
  return out;
}

void check_selection(const oracle::Config& cfg, const oracle::Selection& ref,
                     const std::vector<int32_t>& got, double tol) {
  const int64_t T = cfg.T();
  const int K = cfg.top_k;
  const int L = cfg.local_blocks;
  ASSERT_EQ(got.size(), static_cast<size_t>(cfg.Hp * T * K));
  int failures = 0;
  auto fail = [&](int p, int64_t t, const std::string& why) {
    if (++failures > 8) return;  // a broken selection would otherwise flood the log
    std::ostringstream row;
    for (int i = 0; i < K; ++i) row << (i ? " " : "") << got[(p * T + t) * K + i];
    ADD_FAILURE() << "selection p=" << p << " t=" << t << " [" << row.str() << "]: " << why;
  };
  for (size_t b = 0; b + 1 < cfg.cu_seqlens.size(); ++b) {
    const int64_t start = cfg.cu_seqlens[b];
    for (int64_t t = start; t < cfg.cu_seqlens[b + 1]; ++t) {
      const int n_loc = static_cast<int>((t - start) / cfg.block_size);
      const int count = std::min(K, n_loc + 1);
      for (int p = 0; p < cfg.Hp; ++p) {
        const int32_t* row = &got[(p * T + t) * K];
        const double* bs = &ref.scores[(p * T + t) * ref.max_blocks];
        bool shape_ok = true;
        for (int i = 0; i < K; ++i) {
          if (i < count) {
            if (row[i] < 0 || row[i] > n_loc) shape_ok = false;
            if (i > 0 && row[i] <= row[i - 1]) shape_ok = false;
          } else if (row[i] != -1) {
            shape_ok = false;
          }
        }
        if (!shape_ok) {
          fail(p, t, "expected " + std::to_string(count) + " ascending blocks in [0, " +
                         std::to_string(n_loc) + "] then -1 padding");
          continue;
        }
        for (int n = std::max(0, n_loc - L + 1); n <= n_loc; ++n)
          if (std::find(row, row + count, n) == row + count)
            fail(p, t, "local block " + std::to_string(n) + " missing");
        // The count-th best oracle score; every selected block must reach it up to rounding.
        std::vector<double> sorted(bs, bs + n_loc + 1);
        std::sort(sorted.begin(), sorted.end(), std::greater<double>());
        const double thr = sorted[static_cast<size_t>(count - 1)];
        for (int i = 0; i < count; ++i) {
          const double s = bs[row[i]];
          const bool ok = std::isinf(thr) ? s == thr : s >= thr - tol * (1 + std::fabs(thr));
          if (!ok)
            fail(p, t, "block " + std::to_string(row[i]) + " has oracle score " +
                           std::to_string(s) + " < K-th best " + std::to_string(thr));
        }
      }
    }
  }
  EXPECT_EQ(failures, 0) << "selection rows failing";
}

namespace {

bool verbose() { return std::getenv("FLASHMSA_TEST_VERBOSE") != nullptr; }

void expect_written(const char* name, const HostTensor& t) {
  EXPECT_EQ(t.count_unwritten(), 0) << name << ": elements left unwritten (still poisoned) or non-finite";
}

void expect_close(const char* name, const HostTensor& got, const std::vector<double>& ref,
                  double tol) {
  const double err = rel_l2(got.to_doubles(), ref);
  if (verbose()) std::printf("    %-4s rel_l2 %.3e\n", name, err);
  EXPECT_LT(err, tol) << name << " relative L2 error";
}

void expect_kl(const char* name, const HostTensor& got, double ref, double rel) {
  const double v = got.get(0);
  if (verbose()) std::printf("    %-6s %.9g vs %.9g\n", name, v, ref);
  EXPECT_LE(std::fabs(v - ref), rel * std::fabs(ref) + 1e-6) << name << ": got " << v << ", oracle " << ref;
}

}  // namespace

BackendOutputs check_case(const Case& c, const Tolerance& tol) {
  Problem pr = make_problem(c);
  const std::vector<HostTensor> inputs_before{pr.q, pr.k, pr.v, pr.qp, pr.kp, pr.cu, pr.d_o_t, pr.kl_grad};
  BackendOutputs out;
  try {
    out = run_backend(pr, c);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "backend threw: " << e.what();
    return out;
  }
  const char* input_names[] = {"q", "k", "v", "qp", "kp", "cu_seqlens", "d_o", "kl_grad"};
  const HostTensor* inputs_after[] = {&pr.q, &pr.k, &pr.v, &pr.qp, &pr.kp, &pr.cu, &pr.d_o_t, &pr.kl_grad};
  for (size_t i = 0; i < inputs_before.size(); ++i)
    EXPECT_TRUE(inputs_before[i].bytes() == inputs_after[i]->bytes()) << "input '" << input_names[i] << "' was modified";
  const oracle::Config& cfg = pr.cfg;
  const bool warmup = c.opt.mode == Mode::warmup;
  if (verbose())
    std::printf("  case T=%lld B=%zu dtype=%s mode=%s\n", static_cast<long long>(cfg.T()),
                c.lengths.size(), flashmsa::dtype_name(c.dtype), warmup ? "warmup" : "sparse");

  if (!warmup) expect_written("block_idx", out.block_idx);
  expect_written("o", out.o);
  expect_written("lse", out.lse);
  expect_written("dq", out.dq);
  expect_written("dk", out.dk);
  expect_written("dv", out.dv);
  expect_written("dqp", out.dqp);
  expect_written("dkp", out.dkp);
  if (c.request_kl) {
    expect_written("kl (forward)", out.kl_fwd);
    expect_written("kl (backward)", out.kl_bwd);
  }

  std::vector<int32_t> idx;
  if (!warmup) {
    const oracle::Selection sel = oracle::select_blocks(cfg, pr.in);
    idx = out.block_idx.to_ints();
    check_selection(cfg, sel, idx, 1e-4);
  }
  // The oracle runs with the backend's own selection so near-ties cannot make outputs differ.
  const std::vector<int32_t>* use = warmup ? nullptr : &idx;
  const double g = c.pass_kl_grad ? double(static_cast<float>(c.kl_grad)) : 1.0;
  const oracle::ForwardResult f = oracle::forward(cfg, pr.in, use);
  const oracle::BackwardResult b = oracle::backward(cfg, pr.in, use, pr.d_o, g);

  expect_close("o", out.o, f.o, tol.rel);
  const double lse_err = max_abs_diff(out.lse.to_doubles(), f.lse);
  if (verbose()) std::printf("    lse  max abs %.3e\n", lse_err);
  EXPECT_LT(lse_err, tol.lse_abs) << "lse max abs error";
  expect_close("dq", out.dq, b.dq, tol.rel);
  expect_close("dk", out.dk, b.dk, tol.rel);
  expect_close("dv", out.dv, b.dv, tol.rel);
  expect_close("dqp", out.dqp, b.dqp, tol.rel);
  expect_close("dkp", out.dkp, b.dkp, tol.rel);
  if (c.request_kl) {
    expect_kl("kl_fwd", out.kl_fwd, f.kl_loss, tol.kl_rel);
    expect_kl("kl_bwd", out.kl_bwd, b.kl_loss, tol.kl_rel);
  }
  return out;
}

}  // namespace msatest
