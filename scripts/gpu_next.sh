#!/usr/bin/env bash
# A device call for variant A/Bs (written in the twentieth session). Binaries, built here for sm_90a and
# git-ignored, travel with carry ["ab9"]; rebuild them with
#   bash scripts/build_variants.sh ab9 main=<main> det4=exp/det-fwd-m4:tests
#   ab9/run_main                   main (device code of 9647a8f).
#   ab9/run_det4, ab9/tests_det4   exp/det-fwd-m4: deterministic mode's two-pass fixed-point KV-major
#                  forward for groups of 4 heads too (fm16k-like shapes took the query-major kernel); the
#                  GPU tests gain m = 4 deterministic shapes (CudaForward.WgmmaKvDeterministic: vs the CPU
#                  backend and the fast form, bitwise over reruns with 1 / 3 streams and chunk 256, rows
#                  without their own block, FLASHMSA_DET_FWD=query; WgmmaKvDeterministicNonFiniteInput;
#                  CudaGraph.TrainingStepCapturedAndReplayedDeterministic).
# Both stages ran in the twentieth session (det4 merged, 3b5f2d8; perf-notes); kept as the template for the
# next variant A/B. (Before: the A/B of exp/finprep-vector and exp/select-pipelined, same session.)
# STAGES: tests (det4's forward / deterministic / graph tests, memcheck of its deterministic forward
# test), ab (main / det4 at fm16k deterministic and fast, m3 64k deterministic, 2 rounds, checked).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashmsa-next}
mkdir -p "$OUT"
STAGES=${STAGES:-tests}
for f in ab9/*.xz; do [ -f "$f" ] && [ ! -x "${f%.xz}" ] && xz -d -k -T4 "$f" && chmod +x "${f%.xz}"; done
# variant_tests NAME FILTER MEMCHECK_FILTER: ab9/tests_NAME's FILTER, then memcheck of MEMCHECK_FILTER.
variant_tests() {
  timeout 240 "ab9/tests_$1" --gtest_brief=1 --gtest_filter="$2" > "$OUT/tests_$1.log" 2>&1
  echo "$1 tests: exit $?"; tail -n 3 "$OUT/tests_$1.log"
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 "ab9/tests_$1" --gtest_brief=1 \
    --gtest_filter="$3" > "$OUT/memcheck_$1.log" 2>&1
  echo "memcheck $1: exit $?"; tail -n 2 "$OUT/memcheck_$1.log"
}
if [[ " $STAGES " == *" tests "* ]]; then
  variant_tests det4 'CudaForward.*:CudaBackward.*Determin*:CudaGraph.*' 'CudaForward.WgmmaKvDeterministicNonFiniteInput'
fi
if [[ " $STAGES " == *" ab "* ]]; then
  ROUNDS=${ROUNDS:-2} \
    CONFIGS=${CONFIGS:-"fm16k_det:--seqlen 16384 --heads 16 --kv-heads 2 --deterministic;fm16k:--seqlen 16384 --heads 16 --kv-heads 2;m3_64k_det:--seqlen 65536 --deterministic"} \
    VARIANTS=${VARIANTS:-"main=ab9/run_main;det4=ab9/run_det4"} OUT=$OUT bash scripts/gpu_ab.sh
fi
