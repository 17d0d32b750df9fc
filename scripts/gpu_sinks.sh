#!/usr/bin/env bash
# One call: the step with attention-sink selections (flashmsa_run --sink-blocks 1: every token also
# selects its sequence's first block, so that block's list holds every token) beside the N(0,1)
# inputs' near-random selection, each with the backward's list pieces at $PIECES tokens
# (FLASHMSA_BWD_PIECE; 0: none, the (chunk, block) grid), alternating, every run checked; fm16k, m3
# 32k and 64k. MODES: flashmsa_run flag sets separated by ';' ("-" for none), e.g.
# MODES="-;--forward-kl;--deterministic" (the forward's KL value and deterministic mode take the pieces
# too). Binaries from scripts/build_gpu_bundle.sh (scratch-gpu/, carried). Logs, JSON to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashmsa-sinks}
mkdir -p "$OUT"
for f in scratch-gpu/*.xz; do [ -f "$f" ] && [ ! -x "${f%.xz}" ] && xz -d -k -T8 "$f" && chmod +x "${f%.xz}"; done
nvidia-smi --query-gpu=name --format=csv,noheader
RUN=scratch-gpu/flashmsa_run
CONFIGS=${CONFIGS:-"fm16k:--seqlen 16384 --heads 16 --kv-heads 2;m3_32k:--seqlen 32768;m3_64k:--seqlen 65536"}
IFS=';' read -ra cfgs <<< "$CONFIGS"
IFS=';' read -ra modes <<< "${MODES:--}"
for cfg in "${cfgs[@]}"; do
  name=${cfg%%:*}
  read -ra args <<< "${cfg#*:}"
  for mode in "${modes[@]}"; do
    extra=()
    [ "$mode" = - ] || read -ra extra <<< "$mode"
    tag=$(echo "$mode" | tr -dc 'a-z')
    for round in $(seq "${ROUNDS:-1}"); do
      for s in ${SINKS:-0 1}; do
        for piece in ${PIECES:-0 2048}; do
          log=$OUT/${name}_${tag:-fast}_sink${s}_piece${piece}_$round
          FLASHMSA_BWD_PIECE=$piece "$RUN" --device cuda "${args[@]}" "${extra[@]}" --sink-blocks "$s" --iters 5 \
            --check-tokens 2 --quiet --json "$log.json" > "$log.log" 2>&1
          echo "$name ${tag:-fast} sink=$s piece=$piece round $round: select / forward / backward ms" \
            "$(grep -E '^(select_blocks|sparse forward|backward)' "$log.log" | awk '{printf "%s ", $(NF-1)}')|" \
            "$(grep -o 'longest block list [0-9]* tokens' "$log.log") $(grep -E 'RESULT|rror' "$log.log" | head -n 2)"
        done
      done
    done
  done
done
