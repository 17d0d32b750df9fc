// What the CUDA kernels accept; checked before any launch so nothing is written on error.
#include <climits>
#include <string>

#include "launchers.h"

namespace flashmsa::cuda {

void check_supported(const MsaParams& p, const char* operation) {
  const std::string op(operation);
  if (p.dtype != DType::bf16)
    throw Error("flashmsa: " + op + ": argument 'q' has dtype " + dtype_name(p.dtype) +
                "; the CUDA backend takes bf16");
  if (p.block_size != 128)
    throw Error("flashmsa: " + op + ": option 'block_size' must be 128 on the CUDA backend");
  auto head_dim_ok = [](int d) { return d == 64 || d == 128; };
  if (!head_dim_ok(p.D) || !head_dim_ok(p.Dv) || !head_dim_ok(p.Dp))
    throw Error("flashmsa: " + op + ": arguments 'q', 'v', 'qp' have head dims D = " + std::to_string(p.D) +
                ", Dv = " + std::to_string(p.Dv) + ", Dp = " + std::to_string(p.Dp) +
                "; the CUDA backend takes 64 or 128 (docs/design.md: why not 256)");
  if (p.D != p.Dv || p.D != p.Dp)
    throw Error("flashmsa: " + op + ": arguments 'q', 'v', 'qp' must have equal head dims "
                "(D = Dv = Dp) on the CUDA backend");
  // The forward packs each proxy group's heads into row groups (at most one per head, at most
  // 512 of them) and indexes (token, row group) with 32-bit integers.
  if (p.H > 512)
    throw Error("flashmsa: " + op + ": argument 'q' has more than 512 heads (CUDA backend limit)");
  if (p.T * static_cast<int64_t>(p.H) > INT32_MAX ||
      p.T * static_cast<int64_t>(p.Hp) * p.top_k >= INT32_MAX)
    throw Error("flashmsa: " + op + ": argument 'q' has too many tokens x heads for the CUDA "
                "backend's 32-bit indices");
}

}  // namespace flashmsa::cuda
