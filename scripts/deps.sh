#!/usr/bin/env bash
# Installs what the build and the tests need on a fresh Debian/Ubuntu machine (idempotent).
# FLASHMSA_SKIP_PYTHON=1 skips the Python side (torch, pytest, scikit-build-core).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v g++ >/dev/null || need_apt+=(g++)
command -v ccache >/dev/null || need_apt+=(ccache)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
command -v python3 >/dev/null || need_apt+=(python3)
python3 -m pip --version >/dev/null 2>&1 || need_apt+=(python3-pip)
if [ ${#need_apt[@]} -gt 0 ]; then
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${need_apt[@]}"
fi
# Older distributions (e.g. Ubuntu 22.04: 3.22) ship a cmake below the project's minimum.
cmake_recent || { pip_install "cmake>=3.24"; hash -r; }
if [ "${FLASHMSA_SKIP_PYTHON:-0}" != "1" ]; then
  python3 -c "import torch" 2>/dev/null || pip_install "torch==2.11.*"
  pip_install numpy pytest "scikit-build-core>=0.10" matplotlib
fi
