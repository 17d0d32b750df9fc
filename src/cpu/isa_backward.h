// Fused backward (main attention dq, dk, dv; proxy dqp, dkp from the KL; the KL value), sparse or
// dense warm-up. Included once per ISA after isa_kernels.h and isa_forward.h.
//
// Key-major with phases, so that every accumulator has exactly one writer at a time and the
// summation order is fixed (results are identical for any thread count):
//   * a work item owns one key block g: it gathers the (token, head) rows that attend to g in
//     this phase and adds their dk, dv, dkp contributions into g's rows;
//   * a phase gives each (proxy head, token) at most one key block, so the dq / dqp rows an item
//     adds to are touched by no other item of the phase.
// Sparse: phase k takes slot (k + t) mod K of token t's selection (rotating the slot spreads a
// popular block, e.g. block 0, over all phases instead of loading phase 0 with it).
// Dense: phase d pairs query block nq with key block nq - d.
// Each item recomputes P from lse (no T x T and no per-selection storage); the proxy's student
// normaliser lse_s and D_i = rowsum(dO * O) come from a query-major pre-pass.

namespace {

// The tokens an item serves for one proxy head: list[0 .. count), or first + [0, count) when
// list is null (dense mode's whole query block).
struct TokenSpan {
  const int32_t* list = nullptr;
  int64_t first = 0;
  int64_t count = 0;
  int64_t at(int64_t i) const { return list ? list[i] : first + i; }
};

}  // namespace

void attention_backward(const MsaParams& p, const Layout& lay, Team& team, bool dense) {
  const int H = p.H, Hkv = p.Hkv, Hp = p.Hp, Hpk = p.Hpk, m = p.group_size();
  const int D = p.D, Dv = p.Dv, Dp = p.Dp, K = p.top_k;
  const int64_t T = p.T, G = lay.G;
  const int64_t Dq = round_up(D, kColTile), Dvp = round_up(Dv, kColTile), Dpp = round_up(Dp, kColTile);
  const float scale = p.scale, scale_p = p.proxy_scale;
  const bool want_kl = p.kl != nullptr;
  const float g_up = p.kl_grad ? *p.kl_grad : 1.f;
  // d loss / d <qp, kp> = coef * (Qs - Tch): the proxy scale and the mean over Hp*T folded in.
  const float coef = static_cast<float>(static_cast<double>(g_up) * p.kl_coeff /
                                        (static_cast<double>(Hp) * static_cast<double>(T)) *
                                        scale_p);

  // Key-side operands, fp32.
  std::vector<float> kt = build_panels(p.k, p.dtype, Hkv, D, lay, team);       // S = Q K^T
  std::vector<float> vt = build_panels(p.v, p.dtype, Hkv, Dv, lay, team);      // dP = dO V^T
  std::vector<float> kf = build_rows(p.k, p.dtype, Hkv, D, Dq, lay, team);     // dQ = dS K
  std::vector<float> kpt = build_panels(p.kp, p.dtype, Hpk, Dp, lay, team);    // proxy scores
  std::vector<float> kpf = build_rows(p.kp, p.dtype, Hpk, Dp, Dpp, lay, team); // dqp = dSp Kp

  // fp32 accumulators (zeroed), converted to the output dtype at the end.
  std::vector<float> dq32(static_cast<size_t>(T) * H * Dq);      // [T][H][Dq]
  std::vector<float> dk32(static_cast<size_t>(Hkv) * T * Dq);    // [Hkv][T][Dq]
  std::vector<float> dv32(static_cast<size_t>(Hkv) * T * Dvp);   // [Hkv][T][Dvp]
  std::vector<float> dqp32(static_cast<size_t>(T) * Hp * Dpp);   // [T][Hp][Dpp]
  std::vector<float> dkp32(static_cast<size_t>(Hpk) * T * Dpp);  // [Hpk][T][Dpp]
  std::vector<float> di(static_cast<size_t>(H) * T);             // [H][T] rowsum(dO * O)
  std::vector<float> lse_s(static_cast<size_t>(Hp) * T);         // [Hp][T] student normaliser
  std::vector<float> kl_terms(want_kl ? static_cast<size_t>(Hp) * T : 0);  // [Hp][T]

  std::vector<std::vector<HeadRange>> ranges(Hp);
  int mc_max = 1;
  for (int hp = 0; hp < Hp; ++hp) {
    ranges[hp] = group_ranges(p, hp);
    for (const HeadRange& hr : ranges[hp]) mc_max = std::max(mc_max, hr.h1 - hr.h0);
  }
  const int64_t wmax = max_block_width(p, lay);
  const int64_t max_list = dense ? std::max<int64_t>(lay.max_blocks, 1) : K;

  // ---- pre-pass, query-major: D_i and lse_s ------------------------------------------------
  // Item (proxy head, query block): D_i of the group's heads, and the student normaliser with
  // the block's tokens gathered per selected key block (one GEMM per block, not per token).
  {
    struct Pre {
      Buf o, dO, qpt, qpg, sp;
      std::vector<float> ms, ls;
      TileLists tl;
    };
    std::vector<Pre> pre(team.size());
    team.run(static_cast<int64_t>(Hp) * G, [&](int64_t item, int worker) {
      const QueryBlockItem qb(p, lay, item);
      const int hp = qb.hp, pk = qb.pk, b = qb.b;
      const int64_t gq = qb.gq, nq = qb.nq;
      const int64_t t0 = lay.blk_start[gq], tt = lay.blk_len[gq];
      Pre& s = pre[worker];
      float* o = s.o.get(Dv);
      float* dO = s.dO.get(Dv);
      float* qpt = s.qpt.get(tt * Dp);  // [tt][Dp]
      float* qpg = s.qpg.get(tt * Dp);  // [cnt][Dp]
      float* sp = s.sp.get(tt * wmax);  // [cnt][w]
      for (int64_t i = 0; i < tt; ++i) {
        const int64_t t = t0 + i;
        for (int h = hp * m; h < (hp + 1) * m; ++h) {
          load_f32(p.o, p.dtype, (t * H + h) * Dv, Dv, o);
          load_f32(p.d_o, p.dtype, (t * H + h) * Dv, Dv, dO);
          float acc = 0.f;
          for (int d = 0; d < Dv; ++d) acc += o[d] * dO[d];
          di[h * T + t] = acc;
        }
        load_f32(p.qp, p.dtype, (t * Hp + hp) * Dp, Dp, qpt + i * Dp);
      }
      s.ms.assign(tt, kNegInf);
      s.ls.assign(tt, 0.f);
      s.tl.build(p, dense, hp, t0, tt, nq, max_list);
      const int64_t pos0 = lay.pos(t0);
      for (int64_t n = 0; n <= nq; ++n) {
        const int64_t cnt = s.tl.count(n);
        if (cnt == 0) continue;
        const int32_t* mem = s.tl.tokens(n);
        const int64_t g = lay.blk_base[b] + n;
        const int64_t w = lay.blk_w[g], len = lay.blk_len[g];
        gather_rows(qpg, qpt, Dp, mem, cnt, Dp);
        gemm_nn(cnt, w, Dp, qpg, Dp, kpt.data() + (pk * lay.w_total + lay.blk_woff[g]) * Dp, w,
                sp, w, false);
        for (int64_t a = 0; a < cnt; ++a) {
          const int64_t i = mem[a];
          const int64_t valid = visible_keys(n, pos0 + i, lay.blk, len);
          online_normaliser_add(sp + a * w, w, valid, scale_p, s.ms[i], s.ls[i]);
        }
      }
      for (int64_t i = 0; i < tt; ++i)
        lse_s[hp * T + t0 + i] = s.ls[i] > 0.f || std::isnan(s.ls[i]) ? s.ms[i] + std::log(s.ls[i]) : kNegInf;
    });
  }

  // ---- key-block items ------------------------------------------------------------------------
  // Tokens per chunk: about 256 gathered rows, so the score tiles stay in L2.
  const int64_t ct_max = std::max<int64_t>(4, 256 / mc_max);
  struct Work {
    Buf qg, dog, s, dp, dqg, tch, qpg, sp, dqpg;
    std::vector<int64_t> tok, valid;
    std::vector<float> lse_r, di_r;
  };
  std::vector<Work> work(team.size());
  for (auto& wk : work) {
    wk.tok.resize(ct_max);
    wk.valid.resize(ct_max);
    wk.lse_r.resize(ct_max * mc_max);
    wk.di_r.resize(ct_max * mc_max);
  }

  auto process_block = [&](int64_t g, const std::function<TokenSpan(int)>& span_of, int worker) {
    Work& wk = work[worker];
    const int64_t rows_max = ct_max * mc_max;
    float* qg = wk.qg.get(rows_max * Dq);     // [rows, Dq] gathered q
    float* dog = wk.dog.get(rows_max * Dvp);  // [rows, Dvp] gathered dO
    float* s = wk.s.get(rows_max * wmax);     // [rows, w] scores, then P
    float* dp = wk.dp.get(rows_max * wmax);   // [rows, w] dP, then dS
    float* dqg = wk.dqg.get(rows_max * Dq);   // [rows, Dq]
    float* tch = wk.tch.get(ct_max * wmax);   // [ct, w] sum of the group's P
    float* qpg = wk.qpg.get(ct_max * Dpp);    // [ct, Dpp]
    float* sp = wk.sp.get(ct_max * wmax);     // [ct, w] proxy scores, then dS_proxy
    float* dqpg = wk.dqpg.get(ct_max * Dpp);  // [ct, Dpp]

    const int64_t n = g - lay.blk_base[lay.blk_seq[g]];
    const int64_t sg = lay.blk_start[g], len = lay.blk_len[g], w = lay.blk_w[g];
    const int64_t woff = lay.blk_woff[g];
    const float inv_m = 1.f / static_cast<float>(m);

    for (int hp = 0; hp < Hp; ++hp) {
      const TokenSpan span = span_of(hp);
      const int pk = p.proxy_key_head(hp);
      for (int64_t c0 = 0; c0 < span.count; c0 += ct_max) {
        const int64_t ct = std::min(ct_max, span.count - c0);
        for (int64_t i = 0; i < ct; ++i) {
          wk.tok[i] = span.at(c0 + i);
          wk.valid[i] = visible_keys(n, lay.pos(wk.tok[i]), lay.blk, len);
        }
        std::fill(tch, tch + ct * w, 0.f);

        for (const HeadRange& hr : ranges[hp]) {
          const int mc = hr.h1 - hr.h0;
          const int64_t rows = ct * mc;
          for (int64_t i = 0; i < ct; ++i) {
            const int64_t t = wk.tok[i];
            for (int hh = 0; hh < mc; ++hh) {
              const int h = hr.h0 + hh;
              const int64_t r = i * mc + hh;
              load_f32_padded(p.q, p.dtype, (t * H + h) * D, D, Dq, qg + r * Dq);
              load_f32_padded(p.d_o, p.dtype, (t * H + h) * Dv, Dv, Dvp, dog + r * Dvp);
              wk.lse_r[r] = p.lse[h * T + t];
              wk.di_r[r] = di[h * T + t];
            }
          }
          gemm_nn(rows, w, D, qg, Dq, kt.data() + (hr.c * lay.w_total + woff) * D, w, s, w, false);
          gemm_nn(rows, w, Dv, dog, Dvp, vt.data() + (hr.c * lay.w_total + woff) * Dv, w, dp, w,
                  false);
          for (int64_t i = 0; i < ct; ++i) {
            float* ti = tch + i * w;
            for (int hh = 0; hh < mc; ++hh) {
              const int64_t r = i * mc + hh;
              float* sr = s + r * w;
              float* dr = dp + r * w;
              const float lr = wk.lse_r[r], dr_i = wk.di_r[r];
              for (int64_t j = 0; j < w; j += kW) {
                const vf x = vselect(lanes_below(j, wk.valid[i]), vload(sr + j) * scale - lr,
                                     vset1(kNegInf));
                const vf pr = vexp(x);
                vstore(sr + j, pr);
                vstore(dr + j, pr * (vload(dr + j) - dr_i) * scale);
                vstore(ti + j, vload(ti + j) + pr);
              }
            }
          }
          // dV_g += P^T dO, dK_g += dS^T Q (rows of g only: len, never the padded columns).
          gemm_tn(len, Dvp, rows, s, w, dog, Dvp, dv32.data() + (hr.c * T + sg) * Dvp, Dvp, true);
          gemm_tn(len, Dq, rows, dp, w, qg, Dq, dk32.data() + (hr.c * T + sg) * Dq, Dq, true);
          // dQ rows = dS K_g, added to rows that only this item touches in this phase.
          gemm_nn(rows, Dq, len, dp, w, kf.data() + (hr.c * T + sg) * Dq, Dq, dqg, Dq, false);
          for (int64_t i = 0; i < ct; ++i)
            for (int hh = 0; hh < mc; ++hh)
              vadd_into(dq32.data() + (wk.tok[i] * H + hr.h0 + hh) * Dq, dqg + (i * mc + hh) * Dq,
                        Dq);
        }

        // Proxy: student Qs against the detached teacher Tch = mean of the group's P.
        for (int64_t i = 0; i < ct; ++i)
          load_f32_padded(p.qp, p.dtype, (wk.tok[i] * Hp + hp) * Dp, Dp, Dpp, qpg + i * Dpp);
        gemm_nn(ct, w, Dp, qpg, Dpp, kpt.data() + (pk * lay.w_total + woff) * Dp, w, sp, w, false);
        for (int64_t i = 0; i < ct; ++i) {
          const int64_t t = wk.tok[i];
          const float ls = lse_s[hp * T + t];
          float* si = sp + i * w;
          const float* ti = tch + i * w;
          vf kl = vset1(0.f);
          for (int64_t j = 0; j < w; j += kW) {
            const vi mask = lanes_below(j, wk.valid[i]);
            const vf log_q = vload(si + j) * scale_p - ls;
            const vf qs = vexp(vselect(mask, log_q, vset1(kNegInf)));
            const vf te = vload(ti + j) * inv_m;
            vstore(si + j, vselect(mask, (qs - te) * coef, vset1(0.f)));
            if (want_kl) kl += kl_lanes(mask, te, log_q);
          }
          if (want_kl) kl_terms[hp * T + t] += hsum(kl);
        }
        gemm_nn(ct, Dpp, len, sp, w, kpf.data() + (pk * T + sg) * Dpp, Dpp, dqpg, Dpp, false);
        for (int64_t i = 0; i < ct; ++i)
          vadd_into(dqp32.data() + (wk.tok[i] * Hp + hp) * Dpp, dqpg + i * Dpp, Dpp);
        gemm_tn(len, Dpp, ct, sp, w, qpg, Dpp, dkp32.data() + (pk * T + sg) * Dpp, Dpp, true);
      }
    }
  };

  if (dense) {
    std::vector<int64_t> items;
    for (int64_t d = 0; d < lay.max_blocks; ++d) {
      items.clear();
      for (int64_t gq = 0; gq < G; ++gq)
        if (gq - lay.blk_base[lay.blk_seq[gq]] >= d) items.push_back(gq);
      team.run(static_cast<int64_t>(items.size()), [&](int64_t it, int worker) {
        const int64_t gq = items[it];
        TokenSpan span;
        span.first = lay.blk_start[gq];
        span.count = lay.blk_len[gq];
        process_block(gq - d, [&](int) { return span; }, worker);
      });
    }
  } else {
    // Per phase: counting sort of (proxy head, token) by key block, keyed (g, hp).
    std::vector<int64_t> off(static_cast<size_t>(G) * Hp + 1);
    std::vector<int32_t> toks(static_cast<size_t>(Hp) * T);
    std::vector<int64_t> items;
    for (int k = 0; k < K; ++k) {
      std::fill(off.begin(), off.end(), 0);
      auto key_of = [&](int hp, int64_t t) -> int64_t {
        const int32_t v = p.block_idx[(static_cast<int64_t>(hp) * T + t) * K + (k + t) % K];
        return v < 0 ? -1 : (lay.blk_base[lay.seq_of[t]] + v) * Hp + hp;
      };
      for (int hp = 0; hp < Hp; ++hp)
        for (int64_t t = 0; t < T; ++t) {
          const int64_t key = key_of(hp, t);
          if (key >= 0) ++off[key + 1];
        }
      for (size_t i = 1; i < off.size(); ++i) off[i] += off[i - 1];
      {
        std::vector<int64_t> fill(off.begin(), off.end() - 1);
        for (int hp = 0; hp < Hp; ++hp)
          for (int64_t t = 0; t < T; ++t) {
            const int64_t key = key_of(hp, t);
            if (key >= 0) toks[fill[key]++] = static_cast<int32_t>(t);
          }
      }
      items.clear();
      for (int64_t g = 0; g < G; ++g)
        if (off[(g + 1) * Hp] > off[g * Hp]) items.push_back(g);
      // Biggest first, for balance; ownership makes the order irrelevant to the result.
      std::stable_sort(items.begin(), items.end(), [&](int64_t a, int64_t b) {
        return off[(a + 1) * Hp] - off[a * Hp] > off[(b + 1) * Hp] - off[b * Hp];
      });
      team.run(static_cast<int64_t>(items.size()), [&](int64_t it, int worker) {
        const int64_t g = items[it];
        process_block(
            g,
            [&](int hp) {
              TokenSpan span;
              span.list = toks.data() + off[g * Hp + hp];
              span.count = off[g * Hp + hp + 1] - off[g * Hp + hp];
              return span;
            },
            worker);
      });
    }
  }

  // ---- outputs in the input dtype --------------------------------------------------------------
  constexpr int64_t kChunk = 64;
  team.run((T + kChunk - 1) / kChunk, [&](int64_t item, int) {
    const int64_t t1 = std::min(T, (item + 1) * kChunk);
    for (int64_t t = item * kChunk; t < t1; ++t) {
      for (int h = 0; h < H; ++h)
        store_f32(dq32.data() + (t * H + h) * Dq, D, p.dq, p.dtype, (t * H + h) * D);
      for (int c = 0; c < Hkv; ++c) {
        store_f32(dk32.data() + (c * T + t) * Dq, D, p.dk, p.dtype, (t * Hkv + c) * D);
        store_f32(dv32.data() + (c * T + t) * Dvp, Dv, p.dv, p.dtype, (t * Hkv + c) * Dv);
      }
      for (int hp = 0; hp < Hp; ++hp)
        store_f32(dqp32.data() + (t * Hp + hp) * Dpp, Dp, p.dqp, p.dtype, (t * Hp + hp) * Dp);
      for (int pk = 0; pk < Hpk; ++pk)
        store_f32(dkp32.data() + (pk * T + t) * Dpp, Dp, p.dkp, p.dtype, (t * Hpk + pk) * Dp);
    }
  });
  write_kl(p, kl_terms);
}
