#!/usr/bin/env bash
# exp/bwd-token-chunks on the device: the chunk-size sweep (timing only; the chunked runs were checked before).
set -uo pipefail
D=ab38
for f in $D/*.xz; do [ ! -x "${f%.xz}" ] && xz -d -k -T8 "$f" && chmod +x "${f%.xz}"; done
X=$D/run_x
v="main=$D/run_main"
for c in ${CHUNKS:-4096 6144 8192 12288 16384}; do v+=";c$c=$X,FLASHMSA_BWD_CHUNK=$c"; done
[ -n "${EXTRA:-}" ] && v+=";$EXTRA"
VARIANTS="$v" CONFIGS="${CONFIGS:-m3_64k:--seqlen 65536;m3_32k:--seqlen 32768;m3_128k:--seqlen 131072}" \
  ROUNDS=${ROUNDS:-2} CHECK=${CHECK:-0} OUT=$OUT/sweep timeout ${AB_TIMEOUT:-400} bash scripts/gpu_ab.sh 2>&1 | tail -24
