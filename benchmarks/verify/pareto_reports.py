"""Accuracy against forwards per block from finished ``flash-dllm eval`` reports: one Pareto
report (JSON + PNG) per model, no decoding of its own.

    python benchmarks/verify/pareto_reports.py --out benchmarks/results/verify/pareto_llada2_cpu \
        benchmarks/results/accuracy/eval_*llada2*_cpu.json

Each report is one (suite, decode, threshold) point. Per suite the exact sampler's report
(``decode`` vanilla) is the reference: a point is ``within_1pt`` when its accuracy is at least the
exact's minus one point; ``frontier`` marks the points no other point of the suite beats on both
axes (more accurate with no more forwards per block). The JSON holds every point with its report
path; the PNG (when matplotlib is installed) one panel per suite.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def point(path: Path) -> dict:
    r = json.loads(path.read_text(encoding="utf-8"))
    p = r.get("params", {})
    decode = p.get("decode", "?")
    return {"report": path.as_posix(), "model": r.get("model"), "suite": r["suite"], "n": r["n"],
            "decode": decode, "cache": p.get("cache"),
            "threshold": p.get("threshold") if decode != "vanilla" else None,
            "accuracy": r["accuracy"], "forwards_per_block": r["forwards_per_block"]["mean"],
            "forwards_per_sample": r["forwards_per_sample"], "device": r.get("device"),
            "dtype": r.get("dtype")}


def analyse(points: list[dict]) -> dict:
    suites: dict[str, dict] = {}
    for s in sorted({p["suite"] for p in points}):
        pts = sorted((p for p in points if p["suite"] == s), key=lambda p: p["forwards_per_block"])
        exact = next((p for p in pts if p["decode"] == "vanilla"), None)
        for p in pts:
            p["within_1pt"] = (exact is not None and p["accuracy"] >= exact["accuracy"] - 0.01)
            p["frontier"] = not any(
                q is not p and q["accuracy"] >= p["accuracy"]
                and q["forwards_per_block"] <= p["forwards_per_block"]
                and (q["accuracy"], -q["forwards_per_block"])
                != (p["accuracy"], -p["forwards_per_block"]) for q in pts)
            if exact is not None:
                p["forwards_vs_exact"] = p["forwards_per_block"] / exact["forwards_per_block"]
        fast = [p for p in pts if p["within_1pt"] and p["decode"] != "vanilla"]
        suites[s] = {"exact": exact, "points": pts,
                     "fewest_forwards_within_1pt": min(fast, key=lambda p: p["forwards_per_block"])
                     if fast else None}
    return suites


def plot(suites: dict, path: Path, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(suites), figsize=(5.2 * len(suites), 4.2), squeeze=False)
    for ax, (s, d) in zip(axes[0], suites.items()):
        for i, p in enumerate(d["points"]):
            exact = p["decode"] == "vanilla"
            ax.scatter(p["forwards_per_block"], 100 * p["accuracy"],
                       marker="s" if exact else "o", color="black" if exact else "tab:blue")
            label = "exact" if exact else f"\u03c4 {p['threshold']}"
            # neighbours alternate below / above their marker, so close points do not collide
            ax.annotate(label, (p["forwards_per_block"], 100 * p["accuracy"]),
                        textcoords="offset points", xytext=(4, -13 if i % 2 == 0 else 7),
                        fontsize=8)
        if d["exact"] is not None:
            ax.axhline(100 * d["exact"]["accuracy"] - 1, color="gray", ls=":", lw=1)
        ax.set_title(f"{s} (dotted: exact - 1 point)")
        ax.set_xlabel("forwards per block")
        ax.set_ylabel("accuracy (%)")
        lo = min(100 * p["accuracy"] for p in d["points"])
        ax.set_ylim(max(0, lo - 5), 101)
        ax.margins(x=0.15)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("--out", required=True, help="path stem: writes STEM.json and STEM.png")
    a = ap.parse_args()
    points = [point(p) for p in a.reports]
    suites = analyse(points)
    models = sorted({Path(str(p["model"])).name for p in points})
    report = {"models": models, "reports": [p.as_posix() for p in a.reports], "suites": suites}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    drew = plot(suites, out.with_suffix(".png"), ", ".join(models))
    for s, d in suites.items():
        for p in d["points"]:
            tag = "exact" if p["decode"] == "vanilla" else f"{p['decode']} {p['threshold']}"
            print(f"{s:10s} {tag:16s} acc {100 * p['accuracy']:5.1f} %  forwards/block "
                  f"{p['forwards_per_block']:5.2f}  within 1 pt: {p['within_1pt']}  "
                  f"frontier: {p['frontier']}")
    print(f"wrote {out.with_suffix('.json')}" + (f" and {out.with_suffix('.png')}" if drew else ""))


if __name__ == "__main__":
    main()
