#!/usr/bin/env bash
# Builds, on this (GPU-less) machine, everything scripts/gpu_check.sh runs on the H200, for sm_90a,
# and copies the binaries into scratch-gpu/ (git-ignored by .gitignore's scratch*/) to be carried.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD_DIR:-build-gpu}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHMSA_BUILD_PYTHON=ON >/dev/null
cmake --build "$BUILD" -j"$(nproc)" --target flashmsa_gpu_tests flashmsa_run flashmsa_torch
mkdir -p scratch-gpu
cp "$BUILD"/tests/gpu/flashmsa_gpu_tests "$BUILD"/apps/flashmsa_run "$BUILD"/python/_C*.so scratch-gpu/
strip --strip-debug scratch-gpu/* 2>/dev/null || true
# Compressed: the working tree plus what a device call carries must stay under 64 MiB (the three
# binaries are ~52 MB, ~10 MB as xz); gpu_check.sh unpacks them.
xz -f -T"$(nproc)" scratch-gpu/flashmsa_gpu_tests scratch-gpu/flashmsa_run scratch-gpu/_C*.so
# The commit the binaries come from (the device copy's git metadata can be stale): gpu_check.sh
# exports it as FLASHMSA_COMMIT for the benchmark's JSON.
echo "$(git rev-parse HEAD)$(git diff --quiet HEAD -- src include apps python tests || echo -dirty)" > scratch-gpu/COMMIT
du -sh scratch-gpu
