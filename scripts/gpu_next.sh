#!/usr/bin/env bash
# The next device session's variant A/B (prepared in the twenty-fourth session, not run): the backward /
# KL-value producer's Q, dO, Qp gathers by four threads per row (exp/gather-quads: each warp instruction
# reads 8 rows x 64 bytes instead of 16 rows x 32 bytes; two shuffles per lane), perf-notes. Build here:
#   bash scripts/build_variants.sh ab12 main=main gq=exp/gather-quads:tests
# (ab12 already holds them if this checkout kept it) and carry ["ab12"]. One call (~5 min):
# gq's backward / KL-value / warm-up tests, memcheck of one shape per changed form, then main / gq with
# the forward's KL value at m3 64k and fm16k, 2 rounds, checked. If gq wins: the whole GPU suite on it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashmsa-next}
mkdir -p "$OUT"
D=${AB_DIR:-ab12}
for f in "$D"/*.xz; do [ -f "$f" ] && [ ! -x "${f%.xz}" ] && xz -d -k -T8 "$f" && chmod +x "${f%.xz}"; done
timeout 150 "$D/tests_gq" --gtest_brief=1 --gtest_filter='CudaBackward.*:CudaForward.KlValue*:CudaWarmup.*' \
  > "$OUT/tests_gq.log" 2>&1
echo "gq tests: exit $?"; tail -n 2 "$OUT/tests_gq.log"
timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$D/tests_gq" --gtest_brief=1 \
  --gtest_filter='CudaBackward.WgmmaSharedKvFm16kLike:CudaBackward.TokenRowsGroupOf8:CudaBackward.KlValueSharedKvHead:CudaForward.KlValueKvMajor*' \
  > "$OUT/memcheck_gq.log" 2>&1
echo "memcheck gq: exit $?"; tail -n 2 "$OUT/memcheck_gq.log"
ROUNDS=${ROUNDS:-2} \
  CONFIGS=${CONFIGS:-"m3_64k_kl:--seqlen 65536 --forward-kl;fm16k_kl:--seqlen 16384 --heads 16 --kv-heads 2 --forward-kl"} \
  VARIANTS=${VARIANTS:-"main=$D/run_main;gq=$D/run_gq"} OUT=$OUT bash scripts/gpu_ab.sh
