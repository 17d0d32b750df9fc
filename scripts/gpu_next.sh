#!/usr/bin/env bash
# The next device session's calls (prepared in the twenty-fifth session).
#   bash scripts/gpu_next.sh          the stages the record at 15bdd33 left out (its call ran `main bench`
#                                     at m3 32k / 64k, then `scale`): the whole GPU suite, the 33-test
#                                     memcheck, the PyTorch CUDA tests, the benchmark over every config.
#                                     Build first: bash scripts/build_gpu_bundle.sh; carry ["scratch-gpu"].
#                                     ~6.5-8 min; STAGES="tests sanitizer python" and STAGES=bench split it.
#   bash scripts/gpu_next.sh ab       docs/prepared/quads-followups.patch against main: the m = 4 forward's
#                                     Q by quads (fm16k's forward) and the backward producer's two copy rows
#                                     one after the other (no spill in the deterministic token-row forms).
#                                     Build first:
#     git checkout -b exp/quads-followups && git apply docs/prepared/quads-followups.patch && git commit -am ...
#     bash scripts/build_variants.sh ab15 main=main qf=exp/quads-followups:tests
#                                     and carry ["ab15"]. ~6 min: the forward / backward / graph tests of qf,
#                                     memcheck of the m = 4 and deterministic token-row forms, then main / qf
#                                     at fm16k, m3 64k and m3 64k deterministic, 2 rounds, checked.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" != "ab" ]; then
  exec bash scripts/gpu_check.sh ${STAGES:-tests sanitizer python bench}
fi
OUT=${OUT:-/tmp/flashmsa-next}
mkdir -p "$OUT"
D=${AB_DIR:-ab15}
for f in "$D"/*.xz; do [ -f "$f" ] && [ ! -x "${f%.xz}" ] && xz -d -k -T8 "$f" && chmod +x "${f%.xz}"; done
timeout 200 "$D/tests_qf" --gtest_brief=1 --gtest_filter='CudaForward.*:CudaBackward.*:CudaGraph.*' > "$OUT/tests_qf.log" 2>&1
echo "qf tests: exit $?"; grep -E "FAILED|PASSED" "$OUT/tests_qf.log" | tail -n 8
timeout 70 compute-sanitizer --tool memcheck --error-exitcode 9 "$D/tests_qf" --gtest_brief=1 \
  --gtest_filter='CudaForward.WgmmaKvSmallGroups:CudaBackward.TokenRowsGroupOf8:CudaBackward.*DeterministicWgmma*' \
  > "$OUT/memcheck_qf.log" 2>&1
echo "memcheck qf: exit $?"; tail -n 2 "$OUT/memcheck_qf.log"
ROUNDS=${ROUNDS:-2} \
  CONFIGS=${CONFIGS:-"fm16k:--seqlen 16384 --heads 16 --kv-heads 2;m3_64k:--seqlen 65536;m3_64k_det:--seqlen 65536 --deterministic"} \
  VARIANTS=${VARIANTS:-"main=$D/run_main;qf=$D/run_qf"} OUT=$OUT timeout 300 bash scripts/gpu_ab.sh
