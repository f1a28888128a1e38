#!/usr/bin/env bash
# Builds tools/fuzz/fuzz_safetensors.cpp with libFuzzer + AddressSanitizer + UndefinedBehaviorSanitizer
# and runs it for SECONDS on a seed corpus (valid safetensors/PEFT/JSON inputs from make_seeds.cpp).
# Exit status 0 only when the run ended without a crash, leak, sanitizer report or timeout.
#
# usage: tools/fuzz/run_fuzz.sh [SECONDS=180] [BUILD_DIR=build-fuzz] [extra libFuzzer flags...]
# Needs clang with compiler-rt (Debian: apt-get install -y clang-14 libclang-rt-14-dev) and nlohmann/json's headers
# (scripts/setup.sh installs nlohmann-json3-dev; elsewhere set JSON_INCLUDE_DIR to the folder holding nlohmann/).
set -euo pipefail

secs=${1:-180}
out=${2:-build-fuzz}
shift $(( $# < 2 ? $# : 2 ))
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"

cxx=${CXX_FUZZ:-}
if [[ -z "$cxx" ]]; then
  for c in clang++ clang++-18 clang++-17 clang++-16 clang++-15 clang++-14; do
    if command -v "$c" >/dev/null; then cxx=$c; break; fi
  done
fi
if [[ -z "$cxx" ]]; then
  echo "run_fuzz.sh: no clang++ found; install it, e.g. apt-get install -y clang-14 libclang-rt-14-dev" >&2
  exit 2
fi

# The readers under test and what they need from the library (no threads, no CUDA).
srcs=(src/io/safetensors.cpp src/io/json.cpp src/io/json_write.cpp src/io/peft.cpp src/io/checkpoint_files.cpp
      src/io/checkpoint_config.cpp src/io/checkpoint.cpp src/runtime/types.cpp src/runtime/host_tensor.cpp)
flags=(-std=c++20 -O1 -g -fno-omit-frame-pointer -Iinclude -Isrc ${JSON_INCLUDE_DIR:+-I"$JSON_INCLUDE_DIR"})
mkdir -p "$out/artifacts" "$out/corpus" "$out/seeds"
echo "== building with $("$cxx" --version | head -1)"
"$cxx" "${flags[@]}" -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  tools/fuzz/fuzz_safetensors.cpp "${srcs[@]}" -o "$out/fuzz_safetensors"
"$cxx" "${flags[@]}" -fsanitize=address,undefined tools/fuzz/make_seeds.cpp "${srcs[@]}" -o "$out/make_seeds"
"$out/make_seeds" "$out/seeds"

echo "== fuzzing for ${secs} s (corpus $out/corpus, seeds $out/seeds)"
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
set +e
"$out/fuzz_safetensors" -max_total_time="$secs" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
  -dict=tools/fuzz/safetensors.dict -artifact_prefix="$out/artifacts/" -print_final_stats=1 "$@" \
  "$out/corpus" "$out/seeds" 2>&1 | tee "$out/fuzz.log"
rc=${PIPESTATUS[0]}
set -e

crashes=$(find "$out/artifacts" -type f \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) | wc -l)
execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$out/fuzz.log" | grep -o '[0-9]*$' || true)
last=$(grep -E '^#[0-9]+' "$out/fuzz.log" | tail -1 || true)
echo "== summary: exit $rc, executions ${execs:-?}, crashes/leaks/timeouts $crashes, corpus $(ls "$out/corpus" | wc -l) files"
echo "== last status: $last"
[[ $rc -eq 0 && $crashes -eq 0 ]]
