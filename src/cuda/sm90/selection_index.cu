// cuda::build_selection_index: the inverted selection index (common/selection_index.cuh) into a
// caller's buffer, laid out as selection_index_layout.h says, so that the sparse forward, its KL
// value and the fused backward of one step read it instead of each sorting Hp T K entries again.
#include "common/selection_index.cuh"
#include "launchers.h"

namespace flashmsa::cuda {

void launch_build_selection_index(const MsaParams& p, int32_t* index, cudaStream_t stream) {
  SelectionIndexPlan s = selection_index_sizes(p);
  size_sort_storage(s, stream);
  use_caller_index(s, p, index);
  Workspace ws;
  place_selection_scratch(s, ws);
  const int64_t elements = selection_index_layout(p.T, p.B, p.Hp, p.top_k, kIndexBlk).size;
  ws.allocate(stream);
  // The unused tails zeroed, so that the buffer equals the CPU backend's build bytewise.
  FLASHMSA_CUDA_CHECK(cudaMemsetAsync(index, 0, elements * sizeof(int32_t), stream));
  if (p.T > 0) build_selection_index(p, s, ws, stream);
  ws.release();
}

}  // namespace flashmsa::cuda
