# Helpers shared by the device scripts (sourced): a summary log $S, a time budget $BUDGET counted from $t0, and
# step NAME CAP CMD... which runs CMD for at most min(CAP, time left) seconds with its output in $LOGS/NAME.log.
# Sourcing also sets what the scripts share, unless the caller set it first: LOGS (the first argument, default ./<script>-out, created),
# BIN (carried binaries, default build-dev), FILTER (gtest filter, default *), BUDGET (540 s), t0 (now) and
# S ($LOGS/0-summary.log).
LOGS=${1:-${LOGS:-$PWD/$(basename "$0" .sh)-out}}
mkdir -p "$LOGS"
BIN=${BIN:-build-dev}
FILTER=${FILTER:-*}
BUDGET=${BUDGET:-540}
t0=${t0:-$(date +%s)}
S=${S:-$LOGS/0-summary.log}
say() { echo "$*" | tee -a "$S"; }
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
step() {
  local name=$1 cap=$2; shift 2
  local l; l=$(left); [ "$l" -lt "$cap" ] && cap=$l
  if [ "$cap" -le 5 ]; then say "== $name: skipped (no time left)"; return 124; fi
  local s=$(date +%s)
  timeout -s KILL "$cap" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  say "== $name: rc=$rc in $(( $(date +%s) - s )) s (cap $cap s)"
  return $rc
}
# The first lines of a summary: date, revision (.device-rev, written beside an unpacked `git archive`), GPUs.
header() {
  {
    echo "# date: $(date -u +%FT%TZ) $*"
    echo "# revision: $(cat .device-rev 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
  } >> "$S"
}
# FP4MOE_NCCL_LIBRARY (unless set): the lib folder of PyTorch's nvidia-nccl pip package, whose libnccl.so.2 is not on
# the loader's path.
export_nccl_library() {
  [ -n "${FP4MOE_NCCL_LIBRARY:-}" ] && return 0
  local d
  d=$(python3 -c "import nvidia.nccl, os; print([os.path.join(p, 'lib') for p in nvidia.nccl.__path__][0])" 2>/dev/null)
  if [ -n "$d" ] && [ -e "$d/libnccl.so.2" ]; then export FP4MOE_NCCL_LIBRARY=$d; fi
  return 0
}
