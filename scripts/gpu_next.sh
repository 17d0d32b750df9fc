#!/usr/bin/env bash
# The next device session's variant A/B (prepared in the twenty-fourth session, not run): the backward /
# KL-value producer's Q, dO, Qp gathers by four threads per row (each warp instruction reads 8 rows x 64
# bytes instead of 16 rows x 32 bytes), perf-notes: gq = exp/gather-quads (two shuffles per lane after
# each stage wait), gh = exp/gather-quads-hoist (the shuffles per tile, or before the wait). Build here:
#   bash scripts/build_variants.sh ab12 main=main gq=exp/gather-quads:tests gh=exp/gather-quads-hoist:tests
# (ab12 already holds them if this checkout kept it) and carry ["ab12"]. One call (~7 min): each
# variant's backward / KL-value / warm-up tests, memcheck of one shape per changed form, then main / gq /
# gh with the forward's KL value at m3 64k and fm16k, 2 rounds, checked. The winner then gets the whole
# GPU suite.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashmsa-next}
mkdir -p "$OUT"
D=${AB_DIR:-ab12}
for f in "$D"/*.xz; do [ -f "$f" ] && [ ! -x "${f%.xz}" ] && xz -d -k -T8 "$f" && chmod +x "${f%.xz}"; done
for v in gq gh; do
  timeout 100 "$D/tests_$v" --gtest_brief=1 --gtest_filter='CudaBackward.*:CudaForward.KlValue*:CudaWarmup.*' \
    > "$OUT/tests_$v.log" 2>&1
  echo "$v tests: exit $?"; tail -n 2 "$OUT/tests_$v.log"
  timeout 70 compute-sanitizer --tool memcheck --error-exitcode 9 "$D/tests_$v" --gtest_brief=1 \
    --gtest_filter='CudaBackward.WgmmaSharedKvFm16kLike:CudaBackward.TokenRowsGroupOf8:CudaBackward.KlValueSharedKvHead:CudaForward.KlValueKvMajor*' \
    > "$OUT/memcheck_$v.log" 2>&1
  echo "memcheck $v: exit $?"; tail -n 2 "$OUT/memcheck_$v.log"
done
ROUNDS=${ROUNDS:-2} \
  CONFIGS=${CONFIGS:-"m3_64k_kl:--seqlen 65536 --forward-kl;fm16k_kl:--seqlen 16384 --heads 16 --kv-heads 2 --forward-kl"} \
  VARIANTS=${VARIANTS:-"main=$D/run_main;gq=$D/run_gq;gh=$D/run_gh"} OUT=$OUT bash scripts/gpu_ab.sh
