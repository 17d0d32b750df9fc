// The inverted selection index shared by the KV-major kernels (fused backward, KV-major forward):
// for each (proxy head p, global key block) the list of selection entries (t * K + slot) that
// chose it. Built on a stream with no host synchronisation:
//   1. first global block of each sequence (blk_off), the sequence of each global block (blk_seq);
//   2. one key per entry, p * NB + global block, or a sentinel (nkeys) for padding and blocks
//      the token cannot see; value t * K + slot;
//   3. cub stable radix sort, so each list is ascending in t and the same every run;
//   4. list offsets by lower bound: list `key` is vals[seg[key], seg[key + 1]).
// Plus the host helpers both launchers use (grid sizes, one stream-ordered workspace).
// A caller's index (MsaParams::selection_index, built by cuda::build_selection_index into the
// layout of selection_index_layout.h) replaces the build: the plan then points into it, reserves
// nothing and launches nothing.
#pragma once

#include <cuda_runtime.h>

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>

#include "common/check.cuh"
#include "common/metadata.cuh"
#include "params.h"
#include "selection_index_layout.h"

namespace flashmsa::cuda {

// Keys per block the index is built for: the CUDA backend only takes block_size 128
// (support.cpp), and a compile-time divisor keeps the per-entry division a shift.
constexpr int kIndexBlk = 128;

// Grid for a grid-stride or one-thread-per-item loop over n items, capped at `cap` blocks.
inline int grid_for(int64_t n, int threads, int64_t cap = 65536) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(cap, (n + threads - 1) / threads)));
}

// Bump allocator over one stream-ordered allocation: offsets are planned first (so every size
// is known before anything is allocated or launched), then one workspace allocation.
// Freed by release (checked) or, on an error path, by the destructor (unchecked). Movable while
// unallocated (plans are returned by value), never copied.
class Workspace {
 public:
  Workspace() = default;
  Workspace(Workspace&& other) noexcept : base_(other.base_), size_(other.size_), stream_(other.stream_) {
    other.base_ = nullptr;
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  Workspace& operator=(Workspace&&) = delete;
  ~Workspace() { workspace_free(base_, stream_); }
  // Every region starts 256-byte aligned: add reserves `bytes` padded to that.
  static constexpr size_t padded(size_t bytes) { return (bytes + 255) / 256 * 256; }
  size_t add(size_t bytes) {
    const size_t at = size_;
    size_ += padded(bytes);
    return at;
  }
  size_t size() const { return size_; }
  void allocate(cudaStream_t s) {
    stream_ = s;
    if (size_ > 0) base_ = workspace_allocate(size_, s);
  }
  // On the stream it was allocated on.
  void release() {
    void* base = base_;
    base_ = nullptr;  // before the check: a failed free must not be repeated by the destructor
    if (base) FLASHMSA_CUDA_CHECK(workspace_free(base, stream_));
  }
  template <typename U>
  U* at(size_t offset) const {
    return reinterpret_cast<U*>(static_cast<unsigned char*>(base_) + offset);
  }

 private:
  void* base_ = nullptr;
  size_t size_ = 0;
  cudaStream_t stream_ = nullptr;
};

// Internal linkage, as build_tile_offsets_kernel: each including translation unit gets its own
// copy of the kernels (no relocatable device code).
namespace {

__global__ void block_sequence_kernel(const int32_t* __restrict__ blk_off,  // [B+1]
                                      int32_t* __restrict__ blk_seq) {      // [NB]
  const int b = blockIdx.x;
  const int first = blk_off[b], count = blk_off[b + 1] - first;
  for (int i = threadIdx.x; i < count; i += blockDim.x) blk_seq[first + i] = b;
}

// Block index of a selection entry, or -1 when it is padding (or names a block the token cannot
// see, which a well-formed selection never does; skipping it keeps every read in bounds).
__device__ __forceinline__ int entry_block(const int32_t* __restrict__ cu, int B, int64_t t, int idx,
                                           int& seq) {
  seq = find_sequence(cu, B, t);
  const int nloc = static_cast<int>((t - cu[seq]) / kIndexBlk);
  return idx >= 0 && idx <= nloc ? idx : -1;
}

// Value t * K + slot (not the flat entry index) so a stable sort leaves each list ascending in t.
__global__ void make_keys_kernel(const int32_t* __restrict__ block_idx,  // [Hp, T, K]
                                 const int32_t* __restrict__ cu,         // [B+1]
                                 const int32_t* __restrict__ blk_off,    // [B+1]
                                 int B, int64_t T, int K, int NB, int64_t n,
                                 uint32_t sentinel,
                                 uint32_t* __restrict__ keys,             // [Hp*T*K]
                                 int32_t* __restrict__ vals) {            // [Hp*T*K]
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t tk = i % (T * K);
    const int p = static_cast<int>(i / (T * K));
    const int64_t t = tk / K;
    int seq;
    const int blk = entry_block(cu, B, t, block_idx[i], seq);
    keys[i] = blk >= 0 ? static_cast<uint32_t>(p) * NB + blk_off[seq] + blk : sentinel;
    vals[i] = static_cast<int32_t>(tk);
  }
}

// seg_start[key] = first sorted position whose key is >= key (lower bound), key in [0, nkeys].
__global__ void list_offsets_kernel(const uint32_t* __restrict__ sorted_keys,  // [n]
                                    int64_t n, int64_t nkeys,
                                    int32_t* __restrict__ seg_start) {         // [nkeys+1]
  const int64_t key = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (key > nkeys) return;
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (sorted_keys[mid] < static_cast<uint32_t>(key)) lo = mid + 1;
    else hi = mid;
  }
  seg_start[key] = static_cast<int32_t>(lo);
}

}  // namespace

// Sizes of the index and where its buffers sit in the caller's workspace.
struct SelectionIndexPlan {
  int NB = 0;             // key blocks over all sequences
  int64_t n_entries = 0;  // Hp * T * K
  int64_t nkeys = 0;      // Hp * NB, also the sentinel key
  int end_bit = 1;        // radix bits that cover keys 0..nkeys
  size_t cub_bytes = 0;
  size_t o_blk_off = 0, o_blk_seq = 0;   // [B+1], [max(NB, 1)]
  size_t o_keys_in = 0, o_keys_out = 0;  // [n_entries] each
  size_t o_vals_in = 0, o_vals_out = 0;  // [n_entries] each; vals_out is the sorted list
  size_t o_seg = 0;                      // [nkeys+1]
  size_t o_cub = 0;                      // [cub_bytes]
  // keys in, keys out, values in: contiguous from o_keys_in, free for the caller once the index is
  // built (when place_selection_scratch put them in the caller's own region, they are that region).
  size_t dead_bytes = 0;
  // The scratch's offsets are into this buffer instead of the workspace when it is set
  // (place_selection_scratch_outside: an output buffer not yet written, e.g. the forward's o).
  unsigned char* scratch_base = nullptr;
  // The lasting buffers' offsets are into this buffer instead of the workspace when it is set
  // (a caller's index: use_caller_index); `prebuilt`: it is already built.
  unsigned char* lasting_base = nullptr;
  bool prebuilt = false;
  template <typename U>
  U* scratch_at(const Workspace& ws, size_t offset) const {
    return scratch_base ? reinterpret_cast<U*>(scratch_base + offset) : ws.at<U>(offset);
  }
  template <typename U>
  U* lasting_at(const Workspace& ws, size_t offset) const {
    return lasting_base ? reinterpret_cast<U*>(lasting_base + offset) : ws.at<U>(offset);
  }
  int32_t* blk_off(const Workspace& ws) const { return lasting_at<int32_t>(ws, o_blk_off); }
  int32_t* blk_seq(const Workspace& ws) const { return lasting_at<int32_t>(ws, o_blk_seq); }
  int32_t* vals(const Workspace& ws) const { return lasting_at<int32_t>(ws, o_vals_out); }
  int32_t* seg(const Workspace& ws) const { return lasting_at<int32_t>(ws, o_seg); }
};

// The index's sizes from the host copy of cu_seqlens; no workspace yet (callers may reject the
// problem on these sizes before anything is reserved).
inline SelectionIndexPlan selection_index_sizes(const MsaParams& p) {
  SelectionIndexPlan s;
  for (int b = 0; b < p.B; ++b)
    s.NB += (p.cu_seqlens_host[b + 1] - p.cu_seqlens_host[b] + kIndexBlk - 1) / kIndexBlk;
  s.n_entries = static_cast<int64_t>(p.Hp) * p.T * p.top_k;
  s.nkeys = static_cast<int64_t>(p.Hp) * s.NB;
  while ((int64_t{1} << s.end_bit) <= s.nkeys) ++s.end_bit;
  return s;
}

// cub's temporary storage for the sort.
inline void size_sort_storage(SelectionIndexPlan& s, cudaStream_t stream) {
  FLASHMSA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, s.cub_bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), s.n_entries, 0, s.end_bit, stream));
}

// The lasting buffers at their places in a caller's index buffer (selection_index_layout.h).
inline void use_caller_index(SelectionIndexPlan& s, const MsaParams& p, const int32_t* index) {
  const SelectionIndexLayout l = selection_index_layout(p.T, p.B, p.Hp, p.top_k, kIndexBlk);
  s.lasting_base = reinterpret_cast<unsigned char*>(const_cast<int32_t*>(index));
  s.o_blk_off = l.blk_off * sizeof(int32_t);
  s.o_blk_seq = l.blk_seq * sizeof(int32_t);
  s.o_vals_out = l.vals * sizeof(int32_t);
  s.o_seg = l.seg * sizeof(int32_t);
}

// Reserves the index's lasting buffers (block offsets, block sequences, the sorted list, the
// per-key segments) in `ws` and sizes cub's temporary storage; launches nothing. The scratch
// (keys in and out, values in, cub's storage), read only while the index is built, is placed by
// place_selection_scratch. With the caller's prebuilt index (p.selection_index): nothing of this.
inline void reserve_selection_lists(SelectionIndexPlan& s, const MsaParams& p, Workspace& ws, cudaStream_t stream) {
  if (p.selection_index != nullptr) {
    use_caller_index(s, p, p.selection_index);
    s.prebuilt = true;
    return;
  }
  size_sort_storage(s, stream);
  s.o_blk_off = ws.add((p.B + 1) * sizeof(int32_t));
  s.o_blk_seq = ws.add(std::max(s.NB, 1) * sizeof(int32_t));
  s.o_vals_out = ws.add(s.n_entries * 4);
  s.o_seg = ws.add((s.nkeys + 1) * sizeof(int32_t));
}

// Bytes of the scratch at 256-byte offsets from its start.
inline size_t selection_scratch_bytes(const SelectionIndexPlan& s) {
  if (s.prebuilt) return 0;
  return 3 * Workspace::padded(s.n_entries * 4) + Workspace::padded(s.cub_bytes);
}

// The scratch laid out contiguously from `start`: keys in, keys out, values in, cub's storage.
inline void lay_out_selection_scratch(SelectionIndexPlan& s, size_t start) {
  const size_t entries = Workspace::padded(s.n_entries * 4);
  s.o_keys_in = start;
  s.o_keys_out = start + entries;
  s.o_vals_in = start + 2 * entries;
  s.o_cub = start + 3 * entries;
}

// Places the index's scratch inside [region, region + region_bytes) of `ws` when it fits there (a
// region the caller does not use before the index is built: the backward's accumulators, zeroed
// after it, save the scratch's 16 B per entry of peak workspace), else reserves it after the rest.
inline void place_selection_scratch(SelectionIndexPlan& s, Workspace& ws, size_t region = 0, size_t region_bytes = 0) {
  if (s.prebuilt) return;
  if (selection_scratch_bytes(s) <= region_bytes) {
    lay_out_selection_scratch(s, region);
  } else {
    s.o_keys_in = ws.add(s.n_entries * 4);
    s.o_keys_out = ws.add(s.n_entries * 4);
    s.o_vals_in = ws.add(s.n_entries * 4);
    s.o_cub = ws.add(s.cub_bytes);
  }
  s.dead_bytes = 3 * Workspace::padded(s.n_entries * 4);
}

// Places the scratch in a caller's buffer of `bytes` (its start rounded up to 256 bytes) that
// nothing reads or writes until the index is built, when it fits (true); else changes nothing.
// The plan does not depend on the buffer's address: 255 bytes are set aside for the rounding.
inline bool place_selection_scratch_outside(SelectionIndexPlan& s, void* buffer, size_t bytes) {
  if (s.prebuilt || buffer == nullptr || bytes < 255 || selection_scratch_bytes(s) > bytes - 255) return false;
  const uintptr_t at = (reinterpret_cast<uintptr_t>(buffer) + 255) / 256 * 256;
  s.scratch_base = reinterpret_cast<unsigned char*>(at);
  lay_out_selection_scratch(s, 0);
  s.dead_bytes = 0;  // not the workspace's: nothing there to reuse
  return true;
}

// Both, the scratch reserved with the rest.
inline void reserve_selection_index(SelectionIndexPlan& s, const MsaParams& p, Workspace& ws, cudaStream_t stream) {
  reserve_selection_lists(s, p, ws, stream);
  place_selection_scratch(s, ws);
}

// Builds the index into the allocated workspace (or the caller's buffer), on `stream`; nothing
// when it is prebuilt.
inline void build_selection_index(const MsaParams& p, const SelectionIndexPlan& s, const Workspace& ws,
                                  cudaStream_t stream) {
  if (s.prebuilt) return;
  if (p.B > 0) {
    build_tile_offsets_kernel<<<1, 1024, 0, stream>>>(p.cu_seqlens, p.B, kIndexBlk, s.blk_off(ws));
    FLASHMSA_CHECK_LAUNCH();
    block_sequence_kernel<<<p.B, 128, 0, stream>>>(s.blk_off(ws), s.blk_seq(ws));
    FLASHMSA_CHECK_LAUNCH();
  }
  make_keys_kernel<<<grid_for(s.n_entries, 256), 256, 0, stream>>>(
      p.block_idx, p.cu_seqlens, s.blk_off(ws), p.B, p.T, p.top_k, s.NB, s.n_entries,
      static_cast<uint32_t>(s.nkeys), s.scratch_at<uint32_t>(ws, s.o_keys_in), s.scratch_at<int32_t>(ws, s.o_vals_in));
  FLASHMSA_CHECK_LAUNCH();
  size_t cub_bytes = s.cub_bytes;
  FLASHMSA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      s.scratch_at<void>(ws, s.o_cub), cub_bytes, s.scratch_at<const uint32_t>(ws, s.o_keys_in),
      s.scratch_at<uint32_t>(ws, s.o_keys_out), s.scratch_at<const int32_t>(ws, s.o_vals_in),
      s.vals(ws), s.n_entries, 0, s.end_bit, stream));
  list_offsets_kernel<<<grid_for(s.nkeys + 1, 256, INT_MAX), 256, 0, stream>>>(
      s.scratch_at<uint32_t>(ws, s.o_keys_out), s.n_entries, s.nkeys, s.seg(ws));
  FLASHMSA_CHECK_LAUNCH();
}

}  // namespace flashmsa::cuda
