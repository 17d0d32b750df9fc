// The selection index (build_selection_index) on the CPU backend: its size from shapes alone, and
// its lists checked against a direct scan of block_idx, written here without the layout header.
// The GPU suite compares the CUDA build with this one bytewise (tests/gpu/test_cuda_backward.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "test_util.h"

namespace {

using flashmsa::DType;
using msatest::HostTensor;

int64_t padded64(int64_t n) { return (n + 63) / 64 * 64; }

void check_index(const std::vector<int>& lengths, int block_size, int top_k, uint64_t seed) {
  msatest::Case c;
  c.heads = {4, 2, 2, 1, 8, 8, 4};
  c.lengths = lengths;
  c.opt.block_size = block_size;
  c.opt.top_k = top_k;
  c.seed = seed;
  msatest::Problem pr = msatest::make_problem(c);
  const int64_t T = pr.cfg.T();
  const int Hp = c.heads.Hp, K = top_k, B = static_cast<int>(lengths.size());
  HostTensor idx(DType::int32, {Hp, T, K});
  flashmsa::select_blocks(pr.views(), c.opt, idx.view());
  std::vector<int32_t> sel = idx.to_ints();
  // A few entries the index must file under the sentinel: a block past the token's own, and -5.
  if (T > 2) {
    sel[K - 1] = 3;  // token 0 sees block 0 only
    sel[(T + 1) * K] = -5;
    std::memcpy(idx.data(), sel.data(), sel.size() * sizeof(int32_t));
  }

  // Four arrays of 64-element multiples: B + 1 offsets, nb_max block sequences, the entries, the
  // Hp nb_max + 1 list starts; nb_max bounds the blocks from shapes alone.
  const int64_t nb_max = (T + static_cast<int64_t>(B) * (block_size - 1)) / block_size;
  const int64_t size = padded64(B + 1) + padded64(std::max<int64_t>(nb_max, 1)) + padded64(Hp * T * K) +
                       padded64(Hp * nb_max + 1);
  ASSERT_EQ(flashmsa::selection_index_size(pr.views(), c.opt), size);
  HostTensor index(DType::int32, {size});
  index.fill_bytes(0xAB);
  flashmsa::build_selection_index(pr.views(), idx.view(), c.opt, index.view());
  const std::vector<int32_t> got = index.to_ints();
  const int32_t* blk_off = got.data();
  const int32_t* blk_seq = blk_off + padded64(B + 1);
  const int32_t* vals = blk_seq + padded64(std::max<int64_t>(nb_max, 1));
  const int32_t* seg = vals + padded64(Hp * T * K);

  std::vector<int64_t> first(B + 1, 0), start(B + 1, 0);
  for (int b = 0; b < B; ++b) {
    first[b + 1] = first[b] + (lengths[b] + block_size - 1) / block_size;
    start[b + 1] = start[b] + lengths[b];
  }
  const int64_t NB = first[B], nkeys = Hp * NB;
  for (int b = 0; b <= B; ++b) EXPECT_EQ(blk_off[b], first[b]) << "blk_off " << b;
  for (int b = 0; b < B; ++b)
    for (int64_t g = first[b]; g < first[b + 1]; ++g) EXPECT_EQ(blk_seq[g], b) << "blk_seq " << g;
  // List (p, global block g): the entries t * K + slot of head p naming g's local block from a
  // token of g's sequence that can see it, ascending; then everything else (the sentinel list).
  int64_t pos = 0;
  std::vector<int32_t> rest;
  std::vector<char> listed(static_cast<size_t>(Hp * T * K), 0);
  for (int p = 0; p < Hp; ++p)
    for (int b = 0; b < B; ++b)
      for (int64_t g = first[b]; g < first[b + 1]; ++g) {
        const int64_t key = p * NB + g;
        ASSERT_EQ(seg[key], pos) << "list start of key " << key;
        for (int64_t t = start[b]; t < start[b + 1]; ++t)
          for (int k = 0; k < K; ++k) {
            const int32_t blk = sel[(p * T + t) * K + k];
            if (blk == g - first[b] && blk <= (t - start[b]) / block_size) {
              ASSERT_EQ(vals[pos], t * K + k) << "key " << key << " position " << pos;
              listed[(p * T + t) * K + k] = 1;
              ++pos;
            }
          }
      }
  ASSERT_EQ(seg[nkeys], pos);
  for (int64_t i = 0; i < Hp * T * K; ++i)
    if (!listed[i]) rest.push_back(static_cast<int32_t>(i % (T * K)));
  ASSERT_EQ(static_cast<int64_t>(rest.size()), Hp * T * K - pos);
  for (size_t i = 0; i < rest.size(); ++i) EXPECT_EQ(vals[pos + i], rest[i]) << "sentinel entry " << i;
  // Every slot the layout does not use is zero (the CUDA build writes the same bytes).
  int64_t unused_nonzero = 0;
  for (int64_t i = B + 1; i < padded64(B + 1); ++i) unused_nonzero += blk_off[i] != 0;
  for (int64_t i = NB; i < padded64(std::max<int64_t>(nb_max, 1)); ++i) unused_nonzero += blk_seq[i] != 0;
  for (int64_t i = nkeys + 1; i < padded64(Hp * nb_max + 1); ++i) unused_nonzero += seg[i] != 0;
  EXPECT_EQ(unused_nonzero, 0);
}

TEST(SelectionIndexCpu, OneSequence) { check_index({300}, 16, 4, 1); }

TEST(SelectionIndexCpu, VarlenWithEmptyAndOneToken) { check_index({37, 0, 130, 1, 64}, 16, 3, 2); }

TEST(SelectionIndexCpu, EveryBlockSelected) { check_index({90, 45}, 8, 16, 3); }

TEST(SelectionIndexCpu, NoTokens) { check_index({0, 0}, 16, 2, 4); }

}  // namespace
