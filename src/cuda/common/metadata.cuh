// Scheduling metadata derived from cu_seqlens on the device (no host synchronisation, so a
// training step can be captured in a CUDA graph).
#pragma once

#include <cstdint>

namespace flashmsa::cuda {

// The sequence b holding packed token t: cu[b] <= t < cu[b+1]. Zero-length sequences share an
// offset with their neighbour; the last b with cu[b] <= t is the non-empty one.
__device__ __forceinline__ int find_sequence(const int32_t* __restrict__ cu, int B, int64_t t) {
  int lo = 0, hi = B;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (__ldg(cu + mid) <= t) lo = mid;
    else hi = mid;
  }
  return lo;
}

// Tiles of `tile` tokens aligned to each sequence start: tile_offsets[b] = sum over sequences
// before b of ceil(len / tile), tile_offsets[B] = the total. One block of 1024 threads; each
// thread scans a contiguous run of sequences so B may be large.
namespace {
__global__ void __launch_bounds__(1024)
    build_tile_offsets_kernel(const int32_t* __restrict__ cu,  // [B+1]
                              int B, int tile,
                              int32_t* __restrict__ tile_offsets) {  // [B+1]
  __shared__ int32_t sums[1024];
  const int tid = threadIdx.x;
  const int per = (B + 1023) / 1024;
  const int b0 = min(B, tid * per), b1 = min(B, b0 + per);
  int32_t local = 0;
  for (int b = b0; b < b1; ++b) local += (cu[b + 1] - cu[b] + tile - 1) / tile;
  sums[tid] = local;
  __syncthreads();
  // Hillis-Steele inclusive scan over the 1024 partial sums.
  for (int off = 1; off < 1024; off <<= 1) {
    const int32_t add = tid >= off ? sums[tid - off] : 0;
    __syncthreads();
    sums[tid] += add;
    __syncthreads();
  }
  int32_t run = sums[tid] - local;  // exclusive prefix of this thread's run
  for (int b = b0; b < b1; ++b) {
    tile_offsets[b] = run;
    run += (cu[b + 1] - cu[b] + tile - 1) / tile;
  }
  if (tid == 1023) tile_offsets[B] = sums[1023];
}
}  // namespace

// Query tile `tile` of tile_rows rows (tiles numbered sequence after sequence, tile_offsets[b] =
// the first tile of sequence b) placed in its sequence.
struct TileInSequence {
  int b;      // the owning sequence (last b with tile_offsets[b] <= tile)
  int s0;     // packed index of its first token
  int len;    // its length
  int n_loc;  // the tile's index inside the sequence
  int row0;   // the tile's first row inside the sequence (n_loc * tile_rows)
  int rows;   // rows of the tile inside the sequence (< tile_rows for a last, partial tile)
};
__device__ __forceinline__ TileInSequence tile_in_sequence(const int32_t* __restrict__ tile_offsets,
                                                           const int32_t* __restrict__ cu, int B, int tile,
                                                           int tile_rows) {
  TileInSequence ts;
  ts.b = find_sequence(tile_offsets, B, tile);
  ts.s0 = __ldg(cu + ts.b);
  ts.len = __ldg(cu + ts.b + 1) - ts.s0;
  ts.n_loc = tile - __ldg(tile_offsets + ts.b);
  ts.row0 = ts.n_loc * tile_rows;
  ts.rows = min(tile_rows, ts.len - ts.row0);
  return ts;
}

}  // namespace flashmsa::cuda
