// GPU dense warm-up forward and backward against the CPU backend through the public API.
// The GPU forward's o and lse feed the GPU backward (the CPU backward gets the CPU's own), so
// this suite also exercises the sparse forward kernel over the all-visible-blocks selection.
// A forward without the KL value at D = 128 takes the dense causal kernel instead; the
// DenseForwardNoKl* tests check that one.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
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

// Largest |gpu - cpu| over lse; infinite when the GPU wrote a non-finite value (unwritten rows
// are NaN-poisoned).
double lse_max_abs_error(const std::vector<float>& gpu, const std::vector<float>& cpu) {
  double err = 0;
  for (size_t i = 0; i < gpu.size(); ++i)
    err = std::isfinite(gpu[i]) ? std::max(err, std::fabs(static_cast<double>(gpu[i]) - cpu[i])) : INFINITY;
  return err;
}

void check_warmup(const Shape& s, uint64_t seed) {
  Problem pr;
  gputest::make_problem(pr, s, seed);
  const int64_t T = pr.T;
  std::mt19937_64 rng(seed + 101);
  std::vector<uint16_t> d_o = gputest::random_bf16(static_cast<size_t>(T * s.H * s.D), rng);
  flashmsa::Options opt = pr.options();
  opt.mode = flashmsa::Mode::warmup;
  float kl_grad = 0.6f;

  // ---- CPU ----
  std::vector<uint16_t> o_c(T * s.H * s.D, 0xFFFF);
  std::vector<float> lse_c(s.H * T, std::nanf(""));
  float kl_fc = std::nanf(""), kl_bc = std::nanf("");
  flashmsa::dense_warmup_forward(pr.host_inputs(), opt, flashmsa::make_view(o_c.data(), DType::bf16, {T, s.H, s.D}),
                                 flashmsa::make_view(lse_c.data(), DType::fp32, {s.H, T}),
                                 flashmsa::make_view(&kl_fc, DType::fp32, {1}));
  std::vector<uint16_t> dq_c(T * s.H * s.D), dk_c(T * s.Hkv * s.D), dv_c(T * s.Hkv * s.D), dqp_c(T * s.Hp * s.D),
      dkp_c(T * s.Hpk * s.D);
  const flashmsa::Gradients gc = gputest::grad_views(dq_c.data(), dk_c.data(), dv_c.data(), dqp_c.data(),
                                                     dkp_c.data(), s, T, flashmsa::Device::cpu);
  flashmsa::dense_warmup_backward(pr.host_inputs(), flashmsa::make_view(o_c.data(), DType::bf16, {T, s.H, s.D}),
                                  flashmsa::make_view(lse_c.data(), DType::fp32, {s.H, T}),
                                  flashmsa::make_view(d_o.data(), DType::bf16, {T, s.H, s.D}),
                                  flashmsa::make_view(&kl_grad, DType::fp32, {1}), opt, gc,
                                  flashmsa::make_view(&kl_bc, DType::fp32, {1}));

  // ---- GPU (through msa_forward / msa_backward with mode = warmup) ----
  auto in = pr.device_inputs();
  DeviceBuffer o(T * s.H * s.D * 2), lse(s.H * T * 4), kl_f(4), kl_b(4), dO(T * s.H * s.D * 2), g(4);
  DeviceBuffer dq(T * s.H * s.D * 2), dk(T * s.Hkv * s.D * 2), dv(T * s.Hkv * s.D * 2), dqp(T * s.Hp * s.D * 2),
      dkp(T * s.Hpk * s.D * 2);
  dO.upload(d_o);
  g.upload(std::vector<float>{kl_grad});
  for (DeviceBuffer* b : {&o, &lse, &kl_f, &kl_b, &dq, &dk, &dv, &dqp, &dkp}) b->fill(gputest::kFloatPoison);
  flashmsa::msa_forward(in, opt, flashmsa::TensorView(), gputest::dview(o, DType::bf16, {T, s.H, s.D}),
                        gputest::dview(lse, DType::fp32, {s.H, T}), gputest::dview(kl_f, DType::fp32, {1}));
  const flashmsa::Gradients gg =
      gputest::grad_views(dq.get(), dk.get(), dv.get(), dqp.get(), dkp.get(), s, T, flashmsa::Device::cuda);
  flashmsa::msa_backward(in, flashmsa::TensorView(), gputest::dview(o, DType::bf16, {T, s.H, s.D}),
                         gputest::dview(lse, DType::fp32, {s.H, T}), gputest::dview(dO, DType::bf16, {T, s.H, s.D}),
                         gputest::dview(g, DType::fp32, {1}), opt, gg, gputest::dview(kl_b, DType::fp32, {1}));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  auto cmp = [&](const char* name, const DeviceBuffer& gpu, const std::vector<uint16_t>& cpu) {
    const auto got = gputest::bf16_to_doubles(gpu.download<uint16_t>());
    const auto ref = gputest::bf16_to_doubles(cpu);
    EXPECT_EQ(gputest::count_nonfinite(got), 0) << name << " unwritten/non-finite";
    const double e = gputest::rel_l2(got, ref);
    EXPECT_LT(e, 1e-2) << name;
    std::printf("  warmup %-4s rel L2 %.3e\n", name, e);
  };
  cmp("o", o, o_c);
  const auto lse_g = lse.download<float>();
  const double lse_err = lse_max_abs_error(lse_g, lse_c);
  EXPECT_LT(lse_err, 1e-3) << "lse max abs error";
  cmp("dq", dq, dq_c);
  cmp("dk", dk, dk_c);
  cmp("dv", dv, dv_c);
  cmp("dqp", dqp, dqp_c);
  cmp("dkp", dkp, dkp_c);
  const float kf = kl_f.download<float>()[0], kb = kl_b.download<float>()[0];
  EXPECT_LT(std::fabs(kf - kl_fc) / std::fabs(kl_fc), 1e-2) << "forward kl gpu " << kf << " cpu " << kl_fc;
  EXPECT_LT(std::fabs(kb - kl_bc) / std::fabs(kl_bc), 1e-2) << "backward kl gpu " << kb << " cpu " << kl_bc;
  std::printf("  warmup lse max abs %.3e, kl fwd %.6g/%.6g bwd %.6g/%.6g\n", lse_err, kf, kl_fc, kb, kl_bc);
}

// Warm-up forward without the KL value: with D = Dv = 128 the CUDA backend runs the dense causal
// kernel (dense_forward.cu, no selection index) instead of the sparse forward over all blocks.
// o and lse against the CPU backend's dense_warmup_forward, GPU outputs poisoned (NaN).
void check_dense_forward_no_kl(const Shape& s, uint64_t seed) {
  Problem pr;
  gputest::make_problem(pr, s, seed);
  const int64_t T = pr.T;
  flashmsa::Options opt = pr.options();
  opt.mode = flashmsa::Mode::warmup;

  std::vector<uint16_t> o_c(T * s.H * s.D, 0xFFFF);
  std::vector<float> lse_c(s.H * T, std::nanf(""));
  flashmsa::dense_warmup_forward(pr.host_inputs(), opt, flashmsa::make_view(o_c.data(), DType::bf16, {T, s.H, s.D}),
                                 flashmsa::make_view(lse_c.data(), DType::fp32, {s.H, T}));

  auto in = pr.device_inputs();
  DeviceBuffer o(T * s.H * s.D * 2), lse(s.H * T * 4);
  o.fill(gputest::kFloatPoison);
  lse.fill(gputest::kFloatPoison);
  flashmsa::dense_warmup_forward(in, opt, gputest::dview(o, DType::bf16, {T, s.H, s.D}),
                                 gputest::dview(lse, DType::fp32, {s.H, T}));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  const auto got = gputest::bf16_to_doubles(o.download<uint16_t>());
  const auto ref = gputest::bf16_to_doubles(o_c);
  ASSERT_EQ(gputest::count_nonfinite(ref), 0) << "CPU o non-finite";
  EXPECT_EQ(gputest::count_nonfinite(got), 0) << "o unwritten/non-finite";
  const double e = gputest::rel_l2(got, ref);
  EXPECT_LT(e, 1e-2) << "o rel L2";
  const auto lse_g = lse.download<float>();
  const double lse_err = lse_max_abs_error(lse_g, lse_c);
  EXPECT_LT(lse_err, 1e-3) << "lse max abs error";
  std::printf("  dense fwd (no KL) o rel L2 %.3e, lse max abs %.3e\n", e, lse_err);
}

Shape shape(int H, int Hkv, int Hp, int Hpk, int D, std::vector<int> lengths) {
  return gputest::shape(H, Hkv, Hp, Hpk, D, /*K, ignored by the warm-up mode=*/16, std::move(lengths));
}

TEST(CudaWarmup, GqaD64TwoSequences) {
  GPUTEST_REQUIRE_DEVICE();
  check_warmup(shape(4, 2, 2, 1, 64, {300, 40}), 31);
}

TEST(CudaWarmup, GroupD128LongerThanK) {
  GPUTEST_REQUIRE_DEVICE();
  check_warmup(shape(8, 1, 2, 1, 128, {1000, 3}), 32);
}

// The forward's KL value on the wgmma shapes: dense causal kernel for o / lse, then the KV-major
// KL pass over the all-blocks index (kl_value.cuh), here with K = 33 > 32 blocks (m3-like group of
// 16 heads on one kv head, an empty sequence between) and with Hp = Hpk over short sequences.
TEST(CudaWarmup, KlValueKvMajorGroup16MoreThan32Blocks) {
  GPUTEST_REQUIRE_DEVICE();
  check_warmup(shape(16, 1, 1, 1, 128, {4200, 0, 300}), 35);
}

TEST(CudaWarmup, KlValueKvMajorOwnedProxyShortSequences) {
  GPUTEST_REQUIRE_DEVICE();
  check_warmup(shape(8, 2, 2, 2, 128, {1, 129, 0, 1300}), 36);
}

// Longer than 32 blocks: the all-visible-blocks index has K = 40 (5000 tokens) and K = 71
// (9000 tokens), so the forward walks its rows in windows of 32. 5000: m = 2 on one kv head
// (KL fused in the forward); 9000: m = 4 over two kv heads (KL in kl_rows_kernel).
TEST(CudaWarmup, LongSequence5000FusedKl) {
  GPUTEST_REQUIRE_DEVICE();
  check_warmup(shape(4, 2, 2, 1, 64, {5000}), 33);
}

TEST(CudaWarmup, LongSequence9000KlRows) {
  GPUTEST_REQUIRE_DEVICE();
  check_warmup(shape(4, 2, 1, 1, 64, {9000}), 34);
}

// Dense causal kernel (forward without KL, D = 128). m3-like group of 16 query heads on one kv
// head; 700 and 2500 end in partial tiles (700 = 5*128 + 60, 2500 = 19*128 + 68).
TEST(CudaWarmup, DenseForwardNoKlGroup16TwoSequences) {
  GPUTEST_REQUIRE_DEVICE();
  check_dense_forward_no_kl(shape(16, 1, 1, 1, 128, {700, 2500}), 41);
}

// One key past a whole number of blocks: the last tile has a single valid query row.
TEST(CudaWarmup, DenseForwardNoKlOneRowTile) {
  GPUTEST_REQUIRE_DEVICE();
  check_dense_forward_no_kl(shape(8, 2, 2, 1, 128, {128 * 5 + 1}), 42);
}

// Many short sequences, empty ones (first, middle, last), lengths below, at and just past one
// block: tiles that are the diagonal block only, and tiles whose rows run into the next sequence.
TEST(CudaWarmup, DenseForwardNoKlManyShortSequences) {
  GPUTEST_REQUIRE_DEVICE();
  check_dense_forward_no_kl(
      shape(4, 2, 2, 1, 128, {0, 1, 127, 5, 0, 128, 129, 64, 255, 3, 300, 17, 256, 2, 0}), 43);
}

}  // namespace
