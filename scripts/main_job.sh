#!/usr/bin/env bash
# The main job: one MSA training step (selection, sparse forward, fused backward + KL) on the best
# available device at the default configuration, checked against the fp64 slice reference, timed.
# Extra arguments go to flashmsa_run (see: build/apps/flashmsa_run --help).
set -euo pipefail
cd "$(dirname "$0")/.."
FLASHMSA_SKIP_PYTHON=1 bash scripts/deps.sh
BUILD=${BUILD_DIR:-build}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j"$(nproc)" --target flashmsa_run
"$BUILD"/apps/flashmsa_run "$@"
