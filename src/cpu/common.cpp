// ISA-neutral helpers of the CPU backend (see common.h).
#include "cpu/common.h"

#include <string>

namespace flashmsa {
namespace cpu {

// ---------------------------------------------------------------------------------------------
// Team

Team::Team(int num_threads) : size_(std::max(1, num_threads)) {
  threads_.reserve(size_ - 1);
  for (int w = 1; w < size_; ++w) threads_.emplace_back([this, w] { worker_loop(w); });
}

Team::~Team() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void Team::drain(int worker) {
  for (;;) {
    const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= n_items_) return;
    try {
      (*fn_)(i, worker);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
      next_.store(n_items_, std::memory_order_relaxed);  // stop handing out work
    }
  }
}

void Team::worker_loop(int worker) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    drain(worker);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--busy_ == 0) done_cv_.notify_one();
    }
  }
}

void Team::run(int64_t n_items, const std::function<void(int64_t, int)>& fn) {
  if (n_items <= 0) return;
  if (size_ == 1 || n_items == 1) {
    for (int64_t i = 0; i < n_items; ++i) fn(i, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_items_ = n_items;
    next_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    busy_ = size_ - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  drain(0);
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return busy_ == 0; });
    fn_ = nullptr;
    err = error_;
  }
  if (err) std::rethrow_exception(err);
}

int resolve_threads(int requested) {
  if (requested > 0) return requested;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

// ---------------------------------------------------------------------------------------------
// Layout

Layout::Layout(const MsaParams& p) : T(p.T), B(p.B), blk(p.block_size) {
  const int32_t* cu = p.cu_seqlens_host;
  seq_of.resize(T);
  seq_start.resize(B + 1);
  blk_base.resize(B + 1);
  int64_t g = 0;
  for (int b = 0; b < B; ++b) {
    seq_start[b] = cu[b];
    blk_base[b] = g;
    const int64_t len = cu[b + 1] - cu[b];
    const int64_t nb = (len + blk - 1) / blk;
    max_blocks = std::max(max_blocks, nb);
    g += nb;
    for (int64_t t = cu[b]; t < cu[b + 1]; ++t) seq_of[t] = b;
  }
  seq_start[B] = cu[B];
  blk_base[B] = g;
  G = g;
  blk_seq.resize(G);
  blk_start.resize(G);
  blk_len.resize(G);
  blk_w.resize(G);
  blk_woff.resize(G);
  int64_t woff = 0;
  for (int b = 0; b < B; ++b) {
    for (int64_t i = blk_base[b]; i < blk_base[b + 1]; ++i) {
      const int64_t n = i - blk_base[b];
      const int64_t start = seq_start[b] + n * blk;
      const int64_t len = std::min<int64_t>(blk, seq_start[b + 1] - start);
      blk_seq[i] = b;
      blk_start[i] = start;
      blk_len[i] = static_cast<int32_t>(len);
      blk_w[i] = static_cast<int32_t>(round_up(len, kColTile));
      blk_woff[i] = woff;
      woff += blk_w[i];
    }
  }
  w_total = woff;
}

std::vector<float> build_panels(const void* x, DType dt, int Hx, int Dx, const Layout& lay,
                                Team& team) {
  std::vector<float> out(static_cast<size_t>(Hx) * lay.w_total * Dx);
  const int64_t G = lay.G;
  team.run(static_cast<int64_t>(Hx) * G, [&](int64_t item, int) {
    const int c = static_cast<int>(item / G);
    const int64_t g = item % G;
    const int64_t w = lay.blk_w[g], len = lay.blk_len[g], start = lay.blk_start[g];
    float* panel = out.data() + (static_cast<int64_t>(c) * lay.w_total + lay.blk_woff[g]) * Dx;
    std::vector<float> row(Dx);
    for (int64_t j = 0; j < w; ++j) {
      if (j < len) load_f32(x, dt, ((start + j) * Hx + c) * Dx, Dx, row.data());
      else std::fill(row.begin(), row.end(), 0.f);
      for (int d = 0; d < Dx; ++d) panel[d * w + j] = row[d];
    }
  });
  return out;
}

std::vector<float> build_rows(const void* x, DType dt, int Hx, int Dx, int Dxp, const Layout& lay,
                              Team& team) {
  std::vector<float> out(static_cast<size_t>(Hx) * lay.T * Dxp);
  constexpr int64_t kChunk = 256;
  const int64_t chunks = (lay.T + kChunk - 1) / kChunk;
  team.run(static_cast<int64_t>(Hx) * chunks, [&](int64_t item, int) {
    const int c = static_cast<int>(item / chunks);
    const int64_t t0 = (item % chunks) * kChunk, t1 = std::min(lay.T, t0 + kChunk);
    for (int64_t t = t0; t < t1; ++t)
      load_f32_padded(x, dt, (t * Hx + c) * Dx, Dx, Dxp,
                      out.data() + (static_cast<int64_t>(c) * lay.T + t) * Dxp);
  });
  return out;
}

void check_block_idx_contents(const MsaParams& p, const Layout& lay) {
  const int K = p.top_k;
  for (int hp = 0; hp < p.Hp; ++hp) {
    for (int64_t t = 0; t < p.T; ++t) {
      const int32_t* row = p.block_idx + (static_cast<int64_t>(hp) * p.T + t) * K;
      const int64_t nloc = lay.pos(t) / lay.blk;
      int64_t prev = -1;
      bool padding = false;
      for (int k = 0; k < K; ++k) {
        const int32_t v = row[k];
        bool ok;
        if (v < 0) {
          ok = v == -1;
          padding = true;
        } else {
          ok = !padding && v > prev && v <= nloc;
          prev = v;
        }
        if (!ok)
          throw Error("flashmsa: argument 'block_idx' row (proxy head " + std::to_string(hp) +
                      ", token " + std::to_string(t) + ") must hold strictly ascending block " +
                      "indices in [0, " + std::to_string(nloc) +
                      "] followed only by -1 padding; found " + std::to_string(v) +
                      " at position " + std::to_string(k));
      }
    }
  }
}

void write_kl(const MsaParams& p, const std::vector<float>& kl_terms) {
  if (p.kl == nullptr) return;
  if (p.T == 0) {
    *p.kl = 0.f;
    return;
  }
  // Fixed order, double accumulator: the value does not depend on the thread count.
  double sum = 0.0;
  for (float v : kl_terms) sum += v;
  *p.kl = static_cast<float>(static_cast<double>(p.kl_coeff) * sum /
                             (static_cast<double>(p.Hp) * static_cast<double>(p.T)));
}

}  // namespace cpu
}  // namespace flashmsa
