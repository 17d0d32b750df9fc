#!/usr/bin/env bash
# The next device session's calls (as of the forty-third session).
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
# Next: the H200 record of 5e0444f is done (forty-seventh session). Still unrun there (the forty-eighth
#   session's nine starts all failed): racecheck of the mma.sync paths and of the deterministic wgmma step
#   (STAGES="racecheck racecheck_det" bash scripts/gpu_check.sh), and a sweep of the backward's chunk count
#   since the own-block pass (same binary, no rebuild):
#   B=scratch-gpu/flashmsa_run VARIANTS="c4=$B,FLASHMSA_BWD_CHUNKS=4;c3=$B,FLASHMSA_BWD_CHUNKS=3;c5=$B,FLASHMSA_BWD_CHUNKS=5"
#   CONFIGS="m3_64k:--seqlen 65536" OUT=$OUT bash scripts/gpu_ab.sh. For an A/B of builds, use the ab mode
#   above. A call that must run on an H200 checks the card first (a call for nvidia-h200 may get an H100):
#   nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || exit 3
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
