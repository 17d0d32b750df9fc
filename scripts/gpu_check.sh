#!/usr/bin/env bash
# One call on the H200: GPU tests against the CPU backend, compute-sanitizer on a small case, the
# main job with a full CPU comparison, the PyTorch CUDA tests and the benchmark against peers.
# Results (logs, JSON) go to $OUT. Binaries are built on the workstation for sm_90a first:
#   bash scripts/build_gpu_bundle.sh      # -> scratch-gpu/ (flashmsa_gpu_tests, flashmsa_run, _C.so)
# and the device call carries scratch-gpu. Stages: tests sanitizer main python bench (default: all).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-scratch-gpu}
OUT=${OUT:-/tmp/flashmsa-gpu-out}
mkdir -p "$OUT"
STAGES=${*:-tests sanitizer main python bench}
status=0
has() { [[ " $STAGES " == *" $1 "* ]]; }
run_stage() {  # name, command...: logs to $OUT/<name>.log, remembers failures
  local name=$1; shift
  echo "=== $name: $*"
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "=== $name: exit $rc"
  [ $rc -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
export PYTHONPATH=$PWD/python FLASHMSA_TORCH_LIBRARY=$PWD/$BIN/_C.so PYTHONUNBUFFERED=1
has tests && run_stage gpu_tests "$BIN/flashmsa_gpu_tests" --gtest_brief=1
has sanitizer && run_stage sanitizer compute-sanitizer --tool memcheck --error-exitcode 9 \
  "$BIN/flashmsa_gpu_tests" --gtest_brief=1 --gtest_filter="${SANITIZER_FILTER:-*FewerVisible*:*LocalOnlyK1*:*ManyShort*:*OddHead*:CudaWarmup.GqaD64TwoSequences}"
has main && run_stage main_job "$BIN/flashmsa_run" --device cuda --seqlen 8192 --full-check \
  --json "$OUT/main_job.json"
has python && run_stage python_cuda python3 -m pytest -q -x tests/python -k "cuda or Cuda or CUDA"
has bench && run_stage bench python3 bench/bench_gpu.py --out "$OUT/bench.json" ${BENCH_ARGS:-}
exit $status
