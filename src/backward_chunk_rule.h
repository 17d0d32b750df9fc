// Internal: the fused backward's default token chunking (fast mode), kept free of CUDA so that the
// CPU suite checks the rule (tests/test_backward_chunk_rule.cpp); src/cuda/sm90/fused_backward.cu
// applies it after the FLASHMSA_BWD_CHUNK / FLASHMSA_BWD_CHUNKS overrides. The measurements behind each
// branch are listed there, beside backward_chunk_tokens.
#pragma once

#include <cstdint>

namespace flashmsa {

// How many token chunks the token-row wgmma backward splits its lists into by default (0: none), for
// T tokens on a card whose DRAM peak is dram_bytes_per_s (0: unknown, taken as the H200 rule).
//  - deterministic mode, or T below 16k: none;
//  - below 4.2 TB/s (H100): 8 from 16k tokens, 16 from 32k;
//  - else (H200): 8 up to 32k tokens, 5 below 64k, 4 from 64k.
inline int64_t default_backward_chunk_count(int64_t T, bool deterministic, double dram_bytes_per_s) {
  if (deterministic || T < 16384) return 0;
  const bool slow_dram = dram_bytes_per_s > 0 && dram_bytes_per_s < 4.2e12;
  if (slow_dram) return T >= 32768 ? 16 : 8;
  return T <= 32768 ? 8 : T < 65536 ? 5 : 4;
}

}  // namespace flashmsa
