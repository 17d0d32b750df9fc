// Unit tests of the wgmma primitives in src/cuda/common/wgmma.cuh: one warpgroup fills shared
// tiles (plain stores through sw128_offset), runs m64nNk16 products over K = 64 or 128 with every
// operand orientation the FlashAttention-3 style backward uses, and writes the accumulator to
// global memory with the layout documented in wgmma.cuh. The host compares against a
// double-precision product of the same bf16 inputs. A wrong descriptor field, transpose flag,
// k-step address or fragment packing moves whole 8x8 or 16-element blocks, which shows up as an
// error of the order of the outputs themselves, far above the tolerance.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "common/wgmma.cuh"
#include "gpu_test_util.h"

namespace {

using namespace flashmsa::cuda;
using gputest::DeviceBuffer;

constexpr int kThreads = 128;  // one warpgroup

// Stores a row-major [rows][cols] bf16 matrix into a swizzled shared tile of the same shape.
__device__ void fill_tile(unsigned char* tile, const uint16_t* src, int rows, int cols) {
  for (int i = threadIdx.x; i < rows * cols; i += blockDim.x) {
    const int r = i / cols, c = i % cols;
    *reinterpret_cast<uint16_t*>(tile + sw128_offset(r, c, rows)) = src[i];
  }
}

// Generic-proxy stores above, async-proxy (wgmma) reads below.
__device__ void publish_tiles() {
  fence_proxy_async_shared();
  __syncthreads();
}

__device__ unsigned char* aligned_smem(unsigned char* raw) {
  return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + 1023) &
                                          ~static_cast<uintptr_t>(1023));
}

__device__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Descriptor of k-step ks for an operand of M/N extent `mn` and K extent `k`, stored K-major as
// [mn rows][k cols] (TRANS 0) or MN-major as [k rows][mn cols] (TRANS 1).
template <int TRANS>
__device__ uint64_t operand_desc(uint32_t tile, int mn, int k, int ks) {
  if constexpr (TRANS == 0)
    return wgmma_desc_sw128(tile + (ks / 4) * mn * 128 + (ks % 4) * 32);
  else
    return wgmma_desc_sw128_mn(tile + ks * 16 * 128, static_cast<uint32_t>(k) * 128);
}

// out [64][N] fp32 from an m64nN accumulator.
template <int N>
__device__ void store_acc(const float (&d)[N / 2], float* out) {
  const int t = threadIdx.x, w = t / 32, g = (t % 32) / 4, c = t % 4;
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    const int row = 16 * w + g, col = 8 * j + 2 * c;
    out[row * N + col] = d[4 * j];
    out[row * N + col + 1] = d[4 * j + 1];
    out[(row + 8) * N + col] = d[4 * j + 2];
    out[(row + 8) * N + col + 1] = d[4 * j + 3];
  }
}

// acc = A (64 x K) * B (K x N), both from shared memory.
template <int N, int K, int TA, int TB>
__device__ void ss_product(float (&acc)[N / 2], uint32_t a, uint32_t b) {
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  wgmma_fence_operands(acc);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < K / 16; ++ks)
    wgmma_ss_bf16<N, TA, TB>(acc, operand_desc<TA>(a, 64, K, ks), operand_desc<TB>(b, N, K, ks),
                             ks > 0);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operands(acc);
}

// C = A B with A stored TA ? [K][64] : [64][K] and B stored TB ? [K][N] : [N][K] (row-major bf16).
template <int N, int K, int TA, int TB>
__global__ void __launch_bounds__(kThreads)
    ss_kernel(const uint16_t* __restrict__ a_src,  // [64][K] or [K][64]
              const uint16_t* __restrict__ b_src,  // [N][K] or [K][N]
              float* __restrict__ c_out) {         // [64][N]
  extern __shared__ unsigned char smem_raw[];
  unsigned char* a_s = aligned_smem(smem_raw);  // 64 * K bf16
  unsigned char* b_s = a_s + 64 * K * 2;        // N * K bf16
  fill_tile(a_s, a_src, TA ? K : 64, TA ? 64 : K);
  fill_tile(b_s, b_src, TB ? K : N, TB ? N : K);
  publish_tiles();
  float acc[N / 2];
  ss_product<N, K, TA, TB>(acc, smem_addr(a_s), smem_addr(b_s));
  store_acc<N>(acc, c_out);
}

// The P^T -> dV chain: C1 = A1 B1^T (m64nN1, both K-major, K = K1), then C2 = bf16(C1) B2 with
// the A operand taken from C1's registers (acc_to_a_frag) and B2 MN-major [N1 rows][N2 cols]
// (TB2 = 1, the dV case) or K-major [N2 rows][N1 cols] (TB2 = 0).
template <int N1, int N2, int K1, int TB2>
__global__ void __launch_bounds__(kThreads)
    rs_kernel(const uint16_t* __restrict__ a1_src,  // [64][K1]
              const uint16_t* __restrict__ b1_src,  // [N1][K1]
              const uint16_t* __restrict__ b2_src,  // [N1][N2] or [N2][N1]
              float* __restrict__ c1_out,           // [64][N1]
              float* __restrict__ c2_out) {         // [64][N2]
  extern __shared__ unsigned char smem_raw[];
  unsigned char* a1_s = aligned_smem(smem_raw);  // 64 * K1 bf16
  unsigned char* b1_s = a1_s + 64 * K1 * 2;      // N1 * K1 bf16
  unsigned char* b2_s = b1_s + N1 * K1 * 2;      // N1 * N2 bf16
  fill_tile(a1_s, a1_src, 64, K1);
  fill_tile(b1_s, b1_src, N1, K1);
  fill_tile(b2_s, b2_src, TB2 ? N1 : N2, TB2 ? N2 : N1);
  publish_tiles();

  float c1[N1 / 2];
  ss_product<N1, K1, 0, 0>(c1, smem_addr(a1_s), smem_addr(b1_s));
  store_acc<N1>(c1, c1_out);

  uint32_t a[N1 / 16][4];
#pragma unroll
  for (int kk = 0; kk < N1 / 16; ++kk) acc_to_a_frag(a[kk], c1 + 8 * kk);
  float c2[N2 / 2];
#pragma unroll
  for (int i = 0; i < N2 / 2; ++i) c2[i] = 0.f;
  wgmma_fence_operands(c2);
  wgmma_fence();  // the A registers were just written
  const uint32_t b2 = smem_addr(b2_s);
#pragma unroll
  for (int kk = 0; kk < N1 / 16; ++kk)
    wgmma_rs_bf16<N2, TB2>(c2, a[kk], operand_desc<TB2>(b2, N2, N1, kk), kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operands(c2);
#pragma unroll
  for (int kk = 0; kk < N1 / 16; ++kk) wgmma_fence_operands(a[kk]);
  store_acc<N2>(c2, c2_out);
}

// ---- host side ----

template <typename Kernel>
void set_smem(Kernel kernel, size_t bytes) {
  ASSERT_EQ(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(bytes)),
            cudaSuccess);
}

// ref [M][N] = sum_k A(m, k) B(k, n) in double, A and B given as accessors of bf16 bits.
template <typename FA, typename FB>
std::vector<double> gemm_ref(int M, int N, int K, FA a, FB b) {
  std::vector<double> c(static_cast<size_t>(M) * N, 0.0);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double s = 0;
      for (int k = 0; k < K; ++k) s += static_cast<double>(a(m, k)) * b(k, n);
      c[static_cast<size_t>(m) * N + n] = s;
    }
  return c;
}

// max |got - ref| < 1e-2 * max(1, max |ref|), no NaN (outputs were poisoned).
void expect_close(const std::vector<float>& got, const std::vector<double>& ref, const char* what) {
  ASSERT_EQ(got.size(), ref.size());
  double scale = 1.0, err = 0.0;
  int64_t nonfinite = 0;
  size_t worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    scale = std::max(scale, std::fabs(ref[i]));
    if (!std::isfinite(got[i])) {
      ++nonfinite;
      continue;
    }
    const double e = std::fabs(got[i] - ref[i]);
    if (e > err) err = e, worst = i;
  }
  EXPECT_EQ(nonfinite, 0) << what << ": unwritten or non-finite outputs";
  EXPECT_LT(err, 1e-2 * scale) << what << ": max abs error " << err << " at " << worst << " (got "
                               << got[worst] << ", want " << ref[worst] << "), scale " << scale;
}

template <int N, int K, int TA, int TB>
void run_ss(uint64_t seed) {
  GPUTEST_REQUIRE_DEVICE();
  std::mt19937_64 rng(seed);
  const std::vector<uint16_t> a = gputest::random_bf16(64 * K, rng);  // [64][K] or [K][64]
  const std::vector<uint16_t> b = gputest::random_bf16(N * K, rng);   // [N][K] or [K][N]
  auto av = [&](int m, int k) { return gputest::from_bf16(TA ? a[k * 64 + m] : a[m * K + k]); };
  auto bv = [&](int k, int n) { return gputest::from_bf16(TB ? b[k * N + n] : b[n * K + k]); };
  const std::vector<double> ref = gemm_ref(64, N, K, av, bv);

  DeviceBuffer da(a.size() * 2), db(b.size() * 2), dc(64 * N * 4);
  da.upload(a);
  db.upload(b);
  dc.fill(gputest::kFloatPoison);
  const size_t smem = 1024 + static_cast<size_t>(64 + N) * K * 2;
  set_smem(ss_kernel<N, K, TA, TB>, smem);
  ss_kernel<N, K, TA, TB><<<1, kThreads, smem>>>(static_cast<const uint16_t*>(da.get()),
                                                 static_cast<const uint16_t*>(db.get()),
                                                 static_cast<float*>(dc.get()));
  GPUTEST_CUDA(cudaGetLastError());
  GPUTEST_CUDA(cudaDeviceSynchronize());
  expect_close(dc.download<float>(), ref, "C");
}

template <int N1, int N2, int K1, int TB2>
void run_rs(uint64_t seed) {
  GPUTEST_REQUIRE_DEVICE();
  std::mt19937_64 rng(seed);
  const std::vector<uint16_t> a1 = gputest::random_bf16(64 * K1, rng);  // [64][K1]
  const std::vector<uint16_t> b1 = gputest::random_bf16(N1 * K1, rng);  // [N1][K1]
  const std::vector<uint16_t> b2 = gputest::random_bf16(N1 * N2, rng);  // [N1][N2] or [N2][N1]

  DeviceBuffer da1(a1.size() * 2), db1(b1.size() * 2), db2(b2.size() * 2);
  DeviceBuffer dc1(64 * N1 * 4), dc2(64 * N2 * 4);
  da1.upload(a1);
  db1.upload(b1);
  db2.upload(b2);
  dc1.fill(gputest::kFloatPoison);
  dc2.fill(gputest::kFloatPoison);
  const size_t smem = 1024 + static_cast<size_t>(64 * K1 + N1 * K1 + N1 * N2) * 2;
  set_smem(rs_kernel<N1, N2, K1, TB2>, smem);
  rs_kernel<N1, N2, K1, TB2><<<1, kThreads, smem>>>(
      static_cast<const uint16_t*>(da1.get()), static_cast<const uint16_t*>(db1.get()),
      static_cast<const uint16_t*>(db2.get()), static_cast<float*>(dc1.get()),
      static_cast<float*>(dc2.get()));
  GPUTEST_CUDA(cudaGetLastError());
  GPUTEST_CUDA(cudaDeviceSynchronize());

  const std::vector<float> c1 = dc1.download<float>();
  expect_close(c1, gemm_ref(64, N1, K1,
                            [&](int m, int k) { return gputest::from_bf16(a1[m * K1 + k]); },
                            [&](int k, int n) { return gputest::from_bf16(b1[n * K1 + k]); }),
               "C1");
  // C2's reference starts from the device's own fp32 C1 rounded to bf16 (nearest even, as the
  // kernel's cvt.rn does), so a rounding tie cannot make the comparison flaky; a wrong fragment
  // packing still pairs the wrong C1 elements with B2 rows.
  std::vector<float> c1_bf16(c1.size());
  for (size_t i = 0; i < c1.size(); ++i)
    c1_bf16[i] = std::isfinite(c1[i]) ? gputest::from_bf16(msatest::float_to_bf16(c1[i])) : 0.f;
  expect_close(dc2.download<float>(),
               gemm_ref(64, N2, N1, [&](int m, int k) { return c1_bf16[m * N1 + k]; },
                        [&](int k, int n) {
                          return gputest::from_bf16(TB2 ? b2[k * N2 + n] : b2[n * N1 + k]);
                        }),
               "C2");
}

// The layout helper itself (host): within bounds, one-to-one, 8 consecutive columns contiguous.
TEST(WgmmaLayout, Sw128OffsetIsABijectionWithContiguousChunks) {
  for (int rows : {64, 128})
    for (int cols : {64, 128}) {
      std::set<uint32_t> seen;
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) {
          const uint32_t off = sw128_offset(r, c, rows);
          ASSERT_LT(off, static_cast<uint32_t>(rows * cols * 2));
          ASSERT_TRUE(seen.insert(off).second) << "duplicate offset at " << r << "," << c;
          if (c % 8) ASSERT_EQ(off, sw128_offset(r, c - 1, rows) + 2);
        }
    }
  // Spot values from the layout definition: slab 1, row 9, chunk 2 -> position 2 ^ 1 = 3.
  EXPECT_EQ(sw128_offset(9, 64 + 16 + 5, 128), 128u * 128u + 9u * 128u + 3u * 16u + 5u * 2u);
}

// a) both K-major (the selector's orientation).
TEST(Wgmma, SsKMajorKMajorN64K64) { run_ss<64, 64, 0, 0>(101); }
TEST(Wgmma, SsKMajorKMajorN64K128) { run_ss<64, 128, 0, 0>(102); }
TEST(Wgmma, SsKMajorKMajorN128K64) { run_ss<128, 64, 0, 0>(103); }
TEST(Wgmma, SsKMajorKMajorN128K128) { run_ss<128, 128, 0, 0>(104); }
// b) A K-major, B MN-major [K][N] (dV += P^T dO with B = dO [tok][D]).
TEST(Wgmma, SsKMajorMnMajorN64K64) { run_ss<64, 64, 0, 1>(201); }
TEST(Wgmma, SsKMajorMnMajorN64K128) { run_ss<64, 128, 0, 1>(202); }
TEST(Wgmma, SsKMajorMnMajorN128K64) { run_ss<128, 64, 0, 1>(203); }
TEST(Wgmma, SsKMajorMnMajorN128K128) { run_ss<128, 128, 0, 1>(204); }
// c) both MN-major: A [K][64], B [K][N] (dQ = dS K with dS^T stored [keys][tok], K [keys][D]).
TEST(Wgmma, SsMnMajorMnMajorN64K64) { run_ss<64, 64, 1, 1>(301); }
TEST(Wgmma, SsMnMajorMnMajorN64K128) { run_ss<64, 128, 1, 1>(302); }
TEST(Wgmma, SsMnMajorMnMajorN128K64) { run_ss<128, 64, 1, 1>(303); }
TEST(Wgmma, SsMnMajorMnMajorN128K128) { run_ss<128, 128, 1, 1>(304); }
// A MN-major with B K-major completes the four combinations.
TEST(Wgmma, SsMnMajorKMajorN64K128) { run_ss<64, 128, 1, 0>(401); }
TEST(Wgmma, SsMnMajorKMajorN128K64) { run_ss<128, 64, 1, 0>(402); }
// d) register A from a previous accumulator, B MN-major: <N1 (= K of the second product), N2, K1>.
TEST(Wgmma, RsFromAccumulatorN1_64N2_128K1_64) { run_rs<64, 128, 64, 1>(501); }
TEST(Wgmma, RsFromAccumulatorN1_64N2_64K1_128) { run_rs<64, 64, 128, 1>(502); }
TEST(Wgmma, RsFromAccumulatorN1_128N2_128K1_128) { run_rs<128, 128, 128, 1>(503); }
TEST(Wgmma, RsFromAccumulatorN1_128N2_64K1_64) { run_rs<128, 64, 64, 1>(504); }
// ... and with B K-major (TRANS_B = 0).
TEST(Wgmma, RsFromAccumulatorKMajorBN1_128N2_128K1_64) { run_rs<128, 128, 64, 0>(505); }

}  // namespace
