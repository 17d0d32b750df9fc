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
# Prepared (thirty-eighth session): the deterministic dkp as per-proxy-head fp32 partials. The step's
# +12.5 ms over fast at m3/64k (timing probes, bench/results/h200_det_probes_ab40.log,
# h200_dkp_red_probes_ab41.log): 5.7 the forward's first pass, 6.6 the backward's int64 dkp REDs
# (the fast form's fp32 ones: 2.1). docs/prepared/det-dkp-partials.patch (compiled, not run):
#   (the thirty-ninth session made the branch, bc0e524 on 3de5eac, built ab42/ from it and main, and
#   scratch-gpu/ as the bundle of bc0e524 for the record if the A/B holds (its COMMIT file says which
#   commit a bundle is); where they are gone:)
#     git checkout -b exp/det-dkp-partials && git apply docs/prepared/det-dkp-partials.patch &&
#       git commit -qam "deterministic dkp as fp32 partials per proxy head (docs/prepared/det-dkp-partials.patch)"
#     git checkout main && bash scripts/build_variants.sh ab42 main=main x=exp/det-dkp-partials:tests
#   carry ["ab42"]: AB_DIR=ab42 TEST_FILTER='CudaBackward.*:CudaGraph.*:CudaWorkspace.*:CudaWarmup*' \
#     VARIANTS="main=ab42/run_main;x=ab42/run_x;xi=ab42/run_x,FLASHMSA_DET_DKP=int64;xp=ab42/run_x,FLASHMSA_DKP_PARTIALS=1" \
#     CONFIGS="det64k:--seqlen 65536 --deterministic;m3_64k:--seqlen 65536;m3_32k:--seqlen 32768;fm16k:--seqlen 16384 --heads 16 --kv-heads 2" \
#     OUT=$OUT bash scripts/gpu_next.sh ab; ab42/run_x --device cuda --seqlen 65536 --deterministic --iters 5 \
#     --bitwise-reruns --check-tokens 0 | tail -3
#   (one call, ~7 min: the tests ~1.5, 32 runs ~5, the bitwise run ~0.7). With the prebuilt bundle the
#   first call can be the record's GPU suite instead of tests_x's subset (~8 min), carry ["ab42", "scratch-gpu"]:
#     STAGES=tests OUT=$OUT bash scripts/gpu_check.sh; AB_DIR=ab42 TEST_FILTER=None.None VARIANTS=... \
#       CONFIGS=... OUT=$OUT bash scripts/gpu_next.sh ab; ab42/run_x ... --bitwise-reruns ... | tail -3
#   and, if x holds, the rest of the record on the same bundle: BENCH_TIMEOUT=220 STAGES="sanitizer python
#   main racecheck_wgmma bench", then STAGES="racecheck scale" (carry ["scratch-gpu"]). Predicted: det backward
#   ~41.3 -> ~37.3 ms (the probes: 35.2 without dkp REDs + ~2.1 for fp32 ones); xp says whether same-row contention is part of the fast form's 2.1 ms of dkp REDs.
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
  if [ "$name" != main ] && [ -x "$D/tests_$name" ]; then
    timeout 240 "$D/tests_$name" --gtest_brief=1 --gtest_filter="${TEST_FILTER:-CudaForward.*:CudaBackward.*}" \
      > "$OUT/tests_$name.log" 2>&1
    echo "$name tests: exit $?"; grep -E "FAILED|PASSED" "$OUT/tests_$name.log" | tail -n 8
  fi
done
ROUNDS=${ROUNDS:-2} \
  CONFIGS=${CONFIGS:-"m3_64k:--seqlen 65536;m3_32k:--seqlen 32768;fm16k:--seqlen 16384 --heads 16 --kv-heads 2"} \
  VARIANTS=${VARIANTS:-$variants} OUT=$OUT timeout 400 bash scripts/gpu_ab.sh
