#!/usr/bin/env bash
# The token-chunked backward on the device: a chunk sweep (timing only unless CHECK=1) of AB_DIR's
# run_x (default ab39) against run_main, by chunk size (CHUNKS, tokens: FLASHMSA_BWD_CHUNK) and by
# chunk count (COUNTS: FLASHMSA_BWD_CHUNKS); EXTRA adds variants ("name=bin,ENV=v;...").
set -uo pipefail
D=${AB_DIR:-ab39}
for f in $D/*.xz; do [ ! -x "${f%.xz}" ] && xz -d -k -T8 "$f" && chmod +x "${f%.xz}"; done
X=$D/run_x
v="main=$D/run_main"
for c in ${CHUNKS:-}; do v+=";c$c=$X,FLASHMSA_BWD_CHUNK=$c"; done
for n in ${COUNTS:-}; do v+=";n$n=$X,FLASHMSA_BWD_CHUNKS=$n"; done
[ -n "${EXTRA:-}" ] && v+=";$EXTRA"
VARIANTS="$v" CONFIGS="${CONFIGS:-m3_64k:--seqlen 65536;m3_32k:--seqlen 32768;m3_128k:--seqlen 131072}" \
  ROUNDS=${ROUNDS:-2} CHECK=${CHECK:-0} OUT=$OUT/sweep timeout ${AB_TIMEOUT:-400} bash scripts/gpu_ab.sh 2>&1 | tail -${TAIL:-30}
