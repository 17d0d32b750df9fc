#!/usr/bin/env bash
# Builds timing probes (wrong results by design) from a prepared patch for an A/B on the device:
# the patch applied on HEAD, one commit per variant on a throwaway worktree with the patch's macros
# set, then build_variants.sh. A variant is name=FILE:MACRO=VALUE[,MACRO=VALUE...]; every macro must
# appear in FILE as "#define MACRO 0".
#   bash scripts/build_probe_variants.sh ab35 docs/prepared/probe-l2-window.patch \
#     p0=src/cuda/sm90/backward_wgmma.cuh:FLASHMSA_PROBE_DQ_WINDOW=0 \
#     dq=src/cuda/sm90/backward_wgmma.cuh:FLASHMSA_PROBE_DQ_WINDOW=1024
#   bash scripts/build_probe_variants.sh ab37 docs/prepared/probe-forward.patch \
#     p0=src/cuda/sm90/forward_kv_wgmma.cu:FLASHMSA_PROBE_FWD=0 nr=src/cuda/sm90/forward_kv_wgmma.cu:FLASHMSA_PROBE_FWD=1
# Then on the device (carry [DIR]): AB_DIR=DIR CHECK=0 ROUNDS=2 bash scripts/gpu_next.sh ab
# (p0, the patch with its macros 0, is the base: the patch alone can move the SASS a little.)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: build_probe_variants.sh DIR PATCH name=FILE:MACRO=VALUE[,...]...}
patch=$(realpath "${2:?usage: build_probe_variants.sh DIR PATCH name=FILE:MACRO=VALUE[,...]...}")
shift 2
base=$(git rev-parse HEAD)
wt=$(mktemp -d)
git worktree add -f --detach "$wt" "$base" >/dev/null
trap 'git worktree remove --force "$wt" 2>/dev/null; git worktree prune' EXIT
specs=()
for v in "$@"; do
  name=${v%%=*} rest=${v#*=}
  file=${rest%%:*} defs=${rest#*:}
  (cd "$wt" && git checkout -q --detach "$base" && git apply "$patch" &&
    IFS=, && for d in $defs; do
      grep -q "^#define ${d%%=*} 0$" "$file" || { echo "no '#define ${d%%=*} 0' in $file" >&2; exit 1; }
      sed -i "s/^#define ${d%%=*} 0$/#define ${d%%=*} ${d#*=}/" "$file"
    done &&
    git -c user.name=probe -c user.email=probe@localhost commit -qam "probe $name ($defs)")
  specs+=("$name=$(git -C "$wt" rev-parse HEAD)")
done
bash scripts/build_variants.sh "$DIR" "${specs[@]}"
