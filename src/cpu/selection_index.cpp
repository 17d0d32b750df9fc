// The CPU backend's build of a caller's selection index (selection_index_layout.h). The CPU
// attention does not read the index; this build writes the array the CUDA build writes (a stable
// sort by key, entries of unseen blocks and padding as the sentinel key past every list), so a
// caller's code runs unchanged on either device and the GPU build has a bytewise reference.
#include <algorithm>
#include <vector>

#include "params.h"
#include "selection_index_layout.h"

namespace flashmsa::cpu {

void build_selection_index(const MsaParams& p, int32_t* index) {
  const SelectionIndexLayout l = selection_index_layout(p.T, p.B, p.Hp, p.top_k, p.block_size);
  std::fill(index, index + l.size, 0);
  const int32_t* cu = p.cu_seqlens_host;
  int32_t* blk_off = index + l.blk_off;
  int32_t* blk_seq = index + l.blk_seq;
  int32_t* vals = index + l.vals;
  int32_t* seg = index + l.seg;
  int32_t nb = 0;
  for (int b = 0; b < p.B; ++b) {
    blk_off[b] = nb;
    const int32_t blocks = (cu[b + 1] - cu[b] + p.block_size - 1) / p.block_size;
    for (int32_t i = 0; i < blocks; ++i) blk_seq[nb + i] = b;
    nb += blocks;
  }
  blk_off[p.B] = nb;

  // Keys in entry order (p, t, slot), so a counting sort is stable as the CUDA radix sort is.
  const int64_t K = p.top_k, n = p.Hp * p.T * K, nkeys = static_cast<int64_t>(p.Hp) * nb;
  std::vector<int64_t> keys(static_cast<size_t>(n));
  std::vector<int64_t> start(static_cast<size_t>(nkeys) + 2, 0);
  for (int hp = 0; hp < p.Hp; ++hp)
    for (int b = 0; b < p.B; ++b)
      for (int64_t t = cu[b]; t < cu[b + 1]; ++t) {
        const int64_t own = (t - cu[b]) / p.block_size;
        for (int64_t slot = 0; slot < K; ++slot) {
          const int64_t i = (hp * p.T + t) * K + slot;
          const int32_t blk = p.block_idx[i];
          keys[i] = blk >= 0 && blk <= own ? static_cast<int64_t>(hp) * nb + blk_off[b] + blk : nkeys;
          ++start[keys[i] + 1];
        }
      }
  for (int64_t key = 0; key <= nkeys; ++key) {
    start[key + 1] += start[key];
    seg[key] = static_cast<int32_t>(start[key]);
  }
  for (int64_t i = 0; i < n; ++i) vals[start[keys[i]]++] = static_cast<int32_t>(i % (p.T * K));
}

}  // namespace flashmsa::cpu
