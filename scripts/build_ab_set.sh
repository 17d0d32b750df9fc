#!/usr/bin/env bash
# Rebuilds the ab/ binaries gpu_next.sh compares (if the checkout that made them is gone), each
# from its commit in a worktree under $WT (default /work/wt-ab), sharing ccache
# (CCACHE_BASEDIR=/work: a variant recompiles only the files it changes). Then
# scripts/build_gpu_bundle.sh on this branch gives scratch-gpu/.
#   bash scripts/build_ab_set.sh            (needs cuobjdump for the layout variants' offsets)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WT=${WT:-/work/wt-ab}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-/work}
mkdir -p ab "$WT"
# name  commit-ish  [layout: N producer nanosleeps, KERNEL]
build() {
  local name=$1 rev=$2 pad=${3:-} kernel=${4:-backward} dir="$WT/$1"
  [ -f "ab/run_$name.xz" ] && { echo "ab/run_$name.xz exists"; return; }
  git worktree add -f --detach "$dir" "$rev" >/dev/null
  (cd "$dir" && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null)
  if [ -n "$pad" ]; then
    # The worktree's own copy (the script works on the tree it lives in; older commits lack it).
    cp scripts/build_layout_variant.sh "$dir/scripts/"
    KERNEL=$kernel BUILD_DIR=build bash "$dir/scripts/build_layout_variant.sh" "$pad" "$ROOT/ab/run_$name"
  else
    (cd "$dir" && cmake --build build --target flashmsa_run flashmsa_gpu_tests >/dev/null)
    cp "$dir/build/apps/flashmsa_run" "ab/run_$name"
    strip --strip-debug "ab/run_$name"
    if [ "$name" = aux ]; then
      cp "$dir/build/tests/gpu/flashmsa_gpu_tests" ab/tests_aux && strip --strip-debug ab/tests_aux && xz -f -T2 ab/tests_aux
    fi
  fi
  xz -f -T2 "ab/run_$name"
  git worktree remove --force "$dir"
}
build main ead6161                # main's device code at the fifteenth session (unchanged since)
build main_p4 ead6161 4
build main_p8 ead6161 8
build main_p12 ead6161 12
build main_f4 ead6161 4 forward
build grid2d_p4 b934370 4         # this branch's 2-D grid (same backward SASS as its bundle)
build bgm1d 578138f               # the slow 1-D form
build si exp/select-interleave
build sl exp/bwd-student-lane
build aux exp/bwd-aux
git worktree prune
ls -la ab
