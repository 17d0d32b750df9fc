#!/usr/bin/env bash
# Rebuilds the ab2/ binaries scripts/gpu_next.sh compares (if the checkout that made them is gone),
# each from its commit in a worktree under $WT (default /work/wt-ab2), sharing ccache
# (CCACHE_BASEDIR=/work: a variant recompiles only what it changes).
set -euo pipefail
cd "$(dirname "$0")/.."
WT=${WT:-/work/wt-ab2}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-/work}
mkdir -p ab2 "$WT"
build() {  # name commit-ish [tests]: ab2/run_<name>.xz (and ab2/tests_<name>.xz)
  local name=$1 rev=$2 tests=${3:-} dir="$WT/$1"
  [ -f "ab2/run_$name.xz" ] && { echo "ab2/run_$name.xz exists"; return; }
  git worktree add -f --detach "$dir" "$rev" >/dev/null
  (cd "$dir" && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null &&
    cmake --build build --target flashmsa_run ${tests:+flashmsa_gpu_tests} >/dev/null)
  cp "$dir/build/apps/flashmsa_run" "ab2/run_$name"
  [ -n "$tests" ] && cp "$dir/build/tests/gpu/flashmsa_gpu_tests" "ab2/tests_$name"
  strip --strip-debug ab2/*_"$name"
  xz -f -T2 ab2/*_"$name"
  git worktree remove --force "$dir"
}
build main 3b3dc60                              # the record's device code
build lean exp/bwd-producer-lean tests
build pf exp/bwd-producer-prefetch tests
build dr exp/bwd-defer-release tests
build olean exp/bwd-order-lean tests
build si exp/select-interleave                 # the head-interleaved selector grid
git worktree prune
ls -la ab2
