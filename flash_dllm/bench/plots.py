"""PNG figures of the memory-tier benchmarks, drawn from their JSON reports (matplotlib, Agg
canvas, no pyplot state; ``pip install -e ".[plot]"``).

- ``memory_figure``: ``bench memory``: GPU <-> pinned-host page moves against a plain copy of
  the same bytes, per offload dtype and group size, and the disk tier against sequential I/O,
  each with its target line (0.8x, 0.7x).
- ``multiturn_figure``: ``bench multiturn``: time to first token per turn (p50, with p99 as a
  thin line) with and without prefix reuse, and the throughput of each run.

``plot_report(report, path)`` tells the two apart and writes the PNG; ``flash-dllm bench plot
REPORT.json --png OUT.png`` redraws a committed report, and ``--png`` on either benchmark draws
the fresh one.
"""
from __future__ import annotations

import math
from pathlib import Path

COPY_TARGET = 0.8      # issue 13: page moves vs a plain pinned copy
DISK_TARGET = 0.7      # disk records vs sequential I/O


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def is_memory_report(report: dict) -> bool:
    return "tiers" in report and "plain_d2h_GBps" in report


def is_multiturn_report(report: dict) -> bool:
    return "per_turn" in report or ("reuse_on" in report and "reuse_off" in report)


def memory_figure(report: dict):
    """Left: store / load rate over the plain copy for each (offload dtype, group size) row;
    right: the disk tier's write / read ratios (medians, each pair as a dot) when measured."""
    rows = report["tiers"]
    disk = report.get("disk")
    fig = _figure(11 if disk else 7.5, 4.4)
    grid = fig.add_gridspec(1, 2 if disk else 1, width_ratios=[2.4, 1] if disk else [1],
                            left=0.07, right=0.98, bottom=0.2, top=0.84, wspace=0.25)
    ax = fig.add_subplot(grid[0, 0])
    labels = [f"{r['offload_dtype']}\n{r.get('group_pages', '-')} pages" for r in rows]
    xs = list(range(len(rows)))
    w = 0.38
    store = [r["store_vs_plain_copy"] for r in rows]
    load = [r["load_vs_plain_copy"] for r in rows]
    ax.bar([x - w / 2 for x in xs], store, w, label="store (GPU -> host)", color="#4c72b0")
    ax.bar([x + w / 2 for x in xs], load, w, label="load (host -> GPU)", color="#dd8452")
    for x, s, lo in zip(xs, store, load):
        ax.text(x - w / 2, s, f"{s:.2f}", ha="center", va="bottom", fontsize=7)
        ax.text(x + w / 2, lo, f"{lo:.2f}", ha="center", va="bottom", fontsize=7)
    ax.axhline(COPY_TARGET, color="#555", ls="--", lw=1)
    ax.text(len(rows) - 0.5, COPY_TARGET, f"target {COPY_TARGET}x", ha="right", va="bottom",
            fontsize=8, color="#555")
    ax.axhline(1.0, color="#999", lw=0.8)
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("pool bytes moved / plain pinned copy")
    ax.set_ylim(0, max(store + load + [1.0]) * 1.15)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"GPU <-> pinned host: {report['pages']} pages of "
                 f"{report['page_bytes'] / 2**20:.1f} MiB; plain copy "
                 f"{report['plain_d2h_GBps']:.1f} / {report['plain_h2d_GBps']:.1f} GB/s",
                 fontsize=9)
    if disk:
        ax2 = fig.add_subplot(grid[0, 1])
        meds = [disk["write_ratio"], disk["read_ratio"]]
        ax2.bar([0, 1], meds, 0.55, color=["#4c72b0", "#dd8452"])
        for x, key in ((0, "write_ratios"), (1, "read_ratios")):
            pts = disk.get(key) or []
            ax2.scatter([x] * len(pts), pts, s=12, color="k", zorder=3)
        for x, m in enumerate(meds):
            ax2.text(x + 0.3, m, f"{m:.2f}", va="center", fontsize=8)
        ax2.axhline(DISK_TARGET, color="#555", ls="--", lw=1)
        ax2.text(1.45, DISK_TARGET, f"target {DISK_TARGET}x", ha="right", va="bottom",
                 fontsize=8, color="#555")
        ax2.set_xticks([0, 1])
        ax2.set_xticklabels(["write", "read"])
        top = max(meds + list(disk.get("write_ratios") or []) + list(disk.get("read_ratios")
                                                                       or []) + [1.0])
        ax2.set_ylim(0, top * 1.15)
        ax2.set_xlim(-0.6, 1.6)
        ax2.set_ylabel("page records / sequential I/O")
        reps = disk.get("reps", 1)
        ax2.set_title(f"disk: {disk['record_bytes'] / 2**20:.1f} MiB records, "
                      f"{'median of ' + str(reps) if reps > 1 else 'one pass'}", fontsize=9)
    fig.suptitle(f"bench memory: {report['shape']} {report['dtype']} on {report['device']}",
                 fontsize=11)
    return fig


def _turns(run: dict) -> tuple[list[int], list[float], list[float]]:
    """Turn numbers and TTFT p50 / p99 per turn; NaN (a gap in the line) for a turn with no
    successful request (its summary has None)."""
    def val(v) -> float:
        return float("nan") if v is None else float(v)
    turns = [t["turn"] for t in run["per_turn"]]
    p50 = [val(t["ttft_s"]["p50"]) for t in run["per_turn"]]
    p99 = [val(t["ttft_s"]["p99"]) for t in run["per_turn"]]
    return turns, p50, p99


def multiturn_figure(report: dict):
    """Left: TTFT p50 per turn (p99 thin, dashed) for each run; right: throughput per run."""
    single = {True: "reuse on", False: "reuse off"}.get(report.get("prefix_reuse"), "run")
    runs = ([("reuse on", report["reuse_on"]), ("reuse off", report["reuse_off"])]
            if "reuse_on" in report else [(single, report)])
    fig = _figure(10, 4.4)
    grid = fig.add_gridspec(1, 2, width_ratios=[2.2, 1], left=0.07, right=0.98, bottom=0.13,
                            top=0.84, wspace=0.28)
    ax = fig.add_subplot(grid[0, 0])
    colors = ["#4c72b0", "#dd8452"]
    per_run = [_turns(run) for _, run in runs]
    for (name, _), (turns, p50, p99), c in zip(runs, per_run, colors):
        ax.plot(turns, p50, "o-", color=c, label=f"{name}: p50")
        ax.plot(turns, p99, "--", color=c, lw=0.9, label=f"{name}: p99")
        for t, v in zip(turns, p50):
            if math.isnan(v):
                continue
            ax.annotate(f"{v:.2f}", (t, v), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=7, color=c)
    ax.set_xticks(per_run[0][0])
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (s)")
    seen = [v for _, p50, p99 in per_run for v in p50 + p99 if not math.isnan(v)]
    ax.set_ylim(0, max(seen, default=1.0) * 1.12 or 1.0)
    ax.legend(fontsize=8, loc="lower left")
    cfg = runs[0][1].get("config", {})
    ax.set_title(f"{cfg.get('users', '?')} users x {cfg.get('turns', '?')} turns, ~"
                 f"{cfg.get('history_tokens', '?')}-token histories", fontsize=9)
    ax2 = fig.add_subplot(grid[0, 1])
    rps = [run["throughput_rps"] for _, run in runs]
    ax2.bar(range(len(runs)), rps, 0.55, color=colors[:len(runs)])
    for x, v in enumerate(rps):
        ax2.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax2.set_xticks(range(len(runs)))
    ax2.set_xticklabels([n for n, _ in runs])
    ax2.set_ylabel("requests / s")
    ax2.set_ylim(0, max(rps) * 1.2 if rps and max(rps) > 0 else 1)
    hit = (runs[0][1].get("server_metrics") or {}).get("prefix_cache_hit_rate")
    ax2.set_title("throughput" + (f"; {100 * hit:.0f} % of prompt tokens reused"
                                  if hit is not None else ""), fontsize=9)
    model = runs[0][1].get("model", "")
    fig.suptitle(f"bench multiturn: {Path(str(model)).name or 'model'}", fontsize=11)
    return fig


def plot_report(report: dict, path: str | Path) -> Path:
    """Draw the figure of a ``bench memory`` or ``bench multiturn`` report into ``path``."""
    if is_memory_report(report):
        fig = memory_figure(report)
    elif is_multiturn_report(report):
        fig = multiturn_figure(report)
    else:
        raise ValueError("not a bench memory or bench multiturn report (no 'tiers' or "
                         "'per_turn' / 'reuse_on' keys)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
