#!/usr/bin/env bash
# All tests: C++ (GoogleTest through ctest; GPU tests skip without an sm_90 GPU) and the
# PyTorch package (pytest). Installs what it needs first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
BUILD=${BUILD_DIR:-build}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" -j"$(nproc)"
ctest --test-dir "$BUILD" --output-on-failure -j"$(nproc)"
if [ "${FLASHMSA_SKIP_PYTHON:-0}" != "1" ]; then
  bash scripts/test_python.sh
fi
