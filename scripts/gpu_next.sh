#!/usr/bin/env bash
# The next device call (prepared in the twentieth session). Binaries, built here for sm_90a and
# git-ignored, travel with carry ["ab8"]; rebuild them with
#   bash scripts/build_variants.sh ab8 main=<main>:tests fv=exp/finprep-vector:tests sp=exp/select-pipelined:tests
#   ab8/run_main, ab8/tests_main   main.
#   ab8/run_fv, ab8/tests_fv       exp/finprep-vector: the forward's finprep kernel (finalize the
#                  previous chunk's o / lse, prepare the next chunk's mref and zeroed accumulator) with
#                  half a warp per row and 16-byte accesses instead of a warp per row with 8-byte q / o
#                  accesses. ncu at dbe42fa: finprep 1.89 ms of m3/64k kernel time beside 12.87 ms of
#                  kvw_fwd; it runs where the other lane's launch leaves SMs idle.
#   ab8/run_sp, ab8/tests_sp       exp/select-pipelined: the selector's consumers issue a pair of blocks'
#                  products and pool / top-K the first while the second runs (two accumulators,
#                  setmaxnreg 40 / 232), where each warpgroup waited for its one product before that work.
# STAGES: tests (fv's forward / graph / workspace tests and memcheck of its KV-major forward tests; sp's
# forward / graph tests and memcheck of the selection edge cases), ab (main / fv / sp at m3 64k, 32k,
# fm16k, 2 rounds, every run checked against fp64).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashmsa-next}
mkdir -p "$OUT"
STAGES=${STAGES:-tests}
for f in ab8/*.xz; do [ -f "$f" ] && [ ! -x "${f%.xz}" ] && xz -d -k -T4 "$f" && chmod +x "${f%.xz}"; done
# variant_tests NAME FILTER MEMCHECK_FILTER: ab8/tests_NAME's FILTER, then memcheck of MEMCHECK_FILTER.
variant_tests() {
  timeout 200 "ab8/tests_$1" --gtest_brief=1 --gtest_filter="$2" > "$OUT/tests_$1.log" 2>&1
  echo "$1 tests: exit $?"; tail -n 3 "$OUT/tests_$1.log"
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 "ab8/tests_$1" --gtest_brief=1 \
    --gtest_filter="$3" > "$OUT/memcheck_$1.log" 2>&1
  echo "memcheck $1: exit $?"; tail -n 2 "$OUT/memcheck_$1.log"
}
if [[ " $STAGES " == *" tests "* ]]; then
  variant_tests fv 'CudaForward.*:CudaGraph.*:CudaWorkspace.*' '*WgmmaKv*'
  variant_tests sp 'CudaForward.*:CudaGraph.*' \
    'CudaForward.FewerVisibleBlocksThanK:CudaForward.LocalOnlyK1:CudaForward.ThreeLocalBlocks:CudaForward.LargeK:CudaForward.GqaD64SeveralSequences'
fi
if [[ " $STAGES " == *" ab "* ]]; then
  export ROUNDS=${ROUNDS:-2}
  export CONFIGS=${CONFIGS:-"m3_64k:--seqlen 65536;m3_32k:--seqlen 32768;fm16k:--seqlen 16384 --heads 16 --kv-heads 2"}
  export VARIANTS=${VARIANTS:-"main=ab8/run_main;fv=ab8/run_fv;sp=ab8/run_sp"}
  OUT=$OUT bash scripts/gpu_ab.sh
fi
