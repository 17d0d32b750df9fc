#!/usr/bin/env bash
# One call on the H200: why a CUDA-graph replay of the step can run slower than the eager phases.
# BIN_RUN: a flashmsa_run whose --graph also times the step launched on one stream (no
# synchronisation between phases) alternating with the replay. Per run: SM clock, power and the
# clock-event reasons sampled every 20 ms by nvidia-smi (the H200 there has no nsys). Logs to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashmsa-graph}
BIN_RUN=${BIN_RUN:-scratch-gpu/flashmsa_run}
mkdir -p "$OUT"
[ -f "$BIN_RUN.xz" ] && [ ! -x "$BIN_RUN" ] && xz -d -k -T4 "$BIN_RUN.xz" && chmod +x "$BIN_RUN"
RUNS=${RUNS:-"m3_64k:--seqlen 65536;warmup_16k:--seqlen 16384 --mode warmup --forward-kl;fm16k:--seqlen 16384 --heads 16 --kv-heads 2"}
IFS=';' read -ra runs <<< "$RUNS"
for r in "${runs[@]}"; do
  name=${r%%:*}
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
    --format=csv,noheader,nounits -lms 20 > "$OUT/smi_$name.csv" 2>&1 &
  smi=$!
  "$BIN_RUN" --device cuda --iters ${ITERS:-20} --graph --check-tokens 0 ${r#*:} > "$OUT/run_$name.log" 2>&1
  kill $smi; wait $smi 2>/dev/null
  echo "=== $name"
  grep -E "^(select_blocks|sparse forward|warm-up|dense warm|backward|training step|step \()" "$OUT/run_$name.log"
  # The step logs carry no timestamps: summarise the whole run's samples (eager first, then graph / stream).
  python3 - "$OUT/smi_$name.csv" <<'PY'
import sys, collections
rows = [l.strip().split(", ") for l in open(sys.argv[1]) if l.count(",") >= 4]
busy = [r for r in rows if float(r[2]) > 150]  # samples while the GPU draws power (kernels running)
if not busy: print("no samples"); sys.exit()
n = len(busy); third = n // 3
for part, rr in (("first third", busy[:third]), ("middle", busy[third:2 * third]), ("last third", busy[2 * third:])):
    clk = sorted(float(r[1]) for r in rr); pw = sorted(float(r[2]) for r in rr)
    reasons = collections.Counter(r[4] for r in rr).most_common(3)
    print(f"  {part}: {len(rr)} samples, SM clock median {clk[len(clk)//2]:.0f} MHz (min {clk[0]:.0f}), "
          f"power median {pw[len(pw)//2]:.0f} W (max {pw[-1]:.0f}), temp {rr[-1][3]} C, reasons {reasons}")
PY
done
