// Main attention forward and the KL value (msa.md steps 5-6), sparse or dense warm-up.
// Included once per ISA after isa_kernels.h.
//
// Query-tile major: one work item is (proxy head p, query block), processed in tiles of up to
// TT tokens with the m main heads of group p. For each key block that any token of the tile
// selected, the (token, head) rows that attend to it are gathered into one GEMM
// [rows x D] x [D x BLK], so a K/V block is read once per tile instead of once per token (with
// m = 4 the per-token GEMM was bound by reading K and V from L3). Rows visit their blocks in
// ascending order with an online softmax, and every output row belongs to the item (no
// cross-thread reduction). The KL needs the final P of all m heads of a token, so it is a
// second sweep once lse is known. In sparse mode the first sweep keeps its exponentials per
// (token, selected block) with the running max they were taken against (the tile is sized so
// this cache stays a few MB), and the second sweep only rescales them by exp(max - lse): no
// GEMM and no exp. Dense mode (or a cache that would not fit) recomputes the scores instead,
// so memory stays O(TT * m * BLK) per thread whatever the sequence length.

namespace {

// Heads [h0, h1) of a proxy group that share kv head c (the group may span several kv heads).
struct HeadRange {
  int c, h0, h1;
};

inline std::vector<HeadRange> group_ranges(const MsaParams& p, int hp) {
  std::vector<HeadRange> out;
  const int m = p.group_size();
  for (int h = hp * m; h < (hp + 1) * m; ++h) {
    const int c = p.kv_head(h);
    if (out.empty() || out.back().c != c) out.push_back({c, h, h + 1});
    else out.back().h1 = h + 1;
  }
  return out;
}

// Key blocks (ascending, within the sequence) that token t of proxy head hp attends to.
inline int64_t blocks_of(const MsaParams& p, bool dense, int hp, int64_t t, int64_t nloc,
                         int32_t* out) {
  if (dense) {
    for (int64_t n = 0; n <= nloc; ++n) out[n] = static_cast<int32_t>(n);
    return nloc + 1;
  }
  const int32_t* row = p.block_idx + (static_cast<int64_t>(hp) * p.T + t) * p.top_k;
  int64_t nb = 0;
  for (int k = 0; k < p.top_k && row[k] >= 0; ++k) out[nb++] = row[k];
  return nb;
}

// Keys of block n visible to a query at position tl of its sequence (causal inside the block).
inline int64_t visible_keys(int64_t n, int64_t tl, int blk, int64_t len) {
  return n == tl / blk ? tl - n * blk + 1 : len;
}

// The selections of a tile of tokens (all in query block nq) inverted: for each key block n in
// 0..nq, the tile-local indices of the tokens that attend to it, ascending.
struct TileLists {
  std::vector<int32_t> list, nsel, cnt, members, slot;  // slot: index in the token's own list
  std::vector<int64_t> off;

  void build(const MsaParams& p, bool dense, int hp, int64_t t0, int64_t tt, int64_t nq,
             int64_t max_list) {
    list.resize(tt * max_list);
    nsel.resize(tt);
    cnt.assign(nq + 1, 0);
    off.resize(nq + 2);
    for (int64_t i = 0; i < tt; ++i) {
      int32_t* li = list.data() + i * max_list;
      nsel[i] = static_cast<int32_t>(blocks_of(p, dense, hp, t0 + i, nq, li));
      for (int32_t k = 0; k < nsel[i]; ++k) ++cnt[li[k]];
    }
    off[0] = 0;
    for (int64_t n = 0; n <= nq; ++n) off[n + 1] = off[n] + cnt[n];
    members.resize(off[nq + 1]);
    slot.resize(off[nq + 1]);
    std::fill(cnt.begin(), cnt.end(), 0);
    for (int64_t i = 0; i < tt; ++i) {
      const int32_t* li = list.data() + i * max_list;
      for (int32_t k = 0; k < nsel[i]; ++k) {
        const int64_t at = off[li[k]] + cnt[li[k]]++;
        members[at] = static_cast<int32_t>(i);
        slot[at] = k;
      }
    }
  }
  int64_t count(int64_t n) const { return off[n + 1] - off[n]; }
  const int32_t* tokens(int64_t n) const { return members.data() + off[n]; }
};

}  // namespace

void attention_forward(const MsaParams& p, const Layout& lay, Team& team, bool dense) {
  const int H = p.H, Hp = p.Hp, m = p.group_size(), D = p.D, Dv = p.Dv, Dp = p.Dp;
  const int64_t T = p.T, G = lay.G;
  const int64_t Dvp = round_up(Dv, kColTile);
  const float scale = p.scale, scale_p = p.proxy_scale;
  const float inv_m = 1.f / static_cast<float>(m);
  const bool want_kl = p.kl != nullptr;

  std::vector<float> kt = build_panels(p.k, p.dtype, p.Hkv, D, lay, team);         // [D][w]
  std::vector<float> vrows = build_rows(p.v, p.dtype, p.Hkv, Dv, Dvp, lay, team);  // [Hkv][T][Dvp]
  std::vector<float> kpt;
  if (want_kl) kpt = build_panels(p.kp, p.dtype, p.Hpk, Dp, lay, team);
  std::vector<float> kl_terms(want_kl ? static_cast<size_t>(Hp) * T : 0);

  std::vector<std::vector<HeadRange>> ranges(Hp);
  for (int hp = 0; hp < Hp; ++hp) ranges[hp] = group_ranges(p, hp);

  const int64_t wmax = max_block_width(p, lay);
  const int64_t max_list = dense ? std::max<int64_t>(lay.max_blocks, 1) : p.top_k;
  // Tokens per tile: about 1024 (token, head) rows of state, so the tile stays near L2; with the
  // KL cache (m * K * w floats per token) also at most ~4 MB of cached exponentials.
  const int64_t per_token_cache = static_cast<int64_t>(m + 1) * p.top_k * wmax;
  int64_t tt_max = std::min<int64_t>(lay.blk, std::max<int64_t>(8, 1024 / m));
  const bool cache_kl = want_kl && !dense && per_token_cache * 8 * 4 <= (int64_t(4) << 20);
  if (cache_kl) tt_max = std::min(tt_max, std::max<int64_t>(8, (int64_t(4) << 20) / (per_token_cache * 4)));
  const int64_t rows_max = tt_max * m;
  const int K = p.top_k;

  struct Scratch {
    Buf qt, qg, s, og, acc, qpt, qpg, sp, tch, row, pc, spc, mblk;
    std::vector<float> mx, l, lse_r, ms, ls, lse_s, kl, factor;
    TileLists tl;
  };
  std::vector<Scratch> scratch(team.size());

  team.run(static_cast<int64_t>(Hp) * G, [&](int64_t item, int worker) {
    const QueryBlockItem qb(p, lay, item);
    const int hp = qb.hp, pk = qb.pk, b = qb.b, hb = hp * m;
    const int64_t gq = qb.gq, nq = qb.nq;
    Scratch& sc = scratch[worker];
    float* qt = sc.qt.get(rows_max * D);       // [tt][m][D] the tile's queries
    float* qg = sc.qg.get(rows_max * D);       // [rows][D] gathered for one key block
    float* s = sc.s.get(rows_max * wmax);      // [rows][w] scores, then P
    float* og = sc.og.get(rows_max * Dvp);     // [rows][Dvp] P V of one key block
    float* acc = sc.acc.get(rows_max * Dvp);   // [tt][m][Dvp] output accumulators
    float* qpt = sc.qpt.get(tt_max * Dp);      // [tt][Dp]
    float* qpg = sc.qpg.get(tt_max * Dp);      // [cnt][Dp]
    float* sp = sc.sp.get(tt_max * wmax);      // [cnt][w] proxy scores
    float* tch = sc.tch.get(tt_max * wmax);    // [cnt][w] teacher (sum of the group's P)
    float* row = sc.row.get(Dvp);
    // KL cache (sparse mode): exponentials [tt][K][m][wmax], the max each was taken against
    // [tt][K][m], proxy scores [tt][K][wmax].
    float* pc = cache_kl ? sc.pc.get(tt_max * K * m * wmax) : nullptr;
    float* mblk = cache_kl ? sc.mblk.get(tt_max * K * m) : nullptr;
    float* spc = cache_kl ? sc.spc.get(tt_max * K * wmax) : nullptr;
    sc.factor.resize(m);
    sc.mx.resize(rows_max);
    sc.l.resize(rows_max);
    sc.lse_r.resize(rows_max);
    sc.ms.resize(tt_max);
    sc.ls.resize(tt_max);
    sc.lse_s.resize(tt_max);
    sc.kl.resize(tt_max);
    float* mx = sc.mx.data();
    float* l = sc.l.data();
    float* lse_r = sc.lse_r.data();

    const int64_t qb0 = lay.blk_start[gq], qb1 = qb0 + lay.blk_len[gq];
    for (int64_t t0 = qb0; t0 < qb1; t0 += tt_max) {
      const int64_t tt = std::min(tt_max, qb1 - t0);
      const int64_t pos0 = lay.pos(t0);  // position of the tile's first token
      for (int64_t i = 0; i < tt; ++i) {
        load_f32(p.q, p.dtype, ((t0 + i) * H + hb) * D, static_cast<int64_t>(m) * D, qt + i * m * D);
        if (want_kl) load_f32(p.qp, p.dtype, ((t0 + i) * Hp + hp) * Dp, Dp, qpt + i * Dp);
      }
      const TileLists& tl = sc.tl;
      sc.tl.build(p, dense, hp, t0, tt, nq, max_list);

      std::fill(mx, mx + tt * m, kNegInf);
      std::fill(l, l + tt * m, 0.f);
      std::fill(acc, acc + tt * m * Dvp, 0.f);
      std::fill(sc.ms.begin(), sc.ms.end(), kNegInf);
      std::fill(sc.ls.begin(), sc.ls.end(), 0.f);

      // Visible keys of block n for tile token i (causal only inside the query's own block).
      auto valid_of = [&](int64_t n, int64_t len, int64_t i) {
        return visible_keys(n, pos0 + i, lay.blk, len);
      };
      // Scores of tile tokens mem[0..cnt) against the key block at panel offset woff (width w):
      // heads hr of the group into s [cnt * mc][w], or the proxy head into sp [cnt][w].
      auto main_scores = [&](const HeadRange& hr, const int32_t* mem, int64_t cnt, int64_t woff,
                             int64_t w) {
        const int mc = hr.h1 - hr.h0;
        gather_rows(qg, qt + (hr.h0 - hb) * D, static_cast<int64_t>(m) * D, mem, cnt, mc * D);
        gemm_nn(cnt * mc, w, D, qg, D, kt.data() + (hr.c * lay.w_total + woff) * D, w, s, w, false);
      };
      auto proxy_scores = [&](const int32_t* mem, int64_t cnt, int64_t woff, int64_t w) {
        gather_rows(qpg, qpt, Dp, mem, cnt, Dp);
        gemm_nn(cnt, w, Dp, qpg, Dp, kpt.data() + (pk * lay.w_total + woff) * Dp, w, sp, w, false);
      };

      // ---- sweep 1: online softmax, o, lse; the student's normaliser -----------------------
      for (int64_t n = 0; n <= nq; ++n) {
        const int64_t cnt = tl.count(n);
        if (cnt == 0) continue;
        const int32_t* mem = tl.tokens(n);
        const int32_t* slot = tl.slot.data() + tl.off[n];
        const int64_t g = lay.blk_base[b] + n;
        const int64_t w = lay.blk_w[g], woff = lay.blk_woff[g], sg = lay.blk_start[g];
        const int64_t len = lay.blk_len[g];
        for (const HeadRange& hr : ranges[hp]) {
          const int mc = hr.h1 - hr.h0;
          const int64_t rows = cnt * mc;
          main_scores(hr, mem, cnt, woff, w);
          for (int64_t a = 0; a < cnt; ++a) {
            const int64_t valid = valid_of(n, len, mem[a]);
            for (int hh = 0; hh < mc; ++hh) {
              const int64_t R = mem[a] * m + (hr.h0 - hb) + hh;  // tile row
              float* sr = s + (a * mc + hh) * w;
              const float mnew = std::max(mx[R], max_masked(sr, w, valid) * scale);
              const float alpha = std::exp(mx[R] - mnew);
              vf sum = vset1(0.f);
              for (int64_t j = 0; j < w; j += kW) {
                const vf e = vexp(vselect(lanes_below(j, valid), vload(sr + j) * scale - mnew,
                                          vset1(kNegInf)));
                vstore(sr + j, e);
                sum += e;
              }
              l[R] = l[R] * alpha + hsum(sum);
              if (alpha != 1.f) vscale(acc + R * Dvp, Dvp, alpha);
              mx[R] = mnew;
              if (cache_kl) {
                const int64_t c = (static_cast<int64_t>(mem[a]) * K + slot[a]) * m + (hr.h0 - hb) + hh;
                std::memcpy(pc + c * wmax, sr, sizeof(float) * w);
                mblk[c] = mnew;
              }
            }
          }
          gemm_nn(rows, Dvp, len, s, w, vrows.data() + (hr.c * T + sg) * Dvp, Dvp, og, Dvp, false);
          for (int64_t a = 0; a < cnt; ++a)
            for (int hh = 0; hh < mc; ++hh)
              vadd_into(acc + (mem[a] * m + (hr.h0 - hb) + hh) * Dvp, og + (a * mc + hh) * Dvp, Dvp);
        }
        if (want_kl) {
          proxy_scores(mem, cnt, woff, w);
          for (int64_t a = 0; a < cnt; ++a) {
            const int64_t i = mem[a];
            const int64_t valid = valid_of(n, len, i);
            const float* si = sp + a * w;
            online_normaliser_add(si, w, valid, scale_p, sc.ms[i], sc.ls[i]);
            if (cache_kl) std::memcpy(spc + (i * K + slot[a]) * wmax, si, sizeof(float) * w);
          }
        }
      }

      for (int64_t i = 0; i < tt; ++i) {
        const int64_t t = t0 + i;
        for (int r = 0; r < m; ++r) {
          const int64_t R = i * m + r;
          const int h = hb + r;
          // A NaN sum (a non-finite input: max_masked skips NaN scores, the exponentials do not) is
          // carried into o and lse like any other value, not taken for an empty row.
          if (l[R] > 0.f || std::isnan(l[R])) {
            const float inv = 1.f / l[R];
            for (int64_t d = 0; d < Dv; ++d) row[d] = acc[R * Dvp + d] * inv;
            lse_r[R] = mx[R] + std::log(l[R]);
          } else {  // no key at all (an empty block_idx row): nothing to average
            std::fill(row, row + Dv, 0.f);
            lse_r[R] = kNegInf;
          }
          store_f32(row, Dv, p.o, p.dtype, (t * H + h) * Dv);
          p.lse[h * T + t] = lse_r[R];
        }
        sc.lse_s[i] = sc.ls[i] > 0.f || std::isnan(sc.ls[i]) ? sc.ms[i] + std::log(sc.ls[i]) : kNegInf;
        sc.kl[i] = 0.f;
      }
      if (!want_kl) continue;

      if (cache_kl) {  // ---- sweep 2 from the cache: rescale, no GEMM, no exp ----------------
        for (int64_t i = 0; i < tt; ++i) {
          const int32_t* li = tl.list.data() + i * max_list;
          float kl = 0.f;
          for (int32_t k = 0; k < tl.nsel[i]; ++k) {
            const int64_t n = li[k];
            const int64_t g = lay.blk_base[b] + n;
            const int64_t w = lay.blk_w[g];
            const int64_t valid = valid_of(n, lay.blk_len[g], i);
            const int64_t c0 = (i * K + k) * m;
            for (int r = 0; r < m; ++r)
              sc.factor[r] = std::exp(mblk[c0 + r] - lse_r[i * m + r]) * inv_m;
            const float* probs = pc + c0 * wmax;
            const float* si = spc + (i * K + k) * wmax;
            vf klv = vset1(0.f);
            for (int64_t j = 0; j < w; j += kW) {
              const vi mask = lanes_below(j, valid);
              vf te = vset1(0.f);
              for (int r = 0; r < m; ++r) te += vload(probs + r * wmax + j) * sc.factor[r];
              klv += kl_lanes(mask, te, vload(si + j) * scale_p - sc.lse_s[i]);
            }
            kl += hsum(klv);
          }
          kl_terms[hp * T + t0 + i] = kl;
        }
        continue;
      }

      // ---- sweep 2: exact P against lse, the teacher, KL per token ----------------------------
      for (int64_t n = 0; n <= nq; ++n) {
        const int64_t cnt = tl.count(n);
        if (cnt == 0) continue;
        const int32_t* mem = tl.tokens(n);
        const int64_t g = lay.blk_base[b] + n;
        const int64_t w = lay.blk_w[g], woff = lay.blk_woff[g], len = lay.blk_len[g];
        std::fill(tch, tch + cnt * w, 0.f);
        for (const HeadRange& hr : ranges[hp]) {
          const int mc = hr.h1 - hr.h0;
          main_scores(hr, mem, cnt, woff, w);
          for (int64_t a = 0; a < cnt; ++a) {
            const int64_t valid = valid_of(n, len, mem[a]);
            float* ta = tch + a * w;
            for (int hh = 0; hh < mc; ++hh) {
              const float lr = lse_r[mem[a] * m + (hr.h0 - hb) + hh];
              const float* sr = s + (a * mc + hh) * w;
              for (int64_t j = 0; j < w; j += kW)
                vstore(ta + j, vload(ta + j) + vexp(vselect(lanes_below(j, valid),
                                                            vload(sr + j) * scale - lr,
                                                            vset1(kNegInf))));
            }
          }
        }
        proxy_scores(mem, cnt, woff, w);
        for (int64_t a = 0; a < cnt; ++a) {
          const int64_t i = mem[a];
          const int64_t valid = valid_of(n, len, i);
          const float* ta = tch + a * w;
          const float* si = sp + a * w;
          vf klv = vset1(0.f);
          for (int64_t j = 0; j < w; j += kW) {
            const vi mask = lanes_below(j, valid);
            klv += kl_lanes(mask, vload(ta + j) * inv_m, vload(si + j) * scale_p - sc.lse_s[i]);
          }
          sc.kl[i] += hsum(klv);
        }
      }
      for (int64_t i = 0; i < tt; ++i) kl_terms[hp * T + t0 + i] = sc.kl[i];
    }
  });
  write_kl(p, kl_terms);
}
