#!/usr/bin/env bash
# Two builds of `fp4moe bench` side by side on one GPU (a refactor's "changes no time" check): for each shape the
# old binary, then the new one, the same options; then the table of new / old medians per case.
#   usage: tools/device/ab_bench.sh OLD_FP4MOE NEW_FP4MOE OUTDIR
#   SHAPES (default kimi_k3_tp8,qwen3_30b_a3b,mixtral_8x7b), BENCH_FLAGS (default --tokens 1,8,64,256,1024,4096),
#   CAP (seconds a bench process, default 120)
set -u
OLD=${1:?usage: ab_bench.sh OLD NEW OUTDIR}; NEW=${2:?}; LOGS=${3:?}
mkdir -p "$LOGS"
SHAPES=${SHAPES:-kimi_k3_tp8,qwen3_30b_a3b,mixtral_8x7b}
FLAGS=${BENCH_FLAGS:---tokens 1,8,64,256,1024,4096}
for s in ${SHAPES//,/ }; do
  for which in old new; do
    bin=$OLD; [ "$which" = new ] && bin=$NEW
    timeout -s KILL "${CAP:-120}" "$bin" bench --shapes "$s" $FLAGS --json "$LOGS/$which-$s.json" \
      > "$LOGS/$which-$s.log" 2>&1
    echo "== $which $s rc=$?"
  done
done
python3 - "$LOGS" "$(dirname "$0")/../../bench" <<'PY'
import json, glob, os, sys
d = sys.argv[1]
sys.path.insert(0, sys.argv[2])
from bench_cases import lora_case
rows, ratios = [], []
for f in sorted(glob.glob(os.path.join(d, "new-*.json"))):
    o = f.replace("new-", "old-")
    if not os.path.exists(o): continue
    key = lambda c: (c["shape"], c["T"], lora_case(c))
    old = {key(c): c for c in json.load(open(o))["cases"] if c["status"] == "ok"}
    for c in json.load(open(f))["cases"]:
        if c["status"] != "ok" or key(c) not in old: continue
        r = c["median_us"] / old[key(c)]["median_us"]
        ratios.append(r)
        rows.append(f"| {c['shape']} | {c['T']} | {key(c)[2]} | "
                    f"{old[key(c)]['median_us']:.1f} | {c['median_us']:.1f} | {r:.3f} |")
print("| shape | T | rows | old us | new us | new / old |\n|---|---:|---|---:|---:|---:|")
print("\n".join(rows))
if ratios:
    ratios.sort()
    print(f"\n{len(ratios)} cases: new / old median {ratios[len(ratios)//2]:.3f}, min {ratios[0]:.3f}, max {ratios[-1]:.3f}")
PY
