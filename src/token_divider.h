// Internal: an entry's token (entry / K for the selection index's entries t K + slot) by a multiply and
// a shift, kept free of CUDA so that the CPU suite checks it against the division
// (tests/test_token_divider.cpp). The backward's Index (src/cuda/sm90/backward_tiles.cuh) carries one:
// a signed division by a runtime K is ~20 dependent instructions around a MUFU.RCP, which the student
// lse's row gathers issued for every 16-byte chunk (ncu at fm16k on an H100: integer division about a
// quarter of proxy_lse_kernel's instructions).
#pragma once

#include <cstdint>

#include "host_device.h"

namespace flashmsa {

struct TokenDivider {
  uint32_t mul = 0;
  int shift = 0;

  // m = ceil(2^(31 + s) / k) with 2^s >= k: for 0 <= v < 2^31, v m / 2^(31 + s) = v / k + e with
  // 0 <= e < 2^-s <= 1 / k, so the floors agree (entries are below Hp T K < 2^31, which the
  // backward checks on entry). m <= 2^31 for k a power of two, below 2^32 otherwise.
  static TokenDivider make(int k) {
    TokenDivider d;
    while ((int64_t{1} << d.shift) < k) ++d.shift;
    d.mul = static_cast<uint32_t>(((uint64_t{1} << (31 + d.shift)) + static_cast<uint64_t>(k) - 1) /
                                  static_cast<uint64_t>(k));
    return d;
  }
  // v / k for 0 <= v < 2^31.
  FLASHMSA_HOST_DEVICE int operator()(int v) const {
    return static_cast<int>((static_cast<uint64_t>(static_cast<uint32_t>(v)) * mul) >> (31 + shift));
  }
};

}  // namespace flashmsa
