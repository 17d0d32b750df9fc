#!/usr/bin/env bash
# Builds the L2-window timing probes of docs/prepared/probe-l2-window.patch (wrong results by design)
# for an A/B on the device: one commit per variant on a throwaway branch, then build_variants.sh.
#   p0    the patch with both windows 0 (the base: the patch alone changes the SASS a little)
#   dq    dQ / dqp reduce-adds folded into a 1024-token window (32 MB of dQ rows at H = 64: in L2)
#   ga    gathered Q / dO / Qp rows folded into a 1024-token window
#   both  both
# Then on the device (carry [DIR]): AB_DIR=DIR CHECK=0 ROUNDS=2 bash scripts/gpu_next.sh ab
#   bash scripts/build_probe_variants.sh ab35
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: build_probe_variants.sh DIR}
WINDOW=${WINDOW:-1024}
base=$(git rev-parse HEAD)
patch=$PWD/docs/prepared/probe-l2-window.patch
wt=$(mktemp -d)
git worktree add -f --detach "$wt" "$base" >/dev/null
trap 'git worktree remove --force "$wt" 2>/dev/null; git worktree prune' EXIT
specs=()
for v in p0:0:0 dq:$WINDOW:0 ga:0:$WINDOW both:$WINDOW:$WINDOW; do
  IFS=: read -r name wdq wga <<< "$v"
  (cd "$wt" && git checkout -q --detach "$base" && git apply "$patch" &&
    sed -i "s/^#define FLASHMSA_PROBE_DQ_WINDOW 0$/#define FLASHMSA_PROBE_DQ_WINDOW $wdq/; s/^#define FLASHMSA_PROBE_GATHER_WINDOW 0$/#define FLASHMSA_PROBE_GATHER_WINDOW $wga/" \
      src/cuda/sm90/backward_wgmma.cuh &&
    git -c user.name=probe -c user.email=probe@localhost commit -qam "probe $name (dq $wdq, gather $wga)")
  specs+=("$name=$(git -C "$wt" rev-parse HEAD)")
done
bash scripts/build_variants.sh "$DIR" "${specs[@]}"
