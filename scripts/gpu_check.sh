#!/usr/bin/env bash
# One call on the H200: GPU tests against the CPU backend, compute-sanitizer on a small case, the
# main job with a full CPU comparison, the PyTorch CUDA tests and the benchmark against peers.
# Results (logs, JSON) go to $OUT. Binaries are built on the workstation for sm_90a first:
#   bash scripts/build_gpu_bundle.sh      # -> scratch-gpu/ (flashmsa_gpu_tests, flashmsa_run, _C.so)
# and the device call carries scratch-gpu. Stages, as arguments or in $STAGES: tests sanitizer main
# python scale bench racecheck (default: all; racecheck_wgmma and racecheck_det on request); `scale` runs the main job
# at m3 64k (phase split, memory), 1M tokens, deterministic 64k (timed, and bitwise over 5 steps), fm16k (and bitwise deterministic)
# and the dense warm-up at 16k (with --graph: the step captured in a CUDA graph, too). `timeline` (not in the default) lists one
# op step's kernels with their streams and the GPU's idle time at m3 64k / 32k and fm16k.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-scratch-gpu}
# build_gpu_bundle.sh carries the binaries as .xz.
for f in "$BIN"/*.xz; do [ -f "$f" ] && xz -d -f -T0 "$f"; done
chmod +x "$BIN"/flashmsa_* 2>/dev/null
# Logs and JSON go to $LOGS; at the end they are packed into $OUT/gpu_check.tgz (the device tool
# returns at most 8 files) and the JSON files are also copied to $OUT.
OUT=${OUT:-/tmp/flashmsa-gpu-out}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
pack() { tar czf "$OUT/gpu_check.tgz" -C "$LOGS" . ; cp "$LOGS"/*.json "$OUT"/ 2>/dev/null; }
trap pack EXIT
STAGES=${*:-${STAGES:-tests sanitizer racecheck main python scale bench}}  # arguments, else $STAGES, else all
status=0
has() { [[ " $STAGES " == *" $1 "* ]]; }
run_stage() {  # name, command...: logs to $LOGS/<name>.log, remembers failures
  local name=$1; shift
  echo "=== $name: $*"
  "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$LOGS/$name.log"
  echo "=== $name: exit $rc"
  [ $rc -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
export PYTHONPATH=$PWD/python FLASHMSA_TORCH_LIBRARY=$PWD/$BIN/_C.so PYTHONUNBUFFERED=1
# The commit of the carried binaries (build_gpu_bundle.sh): carry $BIN/COMMIT with them.
[ -z "${FLASHMSA_COMMIT:-}" ] && [ -f "$BIN/COMMIT" ] && export FLASHMSA_COMMIT=$(cat "$BIN/COMMIT")
has tests && run_stage gpu_tests "$BIN/flashmsa_gpu_tests" --gtest_brief=1
has sanitizer && run_stage sanitizer compute-sanitizer --tool memcheck --error-exitcode 9 \
  "$BIN/flashmsa_gpu_tests" --gtest_brief=1 --gtest_filter="${SANITIZER_FILTER:-*FewerVisible*:*LocalOnlyK1*:*ManyShort*:*OddHead*:CudaWarmup.GqaD64TwoSequences:*WgmmaPathGroupOf16K16*:*KlValueKvMajor*:*DeterministicDq*:*WgmmaKv*:*SharedKv*:*TokenRows*:*DeterministicWgmma*:*DeterministicDkp*:SelectionIndex.*}"
if has racecheck; then  # shared-memory hazards of the mma.sync paths (on the wgmma ones > 150 s per test)
  # The stage fails on any hazard: racecheck reports warp-level ones as warnings, with exit code 0.
  race_stage() {  # name, filter, environment...
    local name=$1 filter=$2; shift 2
    run_stage "$name" env "$@" compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN/flashmsa_gpu_tests" \
      --gtest_brief=1 --gtest_filter="$filter"
    grep -q "SUMMARY: 0 hazards displayed" "$LOGS/$name.log" || { echo "=== $name: hazards reported"; status=1; }
  }
  race_stage racecheck_query 'CudaForward.LocalOnlyK1:CudaForward.FewerVisibleBlocksThanK' \
    FLASHMSA_FORWARD_PATH=query FLASHMSA_BACKWARD_PATH=mma
  race_stage racecheck_kv CudaForward.LocalOnlyK1 FLASHMSA_FORWARD_PATH=kv
  race_stage racecheck_bwd_mma CudaBackward.LocalOnlyK1 FLASHMSA_BACKWARD_PATH=mma
fi
# flashmsa_run's whole step (selection, wgmma forward with its KL value, the token-row / shared-kv
# wgmma backward) at 640 tokens (5 blocks < K: the fewer-visible case), one iteration, no check.
race_run() {  # name, flashmsa_run shape arguments...
  local name=$1; shift
  run_stage "$name" timeout "${RACE_TIMEOUT:-150}" compute-sanitizer --tool racecheck --error-exitcode 9 \
    "$BIN/flashmsa_run" --device cuda --seqlen 640 --iters 1 --check-tokens 0 --check-keys 0 --forward-kl --quiet "$@"
  grep -q "SUMMARY: 0 hazards displayed" "$LOGS/$name.log" || { echo "=== $name: hazards reported"; status=1; }
}
if has racecheck_wgmma; then  # not in the default: the default (wgmma) paths on one small step each
  race_run racecheck_wgmma_m16 --heads 16 --kv-heads 1 --proxy-heads 1
  race_run racecheck_wgmma_m4 --heads 8 --kv-heads 1 --proxy-heads 2
fi
if has racecheck_det; then  # not in the default: the same steps in deterministic mode (two-pass forward, DET backward)
  race_run racecheck_det_m16 --heads 16 --kv-heads 1 --proxy-heads 1 --deterministic
  race_run racecheck_det_m4 --heads 8 --kv-heads 1 --proxy-heads 2 --deterministic
fi
has main && run_stage main_job "$BIN/flashmsa_run" --device cuda --seqlen 8192 --full-check \
  --json "$LOGS/main_job.json"
has python && run_stage python_cuda python3 -m pytest -q -x tests/python -k "cuda or Cuda or CUDA"
if has scale; then
  run_stage m3_64k "$BIN/flashmsa_run" --device cuda --seqlen 65536 --check-tokens 4 --check-keys 1 --graph \
    --json "$LOGS/m3_64k.json"
  run_stage m3_1M "$BIN/flashmsa_run" --device cuda --seqlen 1048576 --check-tokens 0 --iters 3 \
    --json "$LOGS/m3_1M.json"
  run_stage m3_64k_det "$BIN/flashmsa_run" --device cuda --seqlen 65536 --check-tokens 0 --deterministic --graph \
    --json "$LOGS/m3_64k_det.json"
  # Bitwise over 5 steps at scale (a separate run: the hashes' downloads leave the GPU idle between
  # steps, which would flatter the timed run's clocks).
  run_stage m3_64k_det_bitwise "$BIN/flashmsa_run" --device cuda --seqlen 65536 --check-tokens 0 --deterministic \
    --iters 5 --bitwise-reruns
  run_stage fm16k "$BIN/flashmsa_run" --device cuda --seqlen 16384 --heads 16 --kv-heads 2 --check-tokens 2 \
    --check-keys 1 --graph --json "$LOGS/fm16k.json"
  # fm16k's deterministic backward takes the per-head form's int32 dq (DQ_ROWS) by default since 1ae94b7.
  run_stage fm16k_det_bitwise "$BIN/flashmsa_run" --device cuda --seqlen 16384 --heads 16 --kv-heads 2 \
    --check-tokens 2 --check-keys 1 --deterministic --iters 5 --bitwise-reruns
  run_stage m3_16k_warmup "$BIN/flashmsa_run" --device cuda --seqlen 16384 --mode warmup --check-tokens 2 \
    --check-keys 0 --graph --json "$LOGS/m3_16k_warmup.json"
fi
if has timeline; then  # kernels with streams and idle time of one op step (torch.profiler)
  run_stage timeline_m3_64k python3 bench/timeline.py --json "$LOGS/timeline_m3_64k.json"
  run_stage timeline_m3_32k python3 bench/timeline.py --seqlen 32768 --json "$LOGS/timeline_m3_32k.json"
  run_stage timeline_fm16k python3 bench/timeline.py --seqlen 16384 --heads 16 --kv-heads 2 \
    --json "$LOGS/timeline_fm16k.json"
fi
has bench && run_stage bench timeout "${BENCH_TIMEOUT:-420}" python3 bench/bench_gpu.py --out "$LOGS/bench.json" \
  --phases "$BIN/flashmsa_run" ${BENCH_ARGS:-}
exit $status
