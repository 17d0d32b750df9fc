// GPU block selection and block-sparse forward against the host reference of gpu_test_util.h
// and against the CPU backend (through the public API) on the GPU's own selection.
// Every output buffer is poisoned before each call, so an element the GPU never writes fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "flashmsa/flashmsa.h"
#include "gpu_test_util.h"

namespace {

using flashmsa::DType;
using gputest::DeviceBuffer;
using gputest::Problem;
using gputest::ScopedEnv;
using gputest::Shape;
using gputest::shape;

constexpr double kScoreTol = 2e-3;  // fp32-from-bf16 scores vs double: rounding only

// Relative error of a kl value, floored so a zero reference cannot divide by zero. Two
// overloads keep the difference in the precision of its operands (float - float stays float).
double rel_err(float got, float ref) {
  return std::fabs(got - ref) / std::max(1e-12, std::fabs(static_cast<double>(ref)));
}
double rel_err(float got, double ref) { return std::fabs(got - ref) / std::max(1e-12, std::fabs(ref)); }

struct GpuForward {
  std::vector<int32_t> sel;
  std::vector<double> o, lse;
  float kl = 0;
};

// Device block_idx, o, lse and kl of one forward of pr, poisoned when made.
struct DeviceForward {
  const Problem& pr;
  DeviceBuffer sel, o, lse, kl;

  explicit DeviceForward(const Problem& p)
      : pr(p),
        sel(static_cast<size_t>(p.s.Hp * p.T * p.s.K) * 4),
        o(static_cast<size_t>(p.T * p.s.H * p.s.D) * 2),
        lse(static_cast<size_t>(p.s.H * p.T) * 4),
        kl(4) {
    sel.fill(gputest::kIntPoisonByte);
    o.fill(gputest::kFloatPoison);
    lse.fill(gputest::kFloatPoison);
    kl.fill(gputest::kFloatPoison);
  }
  flashmsa::TensorView sel_v() const { return gputest::dview(sel, DType::int32, {pr.s.Hp, pr.T, pr.s.K}); }
  flashmsa::TensorView o_v() const { return gputest::dview(o, DType::bf16, {pr.T, pr.s.H, pr.s.D}); }
  flashmsa::TensorView lse_v() const { return gputest::dview(lse, DType::fp32, {pr.s.H, pr.T}); }
  flashmsa::TensorView kl_v(bool with_kl = true) const {
    return with_kl ? gputest::dview(kl, DType::fp32, {1}) : flashmsa::TensorView();
  }
  // Everything, back on the host.
  GpuForward take() const {
    GpuForward r;
    r.sel = sel.download<int32_t>();
    r.o = gputest::bf16_to_doubles(o.download<uint16_t>());
    auto l = lse.download<float>();
    r.lse.assign(l.begin(), l.end());
    r.kl = kl.download<float>()[0];
    return r;
  }
};

// select_blocks then sparse_attention_forward on the device, outputs poisoned first.
GpuForward run_gpu(const Problem& pr, bool with_kl = true) {
  auto in = pr.device_inputs();
  auto opt = pr.options();
  DeviceForward d(pr);
  flashmsa::select_blocks(in, opt, d.sel_v());
  flashmsa::sparse_attention_forward(in, d.sel_v(), opt, d.o_v(), d.lse_v(), d.kl_v(with_kl));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return d.take();
}

// The CPU backend's forward on the GPU's selection, through the public API.
struct CpuForward {
  std::vector<double> o, lse;
  float kl = 0;
};
CpuForward run_cpu_forward_or_throw(Problem& pr, std::vector<int32_t> sel) {
  const Shape& s = pr.s;
  CpuForward r;
  std::vector<uint16_t> o(static_cast<size_t>(pr.T * s.H * s.D), 0xFFFF);
  std::vector<float> lse(static_cast<size_t>(s.H * pr.T), std::nanf(""));
  float kl = std::nanf("");
  flashmsa::sparse_attention_forward(
      pr.host_inputs(), flashmsa::make_view(sel.data(), DType::int32, {s.Hp, pr.T, s.K}),
      pr.options(), flashmsa::make_view(o.data(), DType::bf16, {pr.T, s.H, s.D}),
      flashmsa::make_view(lse.data(), DType::fp32, {s.H, pr.T}),
      flashmsa::make_view(&kl, DType::fp32, {1}));
  r.o = gputest::bf16_to_doubles(o);
  r.lse.assign(lse.begin(), lse.end());
  r.kl = kl;
  return r;
}
// The same, recording a test failure and returning false when the CPU backend throws.
bool run_cpu_forward(Problem& pr, const std::vector<int32_t>& sel, CpuForward& out) {
  try {
    out = run_cpu_forward_or_throw(pr, sel);
    return true;
  } catch (const flashmsa::Error& e) {
    ADD_FAILURE() << "CPU backend forward failed: " << e.what();
    return false;
  }
}

void check_forward_case(const Shape& s, uint64_t seed) {
  Problem pr;
  gputest::make_problem(pr, s, seed);
  const GpuForward g = run_gpu(pr);
  if (::testing::Test::HasFatalFailure()) return;

  int64_t unwritten = 0;
  for (int32_t x : g.sel) unwritten += x == gputest::kIntPoison;
  ASSERT_EQ(unwritten, 0) << "block_idx entries never written";
  gputest::check_selection(pr, g.sel, kScoreTol);

  ASSERT_EQ(gputest::count_nonfinite(g.o), 0) << "o has unwritten (NaN) elements";
  ASSERT_EQ(gputest::count_nonfinite(g.lse), 0) << "lse has unwritten (NaN) elements";
  ASSERT_TRUE(std::isfinite(g.kl)) << "kl not written";

  const gputest::RefForward ref = gputest::reference_forward(pr, g.sel, pr.options().kl_coeff);
  const double o_err = gputest::rel_l2(g.o, ref.o);
  const double lse_err = gputest::max_abs_diff(g.lse, ref.lse);
  const double kl_err = rel_err(g.kl, ref.kl);
  EXPECT_LT(o_err, 1e-2) << "o rel L2 vs host reference";
  EXPECT_LT(lse_err, 1e-3) << "lse max abs vs host reference";
  EXPECT_LT(kl_err, 1e-2) << "kl rel vs host reference: gpu " << g.kl << " ref " << ref.kl;
  EXPECT_GT(ref.kl, 0.0) << "a KL of zero would make the check vacuous";

  CpuForward c;
  if (!run_cpu_forward(pr, g.sel, c)) return;
  EXPECT_LT(gputest::rel_l2(g.o, c.o), 1e-2) << "o rel L2 vs CPU backend";
  EXPECT_LT(gputest::max_abs_diff(g.lse, c.lse), 1e-3) << "lse max abs vs CPU backend";
  EXPECT_LT(rel_err(g.kl, c.kl), 1e-2)
      << "kl vs CPU backend: gpu " << g.kl << " cpu " << c.kl;
  std::printf("    T=%lld H=%d Hkv=%d Hp=%d Hpk=%d D=%d K=%d L=%d: o %.2e lse %.2e kl %.2e (kl=%.5f)\n",
              static_cast<long long>(pr.T), s.H, s.Hkv, s.Hp, s.Hpk, s.D, s.K, s.local_blocks,
              o_err, lse_err, kl_err, g.kl);
}

// The M3 group shape (m = 16 heads on one kv head, 4 proxy heads on one proxy key head), a
// few thousand tokens, T not a multiple of 128, more blocks than K. The KL value takes the
// KV-major route (launch_kl_value) behind the query-major forward.
TEST(CudaForward, M3GroupD128) {
  GPUTEST_REQUIRE_DEVICE();
  check_forward_case(shape(64, 4, 4, 1, 128, 16, {3001}), 11);
}

TEST(CudaForward, GqaD64SeveralSequences) {
  GPUTEST_REQUIRE_DEVICE();
  check_forward_case(shape(8, 2, 4, 2, 64, 8, {1000, 130, 77, 2100}), 12);
}

// m = 1 and Hpk = Hp.
TEST(CudaForward, OneHeadPerProxyHead) {
  GPUTEST_REQUIRE_DEVICE();
  check_forward_case(shape(4, 4, 4, 4, 64, 4, {900, 1}), 13);
}

// K = 1: only the own block.
TEST(CudaForward, LocalOnlyK1) {
  GPUTEST_REQUIRE_DEVICE();
  check_forward_case(shape(8, 2, 2, 2, 128, 1, {700, 300}), 14);
}

// Sequences shorter than a block and with fewer visible blocks than K.
TEST(CudaForward, FewerVisibleBlocksThanK) {
  GPUTEST_REQUIRE_DEVICE();
  check_forward_case(shape(8, 1, 2, 1, 128, 16, {50, 200, 129, 1, 128, 640}), 15);
}

// Many short sequences, zero-length ones among them.
TEST(CudaForward, FiveHundredShortSequences) {
  GPUTEST_REQUIRE_DEVICE();
  std::mt19937_64 rng(99);
  std::vector<int> lengths(500);
  for (int& l : lengths) l = static_cast<int>(rng() % 300);
  lengths[0] = 0;
  lengths[17] = 0;
  lengths[18] = 0;
  lengths[499] = 0;
  check_forward_case(shape(4, 1, 2, 1, 64, 2, lengths), 16);
}

// Several local blocks.
TEST(CudaForward, ThreeLocalBlocks) {
  GPUTEST_REQUIRE_DEVICE();
  check_forward_case(shape(4, 2, 2, 1, 64, 5, {2000}, 3), 17);
}

// Groups that straddle kv heads (m = 6, H/Hkv = 4) and a group larger than 16 rows.
TEST(CudaForward, OddHeadRatios) {
  GPUTEST_REQUIRE_DEVICE();
  check_forward_case(shape(12, 3, 2, 1, 64, 6, {1500}), 18);
  check_forward_case(shape(32, 1, 1, 1, 64, 8, {1200}), 19);
}

// K > 16 (the 32-entry top-K path).
TEST(CudaForward, LargeK) {
  GPUTEST_REQUIRE_DEVICE();
  check_forward_case(shape(4, 1, 1, 1, 128, 20, {4000, 700}), 20);
}

// ---- top_k > 32: the windowed kernels (what the dense warm-up runs). The selector stops at
// 32, so these rows are built on the host: min(K, n_loc+1) distinct visible blocks with the
// local one, ascending, -1 padding, the others drawn at random.
std::vector<int32_t> random_selection(const Problem& pr, uint64_t seed) {
  const Shape& s = pr.s;
  std::mt19937_64 rng(seed);
  std::vector<int32_t> sel(static_cast<size_t>(s.Hp * pr.T * s.K), -1);
  for (int p = 0; p < s.Hp; ++p)
    for (int b = 0; b < pr.B; ++b)
      for (int64_t t = pr.cu[b]; t < pr.cu[b + 1]; ++t) {
        const int n_loc = static_cast<int>(t - pr.cu[b]) / 128;
        std::vector<int32_t> pool(n_loc);  // blocks 0 .. n_loc-1; n_loc itself is always in
        for (int i = 0; i < n_loc; ++i) pool[i] = i;
        std::shuffle(pool.begin(), pool.end(), rng);
        const int want = std::min(s.K, n_loc + 1);
        pool.resize(want - 1);
        pool.push_back(n_loc);
        std::sort(pool.begin(), pool.end());
        std::copy(pool.begin(), pool.end(), sel.begin() + (p * pr.T + t) * s.K);
      }
  return sel;
}

// sparse_attention_forward on the device over a given selection, outputs poisoned first.
GpuForward run_gpu_on(const Problem& pr, const std::vector<int32_t>& sel, bool with_kl, bool det = false) {
  DeviceForward d(pr);
  d.sel.upload(sel);
  auto opt = pr.options();
  opt.deterministic = det;
  flashmsa::sparse_attention_forward(pr.device_inputs(), d.sel_v(), opt, d.o_v(), d.lse_v(), d.kl_v(with_kl));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  GpuForward r = d.take();
  r.sel = sel;
  return r;
}

// With and without kl against the CPU backend (and, with host_ref, the fp64 host reference) on
// the same host-built selection; o and lse must not depend on whether kl is asked for.
void check_wide_case(const Shape& s, uint64_t seed, bool host_ref) {
  ASSERT_GT(s.K, 32);
  Problem pr;
  gputest::make_problem(pr, s, seed);
  const std::vector<int32_t> sel = random_selection(pr, seed + 1000);
  int64_t wide_rows = 0;  // rows whose visible entries reach past the first window of 32
  for (int64_t u = 0; u < s.Hp * pr.T; ++u) wide_rows += sel[u * s.K + 32] >= 0;
  ASSERT_GT(wide_rows, 0) << "no row uses a second window: the case tests nothing new";

  const GpuForward g = run_gpu_on(pr, sel, /*with_kl=*/true);
  const GpuForward n = run_gpu_on(pr, sel, /*with_kl=*/false);
  if (::testing::Test::HasFatalFailure()) return;
  ASSERT_EQ(gputest::count_nonfinite(g.o), 0) << "o has unwritten (NaN) elements";
  ASSERT_EQ(gputest::count_nonfinite(g.lse), 0) << "lse has unwritten (NaN) elements";
  ASSERT_TRUE(std::isfinite(g.kl)) << "kl not written";
  EXPECT_EQ(n.o, g.o) << "o differs without the kl output";
  EXPECT_EQ(n.lse, g.lse) << "lse differs without the kl output";

  CpuForward c;
  if (!run_cpu_forward(pr, sel, c)) return;
  const double o_err = gputest::rel_l2(g.o, c.o), lse_err = gputest::max_abs_diff(g.lse, c.lse);
  const double kl_err = rel_err(g.kl, c.kl);
  EXPECT_LT(o_err, 1e-2) << "o rel L2 vs CPU backend";
  EXPECT_LT(lse_err, 1e-3) << "lse max abs vs CPU backend";
  EXPECT_LT(kl_err, 1e-2) << "kl vs CPU backend: gpu " << g.kl << " cpu " << c.kl;
  EXPECT_GT(c.kl, 0.f) << "a KL of zero would make the check vacuous";
  if (host_ref) {
    const gputest::RefForward ref = gputest::reference_forward(pr, sel, pr.options().kl_coeff);
    EXPECT_LT(gputest::rel_l2(g.o, ref.o), 1e-2) << "o rel L2 vs host reference";
    EXPECT_LT(gputest::max_abs_diff(g.lse, ref.lse), 1e-3) << "lse max abs vs host reference";
    EXPECT_LT(rel_err(g.kl, ref.kl), 1e-2)
        << "kl vs host reference: gpu " << g.kl << " ref " << ref.kl;
  }
  std::printf("    wide T=%lld H=%d Hkv=%d Hp=%d Hpk=%d D=%d K=%d (%lld rows > 32): o %.2e lse %.2e kl %.2e "
              "(kl=%.5f)\n",
              static_cast<long long>(pr.T), s.H, s.Hkv, s.Hp, s.Hpk, s.D, s.K, static_cast<long long>(wide_rows),
              o_err, lse_err, kl_err, g.kl);
}

// One sequence of 43 blocks (K = 40 picks among them; K = 70 takes all and pads a whole
// window), plus sequences with fewer visible blocks than K and an empty one.
const std::vector<int> kWideLengths = {5500, 300, 0, 150, 60};

// The M3 group shape (16 heads on one kv head): the KL runs fused in the forward kernel.
TEST(CudaForward, WideTopKFusedKl) {
  GPUTEST_REQUIRE_DEVICE();
  check_wide_case(shape(16, 1, 1, 1, 64, 40, kWideLengths), 61, true);
  check_wide_case(shape(16, 1, 1, 1, 64, 70, kWideLengths), 62, true);
}

// D = 128 instantiation of the fused path (CPU backend only, to keep the reference quick).
TEST(CudaForward, WideTopKFusedKlD128) {
  GPUTEST_REQUIRE_DEVICE();
  check_wide_case(shape(16, 1, 1, 1, 128, 40, {4700, 900, 37}), 63, false);
}

// m = 6 spanning kv heads (H/Hkv = 4): the KL takes kl_rows_kernel, window by window.
TEST(CudaForward, WideTopKKlRows) {
  GPUTEST_REQUIRE_DEVICE();
  check_wide_case(shape(12, 3, 2, 1, 64, 40, kWideLengths), 64, true);
  check_wide_case(shape(12, 3, 2, 1, 64, 70, kWideLengths), 65, true);
}


// select_blocks + the forward without the kl output: o and lse written, against the host reference.
void check_without_kl_vs_reference(const Shape& s, uint64_t seed) {
  Problem pr;
  gputest::make_problem(pr, s, seed);
  const GpuForward g = run_gpu(pr, /*with_kl=*/false);
  ASSERT_EQ(gputest::count_nonfinite(g.o), 0);
  ASSERT_EQ(gputest::count_nonfinite(g.lse), 0);
  const gputest::RefForward ref = gputest::reference_forward(pr, g.sel, 1.0);
  EXPECT_LT(gputest::rel_l2(g.o, ref.o), 1e-2);
  EXPECT_LT(gputest::max_abs_diff(g.lse, ref.lse), 1e-3);
}

// FLASHMSA_FORWARD_PATH for one scope (nullptr: unset, the default routing).
struct ScopedForwardPath : ScopedEnv {
  explicit ScopedForwardPath(const char* value) : ScopedEnv("FLASHMSA_FORWARD_PATH", value) {}
};

// pr's block selection (it reads qp and kp only), computed once through the query-major path so
// that the tests below can run every forward path on the same selection.
std::vector<int32_t> selection_of(const Problem& pr) {
  ScopedForwardPath query("query");
  return run_gpu(pr).sel;
}

// The KV-major path (forward_kv.cu: groups of m = 2, 4, 8, 16 heads on one kv head, D = 128, not
// deterministic) is the default only for m < 16; these tests force it for their scope.
struct ForceKvPath : ScopedForwardPath {
  ForceKvPath() : ScopedForwardPath("kv") {}
};

// KV-major: several token chunks (>= 1024 tokens each), sequences crossing chunk boundaries, a
// zero-length sequence, sequences with fewer visible blocks than K.
TEST(CudaForward, KvMajorM3SeveralChunks) {
  GPUTEST_REQUIRE_DEVICE();
  ForceKvPath kv;
  check_forward_case(shape(64, 4, 4, 1, 128, 16, {1100, 37, 0, 900, 128, 700}), 41);
}

// KV-major with Hpk = Hp, two kv heads, and many short sequences (thousands of tiny lists).
TEST(CudaForward, KvMajorManyShortSequences) {
  GPUTEST_REQUIRE_DEVICE();
  ForceKvPath kv;
  std::mt19937_64 rng(7);
  std::vector<int> lengths(150);
  for (int& l : lengths) l = static_cast<int>(rng() % 150);
  lengths[3] = 0;
  lengths[149] = 0;
  check_forward_case(shape(32, 2, 2, 2, 128, 4, lengths), 42);
}

// KV-major without the kl output, and T = 0 at the M3 shape.
TEST(CudaForward, KvMajorWithoutKlAndEmpty) {
  GPUTEST_REQUIRE_DEVICE();
  ForceKvPath kv;
  check_without_kl_vs_reference(shape(16, 1, 1, 1, 128, 8, {1500, 300}), 44);

  Problem empty;
  gputest::make_problem(empty, shape(64, 4, 4, 1, 128, 16, {0, 0}), 45);
  const GpuForward e = run_gpu(empty);
  EXPECT_TRUE(e.o.empty());
  EXPECT_EQ(e.kl, 0.f);
}

// Deterministic mode at the M3 group shape with FLASHMSA_FORWARD_PATH=kv (the mma.sync KV-major
// kernel has no deterministic form) takes the query-major kernel: reruns are bitwise identical,
// and its results agree with the (atomic) KV-major path within the tolerances.
TEST(CudaForward, KvMajorDeterministicFallback) {
  GPUTEST_REQUIRE_DEVICE();
  ForceKvPath kv;
  Problem pr;
  gputest::make_problem(pr, shape(32, 2, 2, 1, 128, 8, {1300, 500}), 46);
  const Shape& s = pr.s;
  auto run = [&](bool det) {
    DeviceBuffer sel(static_cast<size_t>(s.Hp * pr.T * s.K) * 4);
    DeviceBuffer o(static_cast<size_t>(pr.T * s.H * s.D) * 2), lse(static_cast<size_t>(s.H * pr.T) * 4), kl(4);
    o.fill(gputest::kFloatPoison);
    lse.fill(gputest::kFloatPoison);
    kl.fill(gputest::kFloatPoison);
    auto opt = pr.options();
    opt.deterministic = det;
    flashmsa::msa_forward(pr.device_inputs(), opt, gputest::dview(sel, DType::int32, {s.Hp, pr.T, s.K}),
                          gputest::dview(o, DType::bf16, {pr.T, s.H, s.D}),
                          gputest::dview(lse, DType::fp32, {s.H, pr.T}), gputest::dview(kl, DType::fp32, {1}));
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    GpuForward r;
    r.o = gputest::bf16_to_doubles(o.download<uint16_t>());
    auto l = lse.download<float>();
    r.lse.assign(l.begin(), l.end());
    r.kl = kl.download<float>()[0];
    return r;
  };
  const GpuForward d1 = run(true), d2 = run(true), f = run(false);
  EXPECT_EQ(d1.o, d2.o);
  EXPECT_EQ(d1.lse, d2.lse);
  EXPECT_EQ(std::memcmp(&d1.kl, &d2.kl, 4), 0);
  ASSERT_EQ(gputest::count_nonfinite(f.o), 0);
  EXPECT_LT(gputest::rel_l2(f.o, d1.o), 1e-2);
  EXPECT_LT(gputest::max_abs_diff(f.lse, d1.lse), 1e-3);
  EXPECT_LT(rel_err(f.kl, d1.kl), 1e-2);
}

// ---- KV-major for groups smaller than 16 heads: a warp's 16 rows are 16/m tokens x m heads.

// Without the kl output: o and lse against the CPU backend on the GPU's selection; lse (pass 1
// and the merge have no atomics) must not change when kl is asked for, and kl must match.
void check_kv_without_kl(const Shape& s, uint64_t seed) {
  Problem pr;
  gputest::make_problem(pr, s, seed);
  const GpuForward g = run_gpu(pr, /*with_kl=*/false);
  if (::testing::Test::HasFatalFailure()) return;
  ASSERT_EQ(gputest::count_nonfinite(g.o), 0) << "o has unwritten (NaN) elements";
  ASSERT_EQ(gputest::count_nonfinite(g.lse), 0) << "lse has unwritten (NaN) elements";
  CpuForward c;
  if (!run_cpu_forward(pr, g.sel, c)) return;
  EXPECT_LT(gputest::rel_l2(g.o, c.o), 1e-2) << "o rel L2 vs CPU backend";
  EXPECT_LT(gputest::max_abs_diff(g.lse, c.lse), 1e-3) << "lse max abs vs CPU backend";
  const GpuForward w = run_gpu_on(pr, g.sel, /*with_kl=*/true);
  EXPECT_EQ(w.lse, g.lse) << "lse depends on whether kl is asked for";
  EXPECT_LT(gputest::rel_l2(w.o, c.o), 1e-2) << "o (with kl) rel L2 vs CPU backend";
  EXPECT_LT(rel_err(w.kl, c.kl), 1e-2)
      << "kl vs CPU backend: gpu " << w.kl << " cpu " << c.kl;
  EXPECT_GT(c.kl, 0.f) << "a KL of zero would make the check vacuous";
}

// m = 4 (fm16k heads: H=16 Hkv=2 Hp=4 Hpk=1): 4 tokens per warp. Several sequences (one shorter
// than a block, one empty, one of exactly a block), T = 4101 (not a multiple of 128, several
// 1024-token chunks), lists of every length so most end with 1-3 live tokens in the last warp.
TEST(CudaForward, KvMajorM4) {
  GPUTEST_REQUIRE_DEVICE();
  ForceKvPath kv;
  check_forward_case(shape(16, 2, 4, 1, 128, 16, {1000, 50, 0, 2222, 128, 701}), 71);
}

// m = 8 (gqa8 heads: H=32 Hkv=4 Hp=4 Hpk=1): 2 tokens per warp.
TEST(CudaForward, KvMajorM8) {
  GPUTEST_REQUIRE_DEVICE();
  ForceKvPath kv;
  check_forward_case(shape(32, 4, 4, 1, 128, 16, {2500, 77, 1100}), 72);
}

// m = 2: 8 tokens per warp, 64 proxy rows per round; two kv heads of 2 groups each, Hpk = Hp,
// K = 8 and a one-token sequence.
TEST(CudaForward, KvMajorM2) {
  GPUTEST_REQUIRE_DEVICE();
  ForceKvPath kv;
  check_forward_case(shape(8, 2, 4, 4, 128, 8, {1500, 300, 1, 260}), 73);
}

// m = 4 with several local blocks and K = 1 (one entry per token per group: short lists).
TEST(CudaForward, KvMajorM4LocalBlocksAndK1) {
  GPUTEST_REQUIRE_DEVICE();
  ForceKvPath kv;
  check_forward_case(shape(8, 1, 2, 1, 128, 6, {1300, 90}, 3), 74);
  check_forward_case(shape(8, 2, 2, 1, 128, 1, {700, 129}), 75);
}

// m = 4, 8, 2 without the kl output, and T = 0 (kl written as 0).
TEST(CudaForward, KvMajorSmallGroupsWithoutKlAndEmpty) {
  GPUTEST_REQUIRE_DEVICE();
  ForceKvPath kv;
  check_kv_without_kl(shape(16, 2, 4, 1, 128, 16, {1900, 33, 400}), 76);
  check_kv_without_kl(shape(32, 4, 4, 1, 128, 8, {1200, 5}), 77);
  check_kv_without_kl(shape(8, 2, 4, 2, 128, 8, {1000, 129}), 78);
  for (std::vector<int> lengths : {std::vector<int>{}, std::vector<int>{0, 0}}) {
    Problem empty;
    gputest::make_problem(empty, shape(16, 2, 4, 1, 128, 16, lengths), 79);
    const GpuForward e = run_gpu(empty);
    EXPECT_TRUE(e.o.empty());
    EXPECT_EQ(e.kl, 0.f);
  }
}

// Routing: unset -> wgmma KV-major where it applies and the KL value can follow it KV-major,
// mma KV-major for other groups of fewer than 16 heads; "query", "kv", "wgmma" force a path
// ("wgmma" is an error where it does not apply). lse is the fingerprint of the path: the query-
// and mma KV-major paths write it without atomics (bitwise reproducible) and in different
// summation orders, so the paths' lse differ in some bits.
TEST(CudaForward, ForwardPathRouting) {
  GPUTEST_REQUIRE_DEVICE();
  auto run_paths = [](const Shape& s, uint64_t seed, const char* expected_default, int n_paths) {
    Problem pr;
    gputest::make_problem(pr, s, seed);
    const std::vector<int32_t> sel = selection_of(pr);
    GpuForward d;
    {
      ScopedForwardPath unset(nullptr);
      d = run_gpu_on(pr, sel, true);
    }
    // The first n_paths of these apply to the shape (a forced path that does not apply falls back).
    const char* names[3] = {"query", "kv", "wgmma"};
    GpuForward forced[3];
    for (int i = 0; i < n_paths; ++i) {
      ScopedForwardPath path(names[i]);
      forced[i] = run_gpu_on(pr, sel, true);
    }
    if (::testing::Test::HasFatalFailure()) return;
    for (int i = 0; i < n_paths; ++i)
      for (int j = i + 1; j < n_paths; ++j)
        ASSERT_NE(forced[i].lse, forced[j].lse)
            << names[i] << " and " << names[j] << " lse identical: the fingerprint tells nothing";
    if (std::strcmp(expected_default, "wgmma") == 0) {
      // Its reduce-adds are not bitwise reproducible: the default must differ from both
      // reproducible paths and agree with the forced wgmma run to rounding.
      for (int i = 0; i < 2; ++i)
        EXPECT_NE(d.lse, forced[i].lse) << "default routing took the " << names[i] << " path, not wgmma";
      EXPECT_LT(gputest::max_abs_diff(d.lse, forced[2].lse), 1e-5) << "default vs forced wgmma lse";
    } else {
      for (int i = 0; i < n_paths; ++i)
        if (std::strcmp(names[i], expected_default) == 0)
          EXPECT_EQ(d.lse, forced[i].lse) << "default routing did not take the " << names[i] << " path";
    }
    CpuForward c;
    if (!run_cpu_forward(pr, sel, c)) return;
    for (int i = -1; i < n_paths; ++i) {
      const GpuForward* g = i < 0 ? &d : &forced[i];
      ASSERT_EQ(gputest::count_nonfinite(g->o), 0) << "o has unwritten (NaN) elements";
      EXPECT_LT(gputest::rel_l2(g->o, c.o), 1e-2) << "o rel L2 vs CPU backend";
      EXPECT_LT(gputest::max_abs_diff(g->lse, c.lse), 1e-3) << "lse max abs vs CPU backend";
      EXPECT_LT(rel_err(g->kl, c.kl), 1e-2)
          << "kl vs CPU backend: gpu " << g->kl << " cpu " << c.kl;
    }
  };
  // m = 4 on two kv heads of two groups each (fm16k's heads) and m = 16 on Hkv = Hp: wgmma
  // KV-major, then launch_kl_value.
  run_paths(shape(16, 2, 4, 1, 128, 16, {2100, 300}), 81, "wgmma", 3);
  run_paths(shape(32, 2, 2, 1, 128, 8, {1400}), 82, "wgmma", 3);
  // m = 2: no wgmma forward; the mma KV-major kernel (fused KL) is the default.
  run_paths(shape(8, 2, 4, 4, 128, 8, {1500, 260}), 83, "kv", 2);
  // A chunk override far past the workspace limit (two 9000-token m = 16 accumulators: 150 MB
  // against 64 MiB) is shrunk to fit; the path stays wgmma instead of falling back to query-major.
  {
    ScopedEnv chunk("FLASHMSA_FWD_CHUNK", "16777216");
    run_paths(shape(32, 2, 2, 1, 128, 8, {9000}), 84, "wgmma", 3);
  }
}

// ---- wgmma KV-major forward (forward_kv_wgmma.cu): fixed softmax reference, chunk accumulators.

// FLASHMSA_FWD_CHUNK for one scope: small chunks make sequences and key blocks straddle chunks.
struct ScopedChunk : ScopedEnv {
  explicit ScopedChunk(const char* tokens) : ScopedEnv("FLASHMSA_FWD_CHUNK", tokens) {}
};

// m = 16 on one kv head (the m3 group), 256-token chunks, a zero-length sequence, a sequence of
// exactly one block, sequences shorter than a block and crossing chunk boundaries.
// The same with 128-token chunks (small enough that the accumulators live in the index's dead
// buffers: the aliasing branch of the workspace plan), and with one stream (no fork) and three
// (four proxy groups over three streams).
TEST(CudaForward, WgmmaKvM16SeveralChunks) {
  GPUTEST_REQUIRE_DEVICE();
  ScopedForwardPath path("wgmma");
  const Shape s = shape(64, 4, 4, 1, 128, 16, {1100, 37, 0, 900, 128, 700});
  {
    ScopedChunk chunk("256");
    check_forward_case(s, 141);
  }
  {
    ScopedChunk chunk("128");
    check_forward_case(s, 149);
  }
  for (const char* streams : {"1", "3"}) {
    ScopedEnv n("FLASHMSA_FWD_STREAMS", streams);
    ScopedChunk chunk("256");
    check_forward_case(s, 150);
  }
}

// m = 4 (fm16k heads, two groups per kv head: K/V blocks shared by two groups' launches) and
// m = 8 (gqa8) with the default chunk, local blocks, K = 1 and many short sequences; with the kl
// output (launch_kl_value after the forward). Then the forced path's own KL rows
// (FLASHMSA_BACKWARD_PATH=mma: the KL value cannot follow KV-major).
TEST(CudaForward, WgmmaKvSmallGroups) {
  GPUTEST_REQUIRE_DEVICE();
  ScopedForwardPath path("wgmma");
  check_forward_case(shape(16, 2, 4, 1, 128, 16, {1000, 50, 0, 2222, 128, 701}), 142);
  check_forward_case(shape(32, 4, 4, 1, 128, 16, {2500, 77, 1100}), 143);
  check_forward_case(shape(8, 1, 2, 1, 128, 6, {1300, 90}, 3), 144);
  check_forward_case(shape(8, 2, 2, 1, 128, 1, {700, 129}), 145);
  std::mt19937_64 rng(146);
  std::vector<int> lengths(120);
  for (int& l : lengths) l = static_cast<int>(rng() % 150);
  lengths[5] = 0;
  check_forward_case(shape(32, 2, 2, 2, 128, 4, lengths), 147);
  ScopedEnv mma("FLASHMSA_BACKWARD_PATH", "mma");
  check_forward_case(shape(16, 2, 4, 1, 128, 16, {1000, 50, 0, 900}), 151);
  check_forward_case(shape(32, 4, 4, 1, 128, 16, {1500, 77}), 152);
}

// o and lse of g finite (nothing unwritten, nothing overflowed) and within msa.md's tolerances of
// the CPU backend on the same selection; the CPU result into *cpu if given (left empty when the
// CPU backend failed). `what` prefixes the messages.
void expect_finite_and_close_to_cpu(Problem& pr, const std::vector<int32_t>& sel, const GpuForward& g,
                                    const char* what = "", CpuForward* cpu = nullptr) {
  ASSERT_EQ(gputest::count_nonfinite(g.o), 0) << what << "o has unwritten or overflowed elements";
  ASSERT_EQ(gputest::count_nonfinite(g.lse), 0) << what << "lse has unwritten or overflowed elements";
  CpuForward c;
  if (!run_cpu_forward(pr, sel, c)) return;
  EXPECT_LT(gputest::rel_l2(g.o, c.o), 1e-2) << what << "o rel L2 vs CPU backend";
  EXPECT_LT(gputest::max_abs_diff(g.lse, c.lse), 1e-3) << what << "lse max abs vs CPU backend";
  if (cpu) *cpu = std::move(c);
}

// Rows whose best score exceeds the diagonal score by far more than the fixed reference allows
// are recomputed by the query-major kernel; the others keep the KV-major result. In every other
// 300-token stretch one head per token (head t % H: rows in both halves of a warpgroup's row
// pairs) has q scaled by 64 (exact in bf16): scores of order 150 above the diagonal, far past the
// 2^64 guard and past fp32's range had the row not been flagged (o would be inf or NaN). The test
// first checks on the host that its inputs contain enough such tokens and enough plain ones.
void check_overflow_recomputed(const Shape& sh, uint64_t seed, bool det = false) {
  ScopedForwardPath path("wgmma");
  ScopedChunk chunk("512");
  Problem pr;
  gputest::make_problem(pr, sh, seed);
  const Shape& s = pr.s;
  for (int64_t t = 0; t < pr.T; ++t) {
    if ((t / 300) % 2 == 0) continue;
    const int64_t h = t % s.H;
    for (int64_t i = (t * s.H + h) * s.D; i < (t * s.H + h + 1) * s.D; ++i)
      if ((pr.q[i] & 0x7f80) != 0) pr.q[i] = static_cast<uint16_t>(pr.q[i] + (6 << 7));  // x 64
  }
  pr.dq.upload(pr.q);
  // Host precondition: a row surely overflows when its own block (always selected) holds a key
  // scoring more than 90 (natural units, ~130 in log2 units) above the diagonal.
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.D));
  int64_t overflowing = 0;
  for (int b = 0; b < pr.B; ++b)
    for (int64_t t = pr.cu[b]; t < pr.cu[b + 1]; ++t) {
      bool over = false;
      for (int h = 0; h < s.H && !over; ++h) {
        const int kvh = h / (s.H / s.Hkv);
        auto score = [&](int64_t j) {
          double acc = 0;
          for (int d = 0; d < s.D; ++d)
            acc += static_cast<double>(gputest::from_bf16(pr.q[(t * s.H + h) * s.D + d])) *
                   gputest::from_bf16(pr.k[(j * s.Hkv + kvh) * s.D + d]);
          return acc * scale;
        };
        const double diag = score(t);
        const int64_t first = pr.cu[b] + (t - pr.cu[b]) / 128 * 128;
        for (int64_t j = first; j <= t && !over; ++j) over = score(j) - diag > 90.0;
      }
      overflowing += over;
    }
  std::printf("    tokens with a row far past the reference (host, own block only): %lld of %lld\n",
              static_cast<long long>(overflowing), static_cast<long long>(pr.T));
  ASSERT_GT(overflowing, 100) << "the inputs do not exercise the recompute path";
  ASSERT_LT(overflowing, pr.T / 2 + 1) << "the inputs do not keep any KV-major rows";

  const std::vector<int32_t> sel = selection_of(pr);
  const GpuForward g = run_gpu_on(pr, sel, /*with_kl=*/false, det);
  if (::testing::Test::HasFatalFailure()) return;
  expect_finite_and_close_to_cpu(pr, sel, g);
  if (::testing::Test::HasFatalFailure()) return;
  if (det) {
    const GpuForward again = run_gpu_on(pr, sel, /*with_kl=*/false, det);
    EXPECT_EQ(again.o, g.o) << "deterministic o differs bitwise on a rerun";
    EXPECT_EQ(again.lse, g.lse) << "deterministic lse differs bitwise on a rerun";
  }
}

TEST(CudaForward, WgmmaKvOverflowRowsRecomputed) {
  GPUTEST_REQUIRE_DEVICE();
  check_overflow_recomputed(shape(32, 2, 2, 1, 128, 8, {1900, 700}), 148);  // m = 16
  check_overflow_recomputed(shape(16, 2, 4, 1, 128, 8, {1900, 700}), 153);  // m = 4
  // The deterministic (two-pass fixed-point) form flags rows whose sum over a block exceeds 2^27
  // (2^64 in the fast form): same inputs.
  check_overflow_recomputed(shape(32, 2, 2, 1, 128, 8, {1900, 700}), 148, /*det=*/true);
}

// Tokens whose selection leaves their own block out (block_idx is the caller's; select_blocks always
// keeps it): the fixed reference, the diagonal score, then lies outside the row's keys, so the row sum
// may fall far below 1 (recomputed query-major below 2^-64). Every third token with another block
// selected drops its own (its last entry: ascending order); 256-token chunks.
TEST(CudaForward, WgmmaKvOwnBlockLeftOut) {
  GPUTEST_REQUIRE_DEVICE();
  ScopedForwardPath path("wgmma");
  ScopedChunk chunk("256");
  for (const Shape& sh : {shape(32, 2, 2, 1, 128, 8, {1300, 400}), shape(16, 2, 4, 1, 128, 8, {900, 800})}) {
    Problem pr;
    gputest::make_problem(pr, sh, 167);
    std::vector<int32_t> sel = selection_of(pr);
    const Shape& s = pr.s;
    int64_t dropped = 0;
    for (int p = 0; p < s.Hp; ++p)
      for (int b = 0; b < pr.B; ++b)
        for (int64_t t = pr.cu[b]; t < pr.cu[b + 1]; ++t) {
          if (t % 3 != 1) continue;
          int32_t* row = sel.data() + (p * pr.T + t) * s.K;
          int last = s.K - 1;
          while (last >= 0 && row[last] < 0) --last;
          ASSERT_GE(last, 0) << "a token with no selected block";
          ASSERT_EQ(row[last], static_cast<int32_t>((t - pr.cu[b]) / 128)) << "the last entry is not the own block";
          if (last == 0) continue;  // the own block alone: the row would be empty
          row[last] = -1;
          ++dropped;
        }
    ASSERT_GT(dropped, pr.T / 4) << "too few tokens without their own block";
    const GpuForward g = run_gpu_on(pr, sel, /*with_kl=*/false);
    if (::testing::Test::HasFatalFailure()) return;
    expect_finite_and_close_to_cpu(pr, sel, g);
  }
}

// Deterministic mode flags a token (recomputed query-major) when one of its rows sums to more than
// 2^27 over a block (kOverflowSumDet); below that the rows stay KV-major, in fixed point with
// l <= K 2^27. Band tokens: one head's q set to c k_j for a key j earlier in the token's own block,
// c chosen on the host so that score(j) - score(t) = 16.3 (natural units: the block sums to
// ~2^23.5, between the old 2^20 and 2^27). Far tokens: that head's q times 64 (sums far past 2^27).
// The recompute runs forward_unit<128, false> with the same arguments as a whole query-major run
// (FLASHMSA_DET_FWD=query), so far tokens must carry that run's bits (the control that gives the
// next check its meaning) and band tokens must not (they stay KV-major; under a 2^20 threshold all
// of them would be recomputed). All within the tolerances of the CPU backend.
TEST(CudaForward, WgmmaKvDeterministicFlagThreshold) {
  GPUTEST_REQUIRE_DEVICE();
  ScopedForwardPath path("wgmma");
  Problem pr;
  gputest::make_problem(pr, shape(32, 2, 2, 1, 128, 8, {1900, 700}), 157);  // m = 16
  const Shape& s = pr.s;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.D));
  const int per_kv = s.H / s.Hkv, per_p = s.H / s.Hp;
  auto qrow = [&](int64_t t, int h) { return pr.q.data() + (t * s.H + h) * s.D; };
  auto krow = [&](int64_t j, int kvh) { return pr.k.data() + (j * s.Hkv + kvh) * s.D; };
  enum Kind { kPlain, kBand, kFar };
  std::vector<Kind> kind(pr.T, kPlain);
  for (int b = 0; b < pr.B; ++b)
    for (int64_t t = pr.cu[b]; t < pr.cu[b + 1]; ++t) {
      const int64_t local = t - pr.cu[b];
      const int stretch = static_cast<int>((t / 300) % 3);
      if (stretch == 0 || local % 128 < 8) continue;
      const int h = static_cast<int>(t % s.H), kvh = h / per_kv;
      uint16_t* q = qrow(t, h);
      if (stretch == 2) {
        for (int d = 0; d < s.D; ++d)
          if ((q[d] & 0x7f80) != 0) q[d] = static_cast<uint16_t>(q[d] + (6 << 7));  // x 64
        kind[t] = kFar;
        continue;
      }
      const int64_t j = t - 1 - local % 7;  // in t's block, since local % 128 >= 8
      const uint16_t* kj = krow(j, kvh);
      const double per_c = scale * (gputest::dot_bf16(kj, kj, s.D) - gputest::dot_bf16(kj, krow(t, kvh), s.D));
      if (per_c < 1.0) continue;  // k_j too close to k_t: the token stays plain
      for (int d = 0; d < s.D; ++d)
        q[d] = msatest::float_to_bf16(static_cast<float>(16.3 / per_c * gputest::from_bf16(kj[d])));
      kind[t] = kBand;
    }
  pr.dq.upload(pr.q);
  const std::vector<int32_t> sel = selection_of(pr);

  // Host: log2 of the largest block sum of the changed row over its selected blocks (visible keys).
  int64_t n_band = 0, n_far = 0;
  std::vector<bool> band(pr.T, false), far(pr.T, false);
  for (int b = 0; b < pr.B; ++b)
    for (int64_t t = pr.cu[b]; t < pr.cu[b + 1]; ++t) {
      if (kind[t] == kPlain) continue;
      const int h = static_cast<int>(t % s.H), kvh = h / per_kv, p = h / per_p;
      const uint16_t* q = qrow(t, h);
      const double diag = scale * gputest::dot_bf16(q, krow(t, kvh), s.D);
      double worst = -INFINITY;
      for (int e = 0; e < s.K; ++e) {
        const int32_t blk = sel[(p * pr.T + t) * s.K + e];
        if (blk < 0) continue;
        const int64_t j0 = pr.cu[b] + static_cast<int64_t>(blk) * 128;
        const int64_t j1 = std::min<int64_t>(j0 + 127, t);
        std::vector<double> g;
        for (int64_t j = j0; j <= j1; ++j) g.push_back(scale * gputest::dot_bf16(q, krow(j, kvh), s.D) - diag);
        if (g.empty()) continue;
        const double mx = *std::max_element(g.begin(), g.end());
        double sum = 0;
        for (double x : g) sum += std::exp(x - mx);
        worst = std::max(worst, (mx + std::log(sum)) / std::log(2.0));
      }
      band[t] = kind[t] == kBand && worst > 21 && worst < 26;
      far[t] = kind[t] == kFar && worst > 40;
      n_band += band[t];
      n_far += far[t];
    }
  std::printf("    tokens summing 2^21-2^26 over a block: %lld, past 2^40: %lld (of %lld)\n",
              static_cast<long long>(n_band), static_cast<long long>(n_far), static_cast<long long>(pr.T));
  ASSERT_GT(n_band, 100) << "the inputs do not put rows between the thresholds";
  ASSERT_GT(n_far, 100) << "the inputs do not exercise the recompute";

  GpuForward det;
  {
    ScopedEnv kv_major("FLASHMSA_DET_FWD", nullptr);  // an inherited =query would make the forced path throw
    det = run_gpu_on(pr, sel, /*with_kl=*/false, /*det=*/true);
  }
  GpuForward qm;
  {
    ScopedForwardPath unset(nullptr);
    ScopedEnv query("FLASHMSA_DET_FWD", "query");
    qm = run_gpu_on(pr, sel, /*with_kl=*/false, /*det=*/true);
  }
  if (::testing::Test::HasFatalFailure()) return;
  expect_finite_and_close_to_cpu(pr, sel, det);
  if (::testing::Test::HasFatalFailure()) return;
  auto same_bits = [&](int64_t t) {  // all of token t's lse and o as the query-major run has them
    for (int h = 0; h < s.H; ++h) {
      if (det.lse[h * pr.T + t] != qm.lse[h * pr.T + t]) return false;
      for (int d = 0; d < s.D; ++d)
        if (det.o[(t * s.H + h) * s.D + d] != qm.o[(t * s.H + h) * s.D + d]) return false;
    }
    return true;
  };
  int64_t band_same = 0, far_same = 0;
  for (int64_t t = 0; t < pr.T; ++t) {
    if (band[t]) band_same += same_bits(t);
    if (far[t]) far_same += same_bits(t);
  }
  std::printf("    with the query-major run's bits: far %lld of %lld, band %lld of %lld\n",
              static_cast<long long>(far_same), static_cast<long long>(n_far), static_cast<long long>(band_same),
              static_cast<long long>(n_band));
  EXPECT_EQ(far_same, n_far) << "recomputed tokens do not carry the query-major bits: the band check cannot tell";
  EXPECT_LE(band_same * 4, n_band) << "tokens summing below 2^27 over every block were recomputed (flag threshold too low?)";
}

// Deterministic mode on the wgmma KV-major forward (two passes: int64 row sums, then int32 o of
// the normalised probabilities; groups of 4, 8 or 16 heads): against the CPU backend and the fast
// (fp32) form, bitwise identical over reruns (also with small chunks and one or three streams,
// whose order of reduce-adds differs), and FLASHMSA_DET_FWD=query (the query-major kernel) within
// the tolerances.
void check_deterministic_wgmma_forward(const Shape& s, uint64_t seed) {
  Problem pr;
  gputest::make_problem(pr, s, seed);
  const std::vector<int32_t> sel = selection_of(pr);
  ScopedForwardPath path("wgmma");  // an error unless the wgmma kernel takes the problem
  const GpuForward fast = run_gpu_on(pr, sel, true, false);
  const GpuForward det = run_gpu_on(pr, sel, true, true);
  if (::testing::Test::HasFatalFailure()) return;
  CpuForward c;
  expect_finite_and_close_to_cpu(pr, sel, det, "deterministic ", &c);
  if (::testing::Test::HasFatalFailure() || c.o.empty()) return;
  EXPECT_LT(rel_err(det.kl, c.kl), 1e-2) << "deterministic kl vs CPU backend";
  EXPECT_LT(gputest::rel_l2(det.o, fast.o), 1e-2) << "deterministic vs fast o";
  EXPECT_LT(gputest::max_abs_diff(det.lse, fast.lse), 1e-4) << "deterministic vs fast lse";
  EXPECT_NE(det.o, fast.o) << "deterministic and fast o bitwise equal: the fixed-point form did not run";
  for (const char* streams : {"1", "3"}) {
    ScopedEnv n("FLASHMSA_FWD_STREAMS", streams);
    ScopedChunk chunk("256");
    const GpuForward again = run_gpu_on(pr, sel, true, true);
    EXPECT_EQ(again.o, det.o) << "deterministic o differs bitwise (streams " << streams << ", chunk 256)";
    EXPECT_EQ(again.lse, det.lse) << "deterministic lse differs bitwise (streams " << streams << ")";
    EXPECT_EQ(std::memcmp(&again.kl, &det.kl, 4), 0) << "deterministic kl differs (streams " << streams << ")";
  }
  // Rows without their own block (the caller's block_idx may leave it out): the reference is no
  // longer a visible score, l may be far below 1 (flagged and recomputed when below 2^-8).
  std::vector<int32_t> sel_no_own = sel;
  int64_t removed = 0;
  for (int p = 0; p < pr.s.Hp; ++p)
    for (int64_t t = 3; t < pr.T; t += 7) {
      int b = 0;
      while (pr.cu[b + 1] <= t) ++b;  // the sequence holding t (empty ones skipped)
      const int32_t own = static_cast<int32_t>((t - pr.cu[b]) / 128);
      for (int k = 0; k < pr.s.K; ++k) {
        int32_t& e = sel_no_own[(p * pr.T + t) * pr.s.K + k];
        if (e == own) e = -1, ++removed;
      }
    }
  ASSERT_GT(removed, 0);
  const GpuForward no_own = run_gpu_on(pr, sel_no_own, false, true);
  CpuForward c2;
  if (!run_cpu_forward(pr, sel_no_own, c2)) return;
  EXPECT_LT(gputest::rel_l2(no_own.o, c2.o), 1e-2) << "deterministic o without own blocks vs CPU backend";
  int64_t bad = 0;
  for (size_t i = 0; i < no_own.lse.size(); ++i)
    bad += std::isinf(c2.lse[i]) ? !(std::isinf(no_own.lse[i]) && no_own.lse[i] < 0)
                                 : !(std::fabs(no_own.lse[i] - c2.lse[i]) < 1e-3);
  EXPECT_EQ(bad, 0) << "deterministic lse without own blocks differs from the CPU backend";
  EXPECT_EQ(run_gpu_on(pr, sel_no_own, false, true).o, no_own.o) << "deterministic rerun differs bitwise";

  ScopedForwardPath unset(nullptr);
  ScopedEnv query_env("FLASHMSA_DET_FWD", "query");
  const GpuForward qm = run_gpu_on(pr, sel, true, true);
  EXPECT_NE(qm.lse, det.lse) << "FLASHMSA_DET_FWD=query gave the KV-major form's bits: the switch did nothing";
  EXPECT_LT(gputest::rel_l2(qm.o, det.o), 1e-2) << "query-major vs KV-major deterministic o";
  EXPECT_LT(gputest::max_abs_diff(qm.lse, det.lse), 1e-4) << "query-major vs KV-major deterministic lse";
}

TEST(CudaForward, WgmmaKvDeterministic) {
  GPUTEST_REQUIRE_DEVICE();
  check_deterministic_wgmma_forward(shape(64, 4, 4, 1, 128, 16, {1100, 37, 0, 900, 128, 700}), 155);  // m = 16
  check_deterministic_wgmma_forward(shape(32, 4, 4, 1, 128, 16, {2500, 77, 1100}), 156);                // m = 8
  check_deterministic_wgmma_forward(shape(16, 2, 4, 1, 128, 16, {2100, 300, 900}), 158);  // m = 4, two groups per kv head
}

// One NaN in v, q or k reaches o of the fast form (every row that selects v's or k's block, the one
// row of q). The deterministic fixed-point form must not turn it into finite values: a non-finite v turns
// its factors NaN and every row is recomputed query-major; a non-finite q or k makes the row sums of
// the tiles it enters non-finite, which flags those tokens for the recompute.
TEST(CudaForward, WgmmaKvDeterministicNonFiniteInput) {
  GPUTEST_REQUIRE_DEVICE();
  // Keys 128 and 256, the first of blocks 1 and 2: every row that loads the block comes after
  // them, so the fast form's masked-but-loaded keys (P = 0 times NaN) and the query-major kernel's
  // zero-filled ones agree.
  struct Case {
    const char* name;
    std::vector<uint16_t> Problem::*tensor;
    int64_t token, head, col;  // the element [token, head, col]
  };
  const Case cases[] = {{"v", &Problem::v, 128, 1, 9}, {"q", &Problem::q, 700, 5, 3}, {"k", &Problem::k, 256, 0, 77}};
  // m = 16 (one group per kv head) and m = 4 (two groups per kv head).
  const Shape shapes[] = {shape(32, 2, 2, 1, 128, 8, {900, 300}), shape(16, 2, 4, 1, 128, 8, {900, 300})};
  for (const Shape& sh : shapes) {
    for (const Case& c : cases) {
      Problem pr;
      gputest::make_problem(pr, sh, 157);
      const std::vector<int32_t> sel = selection_of(pr);
      const int64_t heads = c.tensor == &Problem::q ? pr.s.H : pr.s.Hkv;
      (pr.*c.tensor)[(c.token * heads + c.head) * pr.s.D + c.col] = 0x7fc0;  // bf16 quiet NaN
      pr.dq.upload(pr.q);
      pr.dk.upload(pr.k);
      pr.dv.upload(pr.v);
      ScopedForwardPath path("wgmma");
      const GpuForward fast = run_gpu_on(pr, sel, false, false);
      const GpuForward det = run_gpu_on(pr, sel, false, true);
      const int64_t fast_o = gputest::count_nonfinite(fast.o), det_o = gputest::count_nonfinite(det.o);
      const int64_t fast_l = gputest::count_nonfinite(fast.lse), det_l = gputest::count_nonfinite(det.lse);
      std::printf("  m = %d, NaN in %s: non-finite o fast %lld det %lld, lse fast %lld det %lld\n", sh.H / sh.Hp, c.name,
                  static_cast<long long>(fast_o), static_cast<long long>(det_o), static_cast<long long>(fast_l),
                  static_cast<long long>(det_l));
      ASSERT_GT(fast_o, 0) << c.name << ": the NaN did not reach the fast form's o: the test's premise fails";
      EXPECT_EQ(det_o, fast_o) << c.name << ": deterministic o: non-finite elements differ from the fast form's";
      EXPECT_EQ(det_l, fast_l) << c.name << ": deterministic lse: non-finite elements differ from the fast form's";
    }
  }
}

// Selection rows that are all padding (allowed by the API: block_idx is the caller's) give o = 0
// and lse = -inf on every backend; the wgmma path must not divide 0 by 0 there.
TEST(CudaForward, WgmmaKvPaddingOnlyRows) {
  GPUTEST_REQUIRE_DEVICE();
  ScopedForwardPath path("wgmma");
  Problem pr;
  gputest::make_problem(pr, shape(32, 2, 2, 1, 128, 8, {1300, 400}), 154);
  std::vector<int32_t> sel = selection_of(pr);
  const Shape& s = pr.s;
  int64_t emptied = 0;
  for (int p = 0; p < s.Hp; ++p)
    for (int64_t t = 5; t < pr.T; t += 97, ++emptied)
      for (int k = 0; k < s.K; ++k) sel[(p * pr.T + t) * s.K + k] = -1;
  const GpuForward g = run_gpu_on(pr, sel, /*with_kl=*/false);
  if (::testing::Test::HasFatalFailure()) return;
  ASSERT_EQ(gputest::count_nonfinite(g.o), 0) << "o has unwritten or NaN elements";
  CpuForward c;
  if (!run_cpu_forward(pr, sel, c)) return;
  EXPECT_LT(gputest::rel_l2(g.o, c.o), 1e-2) << "o rel L2 vs CPU backend";
  int64_t bad = 0;
  for (size_t i = 0; i < g.lse.size(); ++i)
    bad += std::isinf(c.lse[i]) ? !(std::isinf(g.lse[i]) && g.lse[i] < 0) : !(std::fabs(g.lse[i] - c.lse[i]) < 1e-3);
  EXPECT_EQ(bad, 0) << "lse differs from the CPU backend (-inf on the emptied rows)";
  // The premise: the CPU backend reads exactly the emptied (p, t) rows as empty (lse -inf for
  // their m heads), so the check above covers them.
  int64_t cpu_empty = 0;
  for (double x : c.lse) cpu_empty += std::isinf(x) && x < 0;
  EXPECT_EQ(cpu_empty, emptied * (s.H / s.Hp)) << "the test's emptied rows are not what the CPU saw as empty";
}

// msa_forward = select_blocks + sparse_attention_forward, and reruns are bitwise identical.
// m = 8 here would default to the (atomic) KV-major path, so the query-major kernel is forced.
TEST(CudaForward, MsaForwardMatchesAndIsDeterministic) {
  GPUTEST_REQUIRE_DEVICE();
  ScopedForwardPath query("query");
  Problem pr;
  gputest::make_problem(pr, shape(16, 2, 2, 1, 128, 8, {1700, 900}), 21);
  const GpuForward a = run_gpu(pr);
  DeviceForward d(pr);
  flashmsa::msa_forward(pr.device_inputs(), pr.options(), d.sel_v(), d.o_v(), d.lse_v(), d.kl_v());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const GpuForward b = d.take();
  EXPECT_EQ(b.sel, a.sel);
  EXPECT_EQ(b.o, a.o);
  EXPECT_EQ(b.lse, a.lse);
  EXPECT_EQ(std::memcmp(&b.kl, &a.kl, 4), 0) << b.kl << " vs " << a.kl;
}

// The KL value KV-major (launch_kl_value: the wgmma backward's KL_ONLY kernel after the
// query-major forward) at m = 16 on one kv head, Hkv = Hp, D = 128: against the CPU backend and
// the old route (FLASHMSA_BACKWARD_PATH=mma: the forward kernel's fused KL pass) within 1e-4;
// o and lse do not depend on the route; deterministic mode takes the same route (it has no
// atomics) and reruns bitwise.
// The KL value KV-major (kl_value.cuh) against the old fused pass, the CPU backend, and itself in
// deterministic mode, on a shape the wgmma kernels take.
void check_kl_value_kv_major(const Shape& sh, uint64_t seed) {
  // The query-major forward (o and lse bitwise the same on both KL routes).
  ScopedForwardPath path("query");
  Problem pr;
  gputest::make_problem(pr, sh, seed);
  GpuForward kv, old;
  {
    ScopedEnv path("FLASHMSA_BACKWARD_PATH", nullptr);
    kv = run_gpu(pr);
  }
  if (::testing::Test::HasFatalFailure()) return;
  {
    ScopedEnv path("FLASHMSA_BACKWARD_PATH", "mma");
    old = run_gpu_on(pr, kv.sel, /*with_kl=*/true);
  }
  if (::testing::Test::HasFatalFailure()) return;
  ASSERT_EQ(gputest::count_nonfinite(kv.o), 0) << "o has unwritten (NaN) elements";
  ASSERT_EQ(gputest::count_nonfinite(kv.lse), 0) << "lse has unwritten (NaN) elements";
  ASSERT_TRUE(std::isfinite(kv.kl)) << "kl not written";
  ASSERT_TRUE(std::isfinite(old.kl)) << "kl not written (old route)";
  EXPECT_EQ(kv.o, old.o) << "o depends on the KL route";
  EXPECT_EQ(kv.lse, old.lse) << "lse depends on the KL route";
  EXPECT_LT(rel_err(kv.kl, old.kl), 1e-4) << "kl KV-major " << kv.kl << " vs old route " << old.kl;

  CpuForward c;
  if (!run_cpu_forward(pr, kv.sel, c)) return;
  EXPECT_GT(c.kl, 0.f) << "a KL of zero would make the check vacuous";
  EXPECT_LT(rel_err(kv.kl, c.kl), 1e-4) << "kl vs CPU backend: gpu " << kv.kl << " cpu " << c.kl;
  EXPECT_LT(gputest::rel_l2(kv.o, c.o), 1e-2) << "o rel L2 vs CPU backend";
  EXPECT_LT(gputest::max_abs_diff(kv.lse, c.lse), 1e-3) << "lse max abs vs CPU backend";

  auto run_det = [&]() {
    DeviceForward d(pr);
    d.sel.upload(kv.sel);
    auto opt = pr.options();
    opt.deterministic = true;
    flashmsa::sparse_attention_forward(pr.device_inputs(), d.sel_v(), opt, d.o_v(), d.lse_v(), d.kl_v());
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return d.take();
  };
  const GpuForward d1 = run_det(), d2 = run_det();
  ASSERT_TRUE(std::isfinite(d1.kl)) << "kl not written (deterministic)";
  EXPECT_EQ(std::memcmp(&d1.kl, &d2.kl, 4), 0) << d1.kl << " vs " << d2.kl;
  EXPECT_LT(rel_err(d1.kl, c.kl), 1e-4) << "kl (deterministic) vs CPU backend";
  std::printf("    kl KV-major %.7f, old route %.7f, cpu %.7f\n", kv.kl, old.kl, c.kl);
}

TEST(CudaForward, KlValueKvMajor) {
  GPUTEST_REQUIRE_DEVICE();
  check_kl_value_kv_major(shape(16, 1, 1, 1, 128, 16, {2300, 517}), 91);
}

// Two proxy heads over one proxy kv head, empty and one-token sequences, key blocks nobody selects
// (K = 4 < visible blocks), the forced route for groups of 8 heads.
TEST(CudaForward, KlValueKvMajorEmptySequencesTwoProxyHeads) {
  GPUTEST_REQUIRE_DEVICE();
  check_kl_value_kv_major(shape(16, 2, 2, 1, 128, 4, {0, 2200, 1, 333, 0}), 92);
}

// Without a kl output the forward still writes o and lse.
TEST(CudaForward, WithoutKl) {
  GPUTEST_REQUIRE_DEVICE();
  check_without_kl_vs_reference(shape(8, 2, 2, 1, 64, 4, {777}), 22);
}

// T = 0 (no sequences, and only empty sequences): the kl value is written as 0.
TEST(CudaForward, EmptyBatch) {
  GPUTEST_REQUIRE_DEVICE();
  for (std::vector<int> lengths : {std::vector<int>{}, std::vector<int>{0, 0, 0}}) {
    Problem pr;
    gputest::make_problem(pr, shape(4, 1, 2, 1, 64, 4, lengths), 23);
    const GpuForward g = run_gpu(pr);
    EXPECT_TRUE(g.sel.empty());
    EXPECT_TRUE(g.o.empty());
    EXPECT_EQ(g.kl, 0.f);
  }
}

// Bad input on the GPU path: an Error naming the argument, and nothing written.
TEST(CudaForward, BadArgumentsWriteNothing) {
  GPUTEST_REQUIRE_DEVICE();
  Problem pr;
  gputest::make_problem(pr, shape(4, 1, 1, 1, 64, 4, {300}), 24);
  const Shape& s = pr.s;
  const int64_t T = pr.T;
  DeviceBuffer sel(static_cast<size_t>(s.Hp * T * s.K) * 4);
  DeviceBuffer o(static_cast<size_t>(T * s.H * s.D) * 4), lse(static_cast<size_t>(s.H * T) * 4), kl(4);
  sel.fill(gputest::kIntPoisonByte);
  o.fill(gputest::kFloatPoison);
  lse.fill(gputest::kFloatPoison);
  kl.fill(gputest::kFloatPoison);

  // fp32 inputs: the CUDA backend takes bf16 only.
  DeviceBuffer q32(static_cast<size_t>(T * s.H * s.D) * 4), k32(static_cast<size_t>(T * s.D) * 4),
      v32(static_cast<size_t>(T * s.D) * 4), qp32(static_cast<size_t>(T * s.D) * 4),
      kp32(static_cast<size_t>(T * s.D) * 4);
  flashmsa::AttentionInputs in;
  in.q = gputest::dview(q32, DType::fp32, {T, s.H, s.D});
  in.k = gputest::dview(k32, DType::fp32, {T, 1, s.D});
  in.v = gputest::dview(v32, DType::fp32, {T, 1, s.D});
  in.qp = gputest::dview(qp32, DType::fp32, {T, 1, s.D});
  in.kp = gputest::dview(kp32, DType::fp32, {T, 1, s.D});
  in.cu_seqlens = gputest::dview(pr.dcu, DType::int32, {pr.B + 1});
  in.cu_seqlens_host = pr.cu.data();
  auto selv = gputest::dview(sel, DType::int32, {s.Hp, T, s.K});
  gputest::expect_error_containing([&] { flashmsa::select_blocks(in, pr.options(), selv); }, "'q'");
  gputest::expect_error_containing(
      [&] {
        flashmsa::sparse_attention_forward(in, selv, pr.options(), gputest::dview(o, DType::fp32, {T, s.H, s.D}),
                                           gputest::dview(lse, DType::fp32, {s.H, T}),
                                           gputest::dview(kl, DType::fp32, {1}));
      },
      "'q'");
  // bf16 inputs but a block_idx of the wrong shape.
  gputest::expect_error_containing(
      [&] {
        flashmsa::sparse_attention_forward(pr.device_inputs(), gputest::dview(sel, DType::int32, {s.Hp, T, s.K - 1}),
                                           pr.options(), gputest::dview(o, DType::bf16, {T, s.H, s.D}),
                                           gputest::dview(lse, DType::fp32, {s.H, T}),
                                           gputest::dview(kl, DType::fp32, {1}));
      },
      "'block_idx'");
  // top_k above what the CUDA selector keeps in registers.
  {
    auto opt = pr.options();
    opt.top_k = 33;
    DeviceBuffer big(static_cast<size_t>(s.Hp * T * 33) * 4);
    big.fill(gputest::kIntPoisonByte);
    gputest::expect_error_containing(
        [&] { flashmsa::select_blocks(pr.device_inputs(), opt, gputest::dview(big, DType::int32, {s.Hp, T, 33})); },
        "'top_k'");
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int32_t x : big.download<int32_t>()) ASSERT_EQ(x, gputest::kIntPoison);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int32_t x : sel.download<int32_t>()) ASSERT_EQ(x, gputest::kIntPoison);
  for (unsigned char b : o.download<unsigned char>()) ASSERT_EQ(b, gputest::kFloatPoison);
  for (unsigned char b : lse.download<unsigned char>()) ASSERT_EQ(b, gputest::kFloatPoison);
  for (unsigned char b : kl.download<unsigned char>()) ASSERT_EQ(b, gputest::kFloatPoison);
}

// D = 128 with Dv = 64 (a v narrower than q and k): the API accepts Dv != D, the CUDA kernels
// do not, so msa_forward must raise an Error before selection writes block_idx. The v and o
// buffers are twice what their views cover, so a kernel that wrongly ran with Dv = D would stay
// inside them (no sticky CUDA error for later tests) and its writes would show in the bytes.
TEST(CudaForward, HeadDimVNotEqualDWritesNothing) {
  GPUTEST_REQUIRE_DEVICE();
  Problem pr;
  gputest::make_problem(pr, shape(4, 1, 1, 1, 128, 4, {300, 77}), 25);
  const Shape& s = pr.s;
  const int64_t T = pr.T;
  const int Dv = 64;
  std::mt19937_64 rng(26);
  DeviceBuffer v64(static_cast<size_t>(T * s.Hkv * s.D) * 2);  // room for [T, Hkv, 128]
  {
    std::vector<uint16_t> h = gputest::random_bf16(static_cast<size_t>(T * s.Hkv * s.D), rng);
    v64.upload(h);
  }
  DeviceBuffer sel(static_cast<size_t>(s.Hp * T * s.K) * 4);
  DeviceBuffer o(static_cast<size_t>(T * s.H * s.D) * 2);  // room for [T, H, 128] bf16
  DeviceBuffer lse(static_cast<size_t>(s.H * T) * 4), kl(4);
  sel.fill(gputest::kIntPoisonByte);
  o.fill(gputest::kFloatPoison);
  lse.fill(gputest::kFloatPoison);
  kl.fill(gputest::kFloatPoison);

  flashmsa::AttentionInputs in = pr.device_inputs();
  in.v = gputest::dview(v64, DType::bf16, {T, s.Hkv, Dv});
  auto opt = pr.options();
  opt.mode = flashmsa::Mode::sparse;
  for (bool host_cu : {true, false}) {
    SCOPED_TRACE(host_cu ? "with cu_seqlens_host" : "cu_seqlens on the device only");
    if (!host_cu) in.cu_seqlens_host = nullptr;
    try {
      flashmsa::msa_forward(in, opt, gputest::dview(sel, DType::int32, {s.Hp, T, s.K}),
                            gputest::dview(o, DType::bf16, {T, s.H, Dv}),
                            gputest::dview(lse, DType::fp32, {s.H, T}), gputest::dview(kl, DType::fp32, {1}));
      ADD_FAILURE() << "msa_forward with D = 128, Dv = 64 on CUDA did not throw";
    } catch (const flashmsa::Error& e) {
      const std::string msg = e.what();
      EXPECT_TRUE(msg.find("Dv") != std::string::npos || msg.find("'v'") != std::string::npos)
          << "message names neither Dv nor 'v': " << msg;
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (unsigned char b : sel.download<unsigned char>()) ASSERT_EQ(b, gputest::kIntPoisonByte) << "block_idx written";
    for (unsigned char b : o.download<unsigned char>()) ASSERT_EQ(b, gputest::kFloatPoison) << "o written";
    for (unsigned char b : lse.download<unsigned char>()) ASSERT_EQ(b, gputest::kFloatPoison) << "lse written";
    for (unsigned char b : kl.download<unsigned char>()) ASSERT_EQ(b, gputest::kFloatPoison) << "kl written";
  }
}

}  // namespace
