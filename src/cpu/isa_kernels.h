// Vector math and the small GEMM every CPU pass is built from.
//
// No include guard on purpose: backend_generic.cpp and backend_avx2.cpp each include this inside
// their own namespace (flashmsa::cpu::<isa>::) after choosing the instruction set, so the same
// source is compiled once per ISA without ODR clashes. Needs common.h included before.
//
// Vectors are GCC vector extensions; the including file picks their width (FLASHMSA_CPU_VEC)
// and the GEMM register-tile height (FLASHMSA_CPU_MR) for its ISA.

#ifndef FLASHMSA_CPU_MR
#error "define FLASHMSA_CPU_MR (GEMM rows per register tile) before including isa_kernels.h"
#endif

namespace {

// The widest vector the target has natively: 8 floats (one ymm) under AVX2, else 4 (one xmm).
// All padded widths are multiples of 16, so loops step by kW without tails.
#if FLASHMSA_CPU_VEC == 8
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
#elif FLASHMSA_CPU_VEC == 4
typedef float vf __attribute__((vector_size(16)));
typedef int32_t vi __attribute__((vector_size(16)));
#else
#error "define FLASHMSA_CPU_VEC (4 or 8) before including isa_kernels.h"
#endif
constexpr int kW = FLASHMSA_CPU_VEC;
constexpr int kMR = FLASHMSA_CPU_MR;

// Vector helpers are always inlined, so no vector crosses a call boundary.
#define FLASHMSA_VINLINE inline __attribute__((always_inline))

FLASHMSA_VINLINE vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
FLASHMSA_VINLINE void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
FLASHMSA_VINLINE vf vset1(float x) {
  vf v;
  for (int i = 0; i < kW; ++i) v[i] = x;
  return v;
}
FLASHMSA_VINLINE vi vset1i(int32_t x) {
  vi v;
  for (int i = 0; i < kW; ++i) v[i] = x;
  return v;
}
FLASHMSA_VINLINE vf as_f(vi x) { return (vf)x; }
FLASHMSA_VINLINE vi as_i(vf x) { return (vi)x; }
FLASHMSA_VINLINE vf vselect(vi mask, vf a, vf b) { return as_f((as_i(a) & mask) | (as_i(b) & ~mask)); }
FLASHMSA_VINLINE vf vmax(vf a, vf b) { return vselect(a > b, a, b); }
FLASHMSA_VINLINE float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < kW; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
FLASHMSA_VINLINE float hsum(vf v) {
  // Fixed pairwise order.
  for (int half = kW / 2; half > 0; half /= 2)
    for (int i = 0; i < half; ++i) v[i] += v[i + half];
  return v[0];
}
// Lanes j0 .. j0+kW-1 that are below `valid`.
FLASHMSA_VINLINE vi lanes_below(int64_t j0, int64_t valid) {
  vi iota;
  for (int i = 0; i < kW; ++i) iota[i] = i;
  const int32_t lim = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(valid - j0, -1), kW + 1));
  return iota < vset1i(lim);
}
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) to about 2 ulp for x in [-87.3, 88]; below that exactly 0 (so exp(-inf) = 0, and
// masked logits vanish without a separate select). Cody-Waite reduction, degree-6 polynomial.
FLASHMSA_VINLINE vf vexp(vf x) {
  const vi nan = x != x;  // carried through: the clamps below would turn a NaN into a finite value
  const vf x_in = x;
  const vi under = x < vset1(-87.33654f);
  x = vmax(x, vset1(-87.33654f));
  x = vselect(x > vset1(88.0f), vset1(88.0f), x);
  vf fx = x * 1.44269504088896341f + 0.5f;
  vi n = __builtin_convertvector(fx, vi);  // truncates; fix to floor below
  n += __builtin_convertvector(n, vf) > fx;   // true lanes are -1
  fx = __builtin_convertvector(n, vf);
  x = x - fx * 0.693359375f;
  x = x - fx * -2.12194440e-4f;
  vf y = vset1(1.9875691500e-4f);
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * (x * x) + x + 1.0f;
  const vi pow2 = (n + 127) << 23;
  y = y * as_f(pow2);
  return vselect(nan, x_in, vselect(under, vset1(0.f), y));
}

// Natural log for positive normal x (callers never pass zero, subnormals or negatives).
FLASHMSA_VINLINE vf vlog(vf x) {
  vi bits = as_i(x);
  vi e = (bits >> 23) - 126;
  bits = (bits & 0x007fffff) | 0x3f000000;  // mantissa in [0.5, 1)
  vf m = as_f(bits);
  const vi small = m < vset1(0.707106781186547524f);
  e += small;  // -1 where small
  m = vselect(small, m + m - 1.0f, m - 1.0f);
  const vf z = m * m;
  vf y = vset1(7.0376836292e-2f);
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  const vf fe = __builtin_convertvector(e, vf);
  y = y + fe * -2.12194440e-4f;
  y = y - 0.5f * z;
  return m + y + fe * 0.693359375f;
}

// ---------------------------------------------------------------------------------------------
// C[M x N] (=, or += when `accumulate`) A[M x kd] * B[kd x N], all fp32.
//   A row-major: a(i, k) = A[i * lda + k]; with kACol, column-major: a(i, k) = A[k * lda + i].
//   B row-major (ldb), C row-major (ldc). N must be a multiple of 16 (callers pad).
// A register tile is MR rows x 16 columns; the k loop runs over B rows that stay in L1.

template <int MR, bool kACol>
inline void gemm_tile(int64_t kd, const float* A, int64_t lda, const float* B, int64_t ldb,
                      float* C, int64_t ldc, bool accumulate) {
  constexpr int NV = 16 / kW;  // vectors per 16-column strip
  vf c[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) c[r][v] = vset1(0.f);
  for (int64_t k = 0; k < kd; ++k) {
    vf b[NV];
    for (int v = 0; v < NV; ++v) b[v] = vload(B + k * ldb + v * kW);
    for (int r = 0; r < MR; ++r) {
      const float a = kACol ? A[k * lda + r] : A[r * lda + k];
      for (int v = 0; v < NV; ++v) c[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < MR; ++r) {
    float* cr = C + r * ldc;
    for (int v = 0; v < NV; ++v) {
      if (accumulate) vstore(cr + v * kW, vload(cr + v * kW) + c[r][v]);
      else vstore(cr + v * kW, c[r][v]);
    }
  }
}

template <bool kACol, int R>
inline void gemm_rows_tail(int64_t rem, int64_t kd, const float* A, int64_t lda, const float* B,
                           int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  if constexpr (R > 0) {
    if (rem == R) {
      gemm_tile<R, kACol>(kd, A, lda, B, ldb, C, ldc, accumulate);
      return;
    }
    gemm_rows_tail<kACol, R - 1>(rem, kd, A, lda, B, ldb, C, ldc, accumulate);
  }
}

template <bool kACol>
void gemm(int64_t M, int64_t N, int64_t kd, const float* A, int64_t lda, const float* B,
          int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  for (int64_t j = 0; j < N; j += 16) {
    int64_t i = 0;
    for (; i + kMR <= M; i += kMR)
      gemm_tile<kMR, kACol>(kd, A + (kACol ? i : i * lda), lda, B + j, ldb, C + i * ldc + j, ldc,
                            accumulate);
    if (i < M)
      gemm_rows_tail<kACol, kMR - 1>(M - i, kd, A + (kACol ? i : i * lda), lda, B + j, ldb,
                                     C + i * ldc + j, ldc, accumulate);
  }
}

// C = A * B with A row-major.
inline void gemm_nn(int64_t M, int64_t N, int64_t kd, const float* A, int64_t lda, const float* B,
                    int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  gemm<false>(M, N, kd, A, lda, B, ldb, C, ldc, accumulate);
}
// C = A^T * B where A is stored row-major [kd x M] (so a(i, k) = A[k * lda + i]).
inline void gemm_tn(int64_t M, int64_t N, int64_t kd, const float* A, int64_t lda, const float* B,
                    int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  gemm<true>(M, N, kd, A, lda, B, ldb, C, ldc, accumulate);
}

// Rows idx[0..cnt) of src (row stride src_stride), n floats each, packed into dst [cnt][n]:
// the GEMM A operand of the tokens that attend to one key block.
inline void gather_rows(float* dst, const float* src, int64_t src_stride, const int32_t* idx,
                        int64_t cnt, int64_t n) {
  for (int64_t a = 0; a < cnt; ++a)
    std::memcpy(dst + a * n, src + idx[a] * src_stride, sizeof(float) * n);
}

// dst[0..n) += src[0..n), n a multiple of kW.
inline void vadd_into(float* dst, const float* src, int64_t n) {
  for (int64_t j = 0; j < n; j += kW) vstore(dst + j, vload(dst + j) + vload(src + j));
}
inline void vscale(float* x, int64_t n, float s) {
  for (int64_t j = 0; j < n; j += kW) vstore(x + j, vload(x + j) * s);
}

// ---------------------------------------------------------------------------------------------
// Softmax pieces over one score row s[0..w) of which the lanes below `valid` are real keys.

inline float max_masked(const float* s, int64_t w, int64_t valid) {
  vf m = vset1(kNegInf);
  for (int64_t j = 0; j < w; j += kW) m = vselect(lanes_below(j, valid), vmax(m, vload(s + j)), m);
  return hmax(m);
}

// Adds the row's keys, scaled by `scale`, into an online softmax normaliser (running max mx,
// sum of exp(x - mx) in sum).
inline void online_normaliser_add(const float* s, int64_t w, int64_t valid, float scale,
                                  float& mx, float& sum) {
  const float mnew = std::max(mx, max_masked(s, w, valid) * scale);
  vf acc = vset1(0.f);
  for (int64_t j = 0; j < w; j += kW)
    acc += vexp(vselect(lanes_below(j, valid), vload(s + j) * scale - mnew, vset1(kNegInf)));
  sum = sum * std::exp(mx - mnew) + hsum(acc);
  mx = mnew;
}

// KL lanes te * (log te - log_q) for teacher probabilities te: zero where the lane is masked
// or te is zero or subnormal (0 log 0 = 0; vlog only takes positive normals); a NaN te (from a
// non-finite input) is carried through.
FLASHMSA_VINLINE vf kl_lanes(vi mask, vf te, vf log_q) {
  const vi pos = mask & (te >= vset1(std::numeric_limits<float>::min()));
  const vi nan = mask & (te != te);
  return vselect(nan, te, vselect(pos, te * (vlog(vselect(pos, te, vset1(1.f))) - log_q), vset1(0.f)));
}

// ---------------------------------------------------------------------------------------------
// Per-worker scratch that only grows, so items reuse one allocation.
struct Buf {
  std::vector<float> v;
  float* get(int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    return v.data();
  }
};

}  // namespace
