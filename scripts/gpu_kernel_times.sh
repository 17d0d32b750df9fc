#!/usr/bin/env bash
# One call on the H200: where the time of a training step goes, kernel by kernel. ncu measures
# every launch of `flashmsa_run --iters 1` (two warm-up steps + one timed) with caches and clocks
# left alone; bench/kernel_times.py sums the last step per kernel name. ncu serialises the
# launches, so kernels that overlap in a real run (the forward's two streams) add up here.
# Each run is "name:flashmsa_run arguments"; binaries from scripts/build_gpu_bundle.sh. Logs to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-scratch-gpu}
OUT=${OUT:-/tmp/flashmsa-kernel-times}
mkdir -p "$OUT"
RUNS=${RUNS:-"m3_64k:--seqlen 65536;m3_64k_det:--seqlen 65536 --deterministic;fm16k:--seqlen 16384 --heads 16 --kv-heads 2;warmup_16k:--seqlen 16384 --mode warmup --forward-kl"}
IFS=';' read -ra runs <<< "$RUNS"
for r in "${runs[@]}"; do
  name=${r%%:*}
  ncu --metrics gpu__time_duration.sum --csv --print-units base --cache-control none --clock-control none \
    "$BIN/flashmsa_run" --device cuda --iters 1 --check-tokens 0 --quiet ${r#*:} > "$OUT/$name.csv" 2>&1
  echo "=== $name: ${r#*:}"
  python3 bench/kernel_times.py "$OUT/$name.csv" --steps 3
done
