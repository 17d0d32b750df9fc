// Helpers shared by the test suites: half-precision conversion, host tensors that can be
// viewed through the public API, random inputs, poisoning, and error metrics.
// Header-only for the generic part so that other suites (tests/gpu) can include it with just
// the flashmsa_oracle include directory; the backend-vs-oracle harness at the bottom is
// implemented in test_harness.cpp and only linked into flashmsa_tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "flashmsa/flashmsa.h"
#include "reference/oracle.h"

// Readable parameter names in gtest output (found by argument-dependent lookup).
namespace flashmsa {
inline void PrintTo(DType d, std::ostream* os) { *os << dtype_name(d); }
inline void PrintTo(Mode m, std::ostream* os) { *os << (m == Mode::sparse ? "sparse" : "warmup"); }
}  // namespace flashmsa

namespace msatest {

// ---------------------------------------------------------------------------------------------
// bf16 / fp16 conversion, round-to-nearest-even, written independently of the library so a
// shared rounding bug cannot hide.

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if (std::isnan(f)) return 0x7FC0;
  // Adding 0x7FFF plus the lowest kept bit rounds half to even; overflow into the exponent is
  // the correct carry (up to inf).
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_half(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  if (std::isnan(f)) return 0x7E00;
  const float a = std::fabs(f);
  if (a >= 65520.f) return sign | 0x7C00;  // rounds to inf (65504 is the largest finite)
  if (a < 6.103515625e-05f) {
    // Subnormal range: the value in units of 2^-24; nearbyint rounds half to even under the
    // default rounding mode.
    const float units = std::nearbyint(a * 16777216.f);
    return sign | static_cast<uint16_t>(units);
  }
  const uint32_t au = float_bits(a);
  uint32_t mant = au & 0x7FFFFFu;
  int32_t exp = static_cast<int32_t>(au >> 23) - 127 + 15;
  // Keep 10 of 23 mantissa bits, round half to even on the 13 dropped bits.
  const uint32_t dropped = mant & 0x1FFFu;
  mant >>= 13;
  if (dropped > 0x1000u || (dropped == 0x1000u && (mant & 1u))) {
    ++mant;
    if (mant == 0x400u) {
      mant = 0;
      ++exp;
    }
  }
  if (exp >= 31) return sign | 0x7C00;
  return sign | static_cast<uint16_t>((exp << 10) | mant);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7F800000u | (mant << 13));
  return bits_float(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

// The value a double takes once stored in `dtype` (fp32 first, as the library would receive it).
inline double round_to(flashmsa::DType dtype, double x) {
  const float f = static_cast<float>(x);
  switch (dtype) {
    case flashmsa::DType::bf16: return bf16_to_float(float_to_bf16(f));
    case flashmsa::DType::fp16: return half_to_float(float_to_half(f));
    case flashmsa::DType::fp32: return f;
    case flashmsa::DType::int32: return static_cast<double>(static_cast<int32_t>(x));
  }
  return f;
}

// ---------------------------------------------------------------------------------------------
// A host tensor in any library dtype. Storage is raw bytes; get/set convert through double.

class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(flashmsa::DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(shape) {
    bytes_.assign(static_cast<size_t>(numel() * flashmsa::dtype_size(dtype)), 0);
  }

  flashmsa::DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    return n;
  }
  void* data() { return bytes_.empty() ? nullptr : bytes_.data(); }
  const std::vector<unsigned char>& bytes() const { return bytes_; }

  double get(int64_t i) const {
    const unsigned char* p = bytes_.data() + i * flashmsa::dtype_size(dtype_);
    switch (dtype_) {
      case flashmsa::DType::bf16: { uint16_t h; std::memcpy(&h, p, 2); return bf16_to_float(h); }
      case flashmsa::DType::fp16: { uint16_t h; std::memcpy(&h, p, 2); return half_to_float(h); }
      case flashmsa::DType::fp32: { float f; std::memcpy(&f, p, 4); return f; }
      case flashmsa::DType::int32: { int32_t v; std::memcpy(&v, p, 4); return v; }
    }
    return 0;
  }
  void set(int64_t i, double x) {
    unsigned char* p = bytes_.data() + i * flashmsa::dtype_size(dtype_);
    switch (dtype_) {
      case flashmsa::DType::bf16: { uint16_t h = float_to_bf16(static_cast<float>(x)); std::memcpy(p, &h, 2); break; }
      case flashmsa::DType::fp16: { uint16_t h = float_to_half(static_cast<float>(x)); std::memcpy(p, &h, 2); break; }
      case flashmsa::DType::fp32: { float f = static_cast<float>(x); std::memcpy(p, &f, 4); break; }
      case flashmsa::DType::int32: { int32_t v = static_cast<int32_t>(x); std::memcpy(p, &v, 4); break; }
    }
  }
  int32_t get_int(int64_t i) const {
    int32_t v;
    std::memcpy(&v, bytes_.data() + i * 4, 4);
    return v;
  }

  void from_doubles(const std::vector<double>& x) {
    for (int64_t i = 0; i < numel(); ++i) set(i, x[static_cast<size_t>(i)]);
  }
  std::vector<double> to_doubles() const {
    std::vector<double> x(static_cast<size_t>(numel()));
    for (int64_t i = 0; i < numel(); ++i) x[static_cast<size_t>(i)] = get(i);
    return x;
  }
  std::vector<int32_t> to_ints() const {
    std::vector<int32_t> x(static_cast<size_t>(numel()));
    if (!x.empty()) std::memcpy(x.data(), bytes_.data(), x.size() * 4);
    return x;
  }

  // Fills with values no correct backend produces: NaN for floats, a large negative sentinel
  // for int32 (block indices are >= -1).
  static constexpr int32_t kIntPoison = -0x3EADBEEF;
  void poison() {
    for (int64_t i = 0; i < numel(); ++i) {
      if (dtype_ == flashmsa::DType::int32) set(i, kIntPoison);
      else set(i, std::numeric_limits<double>::quiet_NaN());
    }
  }
  void fill_bytes(unsigned char b) { std::fill(bytes_.begin(), bytes_.end(), b); }

  // Number of non-finite elements (for floats) or poison sentinels (for int32).
  int64_t count_unwritten() const {
    int64_t n = 0;
    for (int64_t i = 0; i < numel(); ++i) {
      if (dtype_ == flashmsa::DType::int32) n += get_int(i) == kIntPoison;
      else n += !std::isfinite(get(i));
    }
    return n;
  }

  flashmsa::TensorView view() {
    flashmsa::TensorView v;
    v.data = data();
    v.dtype = dtype_;
    v.device = flashmsa::Device::cpu;
    v.ndim = static_cast<int>(shape_.size());
    int64_t stride = 1;
    for (int d = v.ndim - 1; d >= 0; --d) {
      v.shape[d] = shape_[static_cast<size_t>(d)];
      v.stride[d] = stride;
      stride *= shape_[static_cast<size_t>(d)];
    }
    return v;
  }

 private:
  flashmsa::DType dtype_ = flashmsa::DType::fp32;
  std::vector<int64_t> shape_;
  std::vector<unsigned char> bytes_;
};

// ---------------------------------------------------------------------------------------------
// Random inputs and metrics.

inline std::vector<double> random_normal(size_t n, std::mt19937_64& rng, double stddev = 1.0) {
  std::normal_distribution<double> dist(0.0, stddev);
  std::vector<double> x(n);
  for (double& e : x) e = dist(rng);
  return x;
}

inline std::vector<double> rounded(flashmsa::DType dtype, std::vector<double> x) {
  for (double& e : x) e = round_to(dtype, e);
  return x;
}

// ||got - ref|| / ||ref||; ref all zero falls back to the absolute norm.
inline double rel_l2(const std::vector<double>& got, const std::vector<double>& ref) {
  if (got.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = got[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Any NaN difference (an unwritten, poisoned element) makes the result inf, so it can never
// pass a tolerance and is not overwritten by a later finite difference.
inline double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(a[i] - b[i]);
    if (std::isnan(d)) return std::numeric_limits<double>::infinity();
    m = std::max(m, d);
  }
  return m;
}

inline std::vector<int32_t> cu_from_lengths(const std::vector<int>& lengths) {
  std::vector<int32_t> cu{0};
  for (int len : lengths) cu.push_back(cu.back() + len);
  return cu;
}

// ---------------------------------------------------------------------------------------------
// Backend-vs-oracle harness (test_harness.cpp): one call generates fresh inputs, runs the CPU
// backend through the public API with poisoned outputs, and compares everything with the fp64
// oracle computed on the same (rounded) inputs.

struct Heads {
  int H = 4, Hkv = 2, Hp = 2, Hpk = 1;
  int D = 16, Dv = 16, Dp = 8;
};

struct Case {
  Heads heads;
  std::vector<int> lengths;  // sequence lengths (cu_seqlens is their prefix sum)
  flashmsa::DType dtype = flashmsa::DType::fp32;
  flashmsa::Options opt;     // block_size, top_k, local_blocks, mode, ... as the backend gets them
  uint64_t seed = 1;
  double proxy_std = 1.0;    // stddev of qp and kp
  bool integer_proxy = false;  // qp, kp drawn from {-2..2}: exact fp32 scores, many exact ties
  bool request_kl = true;      // pass a kl output to forward and backward
  bool pass_kl_grad = true;    // false: kl_grad absent (g = 1)
  double kl_grad = 0.7;        // g when passed
  bool use_msa_entry = false;  // msa_forward/msa_backward instead of the individual calls
};

struct Tolerance {
  double rel = 1e-4;     // rel L2 for o, dq, dk, dv, dqp, dkp
  double lse_abs = 1e-4;
  double kl_rel = 1e-4;
};
Tolerance default_tolerance(flashmsa::DType dtype);

// Everything the backend wrote in one forward + backward.
struct BackendOutputs {
  HostTensor block_idx, o, lse, kl_fwd, dq, dk, dv, dqp, dkp, kl_bwd;
};

// Generated inputs: the library's tensors and the oracle's view of the same (rounded) values.
struct Problem {
  oracle::Config cfg;
  oracle::Inputs in;
  std::vector<double> d_o;  // rounded, [T, H, Dv]
  HostTensor q, k, v, qp, kp, cu, d_o_t, kl_grad;
  flashmsa::AttentionInputs views();
};

Problem make_problem(const Case& c);
BackendOutputs run_backend(Problem& pr, const Case& c);

// Runs the whole case and records gtest failures; returns the backend outputs for extra checks.
BackendOutputs check_case(const Case& c, const Tolerance& tol);
inline BackendOutputs check_case(const Case& c) { return check_case(c, default_tolerance(c.dtype)); }

// Selection checks against the oracle's fp64 block scores (msa.md's tie rule with a tolerance).
void check_selection(const oracle::Config& cfg, const oracle::Selection& ref,
                     const std::vector<int32_t>& got, double tol);

}  // namespace msatest
