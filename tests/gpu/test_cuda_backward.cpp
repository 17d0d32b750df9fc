// GPU fused backward (dq, dk, dv, dqp, dkp, KL) against the CPU backend through the public API,
// on the same random valid selection and the same forward outputs (the CPU forward's o and
// lse, so this suite does not depend on the GPU forward). Gradients are poisoned before every
// GPU call, so an element the GPU never writes fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "flashmsa/flashmsa.h"
#include "gpu_test_util.h"

namespace {

using flashmsa::DType;
using gputest::DeviceBuffer;
using gputest::Problem;
using gputest::Shape;
using gputest::shape;

// A valid selection that is not the top-K one: for each (p, t) the local block plus random
// other visible blocks, ascending, -1 padding. The backward must take any valid selection.
std::vector<int32_t> random_selection(const Problem& pr, std::mt19937_64& rng) {
  const Shape& s = pr.s;
  std::vector<int32_t> sel(static_cast<size_t>(s.Hp * pr.T * s.K), -1);
  for (int p = 0; p < s.Hp; ++p)
    for (int b = 0; b < pr.B; ++b)
      for (int64_t t = pr.cu[b]; t < pr.cu[b + 1]; ++t) {
        const int n_loc = static_cast<int>(t - pr.cu[b]) / 128;
        std::vector<int> blocks(n_loc);
        for (int i = 0; i < n_loc; ++i) blocks[i] = i;
        std::shuffle(blocks.begin(), blocks.end(), rng);
        const int take = std::min(s.K - 1, n_loc);
        blocks.resize(take);
        blocks.push_back(n_loc);
        std::sort(blocks.begin(), blocks.end());
        int32_t* row = sel.data() + (static_cast<int64_t>(p) * pr.T + t) * s.K;
        for (size_t i = 0; i < blocks.size(); ++i) row[i] = blocks[i];
      }
  return sel;
}

struct Grads {
  std::vector<double> dq, dk, dv, dqp, dkp;
  float kl = 0;
  std::vector<uint16_t> raw;  // all gradients' bits, for the bitwise comparisons
};

struct Setup {
  Problem pr;
  std::vector<int32_t> sel;
  std::vector<uint16_t> o, d_o;
  std::vector<float> lse;
  float kl_grad = 1.f;
  bool pass_kl_grad = false;
  flashmsa::Options opt;
};

// `tweak` (optional) reshapes the random inputs (host and device copies) before o and lse are formed.
void make_setup(Setup& st, const Shape& s, uint64_t seed, bool pass_kl_grad, float kl_grad,
                const std::function<void(Setup&)>& tweak = {}) {
  gputest::make_problem(st.pr, s, seed);
  std::mt19937_64 rng(seed * 7919 + 13);
  st.sel = random_selection(st.pr, rng);
  st.d_o = gputest::random_bf16(static_cast<size_t>(st.pr.T * s.H * s.D), rng);
  if (tweak) tweak(st);
  st.opt = st.pr.options();
  st.pass_kl_grad = pass_kl_grad;
  st.kl_grad = kl_grad;
  // The CPU forward gives o and lse for both backends.
  st.o.assign(static_cast<size_t>(st.pr.T * s.H * s.D), 0);
  st.lse.assign(static_cast<size_t>(s.H * st.pr.T), 0.f);
  const int64_t T = st.pr.T;
  flashmsa::sparse_attention_forward(st.pr.host_inputs(),
                                     flashmsa::make_view(st.sel.data(), DType::int32, {s.Hp, T, s.K}),
                                     st.opt, flashmsa::make_view(st.o.data(), DType::bf16, {T, s.H, s.D}),
                                     flashmsa::make_view(st.lse.data(), DType::fp32, {s.H, T}));
}

Grads run_cpu(Setup& st) {
  const Shape& s = st.pr.s;
  const int64_t T = st.pr.T;
  std::vector<uint16_t> dq(T * s.H * s.D, 0xFFFF), dk(T * s.Hkv * s.D, 0xFFFF), dv(T * s.Hkv * s.D, 0xFFFF),
      dqp(T * s.Hp * s.D, 0xFFFF), dkp(T * s.Hpk * s.D, 0xFFFF);
  float kl = std::nanf("");
  const flashmsa::Gradients g =
      gputest::grad_views(dq.data(), dk.data(), dv.data(), dqp.data(), dkp.data(), s, T, flashmsa::Device::cpu);
  flashmsa::fused_backward(
      st.pr.host_inputs(), flashmsa::make_view(st.sel.data(), DType::int32, {s.Hp, T, s.K}),
      flashmsa::make_view(st.o.data(), DType::bf16, {T, s.H, s.D}),
      flashmsa::make_view(st.lse.data(), DType::fp32, {s.H, T}),
      flashmsa::make_view(st.d_o.data(), DType::bf16, {T, s.H, s.D}),
      st.pass_kl_grad ? flashmsa::make_view(&st.kl_grad, DType::fp32, {1}) : flashmsa::TensorView(), st.opt, g,
      flashmsa::make_view(&kl, DType::fp32, {1}));
  Grads r;
  r.dq = gputest::bf16_to_doubles(dq);
  r.dk = gputest::bf16_to_doubles(dk);
  r.dv = gputest::bf16_to_doubles(dv);
  r.dqp = gputest::bf16_to_doubles(dqp);
  r.dkp = gputest::bf16_to_doubles(dkp);
  r.kl = kl;
  return r;
}

// Device copies of the backward's inputs, uploaded once and reused by repeated runs.
struct DeviceSide {
  DeviceBuffer sel, o, lse, d_o, kl_grad, dq, dk, dv, dqp, dkp, kl;
};

void upload(DeviceSide& d, const Setup& st) {
  const Shape& s = st.pr.s;
  const int64_t T = st.pr.T;
  d.sel = DeviceBuffer(st.sel.size() * 4);
  d.sel.upload(st.sel);
  d.o = DeviceBuffer(st.o.size() * 2);
  d.o.upload(st.o);
  d.lse = DeviceBuffer(st.lse.size() * 4);
  d.lse.upload(st.lse);
  d.d_o = DeviceBuffer(st.d_o.size() * 2);
  d.d_o.upload(st.d_o);
  d.kl_grad = DeviceBuffer(4);
  d.kl_grad.upload(std::vector<float>{st.kl_grad});
  d.dq = DeviceBuffer(static_cast<size_t>(T * s.H * s.D) * 2);
  d.dk = DeviceBuffer(static_cast<size_t>(T * s.Hkv * s.D) * 2);
  d.dv = DeviceBuffer(static_cast<size_t>(T * s.Hkv * s.D) * 2);
  d.dqp = DeviceBuffer(static_cast<size_t>(T * s.Hp * s.D) * 2);
  d.dkp = DeviceBuffer(static_cast<size_t>(T * s.Hpk * s.D) * 2);
  d.kl = DeviceBuffer(4);
}

// `index`: a caller's selection index for st.sel (build_selection_index), or none (the backward's own).
Grads run_gpu(DeviceSide& d, const Setup& st, bool deterministic,
              const flashmsa::TensorView& index = flashmsa::TensorView()) {
  const Shape& s = st.pr.s;
  const int64_t T = st.pr.T;
  for (DeviceBuffer* b : {&d.dq, &d.dk, &d.dv, &d.dqp, &d.dkp, &d.kl}) b->fill(gputest::kFloatPoison);
  const flashmsa::Gradients g = gputest::grad_views(d.dq.get(), d.dk.get(), d.dv.get(), d.dqp.get(), d.dkp.get(),
                                                    s, T, flashmsa::Device::cuda);
  flashmsa::Options opt = st.opt;
  opt.deterministic = deterministic;
  flashmsa::AttentionInputs in = st.pr.device_inputs();
  in.selection_index = index;
  flashmsa::fused_backward(in, gputest::dview(d.sel, DType::int32, {s.Hp, T, s.K}),
                           gputest::dview(d.o, DType::bf16, {T, s.H, s.D}),
                           gputest::dview(d.lse, DType::fp32, {s.H, T}),
                           gputest::dview(d.d_o, DType::bf16, {T, s.H, s.D}),
                           st.pass_kl_grad ? gputest::dview(d.kl_grad, DType::fp32, {1}) : flashmsa::TensorView(),
                           opt, g, gputest::dview(d.kl, DType::fp32, {1}));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Grads r;
  auto take = [&](const DeviceBuffer& b, std::vector<double>& out) {
    auto bits = b.download<uint16_t>();
    out = gputest::bf16_to_doubles(bits);
    r.raw.insert(r.raw.end(), bits.begin(), bits.end());
  };
  take(d.dq, r.dq);
  take(d.dk, r.dk);
  take(d.dv, r.dv);
  take(d.dqp, r.dqp);
  take(d.dkp, r.dkp);
  r.kl = d.kl.download<float>()[0];
  return r;
}

uint32_t float_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

// Runs the deterministic backward again (runs - 1 times) on the same inputs: every gradient and
// kl must be bitwise those of `ref`.
void expect_bitwise_reruns(DeviceSide& d, const Setup& st, const Grads& ref, int runs, const char* what) {
  for (int run = 1; run < runs; ++run) {
    const Grads again = run_gpu(d, st, true);
    EXPECT_TRUE(again.raw == ref.raw) << what << ": deterministic run " << run << " differs bitwise";
    EXPECT_EQ(float_bits(again.kl), float_bits(ref.kl)) << what << ": deterministic kl differs in run " << run;
  }
}

void compare(const Grads& gpu, const Grads& cpu, const std::string& what) {
  const char* names[5] = {"dq", "dk", "dv", "dqp", "dkp"};
  const std::vector<double>* g[5] = {&gpu.dq, &gpu.dk, &gpu.dv, &gpu.dqp, &gpu.dkp};
  const std::vector<double>* c[5] = {&cpu.dq, &cpu.dk, &cpu.dv, &cpu.dqp, &cpu.dkp};
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(gputest::count_nonfinite(*g[i]), 0) << what << ": " << names[i] << " has unwritten/non-finite elements";
    EXPECT_EQ(gputest::count_nonfinite(*c[i]), 0) << what << ": CPU " << names[i] << " non-finite";
    const double e = gputest::rel_l2(*g[i], *c[i]);
    EXPECT_LT(e, 1e-2) << what << ": " << names[i] << " rel L2 vs CPU";
    std::printf("  %s %-4s rel L2 %.3e\n", what.c_str(), names[i], e);
  }
  const double kl_rel = std::fabs(gpu.kl - cpu.kl) / std::max(1e-30, std::fabs(static_cast<double>(cpu.kl)));
  EXPECT_LT(kl_rel, 1e-2) << what << ": kl gpu " << gpu.kl << " cpu " << cpu.kl;
  std::printf("  %s kl gpu %.6g cpu %.6g\n", what.c_str(), gpu.kl, cpu.kl);
}

// The CPU backend's forward KL value on st's selection (o and lse to scratch).
float cpu_forward_kl(Setup& st) {
  const Shape& s = st.pr.s;
  const int64_t T = st.pr.T;
  float kl = std::nanf("");
  std::vector<uint16_t> o(static_cast<size_t>(T * s.H * s.D));
  std::vector<float> lse(static_cast<size_t>(s.H * T));
  flashmsa::sparse_attention_forward(st.pr.host_inputs(),
                                     flashmsa::make_view(st.sel.data(), DType::int32, {s.Hp, T, s.K}), st.opt,
                                     flashmsa::make_view(o.data(), DType::bf16, {T, s.H, s.D}),
                                     flashmsa::make_view(lse.data(), DType::fp32, {s.H, T}),
                                     flashmsa::make_view(&kl, DType::fp32, {1}));
  return kl;
}

void check_backward(const Shape& s, uint64_t seed, bool pass_kl_grad = false, float kl_grad = 1.f,
                    bool deterministic_too = false) {
  Setup st;
  make_setup(st, s, seed, pass_kl_grad, kl_grad);
  const Grads cpu = run_cpu(st);
  DeviceSide d;
  upload(d, st);
  const Grads gpu = run_gpu(d, st, false);
  compare(gpu, cpu, "fast");
  if (deterministic_too) {
    const Grads first = run_gpu(d, st, true);
    compare(first, cpu, "det");
    expect_bitwise_reruns(d, st, first, 5, "det");
  }
}

TEST(CudaBackward, GroupOfFourD64) {
  GPUTEST_REQUIRE_DEVICE();
  check_backward(shape(4, 1, 1, 1, 64, 4, {700}), 11, false, 1.f, true);
}

TEST(CudaBackward, M3LikeD128SeveralSequencesKlGrad) {
  GPUTEST_REQUIRE_DEVICE();
  // m = 4 heads per proxy head, dkp shared by both proxy heads, g != 1.
  check_backward(shape(8, 2, 2, 1, 128, 3, {300, 1000, 5, 129}), 12, true, 0.7f, true);
}

// The student's lse at D = 128 runs on warpgroup MMA; FLASHMSA_PROXY_LSE=mma keeps the mma.sync
// form (the A/B knob, and D = 64's form): both within the tolerances of the CPU backend.
TEST(CudaBackward, StudentLseMmaFormD128) {
  GPUTEST_REQUIRE_DEVICE();
  gputest::ScopedEnv form("FLASHMSA_PROXY_LSE", "mma");
  check_backward(shape(8, 2, 2, 1, 128, 3, {300, 1000, 5, 129}), 12, true, 0.7f, true);
}

TEST(CudaBackward, OneHeadPerProxyHeadHpkEqualsHp) {
  GPUTEST_REQUIRE_DEVICE();
  check_backward(shape(2, 2, 2, 2, 64, 2, {513, 64}), 13, false, 1.f, true);
}

TEST(CudaBackward, LocalOnlyK1) {
  GPUTEST_REQUIRE_DEVICE();
  check_backward(shape(4, 2, 1, 1, 64, 1, {400}), 14, false, 1.f, true);
}

TEST(CudaBackward, KvHeadSharedByTwoGroups) {
  GPUTEST_REQUIRE_DEVICE();
  // m = 3, H/Hkv = 2: kv head 1 serves heads of both groups (dk/dv through accumulators).
  check_backward(shape(6, 3, 2, 1, 64, 2, {260, 100}), 15, true, -1.3f, true);
}

TEST(CudaBackward, MoreProxyHeadsThanKvHeads) {
  GPUTEST_REQUIRE_DEVICE();
  check_backward(shape(4, 1, 4, 2, 128, 2, {384}), 16, false, 1.f, true);
}

TEST(CudaBackward, ManyShortSequencesWithEmptyOnes) {
  GPUTEST_REQUIRE_DEVICE();
  std::mt19937_64 rng(17);
  std::vector<int> lengths;
  for (int i = 0; i < 300; ++i) lengths.push_back(i % 37 == 5 ? 0 : 1 + static_cast<int>(rng() % 150));
  check_backward(shape(4, 1, 2, 2, 64, 2, lengths), 17, false, 1.f, true);
}

TEST(CudaBackward, FewerVisibleBlocksThanK) {
  GPUTEST_REQUIRE_DEVICE();
  check_backward(shape(4, 1, 1, 1, 128, 16, {1100, 77}), 18, true, 2.f, true);
}

TEST(CudaBackward, FoldedLargeGroupD128) {
  GPUTEST_REQUIRE_DEVICE();
  // m = 16 heads per proxy group inside one kv head (the m3 ratios): the KL runs inside the
  // main kernel; partial last tiles, two sequences, g != 1, deterministic mode too.
  check_backward(shape(32, 2, 2, 1, 128, 4, {1200, 333}), 20, true, 0.4f, true);
}

TEST(CudaBackward, FoldedGroupsShareKvHead) {
  GPUTEST_REQUIRE_DEVICE();
  // m = 4, H/Hkv = 8: folded KL with dk/dv through accumulators, Hp == Hpk (dkp per tile).
  check_backward(shape(8, 1, 2, 2, 64, 3, {500}), 21, false, 1.f, true);
}

// FLASHMSA_BACKWARD_PATH for one scope (nullptr: unset, the default routing), restored after.
struct ScopedBackwardPath : gputest::ScopedEnv {
  explicit ScopedBackwardPath(const char* value) : ScopedEnv("FLASHMSA_BACKWARD_PATH", value) {}
};

TEST(CudaBackward, WgmmaPathGroupOf16K16) {
  GPUTEST_REQUIRE_DEVICE();
  // Hkv = Hp: each kv head is exactly one group of m = 16 heads, D = 128, not deterministic:
  // the wgmma kernel (backward_wgmma.cuh). Two sequences, both with a partial last block
  // (2200 = 17 x 128 + 24), K = 16 (the first sequence's late tokens see more than K blocks),
  // two proxy groups sharing one proxy key head (dkp from both), g != 1. "wgmma": an error if the
  // routing would not take the wgmma kernel.
  ScopedBackwardPath path("wgmma");
  check_backward(shape(32, 2, 2, 1, 128, 16, {2200, 333}), 24, true, 0.6f);
}


// Same inputs through the default routing (the wgmma kernel for these shapes) and through the
// mma.sync kernel forced by FLASHMSA_BACKWARD_PATH=mma: the same gradients up to the order of
// the atomics and the bf16 rounding of P / dS.
void check_wgmma_vs_mma(const Shape& s, uint64_t seed) {
  Setup st;
  make_setup(st, s, seed, true, 1.3f);
  DeviceSide d;
  upload(d, st);
  Grads wg, mma;
  {
    ScopedBackwardPath path("wgmma");  // an error unless the wgmma kernel takes the problem
    wg = run_gpu(d, st, false);
  }
  {
    ScopedBackwardPath path("mma");
    mma = run_gpu(d, st, false);
  }
  const char* names[5] = {"dq", "dk", "dv", "dqp", "dkp"};
  const std::vector<double>* a[5] = {&wg.dq, &wg.dk, &wg.dv, &wg.dqp, &wg.dkp};
  const std::vector<double>* b[5] = {&mma.dq, &mma.dk, &mma.dv, &mma.dqp, &mma.dkp};
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(gputest::count_nonfinite(*a[i]), 0) << "wgmma path: " << names[i] << " non-finite/unwritten";
    EXPECT_EQ(gputest::count_nonfinite(*b[i]), 0) << "mma path: " << names[i] << " non-finite/unwritten";
    const double e = gputest::rel_l2(*a[i], *b[i]);
    EXPECT_LT(e, 1e-2) << names[i] << ": wgmma vs mma rel L2";
    std::printf("  wgmma vs mma %-4s rel L2 %.3e\n", names[i], e);
  }
  const double kl_rel = std::fabs(wg.kl - mma.kl) / std::max(1e-30, std::fabs(static_cast<double>(mma.kl)));
  EXPECT_LT(kl_rel, 1e-3) << "kl wgmma " << wg.kl << " mma " << mma.kl;
}

TEST(CudaBackward, WgmmaPathMatchesMmaPath) {
  GPUTEST_REQUIRE_DEVICE();
  // m = 16 on one kv head, a partial 129-token sequence; m = 2 with four groups on one proxy key head.
  check_wgmma_vs_mma(shape(16, 1, 1, 1, 128, 16, {1900, 129}), 25);
  check_wgmma_vs_mma(shape(8, 4, 4, 1, 128, 6, {1000, 70, 520}), 26);
}

// Deterministic mode with K <= 32 computes dq query-major, without atomics: same inputs, it must
// agree with the fast mode's KV-major dq and be bitwise identical over runs.
void check_deterministic_dq(const Shape& s, uint64_t seed) {
  Setup st;
  make_setup(st, s, seed, false, 1.f);
  DeviceSide d;
  upload(d, st);
  const Grads fast = run_gpu(d, st, false);
  const Grads det = run_gpu(d, st, true);
  EXPECT_EQ(gputest::count_nonfinite(det.dq), 0) << "deterministic dq has unwritten/non-finite elements";
  const double e = gputest::rel_l2(det.dq, fast.dq);
  EXPECT_LT(e, 1e-2) << "deterministic dq vs fast dq";
  std::printf("  det dq vs fast dq rel L2 %.3e\n", e);
  // Grads::raw starts with dq's bits.
  const auto n_dq = static_cast<std::ptrdiff_t>(det.dq.size());
  for (int run = 1; run < 5; ++run) {
    const Grads again = run_gpu(d, st, true);
    EXPECT_TRUE(std::equal(det.raw.begin(), det.raw.begin() + n_dq, again.raw.begin()))
        << "deterministic dq differs bitwise in run " << run;
  }
}

TEST(CudaBackward, DeterministicDqMatchesFastDq) {
  GPUTEST_REQUIRE_DEVICE();
  // m = 32: two 16-row groups per token and proxy head; K = 16 > visible blocks (at most 12),
  // partial last blocks, a 3-token sequence.
  check_deterministic_dq(shape(32, 1, 1, 1, 128, 16, {1500, 3, 700}), 22);
  // m = 5 (partial row groups), D = 64, Hp = 2 Hpk, a leading empty sequence.
  check_deterministic_dq(shape(20, 4, 4, 2, 64, 5, {0, 640, 129}), 23);
}

// FLASHMSA_DET_DQ=kv is an error where the wgmma kernel's int32 dq does not run: D = 64, and one
// head per proxy head (m = 1); and FLASHMSA_BWD_ROWS=1 with FLASHMSA_DET_DQ=query. (A TEST body
// cannot name Setup: gtest's Test::Setup hides it.)
void expect_det_dq_env_error(const Shape& s, const char* det_dq, const char* rows) {
  Setup st;
  make_setup(st, s, 24, true, 1.f);
  DeviceSide d;
  upload(d, st);
  gputest::ScopedEnv dq_env("FLASHMSA_DET_DQ", det_dq);
  gputest::ScopedEnv rows_env("FLASHMSA_BWD_ROWS", rows);
  // The message names the setting that refuses the problem, not some other error.
  gputest::expect_error_containing([&] { run_gpu(d, st, true); },
                                   rows && std::string(rows) == "1" ? "FLASHMSA_BWD_ROWS=1" : "FLASHMSA_DET_DQ=kv");
}

TEST(CudaBackward, DeterministicDqEnvErrors) {
  GPUTEST_REQUIRE_DEVICE();
  expect_det_dq_env_error(shape(8, 2, 2, 1, 64, 8, {300}), "kv", nullptr);
  expect_det_dq_env_error(shape(4, 4, 4, 1, 128, 8, {300}), "kv", nullptr);
  expect_det_dq_env_error(shape(16, 1, 1, 1, 128, 8, {300}), "query", "1");
}

// Deterministic mode on the wgmma kernel's shapes (D = 128, K <= 32) runs its DET form (dkp as fp32
// partials per proxy head; dq and dqp staged as int32 (groups of 8 / 16 heads: token rows; other shapes:
// the per-head form's DQ_ROWS) unless FLASHMSA_DET_DQ=query (then dqp in int64 and no dQ beside the
// query-major dq): it must
// agree with the fast mode (fp32 atomics) and with the CPU, and give the same bits, all five gradients
// and kl, every run.
void check_deterministic_wgmma(const Shape& s, uint64_t seed, float kl_grad) {
  Setup st;
  make_setup(st, s, seed, true, kl_grad);
  const Grads cpu = run_cpu(st);
  DeviceSide d;
  upload(d, st);
  ScopedBackwardPath path("wgmma");  // an error unless the wgmma kernel takes both modes
  const Grads fast = run_gpu(d, st, false);
  const Grads det = run_gpu(d, st, true);
  compare(det, cpu, "det wgmma");
  const char* names[5] = {"dq", "dk", "dv", "dqp", "dkp"};
  const std::vector<double>* a[5] = {&det.dq, &det.dk, &det.dv, &det.dqp, &det.dkp};
  const std::vector<double>* b[5] = {&fast.dq, &fast.dk, &fast.dv, &fast.dqp, &fast.dkp};
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(gputest::count_nonfinite(*b[i]), 0) << "fast: " << names[i] << " non-finite/unwritten";
    const double e = gputest::rel_l2(*a[i], *b[i]);
    EXPECT_LT(e, 1e-2) << names[i] << ": deterministic vs fast rel L2";
    std::printf("  det vs fast %-4s rel L2 %.3e\n", names[i], e);
  }
  const double kl_rel = std::fabs(det.kl - fast.kl) / std::max(1e-30, std::fabs(static_cast<double>(fast.kl)));
  EXPECT_LT(kl_rel, 1e-3) << "kl det " << det.kl << " fast " << fast.kl;
  expect_bitwise_reruns(d, st, det, 5, "det wgmma");
}

// The per-head DET form with the int32 dq (DQ_ROWS, the default outside the token rows;
// FLASHMSA_DET_DQ=kv makes any other route an error), on groups of 32, of 4 and of 2 heads (G = 1;
// K = 6 with the 2), on groups of 16 and 8 with FLASHMSA_BWD_ROWS=0, and on fm16k's two groups per kv
// head (SHARED_KV).
TEST(CudaBackward, DeterministicDqRowsPerHead) {
  GPUTEST_REQUIRE_DEVICE();
  gputest::ScopedEnv dq("FLASHMSA_DET_DQ", "kv");  // an error unless the int32 dq runs
  check_deterministic_wgmma(shape(32, 1, 1, 1, 128, 16, {1500, 3, 700}), 71, 0.8f);
  check_deterministic_wgmma(shape(16, 4, 4, 1, 128, 8, {1700, 90}), 72, 1.f);
  check_deterministic_wgmma(shape(8, 4, 4, 1, 128, 6, {1000, 70, 520}), 75, 0.9f);
  check_deterministic_wgmma(shape(16, 2, 4, 1, 128, 16, {1500, 0, 260}), 73, 0.6f);
  gputest::ScopedEnv rows("FLASHMSA_BWD_ROWS", "0");
  check_deterministic_wgmma(shape(32, 2, 2, 1, 128, 16, {2200, 333}), 74, 0.6f);
  check_deterministic_wgmma(shape(16, 2, 2, 1, 128, 16, {1300, 129}), 76, 0.7f);
}

TEST(CudaBackward, DeterministicWgmmaGroupOf16K16) {
  GPUTEST_REQUIRE_DEVICE();
  // m = 16 heads per kv head = proxy group, D = 128, K = 16: the wgmma kernel's DET form. Two
  // sequences with partial last blocks, two groups sharing one proxy key head (dkp from both), g != 1.
  check_deterministic_wgmma(shape(32, 2, 2, 1, 128, 16, {2200, 333}), 27, 0.6f);
}

// The deterministic dkp's two forms: per-proxy-head fp32 partials (the default without token
// chunks, Hp <= 4 Hpk: one CTA adds each row of a partial, in a fixed order; FLASHMSA_DET_DKP=partials
// makes any other route an error) and the int64 fixed point into the shared accumulator
// (FLASHMSA_DET_DKP=int64), each against the CPU and the fast form and bitwise over reruns, in the
// token-row form (m = 16), the per-head form (FLASHMSA_DET_DQ=query) and the SHARED_KV form (G = 2,
// four proxy heads on one key head).
TEST(CudaBackward, DeterministicDkpForms) {
  GPUTEST_REQUIRE_DEVICE();
  gputest::ScopedEnv no_chunk("FLASHMSA_BWD_CHUNK", nullptr), no_chunks("FLASHMSA_BWD_CHUNKS", nullptr);
  for (const char* form : {"partials", "int64"}) {
    gputest::ScopedEnv env("FLASHMSA_DET_DKP", form);
    std::printf("  FLASHMSA_DET_DKP=%s\n", form);
    check_deterministic_wgmma(shape(32, 2, 2, 1, 128, 16, {1900, 333}), 28, 0.7f);
    {
      gputest::ScopedEnv dq("FLASHMSA_DET_DQ", "query");
      check_deterministic_wgmma(shape(32, 2, 2, 1, 128, 8, {900, 200}), 29, 1.f);
    }
    check_deterministic_wgmma(shape(16, 2, 4, 1, 128, 16, {1500, 0, 260}), 30, 0.6f);
  }
}

// FLASHMSA_DET_DKP=partials is an error where the partials do not apply: token chunks, and more than
// four proxy heads per proxy key head (m = 2, Hp = 8, Hpk = 1).
void expect_det_dkp_env_error(const Shape& s, const char* chunk) {
  Setup st;
  make_setup(st, s, 25, true, 1.f);
  DeviceSide d;
  upload(d, st);
  gputest::ScopedEnv form("FLASHMSA_DET_DKP", "partials");
  gputest::ScopedEnv chunk_env("FLASHMSA_BWD_CHUNK", chunk);
  EXPECT_THROW(run_gpu(d, st, true), flashmsa::Error) << "FLASHMSA_BWD_CHUNK=" << (chunk ? chunk : "(unset)");
}

TEST(CudaBackward, DeterministicDkpEnvErrors) {
  GPUTEST_REQUIRE_DEVICE();
  expect_det_dkp_env_error(shape(16, 1, 1, 1, 128, 8, {1300}), "256");
  expect_det_dkp_env_error(shape(16, 8, 8, 1, 128, 8, {700}), nullptr);
}

// ---- kv heads shared by G = Hp/Hkv > 1 proxy groups (the wgmma kernel's SHARED_KV form) ----

void expect_close(const Grads& a, const Grads& b, const std::string& what) {
  const char* names[5] = {"dq", "dk", "dv", "dqp", "dkp"};
  const std::vector<double>* x[5] = {&a.dq, &a.dk, &a.dv, &a.dqp, &a.dkp};
  const std::vector<double>* y[5] = {&b.dq, &b.dk, &b.dv, &b.dqp, &b.dkp};
  for (int i = 0; i < 5; ++i) {
    const double e = gputest::rel_l2(*x[i], *y[i]);
    EXPECT_LT(e, 1e-2) << what << ": " << names[i] << " rel L2";
    std::printf("  %s %-4s rel L2 %.3e\n", what.c_str(), names[i], e);
  }
  const double kl_rel = std::fabs(a.kl - b.kl) / std::max(1e-30, std::fabs(static_cast<double>(b.kl)));
  EXPECT_LT(kl_rel, 1e-3) << what << ": kl " << a.kl << " vs " << b.kl;
}

// D = 128, (H/Hkv) % m == 0 with Hp > Hkv: the wgmma kernel with dk/dv added into accumulators by
// the G groups of a kv head (FLASHMSA_BACKWARD_PATH=wgmma: an error unless it takes the problem).
// Against the CPU and against the mma.sync kernel (FLASHMSA_BACKWARD_PATH=mma) on the same inputs;
// optionally deterministic mode too (the DET + SHARED_KV form: int64 dk/dv), bitwise over reruns.
// (The two kernels round at the same points and, on grids this small, often add in the same order:
// equal bits between them are possible, so they are not used as a fingerprint.)
void check_shared_kv(const Shape& s, uint64_t seed, float kl_grad, bool deterministic_too) {
  ASSERT_EQ(s.D, 128);
  ASSERT_GT(s.Hp, s.Hkv);
  ASSERT_EQ((s.H / s.Hkv) % (s.H / s.Hp), 0);
  Setup st;
  make_setup(st, s, seed, true, kl_grad);
  const Grads cpu = run_cpu(st);
  DeviceSide d;
  upload(d, st);
  Grads wg, wg_again, mma;
  {
    ScopedBackwardPath path("wgmma");
    wg = run_gpu(d, st, false);
    wg_again = run_gpu(d, st, false);
  }
  {
    ScopedBackwardPath path("mma");
    mma = run_gpu(d, st, false);
  }
  compare(wg, cpu, "wgmma shared kv");
  expect_close(wg, mma, "wgmma vs mma");
  expect_close(wg_again, wg, "wgmma rerun");
  if (!deterministic_too) return;

  Grads det, det_mma;
  {
    ScopedBackwardPath path("wgmma");
    det = run_gpu(d, st, true);
    compare(det, cpu, "det wgmma shared kv");
    expect_close(det, wg, "det vs fast");
    expect_bitwise_reruns(d, st, det, 4, "det wgmma shared kv");
  }
  {
    ScopedBackwardPath path("mma");
    det_mma = run_gpu(d, st, true);
  }
  expect_close(det, det_mma, "det wgmma vs det mma");
}

TEST(CudaBackward, WgmmaSharedKvFm16kLike) {
  GPUTEST_REQUIRE_DEVICE();
  // The fm16k ratios (H = 16, Hkv = 2, Hp = 4, Hpk = 1, K = 16: m = 4, G = 2 groups per kv head,
  // four groups on one proxy key head), several sequences: empty ones, partial last blocks
  // (2200 = 17 x 128 + 24, 129, 333), K = 16 below the visible blocks late in the long one; g != 1.
  check_shared_kv(shape(16, 2, 4, 1, 128, 16, {0, 2200, 129, 0, 333}), 30, 0.8f, false);
}

TEST(CudaBackward, WgmmaSharedKvHpkEqualsHp) {
  GPUTEST_REQUIRE_DEVICE();
  // H = 8, Hkv = 1, Hp = Hpk = 2: G = 2 with each group on its own proxy key head.
  check_shared_kv(shape(8, 1, 2, 2, 128, 6, {700, 0, 300}), 31, 1.f, false);
}

TEST(CudaBackward, WgmmaSharedKvGroupsOfTwoG4) {
  GPUTEST_REQUIRE_DEVICE();
  // m = 2, G = 4 groups per kv head (H = 16, Hkv = 2, Hp = 8, Hpk = 1), a short partial sequence.
  check_shared_kv(shape(16, 2, 8, 1, 128, 8, {1000, 45}), 32, -1.2f, false);
}

TEST(CudaBackward, DeterministicWgmmaSharedKv) {
  GPUTEST_REQUIRE_DEVICE();
  // G = 2 (fm16k ratios), deterministic mode: DET + SHARED_KV, int64 fixed-point dk/dv.
  check_shared_kv(shape(16, 2, 4, 1, 128, 16, {1500, 0, 260}), 33, 0.6f, true);
}

// The forward's KL value on a G = 2 shape: kl_value_applies now holds, so the forward computes it
// with the KV-major KL_ONLY kernel (its K loads from kv head p / G; FLASHMSA_BACKWARD_PATH=wgmma
// makes any other route an error); FLASHMSA_BACKWARD_PATH=mma keeps the forward's own KL pass.
// Both against the CPU's kl. (Their bits are no fingerprint of the route: both are accurate
// enough to round to the same float.)
void check_kl_value_shared_kv(const Shape& shp, uint64_t seed) {
  Setup st;
  make_setup(st, shp, seed, false, 1.f);
  const Shape& s = st.pr.s;
  const int64_t T = st.pr.T;
  const float cpu_kl = cpu_forward_kl(st);
  DeviceBuffer sel(st.sel.size() * 4), o(static_cast<size_t>(T * s.H * s.D) * 2),
      lse(static_cast<size_t>(s.H * T) * 4), kl(4);
  sel.upload(st.sel);
  auto gpu_kl = [&]() {
    kl.fill(gputest::kFloatPoison);
    flashmsa::sparse_attention_forward(st.pr.device_inputs(), gputest::dview(sel, DType::int32, {s.Hp, T, s.K}),
                                       st.opt, gputest::dview(o, DType::bf16, {T, s.H, s.D}),
                                       gputest::dview(lse, DType::fp32, {s.H, T}), gputest::dview(kl, DType::fp32, {1}));
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return kl.download<float>()[0];
  };
  // The query-major forward: its lse (which the KL value reads) is bitwise reproducible; the
  // wgmma forward's is not.
  gputest::ScopedEnv forward_path("FLASHMSA_FORWARD_PATH", "query");
  float kv = 0, kv_again = 0, old = 0;
  {
    ScopedBackwardPath path("wgmma");
    kv = gpu_kl();
    kv_again = gpu_kl();
  }
  {
    ScopedBackwardPath path("mma");
    old = gpu_kl();
  }
  ASSERT_TRUE(std::isfinite(cpu_kl));
  EXPECT_GT(cpu_kl, 0.f) << "a KL of zero would make the check vacuous";
  for (float x : {kv, old}) {
    ASSERT_TRUE(std::isfinite(x));
    EXPECT_LT(std::fabs(x - cpu_kl), 1e-3 * std::fabs(cpu_kl) + 1e-7) << "gpu kl " << x << " cpu " << cpu_kl;
  }
  EXPECT_EQ(float_bits(kv), float_bits(kv_again)) << "KV-major kl not reproducible";
  std::printf("    kl KV-major %.7f, old route %.7f, cpu %.7f\n", kv, old, cpu_kl);
}

// ---- token-row tiles of the fast wgmma backward (groups of 8 or 16 heads, G = 1) ----

// The default routing takes the token-row tiles for these shapes; FLASHMSA_BWD_ROWS=0 the per-head
// tiles. Both against the CPU and against each other (their dq accumulators differ in layout and
// in the order of the adds).
void check_token_rows(const Shape& s, uint64_t seed) {
  ASSERT_EQ(s.D, 128);
  ASSERT_EQ(s.Hp, s.Hkv) << "premise: G = 1";
  ASSERT_TRUE(s.H / s.Hp == 8 || s.H / s.Hp == 16) << "premise: groups of 8 or 16 heads";
  Setup st;
  make_setup(st, s, seed, true, 0.7f);
  const Grads cpu = run_cpu(st);
  DeviceSide d;
  upload(d, st);
  ScopedBackwardPath path("wgmma");
  Grads rows, rows_again, per_head;
  {
    gputest::ScopedEnv env("FLASHMSA_BWD_ROWS", "1");  // an error unless the token-row form runs
    rows = run_gpu(d, st, false);
    rows_again = run_gpu(d, st, false);
  }
  {
    gputest::ScopedEnv env("FLASHMSA_BWD_ROWS", "0");
    per_head = run_gpu(d, st, false);
  }
  // FLASHMSA_BWD_ORDER=group (one proxy group's CTAs after the other's), =block (block-major) and
  // =2 (two groups at a time, the default where Hp is even, named for Hp = 4): the same CTAs in
  // other orders, close to the default order (the fp32 adds run in another order), and bitwise
  // equal to it in deterministic mode (owned dk / dv, integer dq sums, the KL share in per-(group,
  // block) slots). FLASHMSA_BWD_WAVES=0: every list walked the same
  // way in every order (a per-wave walk direction would follow the CTA index and reorder the fp32
  // register sums of dK and dV).
  std::vector<const char*> orders = {"group", "block"};
  if (s.Hp % 2 == 0 && s.Hp > 2) orders.push_back("2");
  std::vector<Grads> det_other_orders;
  for (const char* order : orders) {
    gputest::ScopedEnv waves_env("FLASHMSA_BWD_WAVES", "0");
    gputest::ScopedEnv order_env("FLASHMSA_BWD_ORDER", order);
    const std::string what = std::string("FLASHMSA_BWD_ORDER=") + order;
    {
      gputest::ScopedEnv rows_env("FLASHMSA_BWD_ROWS", "0");
      compare(run_gpu(d, st, false), cpu, "per-head tiles, " + what);
    }
    gputest::ScopedEnv rows_env("FLASHMSA_BWD_ROWS", "1");
    const Grads other = run_gpu(d, st, false);
    compare(other, cpu, "token rows, " + what);
    expect_close(other, rows, what + " vs the default order");
    gputest::ScopedEnv dq_env("FLASHMSA_DET_DQ", "kv");
    det_other_orders.push_back(run_gpu(d, st, true));
  }
  compare(rows, cpu, "token rows");
  compare(per_head, cpu, "per-head tiles");
  expect_close(rows, per_head, "token rows vs per-head tiles");
  expect_close(rows_again, rows, "token rows rerun");
  // Deterministic mode takes the token-row tiles too (its DET form, dq and dqp staged as int32
  // fixed point and bulk reduce-added): bitwise over reruns, and close to the query-major dq of
  // the per-head DET form (FLASHMSA_DET_DQ=query).
  Grads det, det_query;
  {
    gputest::ScopedEnv waves_env("FLASHMSA_BWD_WAVES", "0");
    gputest::ScopedEnv rows_env("FLASHMSA_BWD_ROWS", "1");
    gputest::ScopedEnv dq_env("FLASHMSA_DET_DQ", "kv");  // an error unless the int32 dq form runs
    det = run_gpu(d, st, true);
    compare(det, cpu, "det token rows");
    expect_bitwise_reruns(d, st, det, 3, "det token rows");
  }
  for (size_t i = 0; i < orders.size(); ++i) {
    EXPECT_TRUE(det_other_orders[i].raw == det.raw) << "deterministic mode: FLASHMSA_BWD_ORDER=" << orders[i]
                                                    << " changed the bits";
    EXPECT_EQ(float_bits(det_other_orders[i].kl), float_bits(det.kl))
        << "deterministic mode: FLASHMSA_BWD_ORDER=" << orders[i] << " changed kl";
  }
  {
    gputest::ScopedEnv dq_env("FLASHMSA_DET_DQ", "query");
    det_query = run_gpu(d, st, true);
    const Grads again = run_gpu(d, st, true);  // the per-head DET form + query-major dq, bitwise too
    EXPECT_TRUE(again.raw == det_query.raw) << "deterministic (query-major dq) rerun differs bitwise";
  }
  compare(det_query, cpu, "det per-head tiles, query-major dq");
  expect_close(det, det_query, "det token rows vs det query-major dq");
}

TEST(CudaBackward, TokenRowsGroupOf8) {
  GPUTEST_REQUIRE_DEVICE();
  // gqa8 ratios: 8 tokens x 8 heads per tile; a partial last block and a short second sequence.
  check_token_rows(shape(16, 2, 2, 1, 128, 16, {2200, 333}), 50);
}

TEST(CudaBackward, TokenRowsGroupOf16FourGroups) {
  GPUTEST_REQUIRE_DEVICE();
  // The m3 shape (groups of 16 heads, one per kv head, four proxy groups), so that the grid orders
  // (block-major, FLASHMSA_BWD_ORDER=group and =2, the default) all differ.
  check_token_rows(shape(64, 4, 4, 1, 128, 16, {2200, 333}), 52);
}

TEST(CudaBackward, TokenRowsGroupOf16ManyShortSequences) {
  GPUTEST_REQUIRE_DEVICE();
  // 4 tokens x 16 heads per tile; lists shorter than a tile, empty sequences.
  std::mt19937_64 rng(51);
  std::vector<int> lengths;
  for (int i = 0; i < 60; ++i) lengths.push_back(i % 13 == 2 ? 0 : 1 + static_cast<int>(rng() % 300));
  check_token_rows(shape(16, 1, 1, 1, 128, 4, lengths), 51);
}

// The prelude's zeroing, deterministic factors and per-row terms run on a helper stream beside the
// student lse (FLASHMSA_BWD_SIDE_STREAM=0: all on the caller's). Both layouts within the CPU
// backend's tolerances, and deterministic mode's bits the same in both: a missing ordering (an
// accumulator zeroed after the main kernel began, di or lse_s read early) changes them.
void check_side_stream(const Shape& s, uint64_t seed) {
  Setup st;
  make_setup(st, s, seed, true, 0.8f);
  const Grads cpu = run_cpu(st);
  DeviceSide d;
  upload(d, st);
  const Grads fast_side = run_gpu(d, st, false);
  const Grads det_side = run_gpu(d, st, true);
  compare(fast_side, cpu, "fast, side stream");
  compare(det_side, cpu, "det, side stream");
  gputest::ScopedEnv one("FLASHMSA_BWD_SIDE_STREAM", "0");
  const Grads fast_one = run_gpu(d, st, false);
  const Grads det_one = run_gpu(d, st, true);
  compare(fast_one, cpu, "fast, one stream");
  EXPECT_TRUE(det_one.raw == det_side.raw) << "deterministic gradients differ between the prelude's layouts";
  EXPECT_EQ(float_bits(det_one.kl), float_bits(det_side.kl)) << "deterministic kl differs between the layouts";
}

TEST(CudaBackward, SideStreamPreludeTokenRows) {
  GPUTEST_REQUIRE_DEVICE();
  check_side_stream(shape(64, 4, 4, 1, 128, 16, {3000, 333}), 53);
}

TEST(CudaBackward, SideStreamPreludeSharedKv) {
  GPUTEST_REQUIRE_DEVICE();
  // fm16k's ratios (groups of 4 heads, two per kv head) and a D = 64 shape (the mma.sync kernels).
  check_side_stream(shape(16, 2, 4, 1, 128, 16, {2500, 129}), 54);
  check_side_stream(shape(8, 2, 2, 1, 64, 3, {300, 1000, 5, 129}), 55);
}

// Token chunks (FLASHMSA_BWD_CHUNK): the token-row forms over the parts of each list whose tokens
// lie in one chunk, dk / dv as partial sums (fp32; int64 fixed point in deterministic mode, which
// must stay bitwise reproducible). Chunks smaller than a block, cutting a sequence, and chunks of
// many blocks; groups of 16 and of 8 heads; a kl_grad.
void check_token_chunks(const Shape& s, uint64_t seed) {
  Setup st;
  make_setup(st, s, seed, true, 0.7f);
  const Grads cpu = run_cpu(st);
  DeviceSide d;
  upload(d, st);
  gputest::ScopedEnv rows("FLASHMSA_BWD_ROWS", "1");  // an error unless the token-row form runs
  for (const char* chunk : {"96", "640", "2048"}) {
    gputest::ScopedEnv env("FLASHMSA_BWD_CHUNK", chunk);
    compare(run_gpu(d, st, false), cpu, std::string("fast, chunk ") + chunk);
  }
  gputest::ScopedEnv dq_env("FLASHMSA_DET_DQ", "kv");  // an error unless the int32 dq form runs
  for (const char* chunk : {"96", "2048"}) {
    gputest::ScopedEnv env("FLASHMSA_BWD_CHUNK", chunk);
    const Grads det = run_gpu(d, st, true);
    compare(det, cpu, std::string("det, chunk ") + chunk);
    expect_bitwise_reruns(d, st, det, 3, "det chunks");
  }
}

TEST(CudaBackward, TokenChunksTokenRows) {
  GPUTEST_REQUIRE_DEVICE();
  check_token_chunks(shape(64, 4, 4, 1, 128, 16, {3000, 333, 700}), 56);
  check_token_chunks(shape(32, 4, 4, 4, 128, 5, {2600, 1}), 57);
}

// The own-block pass of the fast token-chunked backward (FoldArgs::own_pass): each dq / dqp row is
// first STORED by its token's own-block CTA, so those accumulators are not zeroed; rows of tokens
// whose selection leaves the own block out (here rows (p, t) with (t + p) % 3 == 0, and so some
// all-padding rows) are zeroed by a kernel of their own. On a NaN-poisoned workspace a row that is
// neither stored nor zeroed shows; FLASHMSA_BWD_OWN_PASS=1 proves the pass ran, and =0 (zeroed accumulators)
// must agree.
void check_own_pass(const Shape& s, uint64_t seed) {
  Setup st;
  make_setup(st, s, seed, true, 0.7f, [&](Setup& x) {
    for (int p = 0; p < s.Hp; ++p)
      for (int b = 0; b < x.pr.B; ++b)
        for (int64_t t = x.pr.cu[b]; t < x.pr.cu[b + 1]; ++t) {
          if ((t + p) % 3 != 0) continue;
          int32_t* row = x.sel.data() + (static_cast<int64_t>(p) * x.pr.T + t) * s.K;
          const int own = static_cast<int>(t - x.pr.cu[b]) / 128;
          for (int k = 0; k < s.K; ++k)  // rows ascend: the own block is the last entry
            if (row[k] == own && (k + 1 == s.K || row[k + 1] < 0)) row[k] = -1;
        }
  });
  const Grads cpu = run_cpu(st);
  DeviceSide d;
  upload(d, st);
  gputest::ScopedEnv rows("FLASHMSA_BWD_ROWS", "1");  // an error unless the token-row form runs
  gputest::PoisonedWorkspace poison;
  for (const char* chunk : {"96", "1024"}) {
    gputest::ScopedEnv env("FLASHMSA_BWD_CHUNK", chunk);
    {
      gputest::ScopedEnv on("FLASHMSA_BWD_OWN_PASS", "1");  // an error unless the own pass runs
      compare(run_gpu(d, st, false), cpu, std::string("own pass, chunk ") + chunk);
      // Deterministic mode zeroes its int32 accumulators: the switch must refuse it by name.
      gputest::expect_error_containing([&] { run_gpu(d, st, true); }, "FLASHMSA_BWD_OWN_PASS=1");
    }
    gputest::ScopedEnv off("FLASHMSA_BWD_OWN_PASS", "0");
    compare(run_gpu(d, st, false), cpu, std::string("zeroed accumulators, chunk ") + chunk);
  }
}

TEST(CudaBackward, OwnBlockPass) {
  GPUTEST_REQUIRE_DEVICE();
  check_own_pass(shape(64, 4, 4, 1, 128, 16, {2000, 333, 700}), 58);
  check_own_pass(shape(32, 4, 4, 4, 128, 5, {1500, 1}), 59);
}

// The sparse forward (o, lse, KL value) on the device copies of st, with a caller's index or none.
struct ForwardOut {
  std::vector<uint16_t> o;
  std::vector<float> lse;
  float kl = 0;
};

ForwardOut run_gpu_forward(DeviceSide& d, const Setup& st, bool deterministic, const flashmsa::TensorView& index) {
  const Shape& s = st.pr.s;
  const int64_t T = st.pr.T;
  DeviceBuffer o(static_cast<size_t>(T * s.H * s.D) * 2), lse(static_cast<size_t>(s.H * T) * 4), kl(4);
  for (DeviceBuffer* b : {&o, &lse, &kl}) b->fill(gputest::kFloatPoison);
  flashmsa::Options opt = st.opt;
  opt.deterministic = deterministic;
  flashmsa::AttentionInputs in = st.pr.device_inputs();
  in.selection_index = index;
  flashmsa::sparse_attention_forward(in, gputest::dview(d.sel, DType::int32, {s.Hp, T, s.K}), opt,
                                     gputest::dview(o, DType::bf16, {T, s.H, s.D}),
                                     gputest::dview(lse, DType::fp32, {s.H, T}), gputest::dview(kl, DType::fp32, {1}));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {o.download<uint16_t>(), lse.download<float>(), kl.download<float>()[0]};
}

// List pieces (FoldArgs::pieces): with FLASHMSA_BWD_PIECE small, every list is cut into many pieces of
// uneven tile counts, in every form of the wgmma backward (token rows with and without token chunks
// and the own-block pass, SHARED_KV, per-head tiles), fast and deterministic, and in the forward's
// KV-major KL value, on a selection where every row that can also keeps its sequence's first block
// (an attention sink: that block's list holds every token). The mma.sync backward does not take the
// pieces: the set variable refuses it by name.
void check_list_pieces(const Shape& s, uint64_t seed, std::vector<const char*> chunks) {
  Setup st;
  make_setup(st, s, seed, true, 0.7f, [&](Setup& x) {
    for (int p = 0; p < s.Hp; ++p)
      for (int64_t t = 0; t < x.pr.T; ++t) {
        int32_t* row = x.sel.data() + (static_cast<int64_t>(p) * x.pr.T + t) * s.K;
        // Rows ascend with padding last: the smallest block gives way to block 0 when the row keeps
        // another block (the own one, the largest) and lacks block 0.
        if (row[0] > 0 && s.K > 1 && row[1] >= 0) row[0] = 0;
      }
  });
  const Grads cpu = run_cpu(st);
  const float cpu_kl_fwd = cpu_forward_kl(st);
  ASSERT_TRUE(std::isfinite(cpu_kl_fwd));
  EXPECT_GT(cpu_kl_fwd, 0.f) << "a KL of zero would make the check vacuous";
  DeviceSide d;
  upload(d, st);
  gputest::PoisonedWorkspace poison;
  // The forward's KL value without pieces, on the deterministic forward's lse (bitwise the same in
  // every run): with pieces only the order of the fp32 sums changes, so a share lost or counted
  // twice (one of thousands) shows against the 1e-5 bound.
  float det_kl_whole = 0;
  {
    gputest::ScopedEnv off("FLASHMSA_BWD_PIECE", "0");
    ScopedBackwardPath path("wgmma");  // an error unless the KV-major KL value runs
    det_kl_whole = run_gpu_forward(d, st, true, {}).kl;
  }
  for (const char* piece : {"50", "300"}) {
    gputest::ScopedEnv pieces("FLASHMSA_BWD_PIECE", piece);  // an error unless the pieces apply
    const std::string what = std::string("pieces of ") + piece + " tokens";
    for (const char* chunk : chunks) {
      gputest::ScopedEnv env("FLASHMSA_BWD_CHUNK", chunk);
      compare(run_gpu(d, st, false), cpu, what + ", chunk " + chunk);
      const Grads det = run_gpu(d, st, true);
      compare(det, cpu, what + ", deterministic, chunk " + chunk);
      expect_bitwise_reruns(d, st, det, 2, "deterministic with pieces");
    }
    {
      // The KV-major KL value runs (else an error) and, pieces set, takes them (it refuses nothing).
      ScopedBackwardPath path("wgmma");
      const float kl = run_gpu_forward(d, st, false, {}).kl, det_kl = run_gpu_forward(d, st, true, {}).kl;
      EXPECT_LT(std::fabs(kl - cpu_kl_fwd), 1e-2 * std::fabs(cpu_kl_fwd))
          << what << ": forward kl " << kl << " vs CPU " << cpu_kl_fwd;
      EXPECT_LT(std::fabs(det_kl - det_kl_whole), 1e-5 * std::fabs(det_kl_whole))
          << what << ": deterministic forward kl " << det_kl << " vs " << det_kl_whole << " without pieces";
      std::printf("  %s: forward kl %.7g, deterministic %.7g (without pieces %.7g), CPU %.7g\n", what.c_str(), kl,
                  det_kl, det_kl_whole, cpu_kl_fwd);
    }
    ScopedBackwardPath mma("mma");
    gputest::expect_error_containing([&] { run_gpu(d, st, false); }, "FLASHMSA_BWD_PIECE");
  }
  gputest::ScopedEnv off("FLASHMSA_BWD_PIECE", "0");
  compare(run_gpu(d, st, false), cpu, "no pieces");
  compare(run_gpu(d, st, true), cpu, "no pieces, deterministic");
}

TEST(CudaBackward, ListPieces) {
  GPUTEST_REQUIRE_DEVICE();
  {
    gputest::ScopedEnv rows("FLASHMSA_BWD_ROWS", "1");  // an error unless the token-row form runs
    check_list_pieces(shape(64, 4, 4, 1, 128, 16, {2000, 333, 700}), 61, {"0", "96", "1024"});
  }
  check_list_pieces(shape(16, 2, 4, 1, 128, 8, {1800, 1, 500}), 62, {"0"});  // SHARED_KV (G = 2)
  check_list_pieces(shape(16, 4, 4, 1, 128, 8, {1700, 90}), 63, {"0"});      // per-head tiles (m = 4, G = 1)
}

// The step's selection index built once (build_selection_index) and read by the forward, its KL
// value and the backward instead of their own builds: the CUDA build equals the CPU backend's
// bytewise (tests/test_selection_index.cpp checks that one against block_idx); deterministic
// results equal their own builds' bitwise; the fast ones match the CPU (token chunks too); another
// selection's index changes the results (so it is read); a mis-sized one is refused by name.
void check_index_reuse(const Shape& s, uint64_t seed) {
  Setup st;
  make_setup(st, s, seed, true, 0.7f);
  const Grads cpu = run_cpu(st);
  const float cpu_kl_fwd = cpu_forward_kl(st);
  DeviceSide d;
  upload(d, st);
  gputest::PoisonedWorkspace poison;  // NaN workspace: a buffer the prebuilt plans forget shows
  const int64_t T = st.pr.T;
  const int64_t n = flashmsa::selection_index_size(st.pr.host_inputs(), st.opt);
  auto host_build = [&](std::vector<int32_t>& sel) {
    std::vector<int32_t> index(n);
    flashmsa::build_selection_index(st.pr.host_inputs(), flashmsa::make_view(sel.data(), DType::int32, {s.Hp, T, s.K}),
                                    st.opt, flashmsa::make_view(index.data(), DType::int32, {n}));
    return index;
  };
  const std::vector<int32_t> want = host_build(st.sel);
  DeviceBuffer index(n * 4);
  index.fill(gputest::kIntPoisonByte);
  const flashmsa::TensorView iv = gputest::dview(index, DType::int32, {n});
  flashmsa::build_selection_index(st.pr.device_inputs(), gputest::dview(d.sel, DType::int32, {s.Hp, T, s.K}), st.opt, iv);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<int32_t> got = index.download<int32_t>();
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) wrong += got[i] != want[i];
  EXPECT_EQ(wrong, 0) << "elements of the CUDA build differ from the CPU backend's, of " << n;

  const Grads det_own = run_gpu(d, st, true), det_given = run_gpu(d, st, true, iv);
  EXPECT_TRUE(det_given.raw == det_own.raw) << "deterministic gradients differ with the given index";
  EXPECT_EQ(float_bits(det_given.kl), float_bits(det_own.kl));
  const ForwardOut f_own = run_gpu_forward(d, st, true, {}), f_given = run_gpu_forward(d, st, true, iv);
  EXPECT_TRUE(f_given.o == f_own.o) << "deterministic o differs with the given index";
  EXPECT_TRUE(std::memcmp(f_given.lse.data(), f_own.lse.data(), f_own.lse.size() * 4) == 0) << "deterministic lse";
  EXPECT_EQ(float_bits(f_given.kl), float_bits(f_own.kl)) << "deterministic forward KL value";

  compare(run_gpu(d, st, false, iv), cpu, "fast, given index");
  {
    gputest::ScopedEnv chunk("FLASHMSA_BWD_CHUNK", "256");
    compare(run_gpu(d, st, false, iv), cpu, "fast, given index, chunk 256");
  }
  const ForwardOut f = run_gpu_forward(d, st, false, iv);
  const double e_o = gputest::rel_l2(gputest::bf16_to_doubles(f.o), gputest::bf16_to_doubles(st.o));
  EXPECT_LT(e_o, 1e-2) << "fast o with the given index vs CPU";
  double lse_err = 0;
  for (size_t i = 0; i < f.lse.size(); ++i) lse_err = std::max(lse_err, std::fabs(double(f.lse[i]) - st.lse[i]));
  EXPECT_LT(lse_err, 1e-2) << "fast lse with the given index vs CPU (max abs, NaN fails)";
  EXPECT_LT(std::fabs(f.kl - cpu_kl_fwd), 1e-2 * std::fabs(cpu_kl_fwd)) << f.kl << " vs CPU " << cpu_kl_fwd;
  std::printf("  given index: fast o rel L2 %.3e, lse max abs %.3e, kl %.6g (CPU %.6g)\n", e_o, lse_err, f.kl, cpu_kl_fwd);

  // Another selection: the own block alone. (A random one would not do: these shapes' K covers
  // every causal block, so any selection lists the same blocks.)
  std::vector<int32_t> other(st.sel.size(), -1);
  for (int p = 0; p < s.Hp; ++p)
    for (int b = 0; b < st.pr.B; ++b)
      for (int64_t t = st.pr.cu[b]; t < st.pr.cu[b + 1]; ++t)
        other[(static_cast<int64_t>(p) * T + t) * s.K] = static_cast<int32_t>((t - st.pr.cu[b]) / 128);
  EXPECT_FALSE(other == st.sel) << "the other selection equals the real one";
  DeviceBuffer other_index(n * 4);
  other_index.upload(host_build(other));
  const flashmsa::TensorView ov = gputest::dview(other_index, DType::int32, {n});
  EXPECT_FALSE(run_gpu(d, st, true, ov).raw == det_own.raw) << "another selection's index left the gradients as they were";
  if (s.D == 128)  // the KV-major forwards read the index; the query-major one (other head dims) has none
    EXPECT_FALSE(run_gpu_forward(d, st, true, ov).o == f_own.o) << "another selection's index left o as it was";

  gputest::expect_error_containing([&] { run_gpu(d, st, false, gputest::dview(index, DType::int32, {n - 1})); },
                                   "'selection_index'");
}

TEST(CudaBackward, SelectionIndexReuse) {
  GPUTEST_REQUIRE_DEVICE();
  check_index_reuse(shape(64, 4, 4, 1, 128, 16, {2000, 333, 700}), 61);  // token rows, chunks
  check_index_reuse(shape(16, 2, 4, 1, 128, 16, {1500, 129}), 62);       // fm16k-like: shared kv
  check_index_reuse(shape(8, 2, 2, 1, 64, 8, {900, 1}), 63);             // D = 64: the mma paths
}

// Heavy-tailed inputs for the token-row DET form's int32 dq: one key channel 30x the rest (an
// outlier channel, as trained models have) and one token's dO 100x every other token's. A
// per-tensor fixed-point scale leaves the other rows few bits (a numerical model of these inputs:
// rel L2 5e-3 .. 6.5e-3 against the fast dq); the per-row factors must keep the deterministic dq as
// close to the fast form's fp32 one as on N(0,1) inputs (the model: ~1.3e-4, bf16 rounding
// included), and the other gradients within msa.md's tolerances. (A helper: a TEST body cannot
// name Setup.)
void check_heavy_tails(const Shape& s, uint64_t seed, size_t outlier_token) {
  Setup st;
  make_setup(st, s, seed, true, 1.f, [&](Setup& x) {
    const float k_scale = 30.f, do_scale = 100.f;
    for (size_t i = 5; i < x.pr.k.size(); i += s.D)
      x.pr.k[i] = msatest::float_to_bf16(k_scale * gputest::from_bf16(x.pr.k[i]));
    x.pr.dk.upload(x.pr.k);
    const size_t row = static_cast<size_t>(s.H) * s.D;
    for (size_t i = outlier_token * row; i < (outlier_token + 1) * row; ++i)
      x.d_o[i] = msatest::float_to_bf16(do_scale * gputest::from_bf16(x.d_o[i]));
  });
  const Grads cpu = run_cpu(st);
  DeviceSide d;
  upload(d, st);
  const Grads fast = run_gpu(d, st, false);
  Grads det;
  {
    gputest::ScopedEnv dq_env("FLASHMSA_DET_DQ", "kv");  // an error unless the int32 dq form runs
    det = run_gpu(d, st, true);
    expect_bitwise_reruns(d, st, det, 3, "det heavy tails");
  }
  compare(fast, cpu, "fast heavy tails");
  compare(det, cpu, "det heavy tails");
  std::vector<double> a, b;  // rows other than the outlier token, where a coarse scale shows
  const size_t row = static_cast<size_t>(s.H) * s.D;
  for (size_t i = 0; i < det.dq.size(); ++i)
    if (i / row != outlier_token) {
      a.push_back(det.dq[i]);
      b.push_back(fast.dq[i]);
    }
  const double e = gputest::rel_l2(a, b);
  EXPECT_LT(e, 1e-3) << "deterministic int32 dq vs fast dq, rows other than the outlier token";
  std::printf("  det (int32 dq) vs fast dq, heavy tails, other rows: rel L2 %.3e\n", e);
}

TEST(CudaBackward, DeterministicDqHeavyTails) {
  GPUTEST_REQUIRE_DEVICE();
  // m = 16 heads per kv head = proxy group (token rows), K = 8, two sequences; token 777's dO 100x.
  check_heavy_tails(shape(16, 1, 1, 1, 128, 8, {1800, 500}), 52, 777);
}

// A NaN in one element of q or of v: the fast backward's gradients carry non-finite values; the
// deterministic ones must too (integer sums over NaN terms would be finite garbage: the fixed-point
// factors turn NaN instead), on the token-row int32 form and with the query-major dq. The q case
// puts the NaN in after the forward (o, lse and dO stay finite, as when a caller's q changes between
// the calls): the int32 dq's per-row factors must then take the tensor-wide NaN marker.
void check_nonfinite_input(const Shape& s, uint64_t seed, bool in_v) {
  Setup st;
  make_setup(st, s, seed, true, 1.f, [&](Setup& x) {
    if (!in_v) return;
    x.pr.v[(static_cast<size_t>(150) * s.Hkv) * s.D + 9] = 0x7fc0;  // bf16 quiet NaN, key 150
    x.pr.dv.upload(x.pr.v);
  });
  if (!in_v) {
    st.pr.q[(static_cast<size_t>(100) * s.H + 3) * s.D + 7] = 0x7fc0;  // token 100, head 3
    st.pr.dq.upload(st.pr.q);
  }
  DeviceSide d;
  upload(d, st);
  const Grads fast = run_gpu(d, st, false);
  // The premise: the NaN reaches the fast gradients (dq in both cases; 128 and 1,171,456 values at
  // 8c91b9a), else the comparison below would check nothing.
  ASSERT_GT(gputest::count_nonfinite(fast.dq), 0) << "the NaN input did not reach the fast dq";
  for (const char* dq_env : {static_cast<const char*>(nullptr), "query"}) {
    gputest::ScopedEnv env("FLASHMSA_DET_DQ", dq_env);
    const Grads det = run_gpu(d, st, true);
    const char* names[5] = {"dq", "dk", "dv", "dqp", "dkp"};
    const std::vector<double>* a[5] = {&det.dq, &det.dk, &det.dv, &det.dqp, &det.dkp};
    const std::vector<double>* b[5] = {&fast.dq, &fast.dk, &fast.dv, &fast.dqp, &fast.dkp};
    for (int i = 0; i < 5; ++i) {
      const int64_t nf_fast = gputest::count_nonfinite(*b[i]), nf_det = gputest::count_nonfinite(*a[i]);
      std::printf("  NaN in %s, DET_DQ=%s: %-4s non-finite fast %lld det %lld\n", in_v ? "v" : "q",
                  dq_env ? dq_env : "(unset)", names[i], static_cast<long long>(nf_fast),
                  static_cast<long long>(nf_det));
      if (nf_fast > 0) EXPECT_GT(nf_det, 0) << names[i] << ": deterministic gradient finite where the fast one is not";
    }
  }
}

TEST(CudaBackward, DeterministicNonFiniteInput) {
  GPUTEST_REQUIRE_DEVICE();
  check_nonfinite_input(shape(16, 1, 1, 1, 128, 8, {700, 300}), 53, /*in_v=*/false);
  check_nonfinite_input(shape(16, 1, 1, 1, 128, 8, {700, 300}), 54, /*in_v=*/true);
}

TEST(CudaBackward, KlValueSharedKvHead) {
  GPUTEST_REQUIRE_DEVICE();
  check_kl_value_shared_kv(shape(16, 2, 4, 1, 128, 16, {0, 2200, 1, 333}), 34);
}

// FLASHMSA_BACKWARD_PATH=wgmma: a KL value the KV-major kernel does not take (D = 64) is an error,
// not another route.
void expect_kl_route_error(const Shape& shp) {
  Setup st;
  make_setup(st, shp, 35, false, 1.f);
  const Shape& s = st.pr.s;
  const int64_t T = st.pr.T;
  DeviceBuffer sel(st.sel.size() * 4), o(static_cast<size_t>(T * s.H * s.D) * 2),
      lse(static_cast<size_t>(s.H * T) * 4), kl(4);
  sel.upload(st.sel);
  ScopedBackwardPath path("wgmma");
  EXPECT_THROW(flashmsa::sparse_attention_forward(
                   st.pr.device_inputs(), gputest::dview(sel, DType::int32, {s.Hp, T, s.K}), st.opt,
                   gputest::dview(o, DType::bf16, {T, s.H, s.D}), gputest::dview(lse, DType::fp32, {s.H, T}),
                   gputest::dview(kl, DType::fp32, {1})),
               flashmsa::Error);
}

TEST(CudaBackward, KlValueRouteError) {
  GPUTEST_REQUIRE_DEVICE();
  expect_kl_route_error(shape(8, 2, 2, 1, 64, 4, {300}));
}

TEST(CudaBackward, EmptyBatchWritesZeroKl) {
  GPUTEST_REQUIRE_DEVICE();
  Shape s = shape(4, 1, 1, 1, 64, 4, {});
  Problem pr;
  gputest::make_problem(pr, s, 19);
  DeviceBuffer sel(0), o(0), lse(0), d_o(0), dq(0), dk(0), dv(0), dqp(0), dkp(0), kl(4);
  kl.fill(gputest::kFloatPoison);
  flashmsa::Gradients g;
  g.dq = gputest::dview(dq, DType::bf16, {0, 4, 64});
  g.dk = gputest::dview(dk, DType::bf16, {0, 1, 64});
  g.dv = gputest::dview(dv, DType::bf16, {0, 1, 64});
  g.dqp = gputest::dview(dqp, DType::bf16, {0, 1, 64});
  g.dkp = gputest::dview(dkp, DType::bf16, {0, 1, 64});
  flashmsa::fused_backward(pr.device_inputs(), gputest::dview(sel, DType::int32, {1, 0, 4}),
                           gputest::dview(o, DType::bf16, {0, 4, 64}), gputest::dview(lse, DType::fp32, {4, 0}),
                           gputest::dview(d_o, DType::bf16, {0, 4, 64}), flashmsa::TensorView(), pr.options(), g,
                           gputest::dview(kl, DType::fp32, {1}));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(kl.download<float>()[0], 0.f);
}

}  // namespace
