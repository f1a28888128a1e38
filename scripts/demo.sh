#!/usr/bin/env bash
# The main job: set up, build, run the demo on the built-in default layer (GPU if present, else CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
./build/fp4moe demo "$@"
