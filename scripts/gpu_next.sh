#!/usr/bin/env bash
# The next device session's calls (the modes; the next calls themselves are listed below).
#   bash scripts/gpu_next.sh          a full record on main's build (the GPU suite, the 47-test memcheck,
#                                     racecheck of the mma.sync paths, the PyTorch CUDA tests, the main job, the
#                                     scale runs, the benchmark over every config). Build first:
#                                     bash scripts/build_gpu_bundle.sh; carry ["scratch-gpu"]. ~9.5 min as three
#                                     calls: STAGES="tests racecheck" (~3 min: the suite 2.1, racecheck's three
#                                     runs ~0.6 in the thirty-third session), STAGES="sanitizer python main
#                                     scale" (~4.5 min) and STAGES=bench (~1.5 min).
#   bash scripts/gpu_next.sh ab       an A/B of binaries built by scripts/build_variants.sh into $AB_DIR
#                                     (carry it): the GPU forward and backward tests of each non-main variant
#                                     with a tests_<name> binary, then gpu_ab.sh over $VARIANTS (default: every
#                                     run_<name> in $AB_DIR) and $CONFIGS, every run checked against fp64.
#                                     e.g. with
#     bash scripts/build_variants.sh ab21 main=main x=exp/some-branch:tests
#     and carry ["ab21"]: AB_DIR=ab21 TEST_FILTER='CudaBackward.*:CudaGraph.*' bash scripts/gpu_next.sh ab
# Next (as of the fifty-first session: no H200 for four sessions; its H100 calls found that the memory clock
# query cost each default backward ~0.6 ms (now cached, 7487f70); scratch-gpu must be rebuilt from a commit at
# or after 7487f70 so that the sweep's default is fair):
#   1. the backward's chunk count on an H200 since the own-block pass. On the H100 T / 16 beat T / 4 by
#      3.4 ms at m3/64k, T / 8 beat none by 3.0 ms at m3/16k, and any count beat none by 0.6 ms at fm16k
#      (the own-block pass comes with chunks): step 5.08 -> 4.42 there. The H200 still takes T / 4 .. T / 5
#      from 20k tokens, none below, measured before the pass. Branch exp/chunks-all-cards (7654164: the H100
#      rule on every card) is the change to land if the H200 gains too (fm16k's 3.6 ms goal: 4.06 now).
#      Bundles: main's (bash scripts/build_gpu_bundle.sh) in scratch-gpu and the branch's moved to
#      scratch-cand (git checkout exp/chunks-all-cards && bash scripts/build_gpu_bundle.sh && mv scratch-gpu
#      scratch-cand && git checkout main && bash scripts/build_gpu_bundle.sh); carry ["scratch-gpu",
#      "scratch-cand"] and run END_S=560 bash scripts/gpu_next.sh chunks (timeout_s 580): the candidate's
#      default checked at 64k and fm16k, its benchmark (a record if it lands), main's sweep of 8 / 16 chunks
#      at 64k / fm16k / 16k / 32k, the candidate's suite with time to spare. ONLY_H200=1 returns at once
#      on an H100 (its comparison is done: bench/results/h100_query_cost_ab.log); with less than ~300 s of
#      device time, QUICK=1 END_S=190 runs only the candidate beside main's default and 8 chunks, checked.
#      If it lands: git merge exp/chunks-all-cards-on-main (f3d894c, the branch merged onto main with the
#      cached query's conflict resolved), then README / design.md / perf-notes with the H200 figures.
#   2. the record's other stages on the H200 with HEAD's bundle (tests, sanitizer, python, main, scale).
#   For an A/B of builds, use the ab mode
#   above. A call that must run on an H200 checks the card first (a call for nvidia-h200 may get an H100):
#   nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || exit 3
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-record}
if [ "$mode" = record ]; then
  exec bash scripts/gpu_check.sh  # its stages: $STAGES, else all
fi
if [ "$mode" = chunks ]; then
  # Item 1 above on whichever card came: carry ["scratch-gpu", "scratch-cand"] (main's bundle, and
  # exp/chunks-all-cards' moved there). An H200 checks the candidate's default path, takes its
  # benchmark, sweeps the counts at 64k / 32k / 16k and fm16k on main's bundle, and runs the
  # candidate's suite if time is left; an H100 only checks the candidate's default path beside main's.
  OUT=${OUT:-/tmp/flashmsa-next}
  B=scratch-gpu/flashmsa_run K=scratch-cand/flashmsa_run  # gpu_ab.sh / gpu_check.sh unpack the .xz
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
  echo "card: $card"
  [ "${ONLY_H200:-0}" = 1 ] && [[ $card != *H200* ]] && { echo "not an H200 (ONLY_H200=1): nothing run"; exit 3; }
  if [[ $card == *H200* ]]; then
    # END_S: the call's limit in seconds. The candidate first (its default path checked, then its
    # benchmark), then the sweep on main's bundle in the time left (gpu_ab.sh's log comes back if cut);
    # the candidate's suite (its shapes lie below the chunked range) only with time to spare.
    END=${END_S:-585}
    if [ "${QUICK:-0}" = 1 ]; then  # a short call: the candidate beside main's default and 8 chunks, checked
      VARIANTS="cand=$K;def=$B;c8=$B,FLASHMSA_BWD_CHUNKS=8" \
        CONFIGS="m3_64k:--seqlen 65536;fm16k:--seqlen 16384 --heads 16 --kv-heads 2;m3_16k:--seqlen 16384;m3_32k:--seqlen 32768" \
        ROUNDS=1 CHECK=1 OUT=$OUT/quick timeout $((END - SECONDS - 5)) bash scripts/gpu_ab.sh | tail -n 18
      # QUICK_BENCH=1: then the candidate's benchmark in the time left (a record if it lands)
      left=$((END - SECONDS))
      [ "${QUICK_BENCH:-0}" = 1 ] && [ $left -gt 120 ] && BIN=scratch-cand STAGES=bench BENCH_TIMEOUT=$((left - 15)) \
        OUT=$OUT/cand bash scripts/gpu_check.sh | tail -n 30
      exit 0
    fi
    VARIANTS="cand=$K" CONFIGS="m3_64k:--seqlen 65536;fm16k:--seqlen 16384 --heads 16 --kv-heads 2" ROUNDS=1 \
      CHECK=1 OUT=$OUT/checked timeout 60 bash scripts/gpu_ab.sh | tail -n 5
    BIN=scratch-cand STAGES=bench BENCH_TIMEOUT=200 OUT=$OUT/cand bash scripts/gpu_check.sh | tail -n 30
    VARIANTS="def=$B;c8=$B,FLASHMSA_BWD_CHUNKS=8;c16=$B,FLASHMSA_BWD_CHUNKS=16" \
      CONFIGS="m3_64k:--seqlen 65536;fm16k:--seqlen 16384 --heads 16 --kv-heads 2;m3_16k:--seqlen 16384;m3_32k:--seqlen 32768" \
      ROUNDS=2 CHECK=0 OUT=$OUT/sweep timeout $((END - SECONDS - 10)) bash scripts/gpu_ab.sh | tail -n 18
    left=$((END - SECONDS))
    [ $left -gt 150 ] && timeout $((left - 10)) scratch-cand/flashmsa_gpu_tests --gtest_brief=1 > "$OUT/cand/gpu_tests.log" 2>&1
    echo "candidate's GPU suite: exit $? (left ${left}s)"; grep -E "FAILED|PASSED" "$OUT/cand/gpu_tests.log" | tail -n 8
  else  # the candidate (no clock query) beside main's default (the query cached) and main with the same
    # chunks forced (no query): the three should now read alike on an H100
    VARIANTS="cand=$K;def=$B;c16=$B,FLASHMSA_BWD_CHUNKS=16" CONFIGS="m3_64k:--seqlen 65536;fm16k:--seqlen 16384 --heads 16 --kv-heads 2" \
      ROUNDS=2 CHECK=1 OUT=$OUT/cand_h100 timeout 200 bash scripts/gpu_ab.sh | tail -n 12
  fi
  exit 0
fi
OUT=${OUT:-/tmp/flashmsa-next}
mkdir -p "$OUT"
D=${AB_DIR:?AB_DIR: the directory build_variants.sh wrote}
for f in "$D"/*.xz; do [ -f "$f" ] && [ ! -x "${f%.xz}" ] && xz -d -k -T8 "$f" && chmod +x "${f%.xz}"; done
variants=
for b in "$D"/run_*; do
  case $b in *.xz) continue ;; esac
  name=${b##*/run_}
  variants+="${variants:+;}$name=$b"
  # TEST_VARIANTS: the names whose tests_<name> run (default: every variant that has one).
  if [ "$name" != main ] && [ -x "$D/tests_$name" ] && [[ " ${TEST_VARIANTS:-$name} " == *" $name "* ]]; then
    timeout 240 "$D/tests_$name" --gtest_brief=1 --gtest_filter="${TEST_FILTER:-CudaForward.*:CudaBackward.*}" \
      > "$OUT/tests_$name.log" 2>&1
    echo "$name tests: exit $?"; grep -E "FAILED|PASSED" "$OUT/tests_$name.log" | tail -n 8
  fi
done
ROUNDS=${ROUNDS:-2} \
  CONFIGS=${CONFIGS:-"m3_64k:--seqlen 65536;m3_32k:--seqlen 32768;fm16k:--seqlen 16384 --heads 16 --kv-heads 2"} \
  VARIANTS=${VARIANTS:-$variants} OUT=$OUT timeout 400 bash scripts/gpu_ab.sh
