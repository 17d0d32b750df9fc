// Checks of the fp64 oracle on its own (flashmsa_oracle_tests): hand-computed values, the tie
// rule, structural identities, and analytic gradients against central finite differences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "reference/oracle.h"
#include "test_util.h"

namespace {

using msatest::random_normal;
using msatest::rel_l2;

oracle::Inputs random_inputs(const oracle::Config& c, uint64_t seed, double proxy_std = 1.0) {
  std::mt19937_64 rng(seed);
  const size_t T = static_cast<size_t>(c.T());
  oracle::Inputs in;
  in.q = random_normal(T * c.H * c.D, rng);
  in.k = random_normal(T * c.Hkv * c.D, rng);
  in.v = random_normal(T * c.Hkv * c.Dv, rng);
  in.qp = random_normal(T * c.Hp * c.Dp, rng, proxy_std);
  in.kp = random_normal(T * c.Hpk * c.Dp, rng, proxy_std);
  return in;
}

double inner(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

TEST(Oracle, SingleTokenByHand) {
  oracle::Config c;
  c.H = 2; c.Hkv = 1; c.Hp = 1; c.Hpk = 1; c.D = 3; c.Dv = 2; c.Dp = 2;
  c.cu_seqlens = {0, 1};
  c.top_k = 2; c.block_size = 4; c.kl_coeff = 2.0;
  oracle::Inputs in = random_inputs(c, 11);
  const auto sel = oracle::select_blocks(c, in);
  EXPECT_EQ(sel.block_idx, (std::vector<int32_t>{0, -1}));
  const auto f = oracle::forward(c, in, &sel.block_idx);
  // One key: P = 1, o = v, lse = the single logit, teacher = student = 1, KL = 0.
  for (int h = 0; h < 2; ++h) {
    for (int d = 0; d < 2; ++d) EXPECT_DOUBLE_EQ(f.o[h * 2 + d], in.v[d]);
    double logit = 0;
    for (int d = 0; d < 3; ++d) logit += in.q[h * 3 + d] * in.k[d];
    EXPECT_NEAR(f.lse[h], logit / std::sqrt(3.0), 1e-14);
  }
  EXPECT_NEAR(f.kl_loss, 0.0, 1e-15);
}

TEST(Oracle, TwoTokensByHand) {
  // H = Hkv = Hp = Hpk = 1, D = Dv = Dp = 1: every quantity is a scalar formula.
  oracle::Config c;
  c.D = c.Dv = c.Dp = 1;
  c.cu_seqlens = {0, 2};
  c.block_size = 1; c.top_k = 2; c.scale = 0.5; c.proxy_scale = 2.0; c.kl_coeff = 3.0;
  oracle::Inputs in{{0.3, -1.1}, {0.7, 0.2}, {1.5, -2.0}, {0.4, 0.9}, {-0.6, 1.3}};
  const auto f = oracle::forward(c, in, nullptr);
  // t = 1 attends to keys 0 and 1.
  const double a0 = 0.5 * -1.1 * 0.7, a1 = 0.5 * -1.1 * 0.2;
  const double Z = std::exp(a0) + std::exp(a1);
  const double P0 = std::exp(a0) / Z, P1 = std::exp(a1) / Z;
  EXPECT_NEAR(f.o[1], P0 * 1.5 + P1 * -2.0, 1e-14);
  EXPECT_NEAR(f.lse[1], std::log(Z), 1e-14);
  EXPECT_NEAR(f.o[0], 1.5, 1e-14);
  const double s0 = 2.0 * 0.9 * -0.6, s1 = 2.0 * 0.9 * 1.3;
  const double Zs = std::exp(s0) + std::exp(s1);
  const double Q0 = std::exp(s0) / Zs, Q1 = std::exp(s1) / Zs;
  const double kl1 = P0 * std::log(P0 / Q0) + P1 * std::log(P1 / Q1);
  EXPECT_NEAR(f.kl_loss, 3.0 * (0.0 + kl1) / 2.0, 1e-14);
  // Backward: dqp[1] = scale_p * coeff * sum_j (Q - P) kp[j] with coeff = g kl_coeff / (Hp T).
  const double g = 0.25;
  const auto b = oracle::backward(c, in, nullptr, {1.0, 1.0}, g);
  const double coeff = g * 3.0 / 2.0;
  EXPECT_NEAR(b.dqp[1], 2.0 * coeff * ((Q0 - P0) * -0.6 + (Q1 - P1) * 1.3), 1e-14);
  EXPECT_NEAR(b.dqp[0], 0.0, 1e-15);  // one key: Qs = Tch = 1
}

TEST(Oracle, SelectionTieRuleByHand) {
  // Dp = 1, qp = 1: scores are scale_p * kp, block maxima chosen by hand.
  oracle::Config c;
  c.D = c.Dv = c.Dp = 1;
  c.cu_seqlens = {0, 10};
  c.block_size = 2;
  c.proxy_scale = 1.0;
  oracle::Inputs in = random_inputs(c, 3);
  in.qp.assign(10, 1.0);
  in.kp = {0.1, 0.5, 0.3, 0.2, 0.5, 0.5, -1.0, 0.0, 9.0, 9.0};
  const int64_t t = 9;  // n_loc = 4; maxima of blocks 0..3: 0.5, 0.3, 0.5, 0.0
  auto row = [&](int K, int L) {
    c.top_k = K;
    c.local_blocks = L;
    const auto sel = oracle::select_blocks(c, in);
    return std::vector<int32_t>(sel.block_idx.begin() + t * K, sel.block_idx.begin() + (t + 1) * K);
  };
  EXPECT_EQ(row(1, 1), (std::vector<int32_t>{4}));
  EXPECT_EQ(row(2, 1), (std::vector<int32_t>{0, 4}));  // tie 0 vs 2 -> lower index
  EXPECT_EQ(row(3, 1), (std::vector<int32_t>{0, 2, 4}));
  EXPECT_EQ(row(4, 1), (std::vector<int32_t>{0, 1, 2, 4}));
  EXPECT_EQ(row(5, 1), (std::vector<int32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(row(7, 1), (std::vector<int32_t>{0, 1, 2, 3, 4, -1, -1}));
  EXPECT_EQ(row(2, 2), (std::vector<int32_t>{3, 4}));      // local_blocks = 2 forces block 3
  EXPECT_EQ(row(3, 2), (std::vector<int32_t>{0, 3, 4}));
  // The stored block scores: maxima of earlier blocks, +inf for the local block, -inf beyond.
  c.top_k = 2;
  c.local_blocks = 1;
  const auto sel = oracle::select_blocks(c, in);
  const double inf = std::numeric_limits<double>::infinity();
  const int nb = sel.max_blocks;
  EXPECT_EQ(nb, 5);
  EXPECT_DOUBLE_EQ(sel.scores[2 * nb + 0], 0.5);  // t = 2, n_loc = 1
  EXPECT_EQ(sel.scores[2 * nb + 1], inf);
  EXPECT_EQ(sel.scores[2 * nb + 2], -inf);
  EXPECT_DOUBLE_EQ(sel.scores[5 * nb + 1], 0.3);  // t = 5, n_loc = 2: block 1 = max(0.3, 0.2)
  EXPECT_EQ(sel.scores[5 * nb + 2], inf);
  EXPECT_EQ(sel.scores[5 * nb + 3], -inf);
}

TEST(Oracle, SelectionRowStructure) {
  oracle::Config c;
  c.H = 4; c.Hkv = 2; c.Hp = 2; c.Hpk = 1; c.D = 4; c.Dv = 4; c.Dp = 4;
  c.cu_seqlens = msatest::cu_from_lengths({13, 0, 1, 4, 30});
  c.block_size = 4; c.top_k = 3; c.local_blocks = 2;
  const auto in = random_inputs(c, 5);
  const auto sel = oracle::select_blocks(c, in);
  const int64_t T = c.T();
  for (size_t b = 0; b + 1 < c.cu_seqlens.size(); ++b) {
    for (int64_t t = c.cu_seqlens[b]; t < c.cu_seqlens[b + 1]; ++t) {
      const int n_loc = static_cast<int>((t - c.cu_seqlens[b]) / 4);
      for (int p = 0; p < 2; ++p) {
        const int32_t* row = &sel.block_idx[(p * T + t) * 3];
        const int count = std::min(3, n_loc + 1);
        for (int i = 0; i < 3; ++i) {
          if (i < count) {
            EXPECT_GE(row[i], 0);
            EXPECT_LE(row[i], n_loc);
            if (i) EXPECT_LT(row[i - 1], row[i]);
          } else {
            EXPECT_EQ(row[i], -1);
          }
        }
        EXPECT_TRUE(std::find(row, row + 3, n_loc) != row + 3);
        if (n_loc >= 1) EXPECT_TRUE(std::find(row, row + 3, n_loc - 1) != row + 3);
      }
    }
  }
}

TEST(Oracle, SparseWithEveryBlockEqualsDense) {
  oracle::Config c;
  c.H = 4; c.Hkv = 2; c.Hp = 2; c.Hpk = 1; c.D = 5; c.Dv = 3; c.Dp = 4;
  c.cu_seqlens = msatest::cu_from_lengths({9, 17, 3});
  c.block_size = 4; c.top_k = 5;  // >= 5 blocks: everything visible is selected
  c.kl_coeff = 0.8;
  const auto in = random_inputs(c, 7);
  const auto sel = oracle::select_blocks(c, in);
  std::mt19937_64 rng(8);
  const auto d_o = random_normal(static_cast<size_t>(c.T() * c.H * c.Dv), rng);
  const auto fs = oracle::forward(c, in, &sel.block_idx);
  const auto fd = oracle::forward(c, in, nullptr);
  EXPECT_LT(rel_l2(fs.o, fd.o), 1e-14);
  EXPECT_LT(rel_l2(fs.lse, fd.lse), 1e-14);
  EXPECT_NEAR(fs.kl_loss, fd.kl_loss, 1e-14);
  EXPECT_GT(fs.kl_loss, 0.0);
  const auto bs = oracle::backward(c, in, &sel.block_idx, d_o, 1.3);
  const auto bd = oracle::backward(c, in, nullptr, d_o, 1.3);
  EXPECT_LT(rel_l2(bs.dq, bd.dq), 1e-13);
  EXPECT_LT(rel_l2(bs.dk, bd.dk), 1e-13);
  EXPECT_LT(rel_l2(bs.dv, bd.dv), 1e-13);
  EXPECT_LT(rel_l2(bs.dqp, bd.dqp), 1e-13);
  EXPECT_LT(rel_l2(bs.dkp, bd.dkp), 1e-13);
  EXPECT_NEAR(bs.kl_loss, fs.kl_loss, 1e-14);
}

// A batch equals its sequences run one at a time (attention never crosses cu_seqlens).
TEST(Oracle, SequencesAreIndependent) {
  oracle::Config c;
  c.H = 2; c.Hkv = 1; c.Hp = 2; c.Hpk = 2; c.D = 3; c.Dv = 2; c.Dp = 3;
  const std::vector<int> lengths{6, 0, 11};
  c.cu_seqlens = msatest::cu_from_lengths(lengths);
  c.block_size = 3; c.top_k = 2;
  const auto in = random_inputs(c, 9);
  std::mt19937_64 rng(10);
  const auto d_o = random_normal(static_cast<size_t>(c.T() * c.H * c.Dv), rng);
  const auto sel = oracle::select_blocks(c, in);
  const auto f = oracle::forward(c, in, &sel.block_idx);
  const auto b = oracle::backward(c, in, &sel.block_idx, d_o, 1.0);

  double kl_sum = 0;
  for (size_t s = 0; s < lengths.size(); ++s) {
    const int64_t t0 = c.cu_seqlens[s], len = lengths[s];
    oracle::Config cs = c;
    cs.cu_seqlens = {0, static_cast<int32_t>(len)};
    auto slice = [&](const std::vector<double>& x, int64_t width) {
      return std::vector<double>(x.begin() + t0 * width, x.begin() + (t0 + len) * width);
    };
    oracle::Inputs is{slice(in.q, c.H * c.D), slice(in.k, c.Hkv * c.D), slice(in.v, c.Hkv * c.Dv),
                      slice(in.qp, c.Hp * c.Dp), slice(in.kp, c.Hpk * c.Dp)};
    const auto ss = oracle::select_blocks(cs, is);
    for (int p = 0; p < c.Hp; ++p)
      for (int64_t t = 0; t < len; ++t)
        for (int i = 0; i < c.top_k; ++i)
          EXPECT_EQ(ss.block_idx[(p * len + t) * c.top_k + i],
                    sel.block_idx[(p * c.T() + t0 + t) * c.top_k + i]);
    const auto fs = oracle::forward(cs, is, &ss.block_idx);
    // The KL mean is over T tokens, so g = len / T gives the proxy the batch's coefficient.
    const double g = double(len) / double(c.T());
    const auto bsq = oracle::backward(cs, is, &ss.block_idx, slice(d_o, c.H * c.Dv), g);
    EXPECT_LT(msatest::max_abs_diff(fs.o, slice(f.o, c.H * c.Dv)), 1e-13);
    EXPECT_LT(msatest::max_abs_diff(bsq.dq, slice(b.dq, c.H * c.D)), 1e-13);
    EXPECT_LT(msatest::max_abs_diff(bsq.dk, slice(b.dk, c.Hkv * c.D)), 1e-13);
    EXPECT_LT(msatest::max_abs_diff(bsq.dv, slice(b.dv, c.Hkv * c.Dv)), 1e-13);
    EXPECT_LT(msatest::max_abs_diff(bsq.dqp, slice(b.dqp, c.Hp * c.Dp)), 1e-13);
    EXPECT_LT(msatest::max_abs_diff(bsq.dkp, slice(b.dkp, c.Hpk * c.Dp)), 1e-13);
    // The per-sequence loss is a mean over its own tokens; the batch mean is over all T.
    kl_sum += fs.kl_loss * double(c.Hp) * double(len);
  }
  EXPECT_NEAR(f.kl_loss, kl_sum / (double(c.Hp) * double(c.T())), 1e-14);
}

// With m = 1, qp = q, kp = k and equal scales the student is the teacher: KL = 0 and the
// proxy gets no gradient.
TEST(Oracle, StudentEqualToTeacherHasZeroKl) {
  oracle::Config c;
  c.H = 2; c.Hkv = 1; c.Hp = 2; c.Hpk = 1; c.D = c.Dv = c.Dp = 4;
  c.cu_seqlens = msatest::cu_from_lengths({12, 7});
  c.block_size = 2; c.top_k = 3;
  oracle::Inputs in = random_inputs(c, 12);
  in.qp = in.q;
  in.kp = in.k;
  const auto sel = oracle::select_blocks(c, in);
  const auto f = oracle::forward(c, in, &sel.block_idx);
  EXPECT_NEAR(f.kl_loss, 0.0, 1e-14);
  std::mt19937_64 rng(13);
  const auto b = oracle::backward(c, in, &sel.block_idx,
                                  random_normal(static_cast<size_t>(c.T() * c.H * c.Dv), rng), 2.0);
  for (double x : b.dqp) EXPECT_NEAR(x, 0.0, 1e-14);
  for (double x : b.dkp) EXPECT_NEAR(x, 0.0, 1e-14);
}

// Analytic gradients vs central differences of L = <dO, o> + g * kl_loss with the selection
// fixed. The teacher is detached (msa.md), so for q, k, v the differenced loss is <dO, o> only;
// qp and kp do not enter o, so for them the full L is differenced.
struct FdCase {
  const char* name;
  int H, Hkv, Hp, Hpk, D, Dv, Dp;
  std::vector<int> lengths;
  int block_size, top_k, local_blocks;
  bool dense;
};

class OracleFiniteDifferences : public ::testing::TestWithParam<FdCase> {};

TEST_P(OracleFiniteDifferences, AllFiveGradients) {
  const FdCase& fc = GetParam();
  oracle::Config c;
  c.H = fc.H; c.Hkv = fc.Hkv; c.Hp = fc.Hp; c.Hpk = fc.Hpk;
  c.D = fc.D; c.Dv = fc.Dv; c.Dp = fc.Dp;
  c.cu_seqlens = msatest::cu_from_lengths(fc.lengths);
  c.block_size = fc.block_size; c.top_k = fc.top_k; c.local_blocks = fc.local_blocks;
  c.scale = 0.45; c.proxy_scale = 0.6; c.kl_coeff = 1.7;
  const double g = 0.65;
  oracle::Inputs in = random_inputs(c, 21);
  std::mt19937_64 rng(22);
  const auto d_o = random_normal(static_cast<size_t>(c.T() * c.H * c.Dv), rng);
  const auto sel = oracle::select_blocks(c, in);
  const std::vector<int32_t>* idx = fc.dense ? nullptr : &sel.block_idx;
  if (!fc.dense) {
    // The case must be genuinely sparse somewhere, or it would not test the masking.
    EXPECT_TRUE(std::any_of(sel.block_idx.begin(), sel.block_idx.end(),
                            [](int32_t n) { return n > 0; }));
  }
  const auto an = oracle::backward(c, in, idx, d_o, g);
  EXPECT_GT(an.kl_loss, 0.0);

  auto loss = [&](const oracle::Inputs& x, bool with_kl) {
    const auto f = oracle::forward(c, x, idx);
    return inner(d_o, f.o) + (with_kl ? g * f.kl_loss : 0.0);
  };
  struct Target {
    const char* name;
    std::vector<double> oracle::Inputs::*field;
    const std::vector<double>* grad;
    bool with_kl;
  };
  const Target targets[] = {{"dq", &oracle::Inputs::q, &an.dq, false},
                            {"dk", &oracle::Inputs::k, &an.dk, false},
                            {"dv", &oracle::Inputs::v, &an.dv, false},
                            {"dqp", &oracle::Inputs::qp, &an.dqp, true},
                            {"dkp", &oracle::Inputs::kp, &an.dkp, true}};
  const double eps = 1e-5;
  for (const Target& tg : targets) {
    SCOPED_TRACE(tg.name);
    std::vector<double> fd((in.*tg.field).size());
    for (size_t i = 0; i < fd.size(); ++i) {
      oracle::Inputs x = in;
      (x.*tg.field)[i] += eps;
      const double lp = loss(x, tg.with_kl);
      (x.*tg.field)[i] -= 2 * eps;
      const double lm = loss(x, tg.with_kl);
      fd[i] = (lp - lm) / (2 * eps);
    }
    double scale = 0;
    for (double e : *tg.grad) scale = std::max(scale, std::fabs(e));
    EXPECT_GT(scale, 1e-6) << "gradient is identically zero: the check would be vacuous";
    EXPECT_LT(msatest::max_abs_diff(fd, *tg.grad), 1e-7 * (1 + scale));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Oracle, OracleFiniteDifferences,
    ::testing::Values(
        FdCase{"sparse_gqa", 4, 2, 2, 1, 3, 2, 3, {5, 11}, 2, 2, 1, false},
        FdCase{"sparse_m1_local2", 2, 1, 2, 2, 3, 3, 2, {9, 0, 4}, 2, 3, 2, false},
        FdCase{"dense_gqa", 4, 2, 2, 1, 3, 2, 3, {5, 11}, 2, 2, 1, true},
        FdCase{"dense_m1", 2, 2, 2, 1, 2, 3, 2, {7, 3}, 3, 1, 1, true}),
    [](const ::testing::TestParamInfo<FdCase>& info) { return std::string(info.param.name); });

}  // namespace

namespace {

// The test helpers' own rounding (used to build every bf16/fp16 input), at the halfway cases.
TEST(TestUtil, Bf16RoundsToNearestEven) {
  using msatest::bf16_to_float;
  using msatest::float_to_bf16;
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(float_to_bf16(1.00390625f), 0x3F80);    // 1 + 2^-8: halfway, even is 1.0
  EXPECT_EQ(float_to_bf16(1.01171875f), 0x3F82);    // 1 + 3*2^-8: halfway, even is 1 + 2^-6
  EXPECT_EQ(float_to_bf16(std::nextafter(1.00390625f, 2.f)), 0x3F81);  // just above halfway
  EXPECT_EQ(float_to_bf16(-2.5f), 0xC020);
  EXPECT_EQ(float_to_bf16(3.4e38f), 0x7F80);        // above the largest bf16: inf
  EXPECT_EQ(bf16_to_float(0x3F82), 1.015625f);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
}

TEST(TestUtil, HalfRoundsToNearestEven) {
  using msatest::float_to_half;
  using msatest::half_to_float;
  EXPECT_EQ(float_to_half(1.0f), 0x3C00);
  EXPECT_EQ(float_to_half(1.0f + 1.0f / 2048), 0x3C00);   // halfway, even is 1.0
  EXPECT_EQ(float_to_half(1.0f + 3.0f / 2048), 0x3C02);   // halfway, even is up
  EXPECT_EQ(half_to_float(float_to_half(2051.f)), 2052.f);
  EXPECT_EQ(half_to_float(float_to_half(2049.f)), 2048.f);
  EXPECT_EQ(float_to_half(65519.f), 0x7BFF);              // rounds down to 65504
  EXPECT_EQ(float_to_half(65520.f), 0x7C00);              // halfway to 65536: inf
  EXPECT_EQ(float_to_half(-65504.f), 0xFBFF);
  EXPECT_EQ(float_to_half(std::ldexp(1.f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_half(std::ldexp(1.f, -25)), 0x0000);  // halfway to it: even is 0
  EXPECT_EQ(float_to_half(std::ldexp(3.f, -25)), 0x0002);  // 1.5 units: even is 2
  EXPECT_EQ(float_to_half(std::ldexp(1.f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(float_to_half(std::ldexp(1023.75f, -24)), 0x0400);  // subnormal rounding up into normal
  EXPECT_EQ(half_to_float(0x0001), std::ldexp(1.f, -24));
  EXPECT_EQ(half_to_float(0xC000), -2.f);
  EXPECT_EQ(half_to_float(0x7C00), std::numeric_limits<float>::infinity());
  // Every finite half round-trips exactly.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7C00) == 0x7C00) continue;
    ASSERT_EQ(float_to_half(half_to_float(static_cast<uint16_t>(h))), h) << std::hex << h;
  }
}

}  // namespace
