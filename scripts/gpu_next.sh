#!/usr/bin/env bash
# The next device calls (prepared in the eighteenth session, not run yet). Binaries, built here for
# sm_90a and git-ignored, travel with carry ["ab4"]; rebuild them with
#   bash scripts/build_variants.sh ab4 main=86fa645:tests si=exp/bwd-split-issue:tests
#   ab4/run_main, ab4/tests_main   main at 86fa645 (the backward's side accumulators and the student
#                  lse's partials in dq's buffer, device code of 5d55212). Its full suite last ran at
#                  691f611 (78dea4a: 19 tests); the workspace tests' run_with_allocator, the new
#                  CudaWorkspace.DqOnlySixteenByteAligned and the review fixes of 86fa645 (host side:
#                  block_idx in the overlap check, the placement rule for the index scratch) are
#                  compiled only.
#   ab4/run_si, ab4/tests_si       exp/bwd-split-issue: with token rows (m = 8, 16), a head step's dQ
#                  bulk reduce-adds split between the warpgroups (each WG's warp 0 issues and waits for
#                  half the tokens) instead of all on WG 0's warp 0, which WG 1 then waited for at DsFree
#                  (10.9% of the m3/64k backward's samples at dbe42fa). Same HGMMA / barrier structure,
#                  168 registers, no local memory; RM = 0 (fm16k) unchanged.
# STAGES: tests (~4 min: main's full suite, si's backward-side tests, memcheck of si's token-row
# tests), ab (~4 min: main / si at m3 64k, 32k and gqa8 64k, 2 rounds). Then, if si wins, merge it
# and make a record run (scripts/build_gpu_bundle.sh, carry ["scratch-gpu"], gpu_check.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashmsa-next}
mkdir -p "$OUT"
STAGES=${STAGES:-tests}
for f in ab4/*.xz; do [ -f "$f" ] && [ ! -x "${f%.xz}" ] && xz -d -k -T4 "$f" && chmod +x "${f%.xz}"; done
if [[ " $STAGES " == *" tests "* ]]; then
  timeout 240 ab4/tests_main --gtest_brief=1 > "$OUT/tests_main.log" 2>&1
  echo "main tests: exit $?"; tail -n 3 "$OUT/tests_main.log"
  timeout 150 ab4/tests_si --gtest_brief=1 \
    --gtest_filter='CudaBackward.*:CudaWarmup.*:CudaGraph.*:CudaWorkspace.*:CudaForward.*Kl*' > "$OUT/tests_si.log" 2>&1
  echo "si tests: exit $?"; tail -n 3 "$OUT/tests_si.log"
  timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 ab4/tests_si --gtest_brief=1 \
    --gtest_filter='*TokenRows*' > "$OUT/memcheck_si.log" 2>&1
  echo "memcheck si: exit $?"; tail -n 2 "$OUT/memcheck_si.log"
fi
if [[ " $STAGES " == *" ab "* ]]; then
  export ROUNDS=${ROUNDS:-2}
  export CONFIGS=${CONFIGS:-"m3_64k:--seqlen 65536;m3_32k:--seqlen 32768;gqa8_64k:--seqlen 65536 --heads 32 --kv-heads 4"}
  export VARIANTS=${VARIANTS:-"main=ab4/run_main;si=ab4/run_si"}
  OUT=$OUT bash scripts/gpu_ab.sh
fi
