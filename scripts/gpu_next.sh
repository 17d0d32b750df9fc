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
#   bash scripts/gpu_next.sh rule     HEAD's chunk rule (T / 8 from 16k to 32k tokens on the H200, 2ee1f4c) beside
#                                     the previous default: carry ["scratch-gpu", "scratch-main"] (HEAD's bundle,
#                                     and 7487f70's in scratch-main), END_S=<limit>; an A/B at m3 16k / 24k / 32k
#                                     / 64k, gqa8 16k (not yet run with chunks on an H200) and fm16k, checked,
#                                     then HEAD's benchmark in the time left (the next record). ~4-5 min.
#                                     RULE_CONFIGS (gpu_ab.sh's CONFIGS) narrows the A/B for a short call.
#   bash scripts/gpu_next.sh sinks2   the sink work of the fifty-eighth session (0c, 0d below; carry ["ab58"]).
# Next (as of the fifty-eighth session, whose device calls got one H100 again):
#   0. `gpu_next.sh new` ran on that H100 (bench/results/h100_f561bec_new): the overflow pieces cost N(0, 1)
#      nothing at 8192, DQ_ROWS took fm16k's deterministic backward 10.58 -> 3.90 ms. Both are defaults since
#      1ae94b7 (pieces of 8192 in the fast backward with token chunks or SHARED_KV; DQ_ROWS on every wgmma
#      shape): their H200 run is the record below (its GPU suite runs the new defaults' tests). The m3 sinks
#      on the H200's T / 4 chunks: `sinks2` below (the host model: +17% left at 8192 as landed, +0.4% with
#      the front pieces). (The `new` mode that ran it is gone: git show b181320:scripts/gpu_next.sh.)
#   0c. the sink's residual cost: with its list cut (pieces), a sink block still costs the fast backward +13-17%
#      at fm16k, +21% at m3/64k on the H100, while the forward's KL value (no dkp) shows none. At fm16k the
#      tested hypothesis is dkp's per-tile fp32 REDs all landing on the sink's 128 key rows (against it: ~256
#      REDs a 25 us tile period on each line is far below an L2 slice's same-line rate): probe pd
#      (docs/prepared/probe-dkp-sink.patch, branch exp/probe-dkp-sink: the fast form's dkp REDs left out,
#      wrong dkp by design), and ncu's stalls and SM balance with and without the sink. If pd's sink gap
#      (sink - N(0, 1)) is near zero where main's is not, the REDs are the cause.
#   0d. list pieces at the front (branch exp/pieces-front, also docs/prepared/pieces-front.patch against
#      2e5e320; compiled, CPU tests, not run): a part over the cap goes whole to the overflow slots, the
#      default cap with chunks is half a chunk; host model: the H200's m3/64k sink +18% -> +0.4%, the H100's
#      +3.8% -> +0.4% at 2048. If its tests pass and N(0, 1) loses nothing, land it.
#      0c and 0d in one call (~7 min): `bash scripts/gpu_next.sh sinks2`, carry ["ab58"] (run_main, run_pd,
#      run_front, tests_front; if ab58 is gone: bash scripts/build_variants.sh ab58 main=main
#      pd=exp/probe-dkp-sink front=exp/pieces-front:tests, or apply the two patches on branches).
#   (fifty-third session, which swept the backward's chunks on an H200: the H100's T / 16 loses there at
#   64k, T / 8 gains from 16k to 32k, now the H200's default, measured with forced counts only:)
#   1. ONLY_H200=1 END_S=560 bash scripts/gpu_next.sh rule (timeout_s 580).
#      (fifty-fourth session: no H200 came; HEAD's suite, memcheck, racecheck and main job passed on H100s.)
#      (fifty-fifth session: none again: six of eleven starts found no machine, five got H100s; one ran HEAD's benchmark.)
#      (fifty-sixth session: ten starts found no machine of either kind; the eleventh got an H100, used for the pieces.)
#      (fifty-seventh session: paused at first; then two starts found none, the third got an H100, used for the pieces.)
#      (fifty-eighth session: two starts found none; two calls got H100s: the A/Bs behind 1ae94b7 and its suite.)
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
if [ "$mode" = sinks2 ]; then
  # 0c + 0d (carry ["ab58"]): the front pieces' GPU tests, then main / front / pd (no fast dkp REDs: wrong
  # dkp, its check fails by design) with and without a sink block, one round, checked.
  OUT=${OUT:-/tmp/flashmsa-next}
  mkdir -p "$OUT"
  for f in ab58/*.xz; do [ -f "$f" ] && [ ! -x "${f%.xz}" ] && xz -d -k -T8 "$f" && chmod +x "${f%.xz}"; done
  nvidia-smi --query-gpu=name --format=csv,noheader
  timeout 170 ab58/tests_front --gtest_brief=1 \
    --gtest_filter='CudaBackward.*' \
    > "$OUT/tests_front.log" 2>&1
  echo "front tests: exit $?"; grep -E "FAILED|PASSED" "$OUT/tests_front.log" | tail -n 8
  VARIANTS="main=ab58/run_main;front=ab58/run_front;pd=ab58/run_pd" ROUNDS=1 OUT=$OUT/ab \
    CONFIGS=${SINK_CONFIGS:-"fm16k:--seqlen 16384 --heads 16 --kv-heads 2;fm16k_sink:--seqlen 16384 --heads 16 --kv-heads 2 --sink-blocks 1;m3_64k:--seqlen 65536;m3_64k_sink:--seqlen 65536 --sink-blocks 1"} \
    timeout 380 bash scripts/gpu_ab.sh | tail -n 24
  # Then, while the call has time (END_S, default 560 s), where fm16k's sink waits (ncu, ~1 min a run).
  mkdir -p /tmp/bin_main && cp ab58/run_main /tmp/bin_main/flashmsa_run
  # lse: the student lse kernel at fm16k (on the step's critical path there: 0.24 ms of the H200's 4.14).
  for name in lse sink plain; do
    [ $((${END_S:-560} - SECONDS)) -gt 90 ] || break
    args="--heads 16 --kv-heads 2"; [ $name = sink ] && args+=" --sink-blocks 1"
    kernel=attn_bwd_wgmma_kernel; [ $name = lse ] && kernel=proxy_lse_kernel
    BIN=/tmp/bin_main SEQ=16384 RUN_ARGS="$args" NAME=$name KERNEL=$kernel OUT=$OUT/stalls timeout 100 \
      bash scripts/gpu_stalls.sh | tail -n 8
  done
  tar czf "$OUT/sinks2.tgz" -C "$OUT" tests_front.log ab stalls 2>/dev/null
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
