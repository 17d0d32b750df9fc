#!/usr/bin/env bash
# The next device calls for this branch (FLASHMSA_BWD_ORDER sweeps on a 2-D grid): its GPU tests
# (the order test under memcheck too), then a rotated A/B against main's flashmsa_run and the
# head-interleaved selector (exp/select-interleave) as a side variant.
#   ab/run_main (main's flashmsa_run), ab/run_si (exp/select-interleave's) and scratch-gpu/ (this
#   branch, scripts/build_gpu_bundle.sh). STAGES="tests" or "ab" (one call each: tests ~3 minutes,
#   the A/B ~8 at ROUNDS=2), ROUNDS (default 2), CONFIGS as in gpu_ab.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashmsa-next}
mkdir -p "$OUT"
STAGES=${STAGES:-tests}
BIN=${BIN:-scratch-gpu}
for f in "$BIN"/*.xz ab/*.xz; do [ -f "$f" ] && xz -d -f -T4 "$f"; done
chmod +x "$BIN"/* ab/* 2>/dev/null
if [[ " $STAGES " == *" tests "* ]]; then
  timeout 240 "$BIN/flashmsa_gpu_tests" --gtest_brief=1 > "$OUT/tests.log" 2>&1
  echo "gpu tests: exit $?"; tail -n 3 "$OUT/tests.log"
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/flashmsa_gpu_tests" --gtest_brief=1 \
    --gtest_filter='CudaBackward.TokenRowsGroupOf16FourGroups' > "$OUT/memcheck.log" 2>&1
  echo "memcheck: exit $?"; tail -n 3 "$OUT/memcheck.log"
fi
if [[ " $STAGES " == *" ab "* ]]; then
  export ROUNDS=${ROUNDS:-2}
  export CONFIGS=${CONFIGS:-"m3_64k:--seqlen 65536;m3_32k:--seqlen 32768;fm16k:--seqlen 16384 --heads 16 --kv-heads 2;m3_8k:--seqlen 8192"}
  export VARIANTS=${VARIANTS:-"main=ab/run_main;grid2d=$BIN/flashmsa_run;order2=$BIN/flashmsa_run,FLASHMSA_BWD_ORDER=2;order1=$BIN/flashmsa_run,FLASHMSA_BWD_ORDER=group;si=ab/run_si"}
  OUT=$OUT bash scripts/gpu_ab.sh
fi
