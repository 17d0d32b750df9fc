// fp64 oracle of msa.md. Deliberately naive: every quantity is recomputed per (proxy head,
// query token) from the definitions, so it is easy to read against the spec.
#include "reference/oracle.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

namespace oracle {

double Config::resolved_scale() const { return scale > 0 ? scale : 1.0 / std::sqrt(double(D)); }
double Config::resolved_proxy_scale() const {
  return proxy_scale > 0 ? proxy_scale : 1.0 / std::sqrt(double(Dp));
}
int Config::max_blocks() const {
  int n = 0;
  for (size_t b = 0; b + 1 < cu_seqlens.size(); ++b) {
    const int len = cu_seqlens[b + 1] - cu_seqlens[b];
    n = std::max(n, (len + block_size - 1) / block_size);
  }
  return n;
}

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("oracle: " + what);
}

void validate(const Config& c, const Inputs& in) {
  require(c.H > 0 && c.Hkv > 0 && c.Hp > 0 && c.Hpk > 0, "head counts must be positive");
  require(c.H % c.Hkv == 0 && c.H % c.Hp == 0 && c.Hp % c.Hpk == 0, "bad head ratios");
  require(c.D > 0 && c.Dv > 0 && c.Dp > 0, "head dims must be positive");
  require(c.block_size > 0 && c.top_k > 0, "block_size and top_k must be positive");
  require(c.local_blocks >= 1 && c.local_blocks <= c.top_k, "local_blocks must be in [1, K]");
  require(!c.cu_seqlens.empty() && c.cu_seqlens[0] == 0, "cu_seqlens must start at 0");
  for (size_t b = 0; b + 1 < c.cu_seqlens.size(); ++b)
    require(c.cu_seqlens[b + 1] >= c.cu_seqlens[b], "cu_seqlens must be non-decreasing");
  const size_t T = static_cast<size_t>(c.T());
  require(in.q.size() == T * c.H * c.D, "q size");
  require(in.k.size() == T * c.Hkv * c.D, "k size");
  require(in.v.size() == T * c.Hkv * c.Dv, "v size");
  require(in.qp.size() == T * c.Hp * c.Dp, "qp size");
  require(in.kp.size() == T * c.Hpk * c.Dp, "kp size");
}

double dot(const double* a, const double* b, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Head maps of msa.md.
int kv_head(const Config& c, int h) { return h / (c.H / c.Hkv); }
int proxy_key_head(const Config& c, int p) { return p / (c.Hp / c.Hpk); }

// Proxy score s[p, t, j] (msa.md forward step 1), global token indices.
double proxy_score(const Config& c, const Inputs& in, int p, int64_t t, int64_t j) {
  return c.resolved_proxy_scale() * dot(&in.qp[(t * c.Hp + p) * c.Dp],
                                        &in.kp[(j * c.Hpk + proxy_key_head(c, p)) * c.Dp], c.Dp);
}

// Everything msa.md defines for one (proxy head p, query t): the key set J and, for the m
// main heads of p's group, the attention row P and its lse; the student Qs, teacher Tch, KL.
struct Row {
  int p = 0;
  int64_t t = 0;
  std::vector<int64_t> keys;             // J[p, t], global token indices, ascending
  std::vector<std::vector<double>> P;    // [m][|J|]
  std::vector<double> lse;               // [m]
  std::vector<double> Qs, Tch;           // [|J|]
  double kl = 0;                         // KL[p, t]
};

// Softmax of `logits` in place; returns log-sum-exp.
double softmax(std::vector<double>& x) {
  const double mx = *std::max_element(x.begin(), x.end());
  double sum = 0;
  for (double& e : x) {
    e = std::exp(e - mx);
    sum += e;
  }
  for (double& e : x) e /= sum;
  return mx + std::log(sum);
}

template <class F>
void for_each_row(const Config& c, const Inputs& in, const std::vector<int32_t>* block_idx, F&& f) {
  validate(c, in);
  const int64_t T = c.T();
  const int K = c.top_k;
  const int m = c.H / c.Hp;
  const double scale = c.resolved_scale();
  if (block_idx) require(block_idx->size() == static_cast<size_t>(c.Hp * T * K), "block_idx size");

  for (size_t b = 0; b + 1 < c.cu_seqlens.size(); ++b) {
    const int64_t start = c.cu_seqlens[b];
    const int64_t end = c.cu_seqlens[b + 1];
    for (int64_t t = start; t < end; ++t) {
      for (int p = 0; p < c.Hp; ++p) {
        Row r;
        r.p = p;
        r.t = t;
        // J: causal keys of this sequence whose block is in the selection row.
        std::vector<char> chosen;
        if (block_idx) {
          chosen.assign(static_cast<size_t>((end - start + c.block_size - 1) / c.block_size + 1), 0);
          for (int i = 0; i < K; ++i) {
            const int32_t n = (*block_idx)[(p * T + t) * K + i];
            if (n >= 0 && n < static_cast<int32_t>(chosen.size())) chosen[n] = 1;
          }
        }
        for (int64_t j = start; j <= t; ++j)
          if (!block_idx || chosen[(j - start) / c.block_size]) r.keys.push_back(j);
        const size_t nj = r.keys.size();

        r.Tch.assign(nj, 0.0);
        for (int hi = 0; hi < m; ++hi) {
          const int h = p * m + hi;
          const int kvh = kv_head(c, h);
          std::vector<double> logits(nj);
          for (size_t x = 0; x < nj; ++x)
            logits[x] = scale * dot(&in.q[(t * c.H + h) * c.D], &in.k[(r.keys[x] * c.Hkv + kvh) * c.D], c.D);
          r.lse.push_back(nj ? softmax(logits) : -kInf);
          for (size_t x = 0; x < nj; ++x) r.Tch[x] += logits[x] / m;
          r.P.push_back(std::move(logits));
        }
        r.Qs.resize(nj);
        for (size_t x = 0; x < nj; ++x) r.Qs[x] = proxy_score(c, in, p, t, r.keys[x]);
        if (nj) softmax(r.Qs);
        for (size_t x = 0; x < nj; ++x)
          if (r.Tch[x] > 0) r.kl += r.Tch[x] * (std::log(r.Tch[x]) - std::log(r.Qs[x]));
        f(r);
      }
    }
  }
}

}  // namespace

Selection select_blocks(const Config& c, const Inputs& in) {
  validate(c, in);
  const int64_t T = c.T();
  const int K = c.top_k;
  const int BLK = c.block_size;
  Selection sel;
  sel.max_blocks = c.max_blocks();
  sel.block_idx.assign(static_cast<size_t>(c.Hp * T * K), -1);
  sel.scores.assign(static_cast<size_t>(c.Hp * T * sel.max_blocks), -kInf);

  for (size_t b = 0; b + 1 < c.cu_seqlens.size(); ++b) {
    const int64_t start = c.cu_seqlens[b];
    const int64_t end = c.cu_seqlens[b + 1];
    for (int64_t t = start; t < end; ++t) {
      const int n_loc = static_cast<int>((t - start) / BLK);
      for (int p = 0; p < c.Hp; ++p) {
        double* bs = &sel.scores[(p * T + t) * sel.max_blocks];
        for (int n = 0; n <= n_loc; ++n) {
          if (n >= n_loc - c.local_blocks + 1) {
            bs[n] = kInf;
            continue;
          }
          double mx = -kInf;
          for (int64_t j = start + int64_t(n) * BLK; j < start + int64_t(n + 1) * BLK && j <= t; ++j)
            mx = std::max(mx, proxy_score(c, in, p, t, j));
          bs[n] = mx;
        }
        // Largest score first, ties to the lower block index.
        std::vector<int> order(static_cast<size_t>(n_loc + 1));
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int z) { return bs[a] > bs[z]; });
        const int count = std::min(K, n_loc + 1);
        std::sort(order.begin(), order.begin() + count);
        for (int i = 0; i < count; ++i) sel.block_idx[(p * T + t) * K + i] = order[i];
      }
    }
  }
  return sel;
}

ForwardResult forward(const Config& c, const Inputs& in, const std::vector<int32_t>* block_idx) {
  const int64_t T = c.T();
  const int m = c.H / std::max(c.Hp, 1);
  ForwardResult r;
  r.o.assign(static_cast<size_t>(T * c.H * c.Dv), 0.0);
  r.lse.assign(static_cast<size_t>(c.H * T), 0.0);
  double kl_sum = 0;
  for_each_row(c, in, block_idx, [&](const Row& row) {
    for (int hi = 0; hi < m; ++hi) {
      const int h = row.p * m + hi;
      const int kvh = kv_head(c, h);
      r.lse[h * T + row.t] = row.lse[hi];
      double* o = &r.o[(row.t * c.H + h) * c.Dv];
      for (size_t x = 0; x < row.keys.size(); ++x)
        for (int d = 0; d < c.Dv; ++d) o[d] += row.P[hi][x] * in.v[(row.keys[x] * c.Hkv + kvh) * c.Dv + d];
    }
    kl_sum += row.kl;
  });
  r.kl_loss = T > 0 ? c.kl_coeff * kl_sum / (double(c.Hp) * double(T)) : 0.0;
  return r;
}

BackwardResult backward(const Config& c, const Inputs& in, const std::vector<int32_t>* block_idx,
                        const std::vector<double>& d_o, double g) {
  const int64_t T = c.T();
  const int m = c.H / std::max(c.Hp, 1);
  require(d_o.size() == static_cast<size_t>(T * c.H * c.Dv), "d_o size");
  const double scale = c.resolved_scale();
  const double scale_p = c.resolved_proxy_scale();
  const double proxy_coeff = T > 0 ? g * c.kl_coeff / (double(c.Hp) * double(T)) : 0.0;

  BackwardResult r;
  r.dq.assign(static_cast<size_t>(T * c.H * c.D), 0.0);
  r.dk.assign(static_cast<size_t>(T * c.Hkv * c.D), 0.0);
  r.dv.assign(static_cast<size_t>(T * c.Hkv * c.Dv), 0.0);
  r.dqp.assign(static_cast<size_t>(T * c.Hp * c.Dp), 0.0);
  r.dkp.assign(static_cast<size_t>(T * c.Hpk * c.Dp), 0.0);
  double kl_sum = 0;

  for_each_row(c, in, block_idx, [&](const Row& row) {
    const int64_t t = row.t;
    const size_t nj = row.keys.size();
    // Main attention: dP = dO v, dS = P (dP - sum_j P dP), the ordinary softmax backward.
    for (int hi = 0; hi < m; ++hi) {
      const int h = row.p * m + hi;
      const int kvh = kv_head(c, h);
      const double* dout = &d_o[(t * c.H + h) * c.Dv];
      std::vector<double> dP(nj);
      double rowsum = 0;
      for (size_t x = 0; x < nj; ++x) {
        dP[x] = dot(dout, &in.v[(row.keys[x] * c.Hkv + kvh) * c.Dv], c.Dv);
        rowsum += row.P[hi][x] * dP[x];
      }
      for (size_t x = 0; x < nj; ++x) {
        const int64_t j = row.keys[x];
        const double dS = row.P[hi][x] * (dP[x] - rowsum);
        for (int d = 0; d < c.D; ++d) {
          r.dq[(t * c.H + h) * c.D + d] += scale * dS * in.k[(j * c.Hkv + kvh) * c.D + d];
          r.dk[(j * c.Hkv + kvh) * c.D + d] += scale * dS * in.q[(t * c.H + h) * c.D + d];
        }
        for (int d = 0; d < c.Dv; ++d) r.dv[(j * c.Hkv + kvh) * c.Dv + d] += row.P[hi][x] * dout[d];
      }
    }
    // Proxy: the teacher is a constant, so d kl_loss / d s = coeff * (Qs - Tch).
    const int pk = proxy_key_head(c, row.p);
    for (size_t x = 0; x < nj; ++x) {
      const int64_t j = row.keys[x];
      const double dS = proxy_coeff * (row.Qs[x] - row.Tch[x]);
      for (int d = 0; d < c.Dp; ++d) {
        r.dqp[(t * c.Hp + row.p) * c.Dp + d] += scale_p * dS * in.kp[(j * c.Hpk + pk) * c.Dp + d];
        r.dkp[(j * c.Hpk + pk) * c.Dp + d] += scale_p * dS * in.qp[(t * c.Hp + row.p) * c.Dp + d];
      }
    }
    kl_sum += row.kl;
  });
  r.kl_loss = T > 0 ? c.kl_coeff * kl_sum / (double(c.Hp) * double(T)) : 0.0;
  return r;
}

}  // namespace oracle
