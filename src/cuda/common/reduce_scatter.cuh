// Warp reduce-scatter across the 8 row groups of an mma.m16n8k16 accumulator (g = lane / 4):
// summing 8 values over the 8 groups with 3 levels (7 shuffles) instead of 3 full butterflies
// (24), each lane ending with one sum. Shared by the query-major and KV-major forwards' KL.
#pragma once

namespace flashmsa::cuda {

// One level of a reduce-scatter across lanes lane ^ mask: the lane keeps the upper half of the
// values when `upper`, and adds the partner's copy of that half.
template <int N>
__device__ __forceinline__ void reduce_scatter_level(const float (&in)[2 * N], float (&out)[N], bool upper,
                                                     int mask) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float keep = upper ? in[i + N] : in[i], send = upper ? in[i] : in[i + N];
    out[i] = keep + __shfl_xor_sync(0xffffffffu, send, mask);
  }
}

// v[k] summed over the 8 row groups; lane (g, c) gets the sum of value k = g.
__device__ __forceinline__ float reduce_scatter_rows8(const float (&v)[8], int g) {
  float h4[4], h2[2], h1[1];
  reduce_scatter_level(v, h4, (g >> 2) & 1, 16);
  reduce_scatter_level(h4, h2, (g >> 1) & 1, 8);
  reduce_scatter_level(h2, h1, g & 1, 4);
  return h1[0];
}

}  // namespace flashmsa::cuda
