#!/usr/bin/env bash
# Installs what building and testing dtorch_ops needs, skipping what is already there:
#   from Debian: g++, make, cmake, binutils, Boost >= 1.78 headers (robust interprocess mutexes);
#   torch (2.13.0 unless a torch >= 2.11 is importable), ninja, pytest, pytest-timeout,
#   matplotlib (make bench's plot) and mypy (tests/test_typing.py).
# PYTHON selects the interpreter (default: python3 on PATH).
set -euo pipefail
PYTHON=${PYTHON:-python3}
TORCH_PIN=${TORCH_PIN:-torch==2.13.0}

log() { printf 'install_deps: %s\n' "$*"; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    log "need root to run: $*"; exit 1; fi
}

boost_version() {  # prints BOOST_VERSION (e.g. 108100) or 0
  local header=/usr/include/boost/version.hpp
  if [ -f "$header" ]; then awk '/#define BOOST_VERSION /{print $3}' "$header"; else echo 0; fi
}

apt_packages=()
command -v g++ >/dev/null || apt_packages+=(g++)
command -v make >/dev/null || apt_packages+=(make)
command -v cmake >/dev/null || apt_packages+=(cmake)  # CMakeLists.txt: test_core, wake_bench; examples/cpp
command -v readelf >/dev/null || apt_packages+=(binutils)

if [ "$(boost_version)" -lt 107800 ]; then
  debian_major=$(cut -d. -f1 /etc/debian_version 2>/dev/null || echo 0)
  case "$debian_major" in
    12) boost_pkg=libboost1.81-dev ;;   # Debian 12's default libboost-dev is 1.74
    *) boost_pkg=libboost-dev ;;        # Debian 13: 1.83
  esac
  apt_packages+=("$boost_pkg")
fi

if [ ${#apt_packages[@]} -gt 0 ]; then
  log "installing ${apt_packages[*]} (Debian)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_packages[@]}" >/dev/null
  [ "$(boost_version)" -ge 107800 ] || { log "Boost >= 1.78 still missing"; exit 1; }
fi

if ! "$PYTHON" - <<'PY' 2>/dev/null
import sys, torch
major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PY
then
  log "installing $TORCH_PIN"
  "$PYTHON" -m pip install -q "$TORCH_PIN"
fi

missing=$("$PYTHON" - <<'PY'
import importlib.util
wanted = {"ninja": "ninja", "pytest": "pytest", "pytest_timeout": "pytest-timeout",
          "setuptools": "setuptools>=64", "wheel": "wheel", "matplotlib": "matplotlib",
          "mypy": "mypy"}
print(" ".join(pkg for mod, pkg in wanted.items() if importlib.util.find_spec(mod) is None))
PY
)
if [ -n "$missing" ]; then
  log "installing $missing"
  # shellcheck disable=SC2086
  "$PYTHON" -m pip install -q $missing
fi
