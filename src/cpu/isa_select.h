// Block selection (msa.md forward steps 1-4). Included once per ISA after isa_kernels.h.
//
// One work item is (proxy head, query block): its <= BLK proxy queries against every candidate
// key block as a [rows x Dp] x [Dp x BLK] GEMM, the block max-pool straight from the score tile,
// then a per-row top-K. Only blocks before the forced local range are ever scored: a forced
// block is +inf whatever its score, and every earlier block is complete and fully causal-visible
// (j <= t holds for all of its keys), so no masking is needed besides the padded columns.

namespace {

// The best `r` of scores[0..f) by (score descending, index ascending), returned ascending.
// NaN counts as -inf so the order stays strict.
inline void top_r(const float* scores, int64_t f, int r, float* best_s, int32_t* best_i,
                  int32_t* out) {
  int cnt = 0;
  for (int64_t n = 0; n < f; ++n) {
    float s = scores[n];
    if (s != s) s = -std::numeric_limits<float>::infinity();
    int pos;
    if (cnt < r) {
      pos = cnt++;
    } else if (s > best_s[r - 1]) {
      pos = r - 1;
    } else {
      continue;
    }
    // Strictly-less shift keeps an earlier (lower) index ahead of an equal later score.
    while (pos > 0 && best_s[pos - 1] < s) {
      best_s[pos] = best_s[pos - 1];
      best_i[pos] = best_i[pos - 1];
      --pos;
    }
    best_s[pos] = s;
    best_i[pos] = static_cast<int32_t>(n);
  }
  for (int i = 0; i < cnt; ++i) out[i] = best_i[i];
  std::sort(out, out + cnt);
}

}  // namespace

void select_blocks(const MsaParams& p, const Layout& lay, Team& team) {
  const int K = p.top_k, L = p.local_blocks, Dp = p.Dp, Hp = p.Hp;
  const int64_t T = p.T, G = lay.G;
  std::vector<float> kpt = build_panels(p.kp, p.dtype, p.Hpk, Dp, lay, team);

  struct Scratch {
    Buf qp, s, bs, best_s;
    std::vector<int32_t> best_i;
  };
  std::vector<Scratch> scratch(team.size());
  const int64_t wmax = max_block_width(p, lay);
  constexpr int64_t kRowChunk = 128;

  // Later query blocks score more candidates: hand them out first.
  team.run(static_cast<int64_t>(Hp) * G, [&](int64_t item, int worker) {
    const QueryBlockItem qb(p, lay, item);
    const int hp = qb.hp, pk = qb.pk, b = qb.b;
    const int64_t gq = qb.gq, nq = qb.nq;
    const int64_t t0 = lay.blk_start[gq], rows_total = lay.blk_len[gq];
    int32_t* out = p.block_idx + (static_cast<int64_t>(hp) * T + t0) * K;

    if (nq + 1 <= K) {  // every visible block is selected
      for (int64_t i = 0; i < rows_total; ++i) {
        int32_t* row = out + i * K;
        for (int k = 0; k < K; ++k) row[k] = k <= nq ? k : -1;
      }
      return;
    }
    const int64_t f = std::max<int64_t>(0, nq - L + 1);  // candidates 0 .. f-1, forced f .. nq
    const int r = static_cast<int>(K - (nq - f + 1));    // candidates to pick (>= 0)
    Scratch& sc = scratch[worker];
    const int64_t rc_max = std::min<int64_t>(rows_total, kRowChunk);
    float* qp = sc.qp.get(rc_max * Dp);                       // [rows, Dp]
    float* s = sc.s.get(rc_max * wmax);                       // [rows, w]
    float* bs = sc.bs.get(rc_max * std::max<int64_t>(f, 1));  // [rows, f] block maxima
    float* best_s = sc.best_s.get(K);
    if (static_cast<int>(sc.best_i.size()) < K) sc.best_i.resize(K);

    // Row chunks bound the score tile when BLK is large.
    for (int64_t r0 = 0; r0 < rows_total; r0 += kRowChunk) {
      const int64_t rows = std::min(kRowChunk, rows_total - r0);
      if (r > 0) {
        for (int64_t i = 0; i < rows; ++i)
          load_f32(p.qp, p.dtype, ((t0 + r0 + i) * Hp + hp) * Dp, Dp, qp + i * Dp);
        for (int64_t n = 0; n < f; ++n) {
          const int64_t g = lay.blk_base[b] + n;
          const int64_t w = lay.blk_w[g], len = lay.blk_len[g];
          const float* panel =
              kpt.data() + (static_cast<int64_t>(pk) * lay.w_total + lay.blk_woff[g]) * Dp;
          gemm_nn(rows, w, Dp, qp, Dp, panel, w, s, w, false);
          for (int64_t i = 0; i < rows; ++i) {
            // scale_p > 0, so scaling the max equals the max of the scaled scores.
            bs[i * f + n] = max_masked(s + i * w, w, len) * p.proxy_scale;
          }
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        int32_t* row = out + (r0 + i) * K;
        if (r > 0) top_r(bs + i * f, f, r, best_s, sc.best_i.data(), row);
        int k = r;
        for (int64_t n = f; n <= nq; ++n) row[k++] = static_cast<int32_t>(n);
        for (; k < K; ++k) row[k] = -1;
      }
    }
  });
}
