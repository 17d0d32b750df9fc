#!/usr/bin/env bash
# The next device calls (prepared in the sixteenth session, not run yet). Binaries, built here for
# sm_90a and git-ignored (scripts/build_ab2.sh rebuilds them from their branches), travel with
# carry ["ab2"]:
#   ab2/run_main    main's flashmsa_run (device code of 3b3dc60, the record)
#   ab2/run_lean    branch exp/bwd-producer-lean: the wgmma backward's producer copies each 128-byte
#                   row slab in one asm block (one source pointer with immediates, XOR-swizzled
#                   slots) and forms the next step's source offset before its wait; its step loop
#                   263 -> 219 SASS instructions, the head step's copies ~118 -> ~63
#   ab2/run_olean   branch exp/bwd-order-lean = lean + the 2-D sweep grid (FLASHMSA_BWD_ORDER);
#                   its producer loop is lean's (219), with no constant load before the copies
#   ab2/run_pf      branch exp/bwd-producer-prefetch = lean + each step's list entry loaded a step
#                   earlier (its L2 latency held 4.4% of all stall samples at 3765cc9, in the
#                   producer's chain to the next stage); step loop 240 instructions
#   ab2/run_dr      branch exp/bwd-defer-release = pf + a step's stage released part-way into the
#                   next step instead of right after its dQ bulk reduce-adds (a timing-only build
#                   that skipped that wait: 44.9 against 46.2 / 47.5 ms, perf-notes); the producer
#                   then has ~2/3 of a step to refill it
#   ab2/tests_lean, ab2/tests_olean, ab2/tests_pf, ab2/tests_dr   their GPU test suites
#   ab2/run_si      exp/select-interleave (head-interleaved selector grid; a copy of ab/run_si)
# The question (perf-notes, sixteenth session): the sweep builds ran 1.0 ms slower than main in
# main's own CTA order with the consumers' loop unchanged; a SASS diff found only the producer's
# step changed (a constant load on the copies' address chain, +4 instructions) and ncu ~4% more
# memory stalls. If the producer's per-step chain is what the consumers wait for, lean is faster
# than main, olean in block-major order ~ lean, and its sweep orders keep their 1.2-2.2 ms.
# STAGES: tests (~5 min), races (<= 5: racecheck / synccheck of dr), ab (~9), warm (~2: the dense
# warm-up), si (~1), stalls (~4: stall reasons and SASS stall samples);
# one call each, tests first. All of them take ~26 of the 30 device minutes, so: tests, ab, then
# races only if dr wins (it must pass them before landing), stalls / warm / si as time allows, and a
# record run (gpu_check.sh, ~6 min) only for a variant that lands.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashmsa-next}
mkdir -p "$OUT"
STAGES=${STAGES:-tests}
for f in ab2/*.xz; do [ -f "$f" ] && xz -d -f -T4 "$f"; done
chmod +x ab2/* 2>/dev/null
if [[ " $STAGES " == *" tests "* ]]; then
  timeout 240 ab2/tests_olean --gtest_brief=1 > "$OUT/tests_olean.log" 2>&1
  echo "olean tests: exit $?"; tail -n 3 "$OUT/tests_olean.log"
  for v in lean pf dr; do  # the tests that run the changed backward kernel (incl. the KL value's)
    timeout 120 "ab2/tests_$v" --gtest_brief=1 \
      --gtest_filter='CudaBackward.*:CudaWarmup.*:CudaGraph.*:CudaForward.*Kl*:CudaWorkspace.*' > "$OUT/tests_$v.log" 2>&1
    echo "$v tests: exit $?"; tail -n 3 "$OUT/tests_$v.log"
  done
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 ab2/tests_olean --gtest_brief=1 \
    --gtest_filter='CudaBackward.TokenRowsGroupOf16FourGroups:CudaWarmup.GqaD64TwoSequences:*KlValueKvMajor*' > "$OUT/memcheck.log" 2>&1
  echo "memcheck: exit $?"; tail -n 3 "$OUT/memcheck.log"
fi
if [[ " $STAGES " == *" races "* ]]; then
  # dr moves a release of shared memory: racecheck / synccheck on small token-row and per-head cases.
  for tool in racecheck synccheck; do
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 ab2/tests_dr --gtest_brief=1 \
      --gtest_filter='CudaBackward.TokenRowsGroupOf8:CudaBackward.WgmmaSharedKvFm16kLike' > "$OUT/${tool}_dr.log" 2>&1
    echo "$tool dr: exit $?"; tail -n 2 "$OUT/${tool}_dr.log"
  done
fi
if [[ " $STAGES " == *" ab "* ]]; then
  export ROUNDS=${ROUNDS:-2}
  export CONFIGS=${CONFIGS:-"m3_64k:--seqlen 65536;m3_32k:--seqlen 32768;fm16k:--seqlen 16384 --heads 16 --kv-heads 2"}
  export VARIANTS=${VARIANTS:-"main=ab2/run_main;lean=ab2/run_lean;pf=ab2/run_pf;dr=ab2/run_dr;olean=ab2/run_olean;olean_o2=ab2/run_olean,FLASHMSA_BWD_ORDER=2;olean_o1=ab2/run_olean,FLASHMSA_BWD_ORDER=group"}
  OUT=$OUT bash scripts/gpu_ab.sh
fi
if [[ " $STAGES " == *" warm "* ]]; then  # the dense warm-up runs the same backward kernel (token rows)
  ROUNDS=${ROUNDS:-2} CONFIGS="m3_16k_warmup:--seqlen 16384 --mode warmup" \
    VARIANTS="main=ab2/run_main;lean=ab2/run_lean;pf=ab2/run_pf;dr=ab2/run_dr;olean=ab2/run_olean" \
    OUT=$OUT/warm bash scripts/gpu_ab.sh
fi
if [[ " $STAGES " == *" si "* ]]; then  # selection only matters here: no fp64 check
  CHECK=0 ROUNDS=${ROUNDS:-3} CONFIGS="m3_8k:--seqlen 8192;m3_32k:--seqlen 32768;m3_64k:--seqlen 65536" \
    VARIANTS="main=ab2/run_main;si=ab2/run_si" OUT=$OUT/si bash scripts/gpu_ab.sh
fi
# stalls: one m3/64k backward launch per variant under ncu (scripts/gpu_stalls.sh): its stall
# reasons per issued instruction (top lines printed, all in bwd_<v>_details.txt) and the SASS with
# its stall samples, summarised by sass_stalls.py: the samples on the consumers' full-barrier waits
# are the time they wait for the producer's stage.
if [[ " $STAGES " == *" stalls "* ]]; then
  for v in main lean pf dr; do
    mkdir -p "/tmp/bin_$v" && ln -sf "$PWD/ab2/run_$v" "/tmp/bin_$v/flashmsa_run"
    echo "== $v"
    BIN=/tmp/bin_$v OUT=$OUT SEQ=65536 NAME=bwd_$v timeout 200 bash scripts/gpu_stalls.sh | head -8
    python3 scripts/sass_stalls.py "$OUT/bwd_${v}_sass.csv" 12
    gzip -f "$OUT/bwd_${v}_sass.csv"
  done
fi
