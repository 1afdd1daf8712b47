"""Tables and plots of evaluation reports (``flash-dllm eval --matrix``)."""
from __future__ import annotations

from pathlib import Path

from flash_dllm.defaults import EXACT_REFERENCE


def matrix_table(reports: list[dict]) -> str:
    base = next((r for r in reports
                 if all(r["params"][k] == v for k, v in EXACT_REFERENCE.items())), reports[0])
    lines = [f"{'cache':7s} {'decode':10s} {'accuracy':>9s} {'fwd/sample':>11s} {'tok/fwd':>8s} "
             f"{'seconds':>8s} {'speed-up':>9s}"]
    for r in reports:
        p = r["params"]
        lines.append(f"{p['cache']:7s} {p['decode']:10s} {100 * r['accuracy']:8.2f}% "
                     f"{r['forwards_per_sample']:11.2f} {r['tokens_per_forward']:8.2f} "
                     f"{r['seconds']:8.1f} {base['seconds'] / r['seconds']:8.2f}x")
    return "\n".join(lines)


# one colour per cache mode, one hollow marker per policy (sizes differ, so coincident points of
# two policies stay visible as nested shapes)
CACHE_COLORS = {"none": "tab:blue", "prefix": "tab:orange", "dual": "tab:green",
                "flash": "tab:purple"}
DECODE_MARKERS = {"vanilla": ("o", 150), "threshold": ("s", 80), "verify": ("^", 40)}
# label positions tried around a point, in points from it: right-up, right-down, left-up, ...
_OFFSETS = [(5, 4), (5, -12), (-5, 4), (-5, -12), (5, 14), (5, -22), (-5, 14), (-5, -22),
            (14, -4), (-14, -4), (5, 24), (5, -32), (-5, 24), (-5, -32)]


def _limits(values: list[float], log: bool, lower: float | None = None,
            upper: float | None = None) -> tuple[float, float]:
    """Axis limits that start and end where the data does, with a little padding."""
    lo, hi = min(values), max(values)
    if log:
        lo, hi = lo / 1.25, hi * 1.25
    else:
        pad = max(0.06 * (hi - lo), 0.02 * max(abs(hi), 1e-9), 1e-3)
        lo, hi = lo - pad, hi + pad
    if lower is not None:
        lo = max(lo, lower)
    if upper is not None:
        hi = min(hi, upper)
    return lo, hi


ACC_MIN_SPAN = 10.0      # accuracy axes span at least this many points
ACC_HEADROOM = 6.0       # above 100 %: room for the markers and labels of perfect scores


def _accuracy_limits(ys: list[float]) -> tuple[float, float]:
    """The accuracy axis: the data with padding, at least ``ACC_MIN_SPAN`` points tall (grown
    downwards from a top at 100), never below 0, and up to ``ACC_HEADROOM`` above 100 so that a
    point at 100 % and its label sit inside the axes (the ticks stop at 100)."""
    lo, hi = _limits(ys, False, lower=0.0)
    hi = min(hi, 100.0 + ACC_HEADROOM)
    if max(ys) >= 100.0 - 1e-9:
        hi = 100.0 + ACC_HEADROOM
    if hi - lo < ACC_MIN_SPAN:
        lo = max(0.0, hi - ACC_MIN_SPAN)
    return lo, hi


def _panel(ax, reports: list[dict], key, xlabel: str) -> list[tuple[float, float, int]]:
    """One scatter of accuracy against ``key(report)``; its points as (x, y, number)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    xs = [key(r) for r in reports]
    ys = [100 * r["accuracy"] for r in reports]
    for r, x, y in zip(reports, xs, ys):
        p = r["params"]
        marker, size = DECODE_MARKERS.get(p["decode"], ("x", 60))
        # clip_on=False: points at 100 % sit on the top edge, drawn whole
        ax.scatter(x, y, s=size, marker=marker, facecolors="none", linewidths=1.5,
                   edgecolors=CACHE_COLORS.get(p["cache"], "black"), clip_on=False, zorder=3)
    log = min(xs) > 0 and max(xs) / min(xs) >= 10
    if log:                            # 1-2-5 ticks, plain numbers, no minor labels
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(*_limits(xs, log, lower=None if log else 0.0))
    lo, hi = _accuracy_limits(ys)
    ax.set_ylim(lo, hi)
    ax.set_yticks([t for t in ax.get_yticks() if lo <= t <= 100.0])   # no tick reads > 100 %
    ax.set_ylim(lo, hi)
    ax.set_xlabel(xlabel + (" (log scale)" if log else ""))
    ax.set_ylabel("accuracy (%)")
    ax.grid(alpha=0.3)
    return [(x, y, n) for n, (x, y) in enumerate(zip(xs, ys), 1)]


def _place_labels(fig, ax, points: list[tuple[float, float, int]]) -> None:
    """Number every point; points that coincide on screen share one label ("2,5,9"). Each label
    takes the first offset around its point where it overlaps no other label and stays inside
    the axes."""
    renderer = fig.canvas.get_renderer()
    groups: list[tuple[tuple[float, float], list, list[int]]] = []
    for x, y, n in points:
        px = ax.transData.transform((x, y))
        for g in groups:
            if abs(g[0][0] - px[0]) < 4 and abs(g[0][1] - px[1]) < 4:
                g[2].append(n)
                break
        else:
            groups.append(((px[0], px[1]), (x, y), [n]))
    frame = ax.get_window_extent(renderer)
    placed = []
    for _, (x, y), nums in sorted(groups, key=lambda g: (-g[0][1], g[0][0])):
        text = ",".join(str(n) for n in sorted(nums))
        ann = None
        for dx, dy in _OFFSETS:
            ha = "left" if dx >= 0 else "right"
            if ann is None:
                ann = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points",
                                  fontsize=7, ha=ha, va="bottom", zorder=4)
            else:
                ann.xyann = (dx, dy)
                ann.set_ha(ha)
            box = ann.get_window_extent(renderer)
            inside = (box.x0 >= frame.x0 and box.x1 <= frame.x1 and box.y0 >= frame.y0
                      and box.y1 <= frame.y1)
            if inside and not any(box.overlaps(b) for b in placed):
                break
        placed.append(ann.get_window_extent(renderer))


def matrix_figure(reports: list[dict]):
    """The ``--matrix`` figure: accuracy against forwards per sample and against wall seconds,
    every configuration numbered, and a table of the numbers at the right. A matplotlib
    ``Figure`` (Agg canvas, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 5.2), dpi=110)
    FigureCanvasAgg(fig)
    # fixed margins (no tight_layout after the labels are placed: it would move the axes)
    grid = fig.add_gridspec(1, 3, width_ratios=[1, 1, 0.72], left=0.065, right=0.99,
                            bottom=0.12, top=0.88, wspace=0.22)
    ax_f, ax_s, ax_t = (fig.add_subplot(grid[0, i]) for i in range(3))
    points = {ax_f: _panel(ax_f, reports, lambda r: r["forwards_per_sample"],
                           "forwards per sample"),
              ax_s: _panel(ax_s, reports, lambda r: r["seconds"],
                           "wall seconds (decode + scoring)")}
    ax_f.set_title("accuracy vs forwards", fontsize=10)
    ax_s.set_title("accuracy vs wall time", fontsize=10)
    r0 = reports[0]
    fig.suptitle(f"{r0['suite']}: n={r0['n']}, {Path(str(r0.get('model', ''))).name or 'model'}"
                 f" on {r0.get('device', '?')}", fontsize=11)
    for ax, pts in points.items():
        _place_labels(fig, ax, pts)
    ax_t.axis("off")
    ax_t.text(0.0, 1.0, f"{'#':>2} {'cache/decode':17s} {'acc':>6s} {'fwd':>6s} {'sec':>6s}",
              family="monospace", fontsize=8, va="top", weight="bold",
              transform=ax_t.transAxes)
    line = 1.0 / max(len(reports) + 2, 16)
    for k, r in enumerate(reports, 1):
        p = r["params"]
        ax_t.text(0.0, 1.0 - k * line,
                  f"{k:>2} {p['cache'] + '/' + p['decode']:17s} {100 * r['accuracy']:5.1f}% "
                  f"{r['forwards_per_sample']:6.1f} {r['seconds']:6.1f}",
                  family="monospace", fontsize=8, va="top",
                  color=CACHE_COLORS.get(p["cache"], "black"), transform=ax_t.transAxes)
    ax_t.text(0.0, 1.0 - (len(reports) + 1.5) * line,
              "colour: cache mode\nmarker: circle vanilla, square threshold,\n"
              "triangle verify; coinciding points share a label",
              fontsize=7, va="top", transform=ax_t.transAxes)
    return fig


def plot_matrix(reports: list[dict], path: str) -> None:
    fig = matrix_figure(reports)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
