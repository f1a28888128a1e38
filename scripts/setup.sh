#!/usr/bin/env bash
# Installs what a fresh Debian/Ubuntu machine lacks to build and test fp4moe (idempotent).
set -euo pipefail
need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v g++ >/dev/null || need_apt+=(g++)
command -v git >/dev/null || need_apt+=(git)
command -v python3 >/dev/null || need_apt+=(python3 python3-pip)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
[ -f /usr/include/nlohmann/json.hpp ] || need_apt+=(nlohmann-json3-dev)  # the file readers' JSON (src/io)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi
# Python test dependencies (see requirements-test.txt).
here="$(cd "$(dirname "$0")/.." && pwd)"
if ! python3 -c "import numpy, ml_dtypes, pytest, nanobind, scikit_build_core, safetensors, hypothesis" 2>/dev/null; then
  echo "setup: pip install -r requirements-test.txt"
  python3 -m pip install -q -r "$here/requirements-test.txt" || python3 -m pip install -q --break-system-packages -r "$here/requirements-test.txt"
fi
