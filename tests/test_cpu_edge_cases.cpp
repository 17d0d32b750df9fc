// msa.md's edge cases, one test each, on the CPU backend against the fp64 oracle.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>

#include "test_util.h"

namespace {

using flashmsa::DType;
using flashmsa::Mode;
using msatest::Case;
using msatest::HostTensor;

Case small_case(uint64_t seed, DType dtype = DType::fp32) {
  Case c;
  c.dtype = dtype;
  c.heads = {4, 2, 2, 1, 16, 16, 8};
  c.opt.block_size = 16;
  c.opt.top_k = 3;
  c.seed = seed;
  return c;
}

// Runs the case in both modes (and in bf16 too when asked).
void check_modes(Case c, bool also_bf16 = true) {
  for (Mode mode : {Mode::sparse, Mode::warmup}) {
    c.opt.mode = mode;
    for (DType dtype : {DType::fp32, DType::bf16}) {
      if (dtype == DType::bf16 && !also_bf16) continue;
      SCOPED_TRACE(std::string(mode == Mode::sparse ? "sparse " : "warmup ") + flashmsa::dtype_name(dtype));
      c.dtype = dtype;
      msatest::check_case(c);
    }
  }
}

TEST(CpuEdge, TNotMultipleOfBlock) {
  Case c = small_case(201);
  c.lengths = {45};  // 2 full blocks of 16 and a partial one of 13
  check_modes(c);
}

TEST(CpuEdge, SequencesShorterThanOneBlock) {
  Case c = small_case(202);
  c.lengths = {3, 15, 1, 7};
  check_modes(c);
}

TEST(CpuEdge, FewerVisibleBlocksThanK) {
  Case c = small_case(203);
  c.opt.block_size = 8;
  c.opt.top_k = 6;
  c.lengths = {20, 41};  // at most 3 and 6 blocks: rows padded with -1
  check_modes(c);
}

TEST(CpuEdge, KEqualsOneLocalOnly) {
  Case c = small_case(204);
  c.opt.block_size = 8;
  c.opt.top_k = 1;
  c.lengths = {50, 17};
  check_modes(c);
}

// A head layout other than small_case's, on two sequences of BLK 8.
void check_heads(uint64_t seed, msatest::Heads heads) {
  Case c = small_case(seed);
  c.heads = heads;
  c.opt.block_size = 8;
  c.lengths = {60, 9};
  check_modes(c);
}

TEST(CpuEdge, GroupSizeOne) { check_heads(205, {4, 2, 4, 1, 16, 16, 8}); }  // Hp = H

TEST(CpuEdge, ProxyKeyHeadsEqualProxyHeads) { check_heads(206, {4, 1, 2, 2, 16, 16, 8}); }  // Hpk = Hp

TEST(CpuEdge, ManyShortSequences) {
  Case c = small_case(207);
  c.heads = {4, 2, 2, 1, 8, 8, 4};
  c.opt.block_size = 8;
  std::mt19937_64 rng(2070);
  std::uniform_int_distribution<int> len(1, 40);
  for (int b = 0; b < 300; ++b) c.lengths.push_back(len(rng));
  check_modes(c, /*also_bf16=*/false);
}

TEST(CpuEdge, ZeroLengthSequencesInsideBatch) {
  Case c = small_case(208);
  c.opt.block_size = 8;
  c.lengths = {0, 12, 0, 0, 30, 0};
  check_modes(c);
}

TEST(CpuEdge, LocalBlocksTwo) {
  Case c = small_case(209);
  c.opt.block_size = 8;
  c.opt.local_blocks = 2;
  c.lengths = {70, 8, 9};
  check_modes(c);
}

TEST(CpuEdge, AllSelectedBlocksLocal) {
  Case c = small_case(210);
  c.opt.block_size = 4;
  c.opt.top_k = 3;
  c.opt.local_blocks = 3;  // L = K: a sliding window of 3 blocks
  c.lengths = {33};
  c.opt.mode = Mode::sparse;
  msatest::check_case(c);
}

TEST(CpuEdge, Block128AroundThreeHundredTokens) {
  Case c = small_case(211);
  c.heads = {4, 2, 2, 1, 32, 32, 16};
  c.opt.block_size = 128;
  c.opt.top_k = 2;
  c.lengths = {300};
  check_modes(c);
  c.lengths = {170, 131};
  c.opt.mode = Mode::sparse;
  c.dtype = DType::bf16;
  msatest::check_case(c);
}

// The library defaults (BLK 128, K 16, one local block, D^-0.5 scales) at head dim 64 with 18
// blocks in the sequence, so the top-16 really drops blocks.
TEST(CpuEdge, DefaultOptionsLongSequence) {
  Case c;
  c.heads = {4, 1, 1, 1, 64, 64, 64};
  c.lengths = {2200};
  c.dtype = DType::bf16;
  c.seed = 215;
  msatest::check_case(c);
}

// Head dim 128 as in the reference configuration, with a small K.
TEST(CpuEdge, HeadDim128) {
  Case c;
  c.heads = {8, 1, 2, 1, 128, 128, 128};
  c.lengths = {700};
  c.opt.top_k = 3;
  c.seed = 216;
  for (DType dtype : {DType::fp32, DType::bf16}) {
    c.dtype = dtype;
    msatest::check_case(c);
  }
}

TEST(CpuEdge, Fp16Inputs) {
  Case c = small_case(212, DType::fp16);
  c.opt.block_size = 8;
  c.lengths = {37, 64, 5};
  for (Mode mode : {Mode::sparse, Mode::warmup}) {
    c.opt.mode = mode;
    msatest::check_case(c);
  }
}

// T = 0: nothing to compute, kl is written as 0, outputs are empty; with B = 0 and with
// sequences of length zero.
TEST(CpuEdge, EmptyBatch) {
  for (const std::vector<int>& lengths : {std::vector<int>{}, std::vector<int>{0, 0, 0}}) {
    SCOPED_TRACE("B=" + std::to_string(lengths.size()));
    for (Mode mode : {Mode::sparse, Mode::warmup}) {
      Case c = small_case(213);
      c.lengths = lengths;
      c.opt.mode = mode;
      for (bool entry : {false, true}) {
        c.use_msa_entry = entry;
        const msatest::BackendOutputs out = msatest::check_case(c);
        EXPECT_EQ(out.kl_fwd.numel(), 1);
        EXPECT_EQ(out.kl_fwd.get(0), 0.0);
        EXPECT_EQ(out.kl_bwd.get(0), 0.0);
        EXPECT_EQ(out.o.numel(), 0);
      }
    }
  }
}

// The deterministic option: the same call twice gives bitwise identical outputs and gradients
// (threads on, so any order-dependent reduction would show).
TEST(CpuEdge, DeterministicIsBitwiseReproducible) {
  for (Mode mode : {Mode::sparse, Mode::warmup}) {
    for (DType dtype : {DType::fp32, DType::bf16}) {
      SCOPED_TRACE(std::string(mode == Mode::sparse ? "sparse " : "warmup ") + flashmsa::dtype_name(dtype));
      Case c = small_case(214, dtype);
      c.opt.mode = mode;
      c.opt.block_size = 8;
      c.opt.deterministic = true;
      c.opt.num_threads = 3;
      c.lengths = {90, 33, 120};
      msatest::Problem pr = msatest::make_problem(c);
      const msatest::BackendOutputs a = msatest::run_backend(pr, c);
      const msatest::BackendOutputs b = msatest::run_backend(pr, c);
      auto same = [](const char* name, const HostTensor& x, const HostTensor& y) {
        EXPECT_TRUE(x.bytes() == y.bytes()) << name << " differs between two identical calls";
        EXPECT_EQ(x.count_unwritten(), 0) << name;
      };
      if (mode == Mode::sparse) same("block_idx", a.block_idx, b.block_idx);
      same("o", a.o, b.o);
      same("lse", a.lse, b.lse);
      same("kl", a.kl_fwd, b.kl_fwd);
      same("dq", a.dq, b.dq);
      same("dk", a.dk, b.dk);
      same("dv", a.dv, b.dv);
      same("dqp", a.dqp, b.dqp);
      same("dkp", a.dkp, b.dkp);
      same("kl (backward)", a.kl_bwd, b.kl_bwd);
    }
  }
}

// A NaN input reaches the outputs: a NaN in one element of q makes that row's o and lse NaN (its
// scores are all NaN; the row is not taken for one without keys), and leaves every other row finite;
// the backward carries it on. The outputs start at zero, so a NaN there was computed, not left
// unwritten.
TEST(CpuEdge, NaNInputReachesOutputs) {
  Case c = small_case(215);
  c.lengths = {40};
  c.opt.mode = Mode::sparse;
  msatest::Problem pr = msatest::make_problem(c);
  msatest::BackendOutputs clean = msatest::run_backend(pr, c);  // its selection (qp, kp only)
  const int64_t T = 40, H = c.heads.H, D = c.heads.D, Dv = c.heads.Dv, t = 20, h = 1;
  pr.q.set((t * H + h) * D + 3, std::numeric_limits<double>::quiet_NaN());
  HostTensor o(DType::fp32, {T, H, Dv}), lse(DType::fp32, {H, T});
  flashmsa::sparse_attention_forward(pr.views(), clean.block_idx.view(), c.opt, o.view(), lse.view());
  for (int64_t d = 0; d < Dv; ++d) EXPECT_TRUE(std::isnan(o.get((t * H + h) * Dv + d))) << "o column " << d;
  EXPECT_TRUE(std::isnan(lse.get(h * T + t))) << "lse " << lse.get(h * T + t);
  int64_t non_finite_elsewhere = 0;
  for (int64_t r = 0; r < T * H; ++r) {
    if (r == t * H + h) continue;
    for (int64_t d = 0; d < Dv; ++d) non_finite_elsewhere += !std::isfinite(o.get(r * Dv + d));
    non_finite_elsewhere += !std::isfinite(lse.get((r % H) * T + r / H));
  }
  EXPECT_EQ(non_finite_elsewhere, 0);

  // ... and the backward's gradients: that row's dq, the dk / dv of the keys it attends, and the
  // KL value (its teacher row is NaN). The gradients start at zero too.
  const auto& hd = c.heads;
  HostTensor dq(DType::fp32, {T, H, D}), dk(DType::fp32, {T, hd.Hkv, D}), dv(DType::fp32, {T, hd.Hkv, Dv}),
      dqp(DType::fp32, {T, hd.Hp, hd.Dp}), dkp(DType::fp32, {T, hd.Hpk, hd.Dp}), kl(DType::fp32, {1});
  flashmsa::fused_backward(pr.views(), clean.block_idx.view(), o.view(), lse.view(), pr.d_o_t.view(),
                           flashmsa::TensorView(), c.opt,
                           flashmsa::Gradients{dq.view(), dk.view(), dv.view(), dqp.view(), dkp.view()},
                           kl.view());
  for (int64_t d = 0; d < D; ++d) EXPECT_TRUE(std::isnan(dq.get((t * H + h) * D + d))) << "dq column " << d;
  auto count_non_finite = [](const HostTensor& x) {
    int64_t n = 0;
    for (int64_t i = 0; i < x.numel(); ++i) n += !std::isfinite(x.get(i));
    return n;
  };
  EXPECT_GT(count_non_finite(dk), 0);
  EXPECT_GT(count_non_finite(dv), 0);
  EXPECT_TRUE(std::isnan(kl.get(0))) << "kl " << kl.get(0);
}

}  // namespace
