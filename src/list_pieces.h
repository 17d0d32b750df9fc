// Internal: how the wgmma backward (and its KL-only form) cuts a key block's token list into pieces (FoldArgs::pieces,
// FLASHMSA_BWD_PIECE), kept free of CUDA so that the CPU suite checks it (tests/test_list_pieces.cpp);
// src/cuda/sm90/fused_backward.cu's build_list_pieces_kernel and its grid bound use it.
#pragma once

#include <cstdint>

#include "host_device.h"

namespace flashmsa {

// The pieces of a list part of len entries, at most cap each: the fewest that hold it (none when empty).
FLASHMSA_HOST_DEVICE inline int list_piece_count(int len, int cap) { return len > 0 ? (len + cap - 1) / cap : 0; }

// Where piece j of the part [begin, begin + len) starts (j = count: its end): near-equal pieces in order,
// each ending where the next starts.
FLASHMSA_HOST_DEVICE inline int list_piece_begin(int begin, int len, int count, int j) {
  return begin + static_cast<int>(static_cast<int64_t>(len) * j / count);
}

// Whether a part of len entries is cut (more than one piece of at most cap, cap >= 1): the table builder
// and the kernel's usual CTA (which then exits) decide by this one rule.
FLASHMSA_HOST_DEVICE inline bool list_part_cut(int len, int cap) { return len > cap; }

// The records a part of len entries puts in the overflow table: none when one piece holds it, else all
// its pieces (its own (chunk, block) CTA then exits), so that a cut part's pieces start with the first
// CTAs of the group's grid range instead of one of them waiting for the part's place in grid order.
FLASHMSA_HOST_DEVICE inline int list_piece_overflow(int len, int cap) {
  return list_part_cut(len, cap) ? list_piece_count(len, cap) : 0;
}

// The most overflow records that a proxy group's list parts, holding `entries` entries in all, can make:
// a cut part (len > cap) makes ceil(len / cap) <= floor(len / cap) + 1 <= 2 floor(len / cap), and those
// floors sum to at most floor(entries / cap). The overflow grid's extent per group.
inline int64_t max_overflow_pieces(int64_t entries, int cap) { return 2 * (entries / cap); }

}  // namespace flashmsa
