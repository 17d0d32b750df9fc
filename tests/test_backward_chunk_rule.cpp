// The fused backward's default token chunking (src/backward_chunk_rule.h): the branches measured on
// each card (fused_backward.cu lists the runs), pinned so that an edit of one shows up here. The GPU
// suite covers the chunked kernels' results; this covers which count a card and length get.
#include <gtest/gtest.h>

#include "backward_chunk_rule.h"

namespace {

using flashmsa::default_backward_chunk_count;

constexpr double kH100 = 3.35e12;  // bytes per second, H100 SXM
constexpr double kH200 = 4.8e12;

TEST(BackwardChunkRule, NoneBelow16kOrDeterministic) {
  for (const double dram : {0.0, kH100, kH200}) {
    EXPECT_EQ(default_backward_chunk_count(16383, false, dram), 0);
    EXPECT_EQ(default_backward_chunk_count(1, false, dram), 0);
    for (const int64_t T : {16384, 65536, 1 << 20}) EXPECT_EQ(default_backward_chunk_count(T, true, dram), 0);
  }
}

TEST(BackwardChunkRule, SlowDramTakesTheH100Rule) {
  EXPECT_EQ(default_backward_chunk_count(16384, false, kH100), 8);
  EXPECT_EQ(default_backward_chunk_count(32767, false, kH100), 8);
  EXPECT_EQ(default_backward_chunk_count(32768, false, kH100), 16);
  EXPECT_EQ(default_backward_chunk_count(1 << 20, false, kH100), 16);
  EXPECT_EQ(default_backward_chunk_count(32768, false, 4.19e12), 16);
}

TEST(BackwardChunkRule, FastOrUnknownDramTakesTheH200Rule) {
  for (const double dram : {0.0, kH200, 4.2e12}) {
    EXPECT_EQ(default_backward_chunk_count(16384, false, dram), 8);
    EXPECT_EQ(default_backward_chunk_count(24576, false, dram), 8);
    EXPECT_EQ(default_backward_chunk_count(32768, false, dram), 8);
    EXPECT_EQ(default_backward_chunk_count(32769, false, dram), 5);
    EXPECT_EQ(default_backward_chunk_count(65535, false, dram), 5);
    EXPECT_EQ(default_backward_chunk_count(65536, false, dram), 4);
    EXPECT_EQ(default_backward_chunk_count(1 << 20, false, dram), 4);
  }
}

}  // namespace
