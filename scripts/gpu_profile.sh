#!/usr/bin/env bash
# One call on the H200: where the time of a training step goes, for the next optimisation.
#   1. every kernel of one m3 step (select, forward, backward) with its duration (ncu, no replay of
#      the sections: one metric), at S = $SEQ (default 32768);
#   2. ncu sections of the two kernels that dominate the step: the wgmma KV-major forward
#      (kvw_fwd_kernel, one mid-step launch) and the wgmma backward (attn_bwd_wgmma_kernel).
# Binaries from scripts/build_gpu_bundle.sh (scratch-gpu/). Logs to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-scratch-gpu}
OUT=${OUT:-/tmp/flashmsa-profile}
SEQ=${SEQ:-32768}
mkdir -p "$OUT"
RUN="$BIN/flashmsa_run --device cuda --seqlen $SEQ --iters 1 --check-tokens 0 --quiet"
METRICS=sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed
SECTIONS="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis"

ncu --clock-control none --metrics gpu__time_duration.sum $RUN > "$OUT/kernels.log" 2>&1
# kernel name and duration on one line, then the total per kernel name
grep -E '^\s+[A-Za-z_].*\(.*Context|gpu__time_duration' "$OUT/kernels.log" | paste - - |
  sed -E 's/\(anonymous namespace\):://g; s/^\s+(void )?([^(]+)\(.*gpu__time_duration.sum\s+(\S+)\s+(\S+).*/\4 \3 \2/' |
  awk '{v = ($2 == "ms" ? $1 * 1000 : ($2 == "us" ? $1 : $1 / 1000)); name = $3
        for (i = 4; i <= NF; i++) name = name " " $i
        t[name] += v; n[name]++}
       END {for (k in t) printf "%10.1f us %5d x %s\n", t[k], n[k], k}' |
  sort -rn > "$OUT/kernel_totals.txt"
cat "$OUT/kernel_totals.txt"

ncu --clock-control none -k regex:kvw_fwd_kernel --launch-skip 8 --launch-count 1 $SECTIONS --metrics $METRICS $RUN \
  > "$OUT/forward_kernel.log" 2>&1
ncu --clock-control none -k regex:attn_bwd_wgmma_kernel --launch-count 1 $SECTIONS --metrics $METRICS $RUN \
  > "$OUT/backward_kernel.log" 2>&1
for f in forward_kernel backward_kernel; do
  echo "== $f"
  grep -E "Duration|Throughput|gmma|lts__|l1tex__|dram__|Warp Cycles|Issued Warp|Eligible|No Eligible" "$OUT/$f.log" | head -20
done
