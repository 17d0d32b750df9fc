#!/usr/bin/env bash
# The next device session's calls (prepared in the twenty-sixth session).
#   bash scripts/gpu_next.sh          a full record on main's build (the GPU suite, the 34-test memcheck,
#                                     the PyTorch CUDA tests, the main job, the scale runs, the benchmark over
#                                     every config). Build first: bash scripts/build_gpu_bundle.sh; carry
#                                     ["scratch-gpu"]. ~9.5 min: STAGES="tests sanitizer python main scale"
#                                     (~8 min) and STAGES=bench (~1.5 min) as two calls. New since the
#                                     56c1120 record: the 2 CUDA pytest tests of kl_value_out (the python
#                                     stage) and the benchmark's op step with the KL value from the backward
#                                     (flashmsa_step_kl_from_backward_ms; expected ~the C++ step, not ~62 ms).
#   bash scripts/gpu_next.sh ab       docs/prepared/select-lpt.patch (compiled, not run) against main: the
#                                     selector's grid longest-first over all proxy heads (tile-major, head
#                                     fastest) instead of each head's tiles in turn. A host model of greedy
#                                     dispatch on 132 SMs: makespan / ideal 1.49 -> 1.02 at m3/8k (the last
#                                     head's heaviest tiles start late), equal at 16k and up. Build first:
#     git checkout -b exp/select-lpt main && git am docs/prepared/select-lpt.patch && git checkout main
#     bash scripts/build_variants.sh ab16 main=main lpt=exp/select-lpt:tests
#                                     and carry ["ab16"]. ~3 min: the GPU forward tests (selection checked
#                                     against the CPU with the tie tolerance) on lpt, then main / lpt at m3 8k /
#                                     32k, gqa8 16k and fm16k, 3 rounds, every run checked against fp64.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-record}
if [ "$mode" = record ]; then
  exec bash scripts/gpu_check.sh ${STAGES:-tests sanitizer python main scale bench}
fi
OUT=${OUT:-/tmp/flashmsa-next}
mkdir -p "$OUT"
D=${AB_DIR:-ab16}
for f in "$D"/*.xz; do [ -f "$f" ] && [ ! -x "${f%.xz}" ] && xz -d -k -T8 "$f" && chmod +x "${f%.xz}"; done
timeout 200 "$D/tests_lpt" --gtest_brief=1 --gtest_filter='CudaForward.*' > "$OUT/tests_lpt.log" 2>&1
echo "lpt tests: exit $?"; grep -E "FAILED|PASSED" "$OUT/tests_lpt.log" | tail -n 8
ROUNDS=${ROUNDS:-3} \
  CONFIGS=${CONFIGS:-"m3_8k:--seqlen 8192;m3_32k:--seqlen 32768;gqa8_16k:--seqlen 16384 --heads 32 --kv-heads 4 --proxy-heads 4;fm16k:--seqlen 16384 --heads 16 --kv-heads 2"} \
  VARIANTS=${VARIANTS:-"main=$D/run_main;lpt=$D/run_lpt"} OUT=$OUT timeout 300 bash scripts/gpu_ab.sh
