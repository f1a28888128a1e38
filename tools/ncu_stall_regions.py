#!/usr/bin/env python3
# Where a wgmma GEMM kernel's warps stall: the stall samples of each distinct kernel (first launch) in an ncu
# source CSV (tools/device/ncu_profile.sh's src_*.csv), summed by region of the SASS: the producer warps' copy loop
# (around the LDGSTS; tiles with producer warps), the math warps' wgmma loop (around the HGMMA), before and after
# (chunk sums, epilogue); then the TOP (default 12) SASS lines by samples.
# Usage: python3 tools/ncu_stall_regions.py src_<shape>_T<T>.csv [TOP]
import csv, collections, sys
rows = list(csv.reader(open(sys.argv[1])))
starts = [i for i, r in enumerate(rows) if r and r[0] == "Kernel Name"]
seen = set()
for si in starts:
    if rows[si][1] in seen:
        continue
    seen.add(rows[si][1])
    end = next((x for x in starts if x > si), len(rows))
    hdr = rows[si + 1]
    data = [r for r in rows[si + 2:end] if len(r) >= len(hdr)]
    ia = hdr.index("Warp Stall Sampling (All Samples)")
    cols = [c for c in hdr if c.startswith("stall_") and "(" not in c]
    tot = sum(float(r[ia] or 0) for r in data)
    print(rows[si][1][:200])
    print(f"  samples {tot:.0f}, SASS lines {len(data)}")
    hg = [i for i, r in enumerate(data) if "HGMMA" in r[1]]
    ld = [i for i, r in enumerate(data) if "LDGSTS" in r[1]]
    if not hg:
        print("  (no wgmma loop)")
        continue
    lo, hi = min(hg) - 150, max(hg) + 40
    if ld and max(ld) + 60 < lo:  # producer warps: their copy loop comes before the math loop
        regions = {"before": range(0, min(ld) - 60), "producer copy loop": range(min(ld) - 60, max(ld) + 60),
                   "math wgmma loop": range(max(lo, max(ld) + 60), hi)}
    else:  # every warp loads its share in the loop
        regions = {"before": range(0, lo), "wgmma loop (copies inside)": range(lo, hi)}
    regions["after the loop (chunk sums, epilogue)"] = range(hi, len(data))
    for name, rg in regions.items():
        c = collections.Counter()
        for i in rg:
            for col in cols:
                c[col[6:]] += float(data[i][hdr.index(col)] or 0)
        s = sum(float(data[i][ia] or 0) for i in rg)
        print(f"  {name:40s} {s / tot * 100:5.1f} %  " + ", ".join(f"{k} {v / tot * 100:.1f} %" for k, v in c.most_common(5)))
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    for i in sorted(range(len(data)), key=lambda i: -float(data[i][ia] or 0))[:top]:
        print(f"    line {i:5d} {float(data[i][ia] or 0) / tot * 100:5.1f} %  {data[i][1][:90]}")
