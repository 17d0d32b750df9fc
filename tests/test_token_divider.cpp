// The backward's multiply-and-shift division of index entries by K (src/token_divider.h) against
// the integer division, over every K the API takes in practice and entries up to 2^31 - 1.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "token_divider.h"

namespace {

TEST(TokenDivider, MatchesDivisionOverTheEntryRange) {
  std::mt19937 rng(20261208);
  std::uniform_int_distribution<int> any(0, INT32_MAX);
  for (int k = 1; k <= 1100; ++k) {
    const flashmsa::TokenDivider d = flashmsa::TokenDivider::make(k);
    // Around multiples of k (where a floor changes), at both ends of the range, and at random.
    for (int64_t base : {int64_t{0}, int64_t{k} * 12345, int64_t{INT32_MAX} / k * k, int64_t{INT32_MAX} - 2 * k}) {
      for (int64_t v = base - 2; v <= base + 2 && v <= INT32_MAX; ++v) {
        if (v < 0) continue;
        ASSERT_EQ(d(static_cast<int>(v)), static_cast<int>(v / k)) << "k " << k << " v " << v;
      }
    }
    for (int i = 0; i < 2000; ++i) {
      const int v = any(rng);
      ASSERT_EQ(d(v), v / k) << "k " << k << " v " << v;
    }
  }
  // The largest divisors too (K is bounded by the blocks a sequence has).
  for (int k : {(1 << 20) + 1, (1 << 30) - 1, 1 << 30, INT32_MAX}) {
    const flashmsa::TokenDivider d = flashmsa::TokenDivider::make(k);
    for (int v : {0, 1, k - 1, k, INT32_MAX - 1, INT32_MAX}) ASSERT_EQ(d(v), v / k) << "k " << k << " v " << v;
  }
}

}  // namespace
