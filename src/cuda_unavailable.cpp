// Stand-ins for the CUDA backend in a build without a CUDA compiler: every entry point
// raises a clear error, so a CPU-only build links and reports what is missing.
#include "params.h"

namespace flashmsa {

bool cuda_backend_built() { return false; }

void* workspace_memory_pool(int) {
  throw Error("flashmsa: workspace_memory_pool: this build has no CUDA backend (configured without nvcc)");
}
// Nothing here allocates device workspace, so any allocator (or none) is accepted.
void set_workspace_allocator(const WorkspaceAllocator&) {}

namespace cuda {
namespace {
[[noreturn]] void unavailable() {
  throw Error("flashmsa: this build has no CUDA backend (configured without nvcc)");
}
}  // namespace
void select_blocks(const MsaParams&, void*) { unavailable(); }
void sparse_attention_forward(const MsaParams&, void*) { unavailable(); }
void fused_backward(const MsaParams&, void*) { unavailable(); }
void dense_warmup_forward(const MsaParams&, void*) { unavailable(); }
void dense_warmup_backward(const MsaParams&, void*) { unavailable(); }
void build_selection_index(const MsaParams&, int32_t*, void*) { unavailable(); }
bool device_available() { return false; }
void copy_to_host(void*, const void*, int64_t, int, void*) { unavailable(); }
void check_supported(const MsaParams&, const char*) { unavailable(); }
}  // namespace cuda

}  // namespace flashmsa
