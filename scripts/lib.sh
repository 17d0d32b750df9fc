# Shared helpers for the set-up scripts (sourced, not run).

# pip install into the python3 that runs the tests. A distribution python marked
# EXTERNALLY-MANAGED (PEP 668, e.g. Debian 12) refuses plain installs: there, outside a virtual
# environment, the packages go in with --break-system-packages (CI machines are throwaway).
pip_install() {
  local flags=()
  if python3 - <<'PY'
import os, sys, sysconfig
managed = os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
sys.exit(0 if managed and sys.prefix == sys.base_prefix else 1)
PY
  then
    flags+=(--break-system-packages)
  fi
  python3 -m pip install -q "${flags[@]}" "$@"
}

# Whether `cmake` exists and is at least 3.24 (CMakeLists.txt's minimum).
cmake_recent() {
  command -v cmake >/dev/null || return 1
  local v
  v=$(cmake --version | head -n1 | awk '{print $3}')
  [ "$(printf '%s\n3.24\n' "$v" | sort -V | head -n1)" = "3.24" ]
}
