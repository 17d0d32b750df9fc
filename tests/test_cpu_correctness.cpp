// The CPU backend through the public API against the fp64 oracle: both modes, fp32 and bf16,
// several head layouts, the tie rule, options and the convenience entry points.
#include <gtest/gtest.h>

#include <iterator>
#include <string>
#include <tuple>

#include "test_util.h"

namespace {

using flashmsa::DType;
using flashmsa::Mode;
using msatest::Case;
using msatest::Heads;

Case base_case(DType dtype, Mode mode, uint64_t seed) {
  Case c;
  c.dtype = dtype;
  c.opt.mode = mode;
  c.opt.block_size = 8;
  c.opt.top_k = 4;
  c.lengths = {37, 64, 5, 90};  // partial last blocks, a short sequence, up to 12 blocks
  c.seed = seed;
  return c;
}

struct HeadCase {
  const char* name;
  Heads heads;
};

// Head layouts: GQA with m > 1, Hpk < Hp; m = 1; Hpk = Hp; odd head dims (no multiple of 8,
// to catch vector-tail bugs) with D != Dv != Dp.
const HeadCase kHeadCases[] = {
    {"gqa", {4, 2, 2, 1, 16, 16, 8}},
    {"m1", {4, 2, 4, 2, 16, 16, 8}},
    {"hpk_eq_hp", {8, 2, 2, 2, 16, 16, 8}},
    {"mha_odd_dims", {6, 6, 3, 1, 20, 12, 6}},
    {"wide", {8, 1, 2, 1, 64, 32, 16}},
};

using Param = std::tuple<int, DType, Mode>;

class CpuVsOracle : public ::testing::TestWithParam<Param> {};

TEST_P(CpuVsOracle, ForwardBackward) {
  const auto [head_case, dtype, mode] = GetParam();
  Case c = base_case(dtype, mode, 100 + head_case);
  c.heads = kHeadCases[head_case].heads;
  if (mode == Mode::warmup) c.lengths = {37, 64, 5};  // quadratic oracle: keep it small
  msatest::check_case(c);
}

INSTANTIATE_TEST_SUITE_P(
    Cpu, CpuVsOracle,
    ::testing::Combine(::testing::Range(0, static_cast<int>(std::size(kHeadCases))),
                       ::testing::Values(DType::fp32, DType::bf16),
                       ::testing::Values(Mode::sparse, Mode::warmup)),
    [](const ::testing::TestParamInfo<Param>& info) {
      // std::get, not a structured binding: its commas would split the macro arguments.
      return std::string(kHeadCases[std::get<0>(info.param)].name) + "_" +
             flashmsa::dtype_name(std::get<1>(info.param)) + "_" +
             (std::get<2>(info.param) == Mode::sparse ? "sparse" : "warmup");
    });

// Integer proxies give exact fp32 scores with many exact ties: the backend's selection must then
// equal the oracle's tie rule (lower block index wins) element for element.
TEST(CpuSelection, ExactTieRule) {
  for (int local : {1, 2}) {
    SCOPED_TRACE("local_blocks=" + std::to_string(local));
    Case c = base_case(DType::fp32, Mode::sparse, 7 + local);
    c.heads = {4, 2, 2, 1, 8, 8, 4};
    c.integer_proxy = true;
    c.opt.local_blocks = local;
    c.opt.top_k = 3;
    c.opt.block_size = 4;
    const msatest::BackendOutputs out = msatest::check_case(c);
    msatest::Problem pr = msatest::make_problem(c);
    const oracle::Selection sel = oracle::select_blocks(pr.cfg, pr.in);
    const std::vector<int32_t> got = out.block_idx.to_ints();
    ASSERT_EQ(got.size(), sel.block_idx.size());
    int64_t mismatches = 0, first = -1;
    for (size_t i = 0; i < got.size(); ++i)
      if (got[i] != sel.block_idx[i] && mismatches++ == 0) first = static_cast<int64_t>(i);
    EXPECT_EQ(mismatches, 0) << "first mismatch at flat index " << first << " (p, t, slot = "
                             << first / (pr.cfg.T() * 3) << ", " << (first / 3) % pr.cfg.T()
                             << ", " << first % 3 << ")";
  }
}

// The same call on bf16 inputs: selection scores are fp32 from the bf16 values, so the
// oracle (run on the rounded values) agrees up to rounding.
TEST(CpuSelection, Bf16ScoresFromRoundedInputs) {
  Case c = base_case(DType::bf16, Mode::sparse, 31);
  c.opt.top_k = 2;
  c.lengths = {200, 77};
  msatest::check_case(c);
}

TEST(CpuOptions, ExplicitScalesAndKlCoeff) {
  for (Mode mode : {Mode::sparse, Mode::warmup}) {
    Case c = base_case(DType::fp32, mode, 41);
    c.opt.scale = 0.3f;
    c.opt.proxy_scale = 0.7f;
    c.opt.kl_coeff = 2.5f;
    c.kl_grad = -1.75;
    msatest::check_case(c);
  }
}

TEST(CpuOptions, KlGradAbsentMeansOne) {
  for (Mode mode : {Mode::sparse, Mode::warmup}) {
    Case c = base_case(DType::fp32, mode, 43);
    c.pass_kl_grad = false;
    c.opt.kl_coeff = 0.5f;
    msatest::check_case(c);
  }
}

TEST(CpuOptions, KlNotRequested) {
  for (Mode mode : {Mode::sparse, Mode::warmup}) {
    Case c = base_case(DType::bf16, mode, 47);
    c.request_kl = false;
    msatest::check_case(c);
  }
}

TEST(CpuOptions, ThreadCounts) {
  for (int threads : {1, 3, 0}) {
    SCOPED_TRACE("num_threads=" + std::to_string(threads));
    Case c = base_case(DType::fp32, Mode::sparse, 53);
    c.opt.num_threads = threads;
    msatest::check_case(c);
    c.opt.mode = Mode::warmup;
    c.lengths = {40, 61};
    msatest::check_case(c);
  }
}

TEST(CpuEntryPoints, MsaForwardBackwardBothModes) {
  for (Mode mode : {Mode::sparse, Mode::warmup}) {
    for (DType dtype : {DType::fp32, DType::bf16}) {
      SCOPED_TRACE(std::string(mode == Mode::sparse ? "sparse " : "warmup ") + flashmsa::dtype_name(dtype));
      Case c = base_case(dtype, mode, 59);
      c.use_msa_entry = true;
      msatest::check_case(c);
    }
  }
}

// Proxy inputs with a large spread make the student softmax peaky; small ones make it flat.
TEST(CpuVsOracleProxyScale, PeakyAndFlatStudent) {
  for (double stddev : {0.2, 3.0}) {
    SCOPED_TRACE("proxy_std=" + std::to_string(stddev));
    Case c = base_case(DType::fp32, Mode::sparse, 61);
    c.proxy_std = stddev;
    msatest::check_case(c);
  }
}

}  // namespace
