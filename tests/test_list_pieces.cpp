// How the wgmma backward (and its KL-only form) cuts key blocks' token lists into pieces (src/list_pieces.h,
// FLASHMSA_BWD_PIECE): every entry in exactly one piece, no piece over the cap, the fewest pieces, sizes
// within one of each other, and the overflow grid's bound never below the records a group makes. The GPU suite
// (CudaBackward.ListPieces) covers the kernels' results with pieces.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "list_pieces.h"

namespace {

using flashmsa::list_piece_begin;
using flashmsa::list_piece_count;
using flashmsa::list_piece_overflow;
using flashmsa::max_overflow_pieces;

TEST(ListPieces, CoverEachEntryOnceWithinTheCap) {
  for (const int cap : {1, 2, 50, 64, 300, 2048}) {
    for (int len = 0; len <= 5000; len += len < 130 ? 1 : 97) {
      const int begin = 1000003 % (len + 7), count = list_piece_count(len, cap);
      EXPECT_EQ(count, (len + cap - 1) / cap) << "len " << len << " cap " << cap;
      if (count == 0) continue;
      EXPECT_EQ(list_piece_begin(begin, len, count, 0), begin);
      EXPECT_EQ(list_piece_begin(begin, len, count, count), begin + len);
      int smallest = len, largest = 0;
      for (int j = 0; j < count; ++j) {
        const int size = list_piece_begin(begin, len, count, j + 1) - list_piece_begin(begin, len, count, j);
        smallest = std::min(smallest, size);
        largest = std::max(largest, size);
      }
      EXPECT_GE(smallest, 1) << "len " << len << " cap " << cap;
      EXPECT_LE(largest, cap) << "len " << len << " cap " << cap;
      EXPECT_LE(largest - smallest, 1) << "len " << len << " cap " << cap;
    }
  }
}

TEST(ListPieces, EmptyPartsMakeNone) {
  EXPECT_EQ(list_piece_count(0, 2048), 0);
  EXPECT_EQ(list_piece_count(-3, 2048), 0);
}

// Random lists, a sink's (every token) among them: the overflow records (every piece of each part over the
// cap) never exceed the bound the overflow grid is sized by.
TEST(ListPieces, OverflowBoundHoldsTheGroupsPieces) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int parts = 1 + static_cast<int>(rng() % 600), cap = 1 + static_cast<int>(rng() % 3000);
    std::vector<int> len(parts);
    int64_t entries = 0, overflow = 0;
    for (int& l : len) {
      l = rng() % 4 == 0 ? 0 : static_cast<int>(rng() % 9000);
      if (rng() % 50 == 0) l = 65536;
      entries += l;
      overflow += list_piece_overflow(l, cap);
    }
    EXPECT_LE(overflow, max_overflow_pieces(entries, cap)) << "trial " << trial;
  }
  // The bound is tight for parts one entry over the cap: two pieces each.
  EXPECT_EQ(list_piece_overflow(101, 100), 2);
  EXPECT_EQ(max_overflow_pieces(3 * 101, 100), 6);
}

// A part within the cap stays with its own CTA (no records); a longer one goes whole to the overflow table.
TEST(ListPieces, OnlyCutPartsOverflow) {
  EXPECT_FALSE(flashmsa::list_part_cut(100, 100));
  EXPECT_TRUE(flashmsa::list_part_cut(101, 100));
  EXPECT_EQ(list_piece_overflow(0, 100), 0);
  EXPECT_EQ(list_piece_overflow(100, 100), 0);
  EXPECT_EQ(list_piece_overflow(101, 100), 2);
  EXPECT_EQ(list_piece_overflow(65536, 8192), 8);
}

}  // namespace
