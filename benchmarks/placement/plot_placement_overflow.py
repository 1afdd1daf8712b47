"""One PNG of ``placement_overflow.py`` reports (issue 14): per report, accuracy against host->
device bytes per answer token for each placement and lazy-load budget, at each L0 size.

    python3 benchmarks/placement/plot_placement_overflow.py \
        benchmarks/results/placement/placement_overflow_*_h200.json \
        --out benchmarks/results/placement/placement_overflow_h200.png
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

MARKERS = {"lru": "o", "ema": "s", "kag": "^"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("reports", nargs="+")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    reps = [json.loads(Path(f).read_text()) for f in a.reports]
    cols = min(2, len(reps))
    rows = math.ceil(len(reps) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 4.6 * rows), squeeze=False)
    colors = {None: "black", 0.25: "tab:blue", 0.1: "tab:orange"}
    for ax, r in zip(axes.flat, reps):
        for l0, fill in ((0.25, True), (0.1, False)):
            for row in r["rows"]:
                if row["l0_share"] != l0:
                    continue
                b = row["lazy_load_budget"]
                c = colors.get(b, "tab:green")
                ax.scatter(row["h2d_bytes_per_token"] / 2**10, 100 * row["accuracy"],
                           marker="*" if b is None else MARKERS[row["kv_placement"]], s=90,
                           facecolors=c if fill else "none", edgecolors=c)
        ax.set_title(f"{r['model']} / {r['suite']} (n = {r['n']}, median canvas "
                     f"{r['median_canvas']} tokens, page {r['page_size']})", fontsize=9)
        ax.set_xlabel("host->device KiB per answer token")
        ax.set_ylabel("accuracy (%)")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.tick_params(axis="x", which="minor", labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(reps):]:
        ax.axis("off")
    from matplotlib.lines import Line2D
    handles = ([Line2D([], [], marker="*", ls="", color="black", ms=10, label="exact (no budget)")]
               + [Line2D([], [], marker=m, ls="", color="gray", ms=8, label=f"{k}")
                  for k, m in MARKERS.items()]
               + [Line2D([], [], marker="o", ls="", color=c, ms=8, label=f"F = {b}")
                  for b, c in colors.items() if b is not None]
               + [Line2D([], [], marker="o", ls="", mfc="gray", mec="gray", ms=8,
                         label="L0 25 % (filled)"),
                  Line2D([], [], marker="o", ls="", mfc="none", mec="gray", ms=8,
                         label="L0 10 % (open)")])
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.suptitle("Placement of requests larger than L0 under lazy loading (quest predictor)",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
