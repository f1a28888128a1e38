#!/usr/bin/env python3
"""Plots of `fp4moe bench` results: per model shape, time against T (log-log) for fp4moe, fp4moe in each LoRA case,
the torch bf16 baseline (and its LoRA variant) when given, and the floor: max(bytes / copy ceiling, FLOPs / GEMM
ceiling) of the fp4moe case without LoRA (NVFP4 weight bytes), with the memory-only floor dotted.

  python3 bench/plot.py fp4moe.json [--torch torch.json] [--out DIR]

Writes DIR/<shape>.png and DIR/all_shapes.png (default DIR: bench/plots).
"""
import argparse
import json
import math
import os
import sys

import matplotlib

from bench_cases import lora_case

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# fp4moe's LoRA cases: marker style, colour, legend label.
LORA_STYLES = {
    "per_expert8": ("s-", "tab:green", "fp4moe + 8 LoRA r16 (per expert)"),
    "shared_outer8": ("D-", "tab:olive", "fp4moe + 8 LoRA r16 (shared outer)"),
    "one_adapter": ("P-", "tab:cyan", "fp4moe + 1 LoRA r16"),
    "half_base": ("X-", "tab:purple", "fp4moe + 8 LoRA r16 on half the tokens"),
}


def series(cases, shape, case, key="median_us"):
    pts = sorted((c["T"], c[key]) for c in cases
                 if c["shape"] == shape and lora_case(c) == case and c.get("status") == "ok" and c.get(key))
    return [p[0] for p in pts], [p[1] for p in pts]


def draw(ax, shape, fp, tb):
    fc = fp["cases"]
    x, y = series(fc, shape, "base")
    if x:
        ax.plot(x, y, "o-", color="tab:blue", label="fp4moe (NVFP4)")
    for case, (style, color, label) in LORA_STYLES.items():
        x, y = series(fc, shape, case)
        if x:
            ax.plot(x, y, style, color=color, label=label)
    if tb:
        x, y = series(tb["cases"], shape, "base")
        if x:
            ax.plot(x, y, "^-", color="tab:red", label="torch._grouped_mm bf16")
        x, y = series(tb["cases"], shape, "per_expert8")
        if x:
            ax.plot(x, y, "v--", color="tab:orange", label="torch bf16 + LoRA")
    x, y = series(fc, shape, "base", "floor_us")
    if x:
        ax.plot(x, y, "-", color="black", linewidth=2, label="floor (fp4moe bytes / copy, FLOPs / GEMM)")
    x, y = series(fc, shape, "base", "floor_mem_us")
    if x:
        ax.plot(x, y, ":", color="gray", label="memory floor (NVFP4 bytes / copy)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens T")
    ax.set_ylabel("time per layer call (us)")
    ax.set_title(shape)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fp4moe_json")
    ap.add_argument("--torch", help="JSON of bench/torch_baseline.py")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "plots"))
    args = ap.parse_args()
    fp = json.load(open(args.fp4moe_json))
    tb = json.load(open(args.torch)) if args.torch else None
    shapes = []
    for c in fp["cases"] + (tb["cases"] if tb else []):
        if c["shape"] not in shapes:
            shapes.append(c["shape"])
    if not shapes:
        sys.exit("plot: no cases in the input")
    os.makedirs(args.out, exist_ok=True)
    gpu = fp.get("machine", {}).get("gpu", "")
    for s in shapes:
        fig, ax = plt.subplots(figsize=(6.4, 4.8))
        draw(ax, s, fp, tb)
        fig.suptitle(gpu, fontsize=8)
        fig.tight_layout()
        path = os.path.join(args.out, f"{s}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        print(f"wrote {path}")
    cols = 3
    rows = math.ceil(len(shapes) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.5 * rows), squeeze=False)
    for i, s in enumerate(shapes):
        draw(axes[i // cols][i % cols], s, fp, tb)
    for j in range(len(shapes), rows * cols):
        axes[j // cols][j % cols].axis("off")
    fig.suptitle(f"fp4moe bench, {gpu}")
    fig.tight_layout()
    path = os.path.join(args.out, "all_shapes.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
