#!/usr/bin/env python3
"""Ratios of `fp4moe bench` JSON files to the first one, case by case (same shape base name, T and LoRA case).

Usage: compare_variants.py BASE.json OTHER.json...  Prints one row per case: the base median and, for each other
file, its median and its ratio to the base. Shape names carry the variant as a suffix (kimi_k3_tp8+situ); the
suffix is dropped to match cases across files.
"""
import json
import os
import sys

from bench_cases import lora_case, shape_of


def cases(path):
    doc = json.load(open(path))
    out = {}
    for c in doc["cases"]:
        if c.get("status") != "ok":
            continue
        out[(shape_of(c), c["T"], lora_case(c))] = c["median_us"]
    return out


def main(paths):
    if len(paths) < 2:
        sys.exit(__doc__)
    base = cases(paths[0])
    others = [(os.path.basename(p).removesuffix(".json"), cases(p)) for p in paths[1:]]
    head = f"| shape | T | LoRA case | {os.path.basename(paths[0]).removesuffix('.json')} µs |"
    head += "".join(f" {n} µs | ratio |" for n, _ in others)
    print(head)
    print("|" + "---|" * (4 + 2 * len(others)))
    for key in sorted(base):
        row = f"| {key[0]} | {key[1]} | {key[2]} | {base[key]:.1f} |"
        for _, o in others:
            row += f" {o[key]:.1f} | {o[key] / base[key]:.3f} |" if key in o else " – | – |"
        print(row)


if __name__ == "__main__":
    main(sys.argv[1:])
