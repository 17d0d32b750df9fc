#!/usr/bin/env bash
# One call on the H200: an alternating A/B of flashmsa_run variants (binaries and/or environment) over
# a few shapes, in one process tree, so machine-to-machine drift does not enter the comparison.
#   VARIANTS  "name=binary[,VAR=value...];..."   e.g. "main=ab/run_main;group=ab/run_br,FLASHMSA_BWD_ORDER=group"
#             (binary.xz is unpacked first)
#   CONFIGS   "name:flashmsa_run arguments;..."  default: m3 at 64k and 32k
#   ROUNDS    rounds of every (config, variant) pair, alternating, the order rotated per round (default 2)
#   CHECK     flashmsa_run's --check-tokens (default 1: each run is also checked against fp64)
# Every run's phases (and its workspace peaks) go to $OUT/ab.log; the table at the end gives, per config and variant, each
# phase's times over the rounds (ms) and whether every run passed its check.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashmsa-ab}
mkdir -p "$OUT"
LOG=$OUT/ab.log
: > "$LOG"
VARIANTS=${VARIANTS:?VARIANTS="name=binary[,VAR=value...];..."}
CONFIGS=${CONFIGS:-"m3_64k:--seqlen 65536;m3_32k:--seqlen 32768"}
ROUNDS=${ROUNDS:-2}
CHECK=${CHECK:-1}
IFS=';' read -ra VARS <<< "$VARIANTS"
IFS=';' read -ra CFGS <<< "$CONFIGS"
for v in "${VARS[@]}"; do
  spec=${v#*=}
  bin=${spec%%,*}
  if [ ! -x "$bin" ] && [ -f "$bin.xz" ]; then xz -d -k -T4 "$bin.xz" && chmod +x "$bin"; fi
  [ -x "$bin" ] || { echo "gpu_ab.sh: no binary $bin for variant ${v%%=*}" >&2; exit 2; }
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$LOG"
for ((r = 1; r <= ROUNDS; r++)); do
  for c in "${CFGS[@]}"; do
    cname=${c%%:*}
    args=${c#*:}
    # Round r starts at variant r - 1 (rotated): the first run after a shape change read slower
    # select_blocks times, and a fixed order put that on the first variant only.
    for ((j = 0; j < ${#VARS[@]}; j++)); do
      v=${VARS[$(((j + r - 1) % ${#VARS[@]}))]}
      vname=${v%%=*}
      spec=${v#*=}
      bin=${spec%%,*}
      envs=()
      [ "$spec" != "$bin" ] && IFS=',' read -ra envs <<< "${spec#*,}"
      echo "== round $r | $cname | $vname" >> "$LOG"
      # shellcheck disable=SC2086
      env "${envs[@]}" "$bin" --device cuda $args --check-tokens "$CHECK" --check-keys 0 --quiet 2>&1 |
        grep -E "^(select_blocks|sparse forward|(dense )?warm-up fwd|backward|training step|step \(CUDA graph\))|extra device memory|RESULT|rror" >> "$LOG"
    done
  done
done
python3 - "$LOG" <<'EOF'
import re, sys
from collections import defaultdict
times = defaultdict(list)   # (config, variant, phase) -> [ms]
passed = defaultdict(list)  # (config, variant) -> [bool] per run
order_c, order_v, phases = [], [], []
key = None
for line in open(sys.argv[1]):
    m = re.match(r"== round \d+ \| (\S+) \| (\S+)", line)
    if m:
        key = m.groups()
        passed[key].append(False)
        if key[0] not in order_c: order_c.append(key[0])
        if key[1] not in order_v: order_v.append(key[1])
        continue
    if key is None: continue
    m = re.match(r"(select_blocks|sparse forward(?: \+ KL)?|(?:dense )?warm-up fwd(?: \+ KL)?|backward \(\+KL\)|training step|step \(CUDA graph\))\s+([0-9.]+)", line)
    if m:
        times[key + (m.group(1),)].append(float(m.group(2)))
        if m.group(1) not in phases: phases.append(m.group(1))
    elif "RESULT: PASS" in line:
        passed[key][-1] = True
print("\nms over the rounds (min-max); check: every run's RESULT")
for c in order_c:
    print("== " + c)
    for v in order_v:
        cells = []
        for ph in phases:
            xs = times.get((c, v, ph))
            if xs: cells.append("%s %.2f-%.2f" % (ph.split()[0], min(xs), max(xs)))
        runs = passed[(c, v)]
        print("  %-12s %s | %d/%d PASS" % (v, "  ".join(cells), sum(runs), len(runs)))
EOF
