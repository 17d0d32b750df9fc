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
#   bash scripts/gpu_next.sh either   whichever card comes: an H200 runs the record's benchmark, an H100 the dkp
#                                     bulk A/B (items 0 and 1 below; carry ["scratch-gpu", "ab60"]).
#   bash scripts/gpu_next.sh rule     HEAD's chunk rule (T / 8 from 16k to 32k tokens on the H200, 2ee1f4c) beside
#                                     the previous default: carry ["scratch-gpu", "scratch-main"] (HEAD's bundle,
#                                     and 7487f70's in scratch-main), END_S=<limit>; an A/B at m3 16k / 24k / 32k
#                                     / 64k, gqa8 16k (not yet run with chunks on an H200) and fm16k, checked,
#                                     then HEAD's benchmark in the time left (the next record). ~4-5 min.
#                                     RULE_CONFIGS (gpu_ab.sh's CONFIGS) narrows the A/B for a short call.
# Next (as of the fifty-ninth session: eight starts for an H200 found none; four H100 calls ran the sink work,
# bench/results/h100_b54c15a_sinks2, and the token divider, h100_token_divider; both landed. The `sinks2` mode
# that ran them is gone: git show b54c15a:scripts/gpu_next.sh):
#   The first call of a session, whatever card comes: `END_S=570 bash scripts/gpu_next.sh either` (timeout_s 590,
#   carry ["scratch-gpu", "ab60"], both built as the mode says), naming nvidia-h200.
#   0. the record on an H200 with HEAD's bundle (bash scripts/build_gpu_bundle.sh; carry ["scratch-gpu"]), the
#      benchmark first, since no H200 has run since 5e0444f / 7487f70 (HEAD's chunk rule, the pieces at the
#      front, DQ_ROWS, the token divider): a call naming nvidia-h200 may get an H100, so check the card:
#        nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && STAGES=bench BENCH_TIMEOUT=540 \
#          bash scripts/gpu_check.sh   (timeout_s ~580; then STAGES="tests sanitizer racecheck python main" and
#          STAGES=scale on the warm machine)
#   1. the fast backward's dkp REDs: a timing probe without them (docs/prepared/probe-dkp-sink.patch) took the H100's
#      m3/64k backward 37.77 -> 34.08 ms and fm16k 3.17 -> 2.85 (~10%; the forty-first session's H200 probe: 2.1 ms at
#      m3/64k), while dq's bulk reduce-adds move 8x the bytes a tile. Prepared (compiled, not run):
#      docs/prepared/dkp-bulk.patch (branch exp/dkp-bulk) stages each WG's dkp half (WG 0 in the dS tile, WG 1 in
#      the stage's dO slot, rows 60..63 in the spare rows) and bulk reduce-adds it per 256-byte key row, fast form
#      only. A/B with its tests: bash scripts/build_variants.sh ab60 main=main x=exp/dkp-bulk:tests; carry
#      ["ab60"]; AB_DIR=ab60 TEST_FILTER='CudaBackward.*:CudaGraph.*' bash scripts/gpu_next.sh ab (then the
#      racecheck of the 640-token step: STAGES=racecheck_wgmma with the branch's bundle). On the H200 ~2 ms
#      would take the m3/64k step to ~49 ms (9x cuDNN f+b needs 49.2).
#   2. ONLY_H200=1 END_S=560 bash scripts/gpu_next.sh rule (timeout_s 580): HEAD's chunk rule beside 7487f70's
#      (build scratch-main from 7487f70 first); measured with forced counts already (fifty-third session).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-record}
if [ "$mode" = record ]; then
  exec bash scripts/gpu_check.sh  # its stages: $STAGES, else all
fi
if [ "$mode" = either ]; then
  # Whatever card comes (carry ["scratch-gpu", "ab60"]): the dkp bulk A/B (item 1 below): the branch's
  # backward and graph tests, then main against x at fm16k and m3/64k, two rounds, checked; then the front
  # pieces' cap at m3/32k. On an H200 the record follows in the next calls (item 0), with the winner's
  # bundle. Build: bash scripts/build_gpu_bundle.sh and
  # bash scripts/build_variants.sh ab60 main=main x=exp/dkp-bulk:tests (exp/dkp-bulk: git apply
  # docs/prepared/dkp-bulk.patch on a branch if it is gone). END_S as in `rule`.
  OUT=${OUT:-/tmp/flashmsa-next}
  mkdir -p "$OUT"
  echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
  for f in ab60/*.xz; do [ -f "$f" ] && [ ! -x "${f%.xz}" ] && xz -d -k -T8 "$f" && chmod +x "${f%.xz}"; done
  timeout 150 ab60/tests_x --gtest_brief=1 --gtest_filter='CudaBackward.*:CudaGraph.*' > "$OUT/tests_x.log" 2>&1
  echo "x tests: exit $?"; grep -E "FAILED|PASSED" "$OUT/tests_x.log" | tail -n 8
  VARIANTS="main=ab60/run_main;x=ab60/run_x" ROUNDS=2 OUT=$OUT/ab \
    CONFIGS="fm16k:--seqlen 16384 --heads 16 --kv-heads 2;m3_64k:--seqlen 65536" \
    timeout $((${END_S:-570} - SECONDS - 100)) bash scripts/gpu_ab.sh | tail -n 12
  # In the time left: the front pieces' default cap where it is 1024 tokens (m3/32k's 2048-token chunks on
  # an H100) against no pieces, N(0, 1), one round.
  VARIANTS="main=ab60/run_main;nopc=ab60/run_main,FLASHMSA_BWD_PIECE=0" ROUNDS=1 OUT=$OUT/cap \
    CONFIGS="m3_32k:--seqlen 32768" timeout $((${END_S:-570} - SECONDS)) bash scripts/gpu_ab.sh | tail -n 5
  exit 0
fi
if [ "$mode" = rule ]; then
  OUT=${OUT:-/tmp/flashmsa-next}
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
  echo "card: $card"
  [ "${ONLY_H200:-0}" = 1 ] && [[ $card != *H200* ]] && { echo "not an H200 (ONLY_H200=1): nothing run"; exit 3; }
  END=${END_S:-585}
  VARIANTS="head=scratch-gpu/flashmsa_run;prev=scratch-main/flashmsa_run" \
    CONFIGS=${RULE_CONFIGS:-"m3_16k:--seqlen 16384;gqa8_16k:--seqlen 16384 --heads 32 --kv-heads 4;m3_24k:--seqlen 24576;m3_32k:--seqlen 32768;fm16k:--seqlen 16384 --heads 16 --kv-heads 2;m3_64k:--seqlen 65536"} \
    ROUNDS=2 CHECK=1 OUT=$OUT/rule timeout $((END - SECONDS - 130)) bash scripts/gpu_ab.sh | tail -n 20
  left=$((END - SECONDS))
  [ $left -gt 120 ] && STAGES=bench BENCH_TIMEOUT=$((left - 15)) OUT=$OUT/head bash scripts/gpu_check.sh | tail -n 30
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
