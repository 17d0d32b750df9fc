#!/usr/bin/env bash
# The next device session's calls (prepared in the twenty-fifth session).
#   bash scripts/gpu_next.sh          the stages the record at 15bdd33 left out (its call ran `main bench`
#                                     at m3 32k / 64k, then `scale`): the whole GPU suite, the 33-test
#                                     memcheck, the PyTorch CUDA tests, the benchmark over every config.
#                                     Build first: bash scripts/build_gpu_bundle.sh; carry ["scratch-gpu"].
#                                     ~6.5-8 min; STAGES="tests sanitizer python" and STAGES=bench split it.
#   bash scripts/gpu_next.sh ab       the prepared patches against main (compiled, not run):
#                                     qf = docs/prepared/quads-followups.patch: the m = 4 forward's Q by
#                                     quads (fm16k's forward) and the backward producer's two copy rows one
#                                     after the other (no spill in the deterministic token-row forms);
#                                     go = qf + docs/prepared/gather-octets.patch: the backward / KL-value rows
#                                     by eight threads each (4 whole lines per warp instruction; 4 bytes of
#                                     spill in the deterministic token-row forms again). Build first:
#     git checkout -b exp/quads-followups main && git apply docs/prepared/quads-followups.patch && git commit -qam qf
#     git checkout -b exp/gather-octets && git apply docs/prepared/gather-octets.patch && git commit -qam go
#     git checkout main && bash scripts/build_variants.sh ab15 main=main qf=exp/quads-followups:tests go=exp/gather-octets:tests
#                                     and carry ["ab15"]. ~6 min: main / qf / go at fm16k, m3 64k
#                                     (--forward-kl: the KL value's gathers too) and m3 64k deterministic,
#                                     2 rounds, every run checked against fp64.
#   bash scripts/gpu_next.sh abtests  the same binaries' GPU tests (~4 min): qf's forward / backward / graph
#                                     tests, go's backward / KL-value / warm-up / graph tests, memcheck of the
#                                     changed forms.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-record}
if [ "$mode" = record ]; then
  exec bash scripts/gpu_check.sh ${STAGES:-tests sanitizer python bench}
fi
OUT=${OUT:-/tmp/flashmsa-next}
mkdir -p "$OUT"
D=${AB_DIR:-ab15}
for f in "$D"/*.xz; do [ -f "$f" ] && [ ! -x "${f%.xz}" ] && xz -d -k -T8 "$f" && chmod +x "${f%.xz}"; done
if [ "$mode" = abtests ]; then
  for v in qf go; do
    filter='CudaBackward.*:CudaForward.KlValue*:CudaWarmup.*:CudaGraph.*'
    [ $v = qf ] && filter='CudaForward.*:CudaBackward.*:CudaGraph.*'
    timeout 170 "$D/tests_$v" --gtest_brief=1 --gtest_filter="$filter" > "$OUT/tests_$v.log" 2>&1
    echo "$v tests: exit $?"; grep -E "FAILED|PASSED" "$OUT/tests_$v.log" | tail -n 8
    timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 "$D/tests_$v" --gtest_brief=1 \
      --gtest_filter='CudaForward.WgmmaKvSmallGroups:CudaBackward.TokenRowsGroupOf8:CudaBackward.WgmmaSharedKvFm16kLike:CudaBackward.DeterministicWgmmaGroupOf16K16' \
      > "$OUT/memcheck_$v.log" 2>&1
    echo "memcheck $v: exit $?"; tail -n 2 "$OUT/memcheck_$v.log"
  done
  exit 0
fi
ROUNDS=${ROUNDS:-2} \
  CONFIGS=${CONFIGS:-"fm16k:--seqlen 16384 --heads 16 --kv-heads 2;m3_64k_kl:--seqlen 65536 --forward-kl;m3_64k_det:--seqlen 65536 --deterministic"} \
  VARIANTS=${VARIANTS:-"main=$D/run_main;qf=$D/run_qf;go=$D/run_go"} OUT=$OUT timeout 330 bash scripts/gpu_ab.sh
