#!/usr/bin/env bash
# Builds and installs the PyTorch package against the installed torch, then runs its tests.
# CUDA tests skip without a GPU. FLASHMSA_CUDA=OFF in the environment builds the package CPU-only.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
extra=()
[ "${FLASHMSA_CUDA:-ON}" = "OFF" ] && extra+=(-C cmake.define.FLASHMSA_CUDA=OFF)
pip_install --no-build-isolation --no-deps "${extra[@]}" .
# Run from outside the source tree so the installed package (with its _C.so) is imported.
(cd tests/python && python3 -m pytest -q -rs .)
