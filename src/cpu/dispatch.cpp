// The cpu:: backend entry points of params.h: data checks, the worker team, and the choice of
// the instruction-set copy of the compute (AVX2+FMA when the CPU has it, else portable).
// FLASHMSA_CPU_ISA=generic in the environment forces the portable copy (for testing it).
#include <cstdlib>
#include <string>

#include "cpu/backend.h"

namespace flashmsa {
namespace cpu {
namespace {

bool use_avx2() {
#if FLASHMSA_CPU_HAVE_AVX2
  static const bool yes = [] {
    const char* env = std::getenv("FLASHMSA_CPU_ISA");
    if (env != nullptr && std::string(env) == "generic") return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
#else
  return false;
#endif
}

// No more workers than a few per work item of the coarsest pass.
int team_size(const MsaParams& p, const Layout& lay) {
  const int64_t items = std::max<int64_t>(1, lay.G * p.Hp);
  return static_cast<int>(std::min<int64_t>({resolve_threads(p.num_threads), items, 1024}));
}

void run_select(const MsaParams& p, const Layout& lay, Team& team) {
#if FLASHMSA_CPU_HAVE_AVX2
  if (use_avx2()) return avx2::select_blocks(p, lay, team);
#endif
  generic::select_blocks(p, lay, team);
}

void run_forward(const MsaParams& p, const Layout& lay, Team& team, bool dense) {
#if FLASHMSA_CPU_HAVE_AVX2
  if (use_avx2()) return avx2::attention_forward(p, lay, team, dense);
#endif
  generic::attention_forward(p, lay, team, dense);
}

void run_backward(const MsaParams& p, const Layout& lay, Team& team, bool dense) {
#if FLASHMSA_CPU_HAVE_AVX2
  if (use_avx2()) return avx2::attention_backward(p, lay, team, dense);
#endif
  generic::attention_backward(p, lay, team, dense);
}

// The forward and the backward share their set-up: T = 0 (kl written as 0), block_idx checks.
void attention(const MsaParams& p, bool dense,
               void (*run)(const MsaParams&, const Layout&, Team&, bool)) {
  if (p.T == 0) {
    if (p.kl != nullptr) *p.kl = 0.f;
    return;
  }
  Layout lay(p);
  if (!dense) check_block_idx_contents(p, lay);
  Team team(team_size(p, lay));
  run(p, lay, team, dense);
}

}  // namespace

void select_blocks(const MsaParams& p) {
  if (p.T == 0) return;
  Layout lay(p);
  Team team(team_size(p, lay));
  run_select(p, lay, team);
}

void sparse_attention_forward(const MsaParams& p) { attention(p, false, run_forward); }
void fused_backward(const MsaParams& p) { attention(p, false, run_backward); }
void dense_warmup_forward(const MsaParams& p) { attention(p, true, run_forward); }
void dense_warmup_backward(const MsaParams& p) { attention(p, true, run_backward); }

}  // namespace cpu
}  // namespace flashmsa
