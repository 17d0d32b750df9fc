#!/usr/bin/env bash
# The next device calls (prepared in the nineteenth session, not run yet). Binaries, built here for
# sm_90a and git-ignored, travel with carry ["ab7"]; rebuild them with
#   bash scripts/build_variants.sh ab7 main=c5cedd0:tests fv=exp/finprep-vector:tests noq=exp/finprep-noq \
#     det4=exp/det-fwd-m4:tests sp=exp/select-pipelined:tests
#   ab7/run_main, ab7/tests_main   main (device code of c5cedd0 / 86fa645; 101/101 GPU tests there).
#   ab7/run_fv, ab7/tests_fv       exp/finprep-vector: the forward's finprep kernel (finalize the
#                  previous chunk's o / lse, prepare the next chunk's mref and zeroed accumulator) with
#                  half a warp per row and 16-byte accesses instead of a warp per row with 8-byte q / o
#                  accesses (what made di_kernel / convert_acc_kernel ~0.9 ms faster in the backward).
#                  ncu at dbe42fa: finprep 1.89 ms of m3/64k kernel time beside 12.87 ms of kvw_fwd; the
#                  main kernel's CTAs use the whole register file, so finprep runs only where the other
#                  lane's launch leaves SMs idle: how much of it is on the forward's critical path is
#                  what this measures.
#   ab7/run_noq                    TIMING PROBE on fv (wrong results, its checks FAIL by design):
#                  finprep without the q / k reads (mref = 0): the weight of the 1 GB q read.
#   ab7/run_det4, ab7/tests_det4   exp/det-fwd-m4: deterministic mode's two-pass fixed-point KV-major
#                  forward for groups of 4 heads too (fm16k-like shapes ran the query-major kernel); the
#                  GPU test CudaForward.WgmmaKvDeterministic gains an m = 4, G = 2 shape (vs the CPU
#                  backend and the fast form, bitwise over reruns with 1 / 3 streams and chunk 256,
#                  rows without their own block, FLASHMSA_DET_FWD=query).
#   ab7/run_sp, ab7/tests_sp       exp/select-pipelined: the selector's consumers issue block n + 1's
#                  product before block n's max-pool and top-K (two accumulators; setmaxnreg 40 / 232),
#                  where each warpgroup waited for its product before that work and relied on the other
#                  warpgroup to fill the tensor core (73% of the ceiling at m3/64k). No C7514, no local
#                  memory. If it pays ~10%, selection + forward at 32k gains ~0.1 ms (the 30x point).
# STAGES: tests (~3 min: fv's forward / graph / workspace / KL tests, memcheck of its KV-major
# forward tests; det4's forward and deterministic tests, memcheck of its deterministic forward test),
# ab (~5 min: main / fv / noq at m3 64k and 32k, fm16k (m = 4), det 64k, 2 rounds), det4 (~1 min:
# main / det4 at fm16k deterministic, 2 rounds, checked), sel (~3 min: main / sp at m3 64k, 32k, 8k
# and fm16k, 2 rounds, checked; sp's forward / graph tests and memcheck of its selection edge cases run in
# the tests stage).
# If fv wins: merge it, run the full suite and a record (scripts/build_gpu_bundle.sh, carry
# ["scratch-gpu"], gpu_check.sh tests sanitizer main python scale, then bench m3 32k / 64k).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashmsa-next}
mkdir -p "$OUT"
STAGES=${STAGES:-tests}
for f in ab7/*.xz; do [ -f "$f" ] && [ ! -x "${f%.xz}" ] && xz -d -k -T4 "$f" && chmod +x "${f%.xz}"; done
# variant_tests NAME FILTER MEMCHECK_FILTER: ab7/tests_NAME's FILTER, then memcheck of MEMCHECK_FILTER.
variant_tests() {
  timeout 200 "ab7/tests_$1" --gtest_brief=1 --gtest_filter="$2" > "$OUT/tests_$1.log" 2>&1
  echo "$1 tests: exit $?"; tail -n 3 "$OUT/tests_$1.log"
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 "ab7/tests_$1" --gtest_brief=1 \
    --gtest_filter="$3" > "$OUT/memcheck_$1.log" 2>&1
  echo "memcheck $1: exit $?"; tail -n 2 "$OUT/memcheck_$1.log"
}
if [[ " $STAGES " == *" tests "* ]]; then
  variant_tests fv 'CudaForward.*:CudaGraph.*:CudaWorkspace.*' '*WgmmaKv*'
  variant_tests det4 'CudaForward.*:CudaBackward.*Determin*:CudaGraph.*' 'CudaForward.WgmmaKvDeterministic'
  variant_tests sp 'CudaForward.*:CudaGraph.*' \
    'CudaForward.FewerVisibleBlocksThanK:CudaForward.LocalOnlyK1:CudaForward.ThreeLocalBlocks:CudaForward.LargeK:CudaForward.GqaD64SeveralSequences'
fi
if [[ " $STAGES " == *" ab "* ]]; then
  export ROUNDS=${ROUNDS:-2}
  export CONFIGS=${CONFIGS:-"m3_64k:--seqlen 65536;m3_32k:--seqlen 32768;fm16k:--seqlen 16384 --heads 16 --kv-heads 2;det_64k:--seqlen 65536 --deterministic"}
  export VARIANTS=${VARIANTS:-"main=ab7/run_main;fv=ab7/run_fv;noq=ab7/run_noq"}
  OUT=$OUT bash scripts/gpu_ab.sh
fi
if [[ " $STAGES " == *" det4 "* ]]; then
  ROUNDS=2 CONFIGS="fm16k_det:--seqlen 16384 --heads 16 --kv-heads 2 --deterministic" \
    VARIANTS="main=ab7/run_main;det4=ab7/run_det4" OUT=$OUT/det4 bash scripts/gpu_ab.sh
fi
if [[ " $STAGES " == *" sel "* ]]; then
  ROUNDS=2 CONFIGS="m3_64k:--seqlen 65536;m3_32k:--seqlen 32768;m3_8k:--seqlen 8192;fm16k:--seqlen 16384 --heads 16 --kv-heads 2" \
    VARIANTS="main=ab7/run_main;sp=ab7/run_sp" OUT=$OUT/sel bash scripts/gpu_ab.sh
fi
