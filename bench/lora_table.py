#!/usr/bin/env python3
"""The LoRA rows of an `fp4moe bench` JSON against the base rows of the same run, one markdown table a LoRA case.

Usage: lora_table.py FP4MOE.json [CASE ...]   (default: every LoRA case in the file)

A cell is the LoRA row's time over its own floor (its bytes include the adapter matrices it touches), its time over
the base row's (as +percent), and in parentheses its time-over-floor over the base row's: how much more of its own
floor the LoRA row wastes than the base row. Rows: shapes in file order; columns: token counts. A cell whose LoRA or
base case is missing or not "ok" is "–".
"""
import json
import sys

from bench_cases import lora_case, shape_of


def rows_by_case(doc):
    """{case: {(shape, T): case dict}} over the "ok" cases; shape names lose a variant suffix (+situ)."""
    out = {}
    for c in doc["cases"]:
        if c.get("status") == "ok":
            out.setdefault(lora_case(c), {})[(shape_of(c), c["T"])] = c
    return out


def cell(lora, base):
    if lora is None or base is None:
        return "–"
    over = (lora["median_us"] / base["median_us"] - 1.0) * 100.0
    waste = lora["time_over_floor"] / base["time_over_floor"]
    return f"{lora['time_over_floor']:.2f} {over:+.0f}% ({waste:.2f})"


def table(doc, case):
    """The lines of one LoRA case's table."""
    by_case = rows_by_case(doc)
    base, rows = by_case.get("base", {}), by_case.get(case, {})
    shapes = list(dict.fromkeys(s for s, _ in rows))
    tokens = sorted({t for _, t in rows})
    lines = ["| shape | " + " | ".join(f"T={t}" for t in tokens) + " |", "|---|" + "---|" * len(tokens)]
    for s in shapes:
        lines.append(f"| {s} | " + " | ".join(cell(rows.get((s, t)), base.get((s, t))) for t in tokens) + " |")
    return lines


def main(argv):
    if not argv:
        sys.exit(__doc__)
    doc = json.load(open(argv[0]))
    cases = argv[1:] or [c for c in rows_by_case(doc) if c != "base"]
    for case in cases:
        print(f"\n{case}: × its floor, + over base, (× floor over the base row's × floor)\n")
        print("\n".join(table(doc, case)))


if __name__ == "__main__":
    main(sys.argv[1:])
