// The CPU compute entry points, one set per instruction set (see dispatch.cpp).
#pragma once

#include "cpu/common.h"

// The AVX2+FMA copy is built with GCC's per-function target pragma (x86-64 GCC only); other
// compilers and targets get the portable copy alone.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define FLASHMSA_CPU_HAVE_AVX2 1
#else
#define FLASHMSA_CPU_HAVE_AVX2 0
#endif

namespace flashmsa {
namespace cpu {

#define FLASHMSA_CPU_DECLARE_ISA(ns)                                                   \
  namespace ns {                                                                       \
  void select_blocks(const MsaParams& p, const Layout& lay, Team& team);               \
  void attention_forward(const MsaParams& p, const Layout& lay, Team& team, bool dense); \
  void attention_backward(const MsaParams& p, const Layout& lay, Team& team, bool dense); \
  }

FLASHMSA_CPU_DECLARE_ISA(generic)
#if FLASHMSA_CPU_HAVE_AVX2
FLASHMSA_CPU_DECLARE_ISA(avx2)
#endif

#undef FLASHMSA_CPU_DECLARE_ISA

}  // namespace cpu
}  // namespace flashmsa
