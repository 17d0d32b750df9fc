#!/usr/bin/env bash
# One call on the H200: where the warps of one kernel wait. Stall reasons (per issued
# instruction) and the SASS with its stall samples, for kernel $KERNEL (regex) of one m3 step at
# S = $SEQ (default 32768), and the SMs' balance (active cycles, mean and max). Binaries from
# scripts/build_gpu_bundle.sh (scratch-gpu/). Logs to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-scratch-gpu}
OUT=${OUT:-/tmp/flashmsa-stalls}
SEQ=${SEQ:-32768}
KERNEL=${KERNEL:-attn_bwd_wgmma_kernel}
NAME=${NAME:-backward}
mkdir -p "$OUT"
RUN="$BIN/flashmsa_run --device cuda --seqlen $SEQ --iters 1 --check-tokens 0 --quiet ${RUN_ARGS:-}"
ncu --clock-control none -k regex:"$KERNEL" --launch-skip ${SKIP:-0} --launch-count 1 \
  --section WarpStateStats --section SourceCounters \
  --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_elapsed.max,gpu__time_duration.sum \
  --import-source no -o "$OUT/$NAME" $RUN > "$OUT/${NAME}_ncu.log" 2>&1
ncu -i "$OUT/$NAME.ncu-rep" --page details --print-details all > "$OUT/${NAME}_details.txt" 2>&1
ncu -i "$OUT/$NAME.ncu-rep" --page source --csv --print-source sass > "$OUT/${NAME}_sass.csv" 2>&1
rm -f "$OUT/$NAME.ncu-rep"
grep -E "issue_stalled" "$OUT/${NAME}_details.txt" | sort -k3 -rn | head -30
# SM balance: active cycles' mean against their max and the elapsed cycles (a tail of idle SMs
# shows as avg well below max).
grep -E "sm__cycles_active|sm__cycles_elapsed|gpu__time_duration" "$OUT/${NAME}_details.txt"
head -c 600 "$OUT/${NAME}_sass.csv"; echo
wc -l "$OUT/${NAME}_sass.csv"
