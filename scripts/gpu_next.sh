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
#   bash scripts/gpu_next.sh h200     the record on an H200 (item 0 below) in one call: the benchmark first, then the
#                                     scale runs and the GPU suite in the time left (END_S, default 585); on any
#                                     other card nothing runs (exit 3). Results packed into $OUT/h200.tgz.
#   bash scripts/gpu_next.sh rotate   the rotated list walk (docs/prepared/bwd-rotate.patch, branch exp/bwd-rotate) on any
#                                     card: its backward tests, then one round, checked, of main / x (rotation off:
#                                     the code's own cost) / xr (FLASHMSA_BWD_ROTATE=1) / x512 (FLASHMSA_BWD_PIECE=512)
#                                     / xr512 (both) at fm16k and m3/64k with and without one sink block. Build:
#                                     bash scripts/build_variants.sh ab61 main=main x=exp/bwd-rotate:tests; carry
#                                     ["ab61"]. ~5 min on an H100.
#   bash scripts/gpu_next.sh rule     HEAD's chunk rule (T / 8 from 16k to 32k tokens on the H200, 2ee1f4c) beside
#                                     the previous default: carry ["scratch-gpu", "scratch-main"] (HEAD's bundle,
#                                     and 7487f70's in scratch-main), END_S=<limit>; an A/B at m3 16k / 24k / 32k
#                                     / 64k, gqa8 16k (not yet run with chunks on an H200) and fm16k, checked,
#                                     then HEAD's benchmark in the time left (the next record). ~4-5 min.
#                                     RULE_CONFIGS (gpu_ab.sh's CONFIGS) narrows the A/B for a short call.
# Next (as of the sixty-first session, which had no device: the dkp bulk reduce-adds landed in the sixtieth (H100:
# m3/64k backward -0.5 ms), checked and benchmarked on an H100 (bench/results/h100_93e77b3_record); no H200 has run
# since 5e0444f. The benchmark now also times the op's forward without its KL pass (flashmsa_fwd_no_kl_ms: what
# msa_attention's need_kl=False saves, not yet measured on a GPU)):
#   0. the record on an H200 with HEAD's bundle (bash scripts/build_gpu_bundle.sh; carry ["scratch-gpu"]), naming
#      nvidia-h200 (a call may get an H100: the mode then exits at once): END_S=570 bash scripts/gpu_next.sh h200
#      (timeout_s 590); then STAGES="sanitizer racecheck python main" and STAGES=racecheck_wgmma on the warm machine.
#   1. on whatever card comes (an H100 will do): bash scripts/gpu_next.sh rotate (timeout_s 590). The sink
#      inputs (flashmsa_run --sink-blocks) bias every token's qp, so beyond the sink a dozen blocks become hot:
#      in a 4096-token chunk at 32k their lists hold 570-1110 tokens against 300-410 on N(0, 1) inputs (scripts/
#      count_hot_blocks.py), all below the default cap. Two readings of the sink's unexplained +18%
#      (m3/64k, H100): those long uncut lists' imbalance (x512 cuts them) or their CTAs walking the same tokens
#      in step, reduce-adding into the same dq rows at once (xr rotates each walk). Land whichever pays, as
#      the default where it costs N(0, 1) nothing. The host model with these selections (model_list_pieces.py
#      --proxy-inputs) puts imbalance at +3.5% of the +18% (a 512 cap: +2.7%): the per-tile reading is the lead.
#   2. ONLY_H200=1 END_S=560 bash scripts/gpu_next.sh rule (timeout_s 580): HEAD's chunk rule beside 7487f70's
#      (build scratch-main from 7487f70 first); measured with forced counts already (fifty-third session).
#   The fast backward's dkp adds still cost ~9% of it on an H100 (the probe: 3.7 ms at m3/64k, bulk adds took 0.5
#   of it): halving them needs 128-token proxy steps (perf-notes, thirty-ninth session's design) or registers
#   the consumers do not have (sixtieth session: a resident half spilled ~1.1 KB).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-record}
if [ "$mode" = record ]; then
  exec bash scripts/gpu_check.sh  # its stages: $STAGES, else all
fi
if [ "$mode" = h200 ]; then
  res=${OUT:-/tmp/flashmsa-next}
  work=$(mktemp -d)
  mkdir -p "$res"
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
  echo "card: $card"
  [[ $card != *H200* ]] && { echo "not an H200: nothing run"; exit 3; }
  END=${END_S:-585}
  STAGES=bench BENCH_TIMEOUT=$((END - SECONDS - 10)) OUT=$work/bench bash scripts/gpu_check.sh | tail -n 32
  # scale (~3 min: 1M tokens, deterministic 64k, fm16k, warm-up) only where it fits whole; the suite in the
  # rest (its log tail is printed even if the limit cuts it).
  left=$((END - SECONDS))
  [ $left -gt 240 ] && STAGES=scale OUT=$work/scale bash scripts/gpu_check.sh | grep -E "^=== |RESULT|step|bitwise" | tail -n 40
  left=$((END - SECONDS))
  [ $left -gt 150 ] && STAGES=tests OUT=$work/tests timeout $((left - 10)) bash scripts/gpu_check.sh | tail -n 4
  tar czf "$res/h200.tgz" -C "$work" .
  exit 0
fi
if [ "$mode" = rotate ]; then
  OUT=${OUT:-/tmp/flashmsa-next}
  mkdir -p "$OUT"
  echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
  for f in ab61/*.xz; do [ -f "$f" ] && [ ! -x "${f%.xz}" ] && xz -d -k -T8 "$f" && chmod +x "${f%.xz}"; done
  timeout 200 ab61/tests_x --gtest_brief=1 --gtest_filter='CudaBackward.*:CudaGraph.*' > "$OUT/tests_x.log" 2>&1
  echo "x tests: exit $?"; grep -E "FAILED|PASSED" "$OUT/tests_x.log" | tail -n 8
  x=ab61/run_x
  VARIANTS="main=ab61/run_main;x=$x;xr=$x,FLASHMSA_BWD_ROTATE=1;x512=$x,FLASHMSA_BWD_PIECE=512;xr512=$x,FLASHMSA_BWD_ROTATE=1,FLASHMSA_BWD_PIECE=512" \
    ROUNDS=1 OUT=$OUT/ab CONFIGS="fm16k_sink:--seqlen 16384 --heads 16 --kv-heads 2 --sink-blocks 1;m3_64k_sink:--seqlen 65536 --sink-blocks 1;fm16k:--seqlen 16384 --heads 16 --kv-heads 2;m3_64k:--seqlen 65536" \
    timeout $((${END_S:-585} - SECONDS)) bash scripts/gpu_ab.sh | tail -n 24
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
