"""Tables and plots of evaluation reports (``flash-dllm eval --matrix``)."""
from __future__ import annotations

from pathlib import Path


def matrix_table(reports: list[dict]) -> str:
    base = next((r for r in reports if r["params"]["cache"] == "none"
                 and r["params"]["decode"] == "vanilla"), reports[0])
    lines = [f"{'cache':7s} {'decode':10s} {'accuracy':>9s} {'fwd/sample':>11s} {'tok/fwd':>8s} "
             f"{'seconds':>8s} {'speed-up':>9s}"]
    for r in reports:
        p = r["params"]
        lines.append(f"{p['cache']:7s} {p['decode']:10s} {100 * r['accuracy']:8.2f}% "
                     f"{r['forwards_per_sample']:11.2f} {r['tokens_per_forward']:8.2f} "
                     f"{r['seconds']:8.1f} {base['seconds'] / r['seconds']:8.2f}x")
    return "\n".join(lines)


def plot_matrix(reports: list[dict], path: str) -> None:
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # NOTE: policies often land on the same point; a legend with one colour per cache mode and
    # one (hollow, differently sized) marker per policy keeps coincident points readable.
    colors = {"none": "tab:blue", "prefix": "tab:orange", "dual": "tab:green"}
    markers = {"vanilla": ("o", 140), "threshold": ("s", 80), "verify": ("^", 40)}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in reports:
        p = r["params"]
        marker, size = markers.get(p["decode"], ("x", 60))
        ax.scatter(r["forwards_per_sample"], 100 * r["accuracy"], s=size, marker=marker,
                   facecolors="none", edgecolors=colors.get(p["cache"], "black"), linewidths=1.5,
                   label=f"{p['cache']}/{p['decode']}")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.legend(fontsize=8, loc="best")
    ax.set_xlabel("forwards per sample")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"{reports[0]['suite']}: accuracy vs forwards (n={reports[0]['n']})")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
