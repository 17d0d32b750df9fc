#!/usr/bin/env bash
# This session's second device call (twenty-fifth session): exp/gather-quads against main. Build here:
#   cp build/apps/flashmsa_run ab14/run_gq; cp build/tests/gpu/flashmsa_gpu_tests ab14/tests_gq (strip, xz);
#   ab14/run_main.xz from scripts/build_variants.sh ab14 main=main
# and carry ["ab14"]. One call (~7 min): the backward / KL-value / warm-up tests of gq, memcheck of one
# shape per changed form, then main / gq with the forward's KL value at m3 64k and fm16k, 2 rounds, checked.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashmsa-next}
mkdir -p "$OUT"
D=${AB_DIR:-ab14}
for f in "$D"/*.xz; do [ -f "$f" ] && [ ! -x "${f%.xz}" ] && xz -d -k -T8 "$f" && chmod +x "${f%.xz}"; done
timeout 120 "$D/tests_gq" --gtest_brief=1 --gtest_filter='CudaBackward.*:CudaForward.KlValue*:CudaWarmup.*' \
  > "$OUT/tests_gq.log" 2>&1
echo "gq tests: exit $?"; grep -E "FAILED|PASSED" "$OUT/tests_gq.log" | tail -n 8
timeout 70 compute-sanitizer --tool memcheck --error-exitcode 9 "$D/tests_gq" --gtest_brief=1 \
  --gtest_filter='CudaBackward.WgmmaSharedKvFm16kLike:CudaBackward.TokenRowsGroupOf8:CudaBackward.KlValueSharedKvHead:CudaForward.KlValueKvMajor*' \
  > "$OUT/memcheck_gq.log" 2>&1
echo "memcheck gq: exit $?"; tail -n 2 "$OUT/memcheck_gq.log"
ROUNDS=${ROUNDS:-2} \
  CONFIGS=${CONFIGS:-"m3_64k_kl:--seqlen 65536 --forward-kl;fm16k_kl:--seqlen 16384 --heads 16 --kv-heads 2 --forward-kl"} \
  VARIANTS=${VARIANTS:-"main=$D/run_main;gq=$D/run_gq"} OUT=$OUT timeout 300 bash scripts/gpu_ab.sh
