// Tests of the inverted selection index (src/cuda/common/selection_index.cuh) that the KV-major
// forward and the fused backward read: for every (proxy head, global key block) the list of
// entries t * K + slot that chose it, ascending, the padding and the entries naming a block the
// token cannot see last (the sentinel key), plus the lists' offsets. The index is built into a
// poisoned workspace and compared element for element with a stable sort on the host, over the
// whole value array: an entry written twice, a missed one or a wrong rank all show.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/selection_index.cuh"
#include "gpu_test_util.h"

namespace {

using namespace flashmsa::cuda;
using gputest::DeviceBuffer;

struct IndexCase {
  std::vector<int32_t> cu;  // [B+1]
  int Hp = 1, K = 1;
  bool all_blocks = false;  // every visible block (the dense warm-up's selection)
};

struct HostIndex {
  std::vector<int32_t> vals, seg;
};

// A selection in msa.md's form (distinct visible blocks, the own block among them, -1 padding),
// with a few entries naming a block the token cannot see (past its own, or negative other than
// -1), which the index files under the sentinel like the padding.
std::vector<int32_t> make_selection(const IndexCase& c, uint32_t seed) {
  const int B = static_cast<int>(c.cu.size()) - 1;
  const int64_t T = c.cu[B];
  std::vector<int32_t> sel(static_cast<size_t>(c.Hp) * T * c.K, -1);
  std::mt19937 rng(seed);
  for (int p = 0; p < c.Hp; ++p)
    for (int b = 0; b < B; ++b)
      for (int64_t t = c.cu[b]; t < c.cu[b + 1]; ++t) {
        const int nloc = static_cast<int>((t - c.cu[b]) / kIndexBlk);
        int32_t* row = sel.data() + (static_cast<int64_t>(p) * T + t) * c.K;
        std::vector<int> blocks(nloc + 1);
        std::iota(blocks.begin(), blocks.end(), 0);
        std::shuffle(blocks.begin(), blocks.end() - 1, rng);  // the own block stays last
        int take = std::min(nloc + 1, c.K);
        if (!c.all_blocks) take = std::min(take, 1 + static_cast<int>(rng() % c.K));
        std::vector<int> chosen(blocks.end() - take, blocks.end());
        std::sort(chosen.begin(), chosen.end());
        for (int i = 0; i < take; ++i) row[i] = chosen[i];
        if (!c.all_blocks && rng() % 16 == 0) row[rng() % c.K] = (rng() % 2) ? nloc + 1 + static_cast<int>(rng() % 3) : -7;
      }
  return sel;
}

// The expected index: a stable sort of the entries (head-major, then t * K + slot) by key.
HostIndex host_index(const IndexCase& c, const std::vector<int32_t>& sel, int NB) {
  const int B = static_cast<int>(c.cu.size()) - 1;
  const int64_t T = c.cu[B], TK = T * c.K;
  const int64_t nkeys = static_cast<int64_t>(c.Hp) * NB;
  std::vector<int32_t> blk_off(B + 1, 0);
  for (int b = 0; b < B; ++b) blk_off[b + 1] = blk_off[b] + (c.cu[b + 1] - c.cu[b] + kIndexBlk - 1) / kIndexBlk;
  std::vector<std::vector<int32_t>> lists(nkeys + 1);
  for (int p = 0; p < c.Hp; ++p)
    for (int b = 0; b < B; ++b)
      for (int64_t t = c.cu[b]; t < c.cu[b + 1]; ++t)
        for (int slot = 0; slot < c.K; ++slot) {
          const int64_t tk = t * c.K + slot;
          const int idx = sel[p * TK + tk];
          const bool visible = idx >= 0 && idx <= (t - c.cu[b]) / kIndexBlk;
          lists[visible ? static_cast<int64_t>(p) * NB + blk_off[b] + idx : nkeys].push_back(static_cast<int32_t>(tk));
        }
  HostIndex h;
  for (int64_t key = 0; key <= nkeys; ++key) {
    h.seg.push_back(static_cast<int32_t>(h.vals.size()));
    h.vals.insert(h.vals.end(), lists[key].begin(), lists[key].end());
  }
  return h;
}

void check_index(const IndexCase& c, uint32_t seed) {
  GPUTEST_REQUIRE_DEVICE();
  const int B = static_cast<int>(c.cu.size()) - 1;
  const std::vector<int32_t> sel = make_selection(c, seed);
  DeviceBuffer d_sel(sel.size() * sizeof(int32_t)), d_cu(c.cu.size() * sizeof(int32_t));
  d_sel.upload(sel);
  d_cu.upload(c.cu);
  flashmsa::MsaParams p;
  p.T = c.cu[B];
  p.B = B;
  p.Hp = c.Hp;
  p.top_k = c.K;
  p.cu_seqlens = static_cast<const int32_t*>(d_cu.get());
  p.cu_seqlens_host = c.cu.data();
  p.block_idx = static_cast<int32_t*>(d_sel.get());
  cudaStream_t stream;
  GPUTEST_CUDA(cudaStreamCreate(&stream));
  SelectionIndexPlan s = selection_index_sizes(p);
  Workspace ws;
  reserve_selection_index(s, p, ws, stream);
  ws.allocate(stream);
  const HostIndex want = host_index(c, sel, s.NB);
  ASSERT_EQ(want.vals.size(), static_cast<size_t>(s.n_entries));
  GPUTEST_CUDA(cudaMemsetAsync(ws.at<void>(0), gputest::kIntPoisonByte, ws.size(), stream));
  build_selection_index(p, s, ws, stream);
  std::vector<int32_t> vals(s.n_entries), seg(s.nkeys + 1);
  GPUTEST_CUDA(cudaMemcpyAsync(vals.data(), ws.at<int32_t>(s.o_vals_out), vals.size() * 4, cudaMemcpyDeviceToHost, stream));
  GPUTEST_CUDA(cudaMemcpyAsync(seg.data(), ws.at<int32_t>(s.o_seg), seg.size() * 4, cudaMemcpyDeviceToHost, stream));
  GPUTEST_CUDA(cudaStreamSynchronize(stream));
  EXPECT_EQ(seg, want.seg);
  int64_t wrong = 0, first = -1;
  for (size_t i = 0; i < vals.size(); ++i)
    if (vals[i] != want.vals[i] && wrong++ == 0) first = static_cast<int64_t>(i);
  EXPECT_EQ(wrong, 0) << "first at " << first << ": " << (first >= 0 ? vals[first] : 0) << " instead of "
                      << (first >= 0 ? want.vals[first] : 0);
  ws.release();
  GPUTEST_CUDA(cudaStreamSynchronize(stream));
  GPUTEST_CUDA(cudaStreamDestroy(stream));
}

std::vector<int32_t> offsets(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> cu{0};
  for (int32_t n : lengths) cu.push_back(cu.back() + n);
  return cu;
}

TEST(SelectionIndex, OneSequenceNotABlockMultiple) { check_index({offsets({1000}), 2, 4}, 11); }

TEST(SelectionIndex, VarlenEdgeLengths) { check_index({offsets({1, 127, 128, 129, 700, 3000}), 4, 16}, 12); }

TEST(SelectionIndex, OneBlockPerToken) { check_index({offsets({5000}), 1, 1}, 13); }

// 128 blocks per head with K = 16, as at m3.
TEST(SelectionIndex, M3LikeSixteenK) { check_index({offsets({16384}), 4, 16}, 14); }

// Many sequences: the global blocks' offsets and the sequence of each token.
TEST(SelectionIndex, ManySequences) {
  std::vector<int32_t> lengths;
  std::mt19937 rng(7);
  for (int i = 0; i < 150; ++i) lengths.push_back(1 + static_cast<int>(rng() % 400));
  check_index({offsets(lengths), 2, 8}, 15);
}

TEST(SelectionIndex, EveryVisibleBlock) { check_index({offsets({2048, 300}), 2, 16, true}, 16); }

// K > 32 with every visible block selected.
TEST(SelectionIndex, EveryVisibleBlockKAbove32) { check_index({offsets({5200}), 1, 40, true}, 18); }

// One-token sequences with K = 1: a block per token.
TEST(SelectionIndex, OneTokenSequences) { check_index({offsets(std::vector<int32_t>(200, 1)), 2, 1}, 17); }

}  // namespace
