#include "slice_check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>

namespace flashmsa::app {
namespace {

struct ErrAcc {  // relative L2 error accumulated over many rows
  double num = 0, den = 0;
  void add(double got, double want) {
    num += (got - want) * (got - want);
    den += want * want;
  }
  double rel() const { return den > 0 ? std::sqrt(num / den) : std::sqrt(num); }
};

double dot(const float* a, const float* b, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

class Slice {
 public:
  explicit Slice(const HostProblem& p) : p_(p), m_(p.H / p.Hp) {}

  int seq_of(int64_t t) const {
    auto it = std::upper_bound(p_.cu_seqlens.begin(), p_.cu_seqlens.end(), static_cast<int32_t>(t));
    return static_cast<int>(it - p_.cu_seqlens.begin()) - 1;
  }
  int kv(int h) const { return h / (p_.H / p_.Hkv); }
  int ph(int h) const { return h / m_; }
  int pk(int pp) const { return pp / (p_.Hp / p_.Hpk); }

  const float* Q(int64_t t, int h) const { return &p_.q[(t * p_.H + h) * p_.D]; }
  const float* Kt(int64_t j, int g) const { return &p_.k[(j * p_.Hkv + g) * p_.D]; }
  const float* V(int64_t j, int g) const { return &p_.v[(j * p_.Hkv + g) * p_.Dv]; }
  const float* QP(int64_t t, int pp) const { return &p_.qp[(t * p_.Hp + pp) * p_.Dp]; }
  const float* KP(int64_t j, int g) const { return &p_.kp[(j * p_.Hpk + g) * p_.Dp]; }
  const float* dO(int64_t t, int h) const { return &p_.d_o[(t * p_.H + h) * p_.Dv]; }
  const int32_t* row(int pp, int64_t t) const { return &p_.block_idx[(pp * p_.T + t) * p_.top_k]; }

  double proxy_score(int pp, int64_t t, int64_t j) const {
    return p_.proxy_scale * dot(QP(t, pp), KP(j, pk(pp)), p_.Dp);
  }

  // The selected key set J of (proxy head pp, token t), from the backend's block indices.
  std::vector<int64_t> keys(int pp, int64_t t) const {
    const int64_t s0 = p_.cu_seqlens[seq_of(t)];
    std::vector<int64_t> out;
    const int32_t* r = row(pp, t);
    for (int i = 0; i < p_.top_k; ++i) {
      if (r[i] < 0) continue;
      for (int64_t j = s0 + int64_t(r[i]) * p_.block_size; j <= t && j < s0 + int64_t(r[i] + 1) * p_.block_size; ++j)
        out.push_back(j);
    }
    return out;
  }

  // Selection of (pp, t) against fp64 block scores; returns the worst score shortfall.
  double check_selection(int pp, int64_t t, bool& structural_ok) const {
    const int64_t s0 = p_.cu_seqlens[seq_of(t)];
    const int n_loc = static_cast<int>((t - s0) / p_.block_size);
    std::vector<double> bs(n_loc + 1, -std::numeric_limits<double>::infinity());
    for (int64_t j = s0; j <= t; ++j) {
      const int n = static_cast<int>((j - s0) / p_.block_size);
      bs[n] = std::max(bs[n], proxy_score(pp, t, j));
    }
    for (int n = std::max(0, n_loc - p_.local_blocks + 1); n <= n_loc; ++n)
      bs[n] = std::numeric_limits<double>::infinity();
    std::vector<double> sorted = bs;
    std::sort(sorted.begin(), sorted.end(), std::greater<double>());
    const int want = std::min(p_.top_k, n_loc + 1);
    const double kth = sorted[want - 1];
    const int32_t* r = row(pp, t);
    structural_ok = true;
    double worst = 0;
    bool has_local = false;
    for (int i = 0; i < p_.top_k; ++i) {
      if (i < want) {
        if (r[i] < 0 || r[i] > n_loc || (i > 0 && r[i] <= r[i - 1])) {
          structural_ok = false;
          continue;
        }
        has_local |= r[i] == n_loc;
        if (std::isfinite(kth)) worst = std::max(worst, kth - bs[r[i]]);
      } else if (r[i] != -1) {
        structural_ok = false;
      }
    }
    if (!has_local) structural_ok = false;
    return worst;
  }

  // Main attention of (h, t) over J: fills P (aligned with J) and returns the fp64 lse.
  double attend(int h, int64_t t, const std::vector<int64_t>& J, std::vector<double>& P) const {
    P.resize(J.size());
    double mx = -std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < J.size(); ++i) {
      P[i] = p_.scale * dot(Q(t, h), Kt(J[i], kv(h)), p_.D);
      mx = std::max(mx, P[i]);
    }
    double sum = 0;
    for (double& x : P) sum += std::exp(x - mx);
    const double lse = mx + std::log(sum);
    for (double& x : P) x = std::exp(x - lse);
    return lse;
  }

  // Student log-probabilities log Qs over J (softmax of the proxy scores).
  std::vector<double> student_log_probs(int pp, int64_t t, const std::vector<int64_t>& J) const {
    std::vector<double> s(J.size());
    double mx = -std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < J.size(); ++i) mx = std::max(mx, s[i] = proxy_score(pp, t, J[i]));
    double sum = 0;
    for (double x : s) sum += std::exp(x - mx);
    const double lse = mx + std::log(sum);
    for (double& x : s) x -= lse;
    return s;
  }

  // The proxy-logit gradient dS_p = c * (Qs - Tch) (upstream gradient g = 1).
  double proxy_coeff() const { return p_.kl_coeff / (double(p_.Hp) * double(p_.T)); }
  double proxy_grad_at(int pp, int64_t t, const std::vector<int64_t>& J, size_t i,
                       double Tch_i) const {
    return proxy_coeff() * (std::exp(student_log_probs(pp, t, J)[i]) - Tch_i);
  }

  const HostProblem& p_;
  const int m_;
};

}  // namespace

std::string SliceReport::summary() const {
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "slice check (%d query tokens, %d key tokens): selection worst shortfall %.2e, "
                "bad rows %d | rel L2: o %.2e dq %.2e dqp %.2e dk %.2e dv %.2e dkp %.2e | lse max "
                "abs %.2e -> %s",
                tokens_checked, keys_checked, sel_violation, sel_rows_bad, err_o, err_dq, err_dqp,
                err_dk, err_dv, err_dkp, err_lse, pass ? "PASS" : "FAIL");
  return buf;
}

SliceReport check_slice(const HostProblem& p, int n_tokens, int n_keys, uint64_t seed,
                        double tol_rel) {
  SliceReport rep;
  if (p.T == 0) {
    rep.pass = true;
    return rep;
  }
  Slice s(p);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> pick(0, p.T - 1);
  std::vector<int64_t> tokens{0, p.T - 1};
  while (static_cast<int>(tokens.size()) < n_tokens) tokens.push_back(pick(rng));
  const int m = p.H / p.Hp;

  ErrAcc eo, edq, edqp;
  std::vector<double> P;
  for (int64_t t : tokens) {
    for (int pp = 0; pp < p.Hp; ++pp) {
      bool ok = true;
      rep.sel_violation = std::max(rep.sel_violation, s.check_selection(pp, t, ok));
      if (!ok) ++rep.sel_rows_bad;
      const std::vector<int64_t> J = s.keys(pp, t);
      std::vector<double> Tch(J.size(), 0.0);
      for (int h = pp * m; h < (pp + 1) * m; ++h) {
        const double lse = s.attend(h, t, J, P);
        rep.err_lse = std::max(rep.err_lse, std::fabs(lse - p.lse[h * p.T + t]));
        std::vector<double> o(p.Dv, 0.0), dq(p.D, 0.0);
        std::vector<double> dP(J.size());
        double Di = 0;
        for (size_t i = 0; i < J.size(); ++i) {
          const float* vj = s.V(J[i], s.kv(h));
          for (int d = 0; d < p.Dv; ++d) o[d] += P[i] * vj[d];
          dP[i] = dot(s.dO(t, h), vj, p.Dv);
          Di += P[i] * dP[i];
          Tch[i] += P[i] / m;
        }
        for (int d = 0; d < p.Dv; ++d) eo.add(p.o[(t * p.H + h) * p.Dv + d], o[d]);
        if (!p.have_backward) continue;
        for (size_t i = 0; i < J.size(); ++i) {
          const double dS = P[i] * (dP[i] - Di) * p.scale;
          const float* kj = s.Kt(J[i], s.kv(h));
          for (int d = 0; d < p.D; ++d) dq[d] += dS * kj[d];
        }
        for (int d = 0; d < p.D; ++d) edq.add(p.dq[(t * p.H + h) * p.D + d], dq[d]);
      }
      if (!p.have_backward) continue;
      const std::vector<double> logQs = s.student_log_probs(pp, t, J);
      std::vector<double> dqp(p.Dp, 0.0);
      for (size_t i = 0; i < J.size(); ++i) {
        const double dSp = s.proxy_coeff() * (std::exp(logQs[i]) - Tch[i]);
        const float* kj = s.KP(J[i], s.pk(pp));
        for (int d = 0; d < p.Dp; ++d) dqp[d] += p.proxy_scale * dSp * kj[d];
      }
      for (int d = 0; d < p.Dp; ++d) edqp.add(p.dqp[(t * p.Hp + pp) * p.Dp + d], dqp[d]);
    }
  }
  rep.tokens_checked = static_cast<int>(tokens.size());
  rep.err_o = eo.rel();
  rep.err_dq = edq.rel();
  rep.err_dqp = edqp.rel();

  // Key side: every query that selected the key's block contributes to dk, dv, dkp.
  ErrAcc edk, edv, edkp;
  if (p.have_backward) {
    std::vector<int64_t> key_tokens{0};
    while (static_cast<int>(key_tokens.size()) < n_keys) key_tokens.push_back(pick(rng));
    for (int64_t j : key_tokens) {
      const int b = s.seq_of(j);
      const int64_t s0 = p.cu_seqlens[b], s1 = p.cu_seqlens[b + 1];
      const int blk = static_cast<int>((j - s0) / p.block_size);
      std::vector<double> dk(size_t(p.Hkv) * p.D, 0.0), dv(size_t(p.Hkv) * p.Dv, 0.0);
      std::vector<double> dkp(size_t(p.Hpk) * p.Dp, 0.0);
      for (int64_t t = j; t < s1; ++t) {
        for (int pp = 0; pp < p.Hp; ++pp) {
          const int32_t* r = s.row(pp, t);
          if (std::find(r, r + p.top_k, blk) == r + p.top_k) continue;
          const std::vector<int64_t> J = s.keys(pp, t);
          const size_t jpos = std::find(J.begin(), J.end(), j) - J.begin();
          double Tch_j = 0;  // only the key's own teacher weight is needed
          for (int h = pp * m; h < (pp + 1) * m; ++h) {
            const int g = s.kv(h);
            const double lse = p.lse[h * p.T + t];
            const double Pj = std::exp(p.scale * dot(s.Q(t, h), s.Kt(j, g), p.D) - lse);
            Tch_j += Pj / m;
            const double Di = dot(s.dO(t, h), &p.o[(t * p.H + h) * p.Dv], p.Dv);
            const double dS = Pj * (dot(s.dO(t, h), s.V(j, g), p.Dv) - Di) * p.scale;
            for (int d = 0; d < p.D; ++d) dk[g * p.D + d] += dS * s.Q(t, h)[d];
            for (int d = 0; d < p.Dv; ++d) dv[g * p.Dv + d] += Pj * s.dO(t, h)[d];
          }
          const double dSp = s.proxy_grad_at(pp, t, J, jpos, Tch_j);
          for (int d = 0; d < p.Dp; ++d)
            dkp[s.pk(pp) * p.Dp + d] += p.proxy_scale * dSp * s.QP(t, pp)[d];
        }
      }
      for (int g = 0; g < p.Hkv; ++g) {
        for (int d = 0; d < p.D; ++d) edk.add(p.dk[(j * p.Hkv + g) * p.D + d], dk[g * p.D + d]);
        for (int d = 0; d < p.Dv; ++d) edv.add(p.dv[(j * p.Hkv + g) * p.Dv + d], dv[g * p.Dv + d]);
      }
      for (int g = 0; g < p.Hpk; ++g)
        for (int d = 0; d < p.Dp; ++d) edkp.add(p.dkp[(j * p.Hpk + g) * p.Dp + d], dkp[g * p.Dp + d]);
    }
    rep.keys_checked = static_cast<int>(key_tokens.size());
  }
  rep.err_dk = edk.rel();
  rep.err_dv = edv.rel();
  rep.err_dkp = edkp.rel();

  rep.pass = rep.sel_rows_bad == 0 && rep.sel_violation < 1e-3 && rep.err_lse < 1e-3 &&
             rep.err_o < tol_rel && rep.err_dq < tol_rel && rep.err_dqp < tol_rel &&
             rep.err_dk < tol_rel && rep.err_dv < tol_rel && rep.err_dkp < tol_rel;
  return rep;
}

}  // namespace flashmsa::app
