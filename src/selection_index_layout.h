// Internal: where the four arrays of a caller's selection index (AttentionInputs::selection_index,
// built by build_selection_index) sit in its int32 buffer. The layout depends on shapes only (T,
// B, Hp, K, block size), never on cu_seqlens' values, so a framework can size the buffer from
// shapes (the PyTorch op's fake kernel repeats this formula: flashmsa/__init__.py). The key
// blocks over all sequences, NB = sum over b of ceil(len_b / BLK), are at most
// nb_max = floor((T + B (BLK - 1)) / BLK).
//   blk_off [B + 1]         first global key block of each sequence
//   blk_seq [nb_max]        the sequence of each global key block (NB used)
//   vals    [Hp T K]        the entries' t * K + slot, sorted by key (p * NB + block), stably
//   seg     [Hp nb_max + 1] list `key` is vals[seg[key], seg[key + 1]) (Hp NB + 1 used)
// Each array starts 256-byte aligned; the unused tails are zero.
#pragma once

#include <algorithm>
#include <cstdint>

namespace flashmsa {

struct SelectionIndexLayout {
  int64_t nb_max = 0;
  int64_t blk_off = 0, blk_seq = 0, vals = 0, seg = 0;  // offsets in int32 elements
  int64_t size = 0;                                     // int32 elements in all
};

inline SelectionIndexLayout selection_index_layout(int64_t T, int64_t B, int64_t Hp, int64_t K,
                                                   int64_t block_size) {
  constexpr int64_t kAlign = 64;  // int32 elements in 256 bytes
  auto padded = [](int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; };
  SelectionIndexLayout l;
  l.nb_max = (T + B * (block_size - 1)) / block_size;
  l.blk_off = 0;
  l.blk_seq = padded(B + 1);
  l.vals = l.blk_seq + padded(std::max<int64_t>(l.nb_max, 1));
  l.seg = l.vals + padded(Hp * T * K);
  l.size = l.seg + padded(Hp * l.nb_max + 1);
  return l;
}

}  // namespace flashmsa
