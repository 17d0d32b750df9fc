#!/usr/bin/env bash
# The next device session's variant A/B (prepared in the twenty-third session, not run): the cp.async row
# gathers by thread pairs per 32-byte sector, docs/prepared/gather-pairs.patch (perf-notes). Build here, free:
#   git checkout -b exp/gather-pairs && git am docs/prepared/gather-pairs.patch && git checkout main
#   bash scripts/build_variants.sh ab12 main=main gp=exp/gather-pairs:tests
# and carry ["ab12"]. Two calls (one call of both ran past 600 s in the twenty-third session's A/B):
#   STAGES=tests: gp's whole GPU suite (the patch changes every wgmma backward form's producer, the KL value and
#                 the m = 4 forward), then memcheck of the shapes that take each changed path (~5 min);
#   STAGES=ab:    main / gp with the forward's KL value (--forward-kl: the op's forward and the backward in one
#                 run) at m3 64k / 32k, fm16k and the m3 16k warm-up, 2 rounds, checked (~7 min).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashmsa-next}
mkdir -p "$OUT"
STAGES=${STAGES:-tests}
D=${AB_DIR:-ab12}
for f in "$D"/*.xz; do [ -f "$f" ] && [ ! -x "${f%.xz}" ] && xz -d -k -T4 "$f" && chmod +x "${f%.xz}"; done
if [[ " $STAGES " == *" tests "* ]]; then
  timeout 330 "$D/tests_gp" --gtest_brief=1 > "$OUT/tests_gp.log" 2>&1
  echo "gp tests: exit $?"; tail -n 3 "$OUT/tests_gp.log"
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 "$D/tests_gp" --gtest_brief=1 \
    --gtest_filter='CudaBackward.WgmmaSharedKvFm16kLike:CudaBackward.TokenRowsGroupOf8:CudaBackward.KlValueSharedKvHead:CudaForward.KlValueKvMajor*:CudaForward.WgmmaKvDeterministic*' \
    > "$OUT/memcheck_gp.log" 2>&1
  echo "memcheck gp: exit $?"; tail -n 2 "$OUT/memcheck_gp.log"
fi
if [[ " $STAGES " == *" ab "* ]]; then
  ROUNDS=${ROUNDS:-2} \
    CONFIGS=${CONFIGS:-"m3_64k_kl:--seqlen 65536 --forward-kl;m3_32k_kl:--seqlen 32768 --forward-kl;fm16k_kl:--seqlen 16384 --heads 16 --kv-heads 2 --forward-kl;warmup_16k_kl:--mode warmup --seqlen 16384 --forward-kl"} \
    VARIANTS=${VARIANTS:-"main=$D/run_main;gp=$D/run_gp"} OUT=$OUT bash scripts/gpu_ab.sh
fi
