// What the CUDA kernels accept; checked before any launch so nothing is written on error.
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
    throw Error("flashmsa: " + op + ": head dims D, Dv, Dp must be 64 or 128 on the CUDA backend");
}

}  // namespace flashmsa::cuda
