#!/usr/bin/env bash
# Installs what the build and the tests need on a fresh Debian/Ubuntu machine (idempotent).
set -euo pipefail
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v g++ >/dev/null || need_apt+=(g++)
command -v ccache >/dev/null || need_apt+=(ccache)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${need_apt[@]}"
fi
if [ "${FLASHMSA_SKIP_PYTHON:-0}" != "1" ]; then
  python3 -c "import torch" 2>/dev/null || python3 -m pip install -q "torch==2.11.*"
  python3 -m pip install -q numpy pytest "scikit-build-core>=0.10" matplotlib
fi
