#!/usr/bin/env bash
# The next device session's calls (as of the thirty-fourth session).
#   bash scripts/gpu_next.sh          a full record on main's build (the GPU suite, the 36-test memcheck,
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
# Prepared (thirty-eighth to forty-first sessions). The deterministic step's +12.5 ms over fast at
# m3/64k (timing probes, bench/results/h200_det_probes_ab40.log, h200_dkp_red_probes_ab41.log): 5.7 the
# forward's first pass, 6.6 the backward's int64 dkp REDs (the fast form's fp32 ones: 2.1).
#   main (e453b04 on): FLASHMSA_INDEX_SORT=counting (mc) builds the inverted selection index by a
#       counting sort instead of cub's radix sort (opt-in, never run yet; SelectionIndex.* tests both).
#   x = docs/prepared/det-dkp-partials.patch on main: deterministic dkp as per-proxy-head fp32
#       partials; FLASHMSA_DKP_PARTIALS=1 (xp) takes them in fast mode too (whether same-row
#       contention is part of the fast form's dkp cost: at fm16k a key block's four proxy-head CTAs
#       run together).
#   y = docs/prepared/dkp-both-halves.patch on x: both dkp halves' products in flight at a proxy step
#       (one exposed product instead of two; fm16k ~-1%).
# Build on this machine (branches do not survive a new checkout; binaries git-ignored):
#     git checkout -b exp/det-dkp-partials main && git apply docs/prepared/det-dkp-partials.patch && git commit -qam x
#     git checkout -b exp/dkp-both-halves && git apply docs/prepared/dkp-both-halves.patch && git commit -qam y
#     git checkout main && bash scripts/build_variants.sh ab43 x=exp/det-dkp-partials:tests y=exp/dkp-both-halves:tests
#     bash scripts/build_gpu_bundle.sh    (main's bundle: scratch-gpu/; its flashmsa_run is the A/B's main)
# First call (~8 min; carry ["ab43", "scratch-gpu"]): main's GPU suite (SelectionIndex.* included), its
# forward / backward / graph tests again with the counting sort, y's backward tests, the A/B, x's
# bitwise check at 64k:
#     STAGES=tests OUT=$OUT/rec bash scripts/gpu_check.sh; FLASHMSA_INDEX_SORT=counting timeout 200 \
#     scratch-gpu/flashmsa_gpu_tests --gtest_brief=1 --gtest_filter='CudaForward.*Wgmma*:CudaBackward.*:CudaGraph.*' \
#     > $OUT/tests_mc.log 2>&1; tail -3 $OUT/tests_mc.log; AB_DIR=ab43 TEST_VARIANTS=y \
#     TEST_FILTER='CudaBackward.*:CudaGraph.*' VARIANTS="main=scratch-gpu/flashmsa_run;mc=scratch-gpu/flashmsa_run,FLASHMSA_INDEX_SORT=counting;x=ab43/run_x;xp=ab43/run_x,FLASHMSA_DKP_PARTIALS=1;y=ab43/run_y" \
#     CONFIGS="m3_64k:--seqlen 65536;fm16k:--seqlen 16384 --heads 16 --kv-heads 2" OUT=$OUT/ab1 bash scripts/gpu_next.sh ab; \
#     VARIANTS="main=scratch-gpu/flashmsa_run;x=ab43/run_x" CONFIGS="det64k:--seqlen 65536 --deterministic" \
#     OUT=$OUT/ab2 bash scripts/gpu_ab.sh; ab43/run_x --device cuda --seqlen 65536 --deterministic --iters 5 \
#     --bitwise-reruns --check-tokens 0 | tail -3
# (gpu_check.sh unpacks scratch-gpu/*.xz first; run the A/B after it.) Then land what holds (the
# counting sort as the default if mc gains and its tests pass; x if the det step gains; y on top if it
# gains), rebuild the bundle, and record on it (carry ["scratch-gpu"]):
#     BENCH_TIMEOUT=220 STAGES="tests sanitizer python main racecheck_wgmma bench", then STAGES="racecheck scale".
# Predicted: mc forward and backward each ~-0.13 ms at m3/64k (index ~177 -> ~45 us; 0.25% of the step);
# det backward ~41.3 -> ~37.3 ms (the probes: 35.2 without dkp REDs + ~2.1 for fp32 ones), det step
# ~+16.5% over fast; xp at fm16k at most -0.25 ms (probe fk), nothing at m3 (its chunked grid keeps a
# block's groups apart); y within noise at m3, ~-1% at fm16k.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-record}
if [ "$mode" = record ]; then
  exec bash scripts/gpu_check.sh  # its stages: $STAGES, else all
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
