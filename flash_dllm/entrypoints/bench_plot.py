"""``flash-dllm bench plot`` and the ``--png`` of ``bench memory`` / ``bench multiturn``: figures
drawn from a benchmark's JSON report (``bench/plots.py``)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flash_dllm.entrypoints.args import CommandError, require_matplotlib


def add_plot_parser(bsub) -> None:
    pl = bsub.add_parser("plot", help="redraw the figure of a bench memory or bench multiturn "
                                      "JSON report (matplotlib)")
    pl.add_argument("report", help="the JSON report")
    pl.add_argument("--png", required=True, help="write the figure here")
    pl.set_defaults(func=cmd_bench_plot)


def draw(report: dict, path: str) -> Path:
    """The report's figure into ``path``; CommandError naming what is missing from a report
    that is not one of ours (or lacks a field)."""
    from flash_dllm.bench.plots import plot_report

    if not isinstance(report, dict):
        raise CommandError(f"a report is a JSON object, got {type(report).__name__}")
    try:
        return plot_report(report, path)
    except ValueError as e:                 # plot_report: not one of the two kinds of report
        raise CommandError(str(e)) from None
    except (KeyError, TypeError) as e:
        raise CommandError(f"cannot draw the report: {type(e).__name__}: {e}") from None


def write_png(report: dict, path: str | None) -> None:
    """``--png`` after a run: the run's outcome (its JSON, its exit code) does not depend on
    the figure, so a figure that cannot be drawn is reported, not raised."""
    if not path:
        return
    try:
        print(f"wrote {draw(report, path)}", file=sys.stderr)
    except CommandError as e:
        print(f"--png: {e}", file=sys.stderr)


def cmd_bench_plot(a: argparse.Namespace) -> int:
    require_matplotlib("bench plot")
    try:
        report = json.loads(Path(a.report).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CommandError(f"cannot read the report {a.report}: {e}") from None
    try:
        out = draw(report, a.png)
    except CommandError as e:
        raise CommandError(f"{a.report}: {e}") from None
    print(f"wrote {out}", file=sys.stderr)
    return 0
