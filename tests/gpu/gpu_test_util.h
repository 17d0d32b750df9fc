// Helpers for the GPU suites: device buffers that are poisoned before every run, random bf16
// problems in the packed varlen layout, and a threaded host reference for the parts of msa.md
// the GPU results are compared against (block scores for the selection rule; o, lse and the KL
// value of a forward on a given selection). The reference is written from msa.md alone and
// accumulates in double, so it shares no code (and no bug) with either backend.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "flashmsa/flashmsa.h"
#include "test_util.h"  // bf16 conversion, cu_seqlens, error metrics shared with the CPU suites

namespace gputest {

using msatest::max_abs_diff;
using msatest::rel_l2;

#define GPUTEST_CUDA(call)                                                          \
  do {                                                                              \
    cudaError_t e_ = (call);                                                        \
    if (e_ != cudaSuccess) FAIL() << #call << ": " << cudaGetErrorString(e_);       \
  } while (0)

// Skips the calling test when there is no sm_90 device (CI machines have none).
#define GPUTEST_REQUIRE_DEVICE()                                                    \
  do {                                                                              \
    if (!flashmsa::cuda_device_available()) GTEST_SKIP() << "no sm_90 CUDA device"; \
  } while (0)

// bf16 on the host (round to nearest even), independent of the library: test_util.h's.
inline float from_bf16(uint16_t h) { return msatest::bf16_to_float(h); }

// A device allocation; poison() fills it with 0xFF bytes: NaN for bf16 and fp32, and -1
// (a legal padding value) would hide misses, so int32 buffers are poisoned with 0xAB bytes.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0 && cudaMalloc(&ptr_, bytes_) != cudaSuccess) {
      ptr_ = nullptr;
      ADD_FAILURE() << "cudaMalloc of " << bytes_ << " bytes failed";
    }
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }

  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  void fill(unsigned char b) {
    if (bytes_) EXPECT_EQ(cudaMemset(ptr_, b, bytes_), cudaSuccess);
  }
  template <typename T>
  void upload(const std::vector<T>& h) {
    ASSERT_EQ(h.size() * sizeof(T), bytes_);
    if (bytes_) ASSERT_EQ(cudaMemcpy(ptr_, h.data(), bytes_, cudaMemcpyHostToDevice), cudaSuccess);
  }
  template <typename T>
  std::vector<T> download() const {
    std::vector<T> h(bytes_ / sizeof(T));
    if (bytes_) EXPECT_EQ(cudaMemcpy(h.data(), ptr_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

constexpr unsigned char kFloatPoison = 0xFF;
constexpr unsigned char kIntPoisonByte = 0xAB;
constexpr int32_t kIntPoison = static_cast<int32_t>(0xABABABABu);

inline flashmsa::TensorView dview(const DeviceBuffer& b, flashmsa::DType dt,
                                  std::initializer_list<int64_t> shape) {
  return flashmsa::make_view(b.get(), dt, shape, flashmsa::Device::cuda, 0);
}

// ---- problem description and random inputs ----
struct Shape {
  int H = 4, Hkv = 1, Hp = 1, Hpk = 1;
  int D = 64;  // D = Dv = Dp on the CUDA backend
  int K = 16;
  int local_blocks = 1;
  std::vector<int> lengths;
};

// The tests' usual shape constructor (K and L matter only to the sparse mode).
inline Shape shape(int H, int Hkv, int Hp, int Hpk, int D, int K, std::vector<int> lengths,
                   int L = 1) {
  Shape s;
  s.H = H;
  s.Hkv = Hkv;
  s.Hp = Hp;
  s.Hpk = Hpk;
  s.D = D;
  s.K = K;
  s.local_blocks = L;
  s.lengths = std::move(lengths);
  return s;
}

// bf16 views of the five [T, heads, D] tensors of shape s, in the order q, k, v, qp, kp (the
// gradients dq .. dkp have the same shapes), over the given buffers on `dev` (host or device).
inline std::array<flashmsa::TensorView, 5> five_views(const std::array<const void*, 5>& ptr,
                                                      const Shape& s, int64_t T,
                                                      flashmsa::Device dev) {
  const int heads[5] = {s.H, s.Hkv, s.Hkv, s.Hp, s.Hpk};
  std::array<flashmsa::TensorView, 5> v;
  for (int i = 0; i < 5; ++i)
    v[i] = flashmsa::make_view(ptr[i], flashmsa::DType::bf16, {T, heads[i], s.D}, dev, 0);
  return v;
}

inline flashmsa::Gradients grad_views(void* dq, void* dk, void* dv, void* dqp, void* dkp,
                                      const Shape& s, int64_t T, flashmsa::Device dev) {
  const auto v = five_views({dq, dk, dv, dqp, dkp}, s, T, dev);
  return {v[0], v[1], v[2], v[3], v[4]};
}

// Host inputs (bf16 bits) and their device copies.
struct Problem {
  Shape s;
  int64_t T = 0;
  int B = 0;
  std::vector<int32_t> cu;
  std::vector<uint16_t> q, k, v, qp, kp;  // bf16 bits, [T, heads, D]
  DeviceBuffer dq, dk, dv, dqp, dkp, dcu;

  flashmsa::AttentionInputs device_inputs() const {
    flashmsa::AttentionInputs in = inputs_over(dq.get(), dk.get(), dv.get(), dqp.get(), dkp.get(),
                                               dcu.get(), flashmsa::Device::cuda);
    in.cu_seqlens_host = cu.data();
    return in;
  }
  flashmsa::AttentionInputs host_inputs() {
    return inputs_over(q.data(), k.data(), v.data(), qp.data(), kp.data(), cu.data(),
                       flashmsa::Device::cpu);
  }
  // The inputs as bf16 views (cu_seqlens int32) of the given buffers on `dev`.
  flashmsa::AttentionInputs inputs_over(const void* q_, const void* k_, const void* v_,
                                        const void* qp_, const void* kp_, const void* cu_,
                                        flashmsa::Device dev) const {
    const auto v = five_views({q_, k_, v_, qp_, kp_}, s, T, dev);
    flashmsa::AttentionInputs in;
    in.q = v[0];
    in.k = v[1];
    in.v = v[2];
    in.qp = v[3];
    in.kp = v[4];
    in.cu_seqlens = flashmsa::make_view(cu_, flashmsa::DType::int32, {B + 1}, dev, 0);
    return in;
  }
  flashmsa::Options options() const {
    flashmsa::Options o;
    o.top_k = s.K;
    o.local_blocks = s.local_blocks;
    o.kl_coeff = 0.37f;
    return o;
  }
};

inline std::vector<uint16_t> random_bf16(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<uint16_t> x(n);
  for (auto& e : x) e = msatest::float_to_bf16(dist(rng));
  return x;
}

inline void make_problem(Problem& pr, const Shape& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  pr.s = s;
  pr.cu = msatest::cu_from_lengths(s.lengths);
  pr.B = static_cast<int>(s.lengths.size());
  pr.T = pr.cu.back();
  const size_t T = static_cast<size_t>(pr.T);
  pr.q = random_bf16(T * s.H * s.D, rng);
  pr.k = random_bf16(T * s.Hkv * s.D, rng);
  pr.v = random_bf16(T * s.Hkv * s.D, rng);
  pr.qp = random_bf16(T * s.Hp * s.D, rng);
  pr.kp = random_bf16(T * s.Hpk * s.D, rng);
  pr.dq = DeviceBuffer(pr.q.size() * 2);
  pr.dk = DeviceBuffer(pr.k.size() * 2);
  pr.dv = DeviceBuffer(pr.v.size() * 2);
  pr.dqp = DeviceBuffer(pr.qp.size() * 2);
  pr.dkp = DeviceBuffer(pr.kp.size() * 2);
  pr.dcu = DeviceBuffer(pr.cu.size() * 4);
  pr.dq.upload(pr.q);
  pr.dk.upload(pr.k);
  pr.dv.upload(pr.v);
  pr.dqp.upload(pr.qp);
  pr.dkp.upload(pr.kp);
  pr.dcu.upload(pr.cu);
}

// Runs f(i) for i in [0, n) on all hardware threads.
inline void parallel_for(int64_t n, const std::function<void(int64_t)>& f) {
  const int nt = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int w = 0; w < nt; ++w)
    pool.emplace_back([&, w] {
      for (int64_t i = w; i < n; i += nt) f(i);
    });
  for (auto& th : pool) th.join();
}

inline double dot_bf16(const uint16_t* a, const uint16_t* b, int d) {
  double s = 0;
  for (int i = 0; i < d; ++i) s += static_cast<double>(from_bf16(a[i])) * from_bf16(b[i]);
  return s;
}

// msa.md steps 1-3 for one (proxy head, token): bs over the visible blocks 0..n_loc.
inline std::vector<double> block_scores(const Problem& pr, int p, int64_t t, int64_t s0) {
  const Shape& s = pr.s;
  const int pk = p / (s.Hp / s.Hpk);
  const double scale_p = 1.0 / std::sqrt(static_cast<double>(s.D));
  const int tpos = static_cast<int>(t - s0), n_loc = tpos / 128;
  std::vector<double> bs(n_loc + 1, -std::numeric_limits<double>::infinity());
  const uint16_t* qrow = pr.qp.data() + (t * s.Hp + p) * s.D;
  for (int j = 0; j <= tpos; ++j) {
    const double v = scale_p * dot_bf16(qrow, pr.kp.data() + ((s0 + j) * s.Hpk + pk) * s.D, s.D);
    bs[j / 128] = std::max(bs[j / 128], v);
  }
  for (int n = std::max(0, n_loc - s.local_blocks + 1); n <= n_loc; ++n)
    bs[n] = std::numeric_limits<double>::infinity();
  return bs;
}

// Checks a [Hp, T, K] selection against msa.md: ascending, -1 padding last, exactly
// min(K, n_loc+1) blocks, local blocks present, and every selected block's score >= the K-th
// best reference score - tol (ties within rounding are accepted).
inline void check_selection(const Problem& pr, const std::vector<int32_t>& sel, double tol) {
  const Shape& s = pr.s;
  std::vector<int> bad(static_cast<size_t>(s.Hp * pr.T), 0);
  std::vector<std::string> why(bad.size());
  parallel_for(s.Hp * pr.T, [&](int64_t u) {
    const int p = static_cast<int>(u / pr.T);
    const int64_t t = u % pr.T;
    const int b = static_cast<int>(std::upper_bound(pr.cu.begin(), pr.cu.end(), t) - pr.cu.begin()) - 1;
    const int64_t s0 = pr.cu[b];
    const int n_loc = static_cast<int>(t - s0) / 128;
    const int32_t* row = sel.data() + u * s.K;
    const int want = std::min(s.K, n_loc + 1);
    auto fail = [&](const std::string& m) {
      bad[u] = 1;
      why[u] = "p=" + std::to_string(p) + " t=" + std::to_string(t) + ": " + m;
    };
    for (int i = 0; i < s.K; ++i) {
      if (i < want) {
        if (row[i] < 0 || row[i] > n_loc) return fail("entry " + std::to_string(i) + " = " + std::to_string(row[i]));
        if (i > 0 && row[i] <= row[i - 1]) return fail("not strictly ascending");
      } else if (row[i] != -1) {
        return fail("padding entry " + std::to_string(i) + " = " + std::to_string(row[i]));
      }
    }
    for (int n = std::max(0, n_loc - s.local_blocks + 1); n <= n_loc; ++n)
      if (std::find(row, row + want, n) == row + want) return fail("local block missing");
    if (want == n_loc + 1) return;  // every visible block is selected
    std::vector<double> bs = block_scores(pr, p, t, s0);
    std::vector<double> sorted = bs;
    std::nth_element(sorted.begin(), sorted.begin() + (s.K - 1), sorted.end(), std::greater<double>());
    const double kth = sorted[s.K - 1];
    for (int i = 0; i < want; ++i)
      if (bs[row[i]] < kth - tol)
        return fail("block " + std::to_string(row[i]) + " score " + std::to_string(bs[row[i]]) +
                    " < K-th best " + std::to_string(kth));
  });
  int64_t nbad = 0;
  std::string first;
  for (size_t i = 0; i < bad.size(); ++i)
    if (bad[i] && nbad++ == 0) first = why[i];
  EXPECT_EQ(nbad, 0) << "selection rows violating msa.md, first: " << first;
}

// Reference forward (msa.md steps 5-6) on a given selection, double accumulation.
struct RefForward {
  std::vector<double> o;    // [T, H, D]
  std::vector<double> lse;  // [H, T]
  double kl = 0;            // kl_coeff * mean KL
};

inline RefForward reference_forward(const Problem& pr, const std::vector<int32_t>& sel,
                                    double kl_coeff) {
  const Shape& s = pr.s;
  const int m = s.H / s.Hp, G = s.H / s.Hkv, D = s.D;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  RefForward r;
  r.o.assign(static_cast<size_t>(pr.T * s.H * D), 0.0);
  r.lse.assign(static_cast<size_t>(s.H * pr.T), 0.0);
  std::vector<double> kl_rows(static_cast<size_t>(s.Hp * pr.T), 0.0);
  parallel_for(s.Hp * pr.T, [&](int64_t u) {
    const int p = static_cast<int>(u / pr.T);
    const int64_t t = u % pr.T;
    const int b = static_cast<int>(std::upper_bound(pr.cu.begin(), pr.cu.end(), t) - pr.cu.begin()) - 1;
    const int64_t s0 = pr.cu[b];
    const int tpos = static_cast<int>(t - s0);
    std::vector<int> keys;
    const int32_t* row = sel.data() + u * s.K;
    for (int i = 0; i < s.K; ++i)
      if (row[i] >= 0)
        for (int j = row[i] * 128; j < (row[i] + 1) * 128 && j <= tpos; ++j) keys.push_back(j);
    std::vector<double> teacher(keys.size(), 0.0), sc(keys.size());
    for (int h = p * m; h < (p + 1) * m; ++h) {
      const int kvh = h / G;
      const uint16_t* qrow = pr.q.data() + (t * s.H + h) * D;
      double mx = -std::numeric_limits<double>::infinity();
      for (size_t i = 0; i < keys.size(); ++i) {
        sc[i] = scale * dot_bf16(qrow, pr.k.data() + ((s0 + keys[i]) * s.Hkv + kvh) * D, D);
        mx = std::max(mx, sc[i]);
      }
      double sum = 0;
      for (size_t i = 0; i < keys.size(); ++i) sum += std::exp(sc[i] - mx);
      const double lse = mx + std::log(sum);
      r.lse[static_cast<size_t>(h * pr.T + t)] = lse;
      double* orow = r.o.data() + (t * s.H + h) * D;
      for (size_t i = 0; i < keys.size(); ++i) {
        const double pw = std::exp(sc[i] - lse);
        teacher[i] += pw / m;
        const uint16_t* vrow = pr.v.data() + ((s0 + keys[i]) * s.Hkv + kvh) * D;
        for (int d = 0; d < D; ++d) orow[d] += pw * from_bf16(vrow[d]);
      }
    }
    const int pk = p / (s.Hp / s.Hpk);
    const double scale_p = 1.0 / std::sqrt(static_cast<double>(D));
    double mx = -std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < keys.size(); ++i) {
      sc[i] = scale_p * dot_bf16(pr.qp.data() + (t * s.Hp + p) * D,
                                 pr.kp.data() + ((s0 + keys[i]) * s.Hpk + pk) * D, D);
      mx = std::max(mx, sc[i]);
    }
    double sum = 0;
    for (size_t i = 0; i < keys.size(); ++i) sum += std::exp(sc[i] - mx);
    const double lse_s = mx + std::log(sum);
    double kl = 0;
    for (size_t i = 0; i < keys.size(); ++i)
      if (teacher[i] > 0) kl += teacher[i] * (std::log(teacher[i]) - (sc[i] - lse_s));
    kl_rows[static_cast<size_t>(u)] = kl;
  });
  double total = 0;
  for (double x : kl_rows) total += x;
  r.kl = pr.T > 0 ? kl_coeff * total / static_cast<double>(s.Hp * pr.T) : 0.0;
  return r;
}

inline std::vector<double> bf16_to_doubles(const std::vector<uint16_t>& x) {
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = from_bf16(x[i]);
  return y;
}

inline int64_t count_nonfinite(const std::vector<double>& x) {
  int64_t n = 0;
  for (double e : x) n += !std::isfinite(e);
  return n;
}

// call() must throw a flashmsa::Error whose message contains `text` (an argument's quoted name, or the
// environment variable that refused the call).
template <typename Call>
void expect_error_containing(Call call, const std::string& text) {
  try {
    call();
    ADD_FAILURE() << "no error containing " << text;
  } catch (const flashmsa::Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

// An environment variable for one scope (nullptr: unset), restored after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value != nullptr) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_.c_str(), old_.c_str(), 1);
    else unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  bool had_ = false;
  std::string old_;
};

// For one scope, every flashmsa workspace allocation comes from cudaMallocAsync filled with 0xFF
// bytes (NaN in fp32), so an accumulator element a kernel relies on but never writes shows as NaN;
// flashmsa's own pool (which hands back earlier calls' memory) is restored after.
class PoisonedWorkspace {
 public:
  PoisonedWorkspace() {
    flashmsa::WorkspaceAllocator a;
    a.allocate = [](void*, size_t bytes, int, flashmsa::Stream stream) -> void* {
      void* p = nullptr;
      const auto st = static_cast<cudaStream_t>(stream);
      if (cudaMallocAsync(&p, bytes, st) != cudaSuccess) return nullptr;
      if (cudaMemsetAsync(p, kFloatPoison, bytes, st) != cudaSuccess) {
        cudaFreeAsync(p, st);
        return nullptr;
      }
      return p;
    };
    a.deallocate = [](void*, void* p, int, flashmsa::Stream stream) {
      cudaFreeAsync(p, static_cast<cudaStream_t>(stream));
    };
    flashmsa::set_workspace_allocator(a);
  }
  ~PoisonedWorkspace() {
    cudaDeviceSynchronize();
    flashmsa::set_workspace_allocator(flashmsa::WorkspaceAllocator());
  }
  PoisonedWorkspace(const PoisonedWorkspace&) = delete;
  PoisonedWorkspace& operator=(const PoisonedWorkspace&) = delete;
};

}  // namespace gputest
