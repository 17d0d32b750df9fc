#!/usr/bin/env bash
# Builds flashmsa_run (and, with ":tests", the GPU test suite) of several commits for an A/B on the
# device (scripts/gpu_ab.sh), each in a worktree under $WT (default /work/wt-variants) sharing ccache
# (CCACHE_BASEDIR=/work: a variant recompiles only what it changes), into DIR/run_<name>.xz and
# DIR/tests_<name>.xz (DIR git-ignored; the device call carries it). An existing binary is kept.
#   bash scripts/build_variants.sh ab3 main=dbe42fa pr=exp/bwd-producer-reduce:tests
# Code-layout probes (N instructions more before a kernel's producer): scripts/build_layout_variant.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: build_variants.sh DIR name=commit[:tests]...}
shift
WT=${WT:-/work/wt-variants}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-/work}
mkdir -p "$DIR" "$WT"
for spec in "$@"; do
  name=${spec%%=*} rev=${spec#*=} tests=
  [[ $rev == *:tests ]] && { rev=${rev%:tests}; tests=1; }
  if [ -f "$DIR/run_$name.xz" ]; then echo "$DIR/run_$name.xz exists"; continue; fi
  dir="$WT/$name"
  git worktree add -f --detach "$dir" "$rev" >/dev/null
  (cd "$dir" && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null &&
    cmake --build build --target flashmsa_run ${tests:+flashmsa_gpu_tests} >/dev/null)
  cp "$dir/build/apps/flashmsa_run" "$DIR/run_$name"
  [ -n "$tests" ] && cp "$dir/build/tests/gpu/flashmsa_gpu_tests" "$DIR/tests_$name"
  strip --strip-debug "$DIR"/*_"$name"
  xz -f -T2 "$DIR"/*_"$name"
  git worktree remove --force "$dir"
done
git worktree prune
ls -la "$DIR"
