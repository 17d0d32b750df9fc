#!/usr/bin/env bash
# A device call for variant A/Bs (twenty-third session). Binaries, built here for sm_90a and
# git-ignored, travel with carry ["ab11"]; rebuild them with
#   bash scripts/build_variants.sh ab11 main=main kp=exp/kl-pairs:tests
#   ab11/run_main               main (device code of 5982050).
#   ab11/run_kp, ab11/tests_kp  exp/kl-pairs: the forward's KL value (attn_bwd_wgmma_kernel<KL_ONLY>) in a loop
#                               of its own, steps in pairs on two accumulators (each step's softmax under the
#                               next step's product); every other kernel's PTX unchanged.
# Both stages ran in the twenty-third session (kp slower; its successor kp2 landed, d7769f6; perf-notes); kept as
# the template for the next variant A/B.
# STAGES: tests (kp's forward / warm-up / KL / graph tests, memcheck of the KL-value tests), ab (main / kp with
# the forward's KL value, as the PyTorch op runs it: m3 64k / 32k, fm16k, the m3 16k warm-up; 2 rounds, checked).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashmsa-next}
mkdir -p "$OUT"
STAGES=${STAGES:-tests}
D=${AB_DIR:-ab11}
for f in "$D"/*.xz; do [ -f "$f" ] && [ ! -x "${f%.xz}" ] && xz -d -k -T4 "$f" && chmod +x "${f%.xz}"; done
# variant_tests NAME FILTER MEMCHECK_FILTER: $D/tests_NAME's FILTER, then memcheck of MEMCHECK_FILTER.
variant_tests() {
  timeout 300 "$D/tests_$1" --gtest_brief=1 --gtest_filter="$2" > "$OUT/tests_$1.log" 2>&1
  echo "$1 tests: exit $?"; tail -n 3 "$OUT/tests_$1.log"
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 "$D/tests_$1" --gtest_brief=1 \
    --gtest_filter="$3" > "$OUT/memcheck_$1.log" 2>&1
  echo "memcheck $1: exit $?"; tail -n 2 "$OUT/memcheck_$1.log"
}
if [[ " $STAGES " == *" tests "* ]]; then
  variant_tests kp 'CudaForward.*:CudaWarmup.*:CudaBackward.*Kl*:CudaGraph.*' \
    'CudaForward.KlValueKvMajor*:CudaBackward.KlValueSharedKvHead:CudaWarmup.KlValueKvMajor*'
fi
if [[ " $STAGES " == *" ab "* ]]; then
  ROUNDS=${ROUNDS:-2} \
    CONFIGS=${CONFIGS:-"m3_64k_kl:--seqlen 65536 --forward-kl;m3_32k_kl:--seqlen 32768 --forward-kl;fm16k_kl:--seqlen 16384 --heads 16 --kv-heads 2 --forward-kl;warmup_16k_kl:--mode warmup --seqlen 16384 --forward-kl"} \
    VARIANTS=${VARIANTS:-"main=$D/run_main;kp=$D/run_kp"} OUT=$OUT bash scripts/gpu_ab.sh
fi
