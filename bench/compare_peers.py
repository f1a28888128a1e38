#!/usr/bin/env python3
"""fp4moe beside its peers: one markdown table from an `fp4moe bench` JSON and the peers' JSON of the same run.

Usage: compare_peers.py FP4MOE.json NAME=PEER.json [NAME=PEER.json ...] [--lora-case CASE]

A peer file is a JSON list of cases, or an object with a "cases" (or "results") list; a case has "shape", "T" and "median_us"
(cases with a "status" other than "ok" are left out). Rows: every (shape, T) of the fp4moe file's CASE rows (default
"base", the rows without LoRA), with the floor, fp4moe's time and its multiple of the floor, each peer's time and
fp4moe's time over it (below 1: fp4moe is faster); the fastest time of a row is in bold. Shape names match after
dropping a variant suffix ("kimi_k3_tp8+situ" is "kimi_k3_tp8").
"""
import json
import sys

from bench_cases import lora_case, shape_of


def fp4moe_rows(doc, case):
    return {(shape_of(c), c["T"]): c for c in doc["cases"] if c.get("status") == "ok" and lora_case(c) == case}


def peer_times(doc):
    cases = (doc["cases"] if "cases" in doc else doc["results"]) if isinstance(doc, dict) else doc
    return {(shape_of(c), c["T"]): c["median_us"] for c in cases if c.get("status", "ok") == "ok"}


def table(fp4moe_doc, peers, case="base"):
    """peers: [(name, peer JSON document)]; returns the table's lines."""
    ours = fp4moe_rows(fp4moe_doc, case)
    times = [(name, peer_times(doc)) for name, doc in peers]
    head = "| shape | T | floor µs | fp4moe µs | × floor |" + "".join(f" {n} µs | fp4moe / {n} |" for n, _ in times)
    lines = [head, "|---|---:|---:|---:|---:|" + "---:|---:|" * len(times)]
    for key in sorted(ours, key=lambda k: (k[0], k[1])):
        c = ours[key]
        mine = c["median_us"]
        best = min([mine] + [t[key] for _, t in times if key in t])
        bold = lambda v: f"**{v:.1f}**" if v == best else f"{v:.1f}"
        row = f"| {key[0]} | {key[1]} | {c['floor_us']:.1f} | {bold(mine)} | {mine / c['floor_us']:.2f} |"
        for _, t in times:
            row += f" {bold(t[key])} | {mine / t[key]:.2f} |" if key in t else " – | – |"
        lines.append(row)
    return lines


def main(argv):
    case = "base"
    if "--lora-case" in argv:
        i = argv.index("--lora-case")
        if i + 1 >= len(argv):
            sys.exit(__doc__)
        case = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        sys.exit(__doc__)
    peers = []
    for a in argv[1:]:
        name, path = a.split("=", 1)
        peers.append((name, json.load(open(path))))
    print("\n".join(table(json.load(open(argv[0])), peers, case)))


if __name__ == "__main__":
    main(sys.argv[1:])
