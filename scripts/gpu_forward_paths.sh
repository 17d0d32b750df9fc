#!/usr/bin/env bash
# On the H200: time the forward (+KL, as the PyTorch op runs it) and the whole step under both
# forward paths (FLASHMSA_FORWARD_PATH=query|kv) at the fm16k, gqa8 and m3 shapes, with a slice check.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-scratch-gpu}
run() {  # label, flags...
  local label=$1; shift
  for path in query kv; do
    echo "--- $label, FLASHMSA_FORWARD_PATH=$path"
    FLASHMSA_FORWARD_PATH=$path "$BIN/flashmsa_run" --device cuda --forward-kl --check-tokens 2 \
      --check-keys 0 --quiet "$@" | grep -E "^(select|sparse|backward|training)|slice|RESULT"
  done
}
run fm16k --heads 16 --kv-heads 2 --proxy-heads 4 --seqlen 16384
run gqa8 --heads 32 --kv-heads 4 --seqlen 65536
run m3 --seqlen 65536
