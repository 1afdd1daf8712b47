"""Figures of the memory-tier benchmarks (``bench/plots.py``): drawn from real reports (a CPU
``bench memory`` run with the disk tier, the committed H200 reports), through ``--png`` and
``bench plot``; a file that is not such a report is refused with a message."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from flash_dllm.bench.plots import memory_figure, multiturn_figure, plot_report
from flash_dllm.cli import main

RESULTS = (Path(__file__).resolve().parent.parent / "benchmarks" / "results"
           / "kv-tiers")
PNG = b"\x89PNG\r\n\x1a\n"


def test_bench_memory_png_from_a_cpu_run(tmp_path):
    png, js = tmp_path / "mem.png", tmp_path / "mem.json"
    rc = main(["bench", "memory", "--pages", "2", "--reps", "1", "--group-pages", "1", "2",
               "--disk-path", str(tmp_path / "kv.bin"), "--disk-mb", "1", "--json", str(js),
               "--png", str(png)])
    assert rc == 0 and png.read_bytes()[:8] == PNG
    rep = json.loads(js.read_text())
    assert [r["group_pages"] for r in rep["tiers"]] == [1, 1, 1, 2, 2, 2]
    assert all(r["verified"] for r in rep["tiers"]) and rep["disk"]["reps"] == 5
    fig = memory_figure(rep)
    assert len(fig.axes) == 2                      # page moves and the disk tier


@pytest.mark.parametrize("name", ["memory_h200", "multiturn_long_h200",
                                  "multiturn_oversubscribed_l1fits_h200", "multiturn_disk_h200"])
def test_committed_reports_redraw(tmp_path, name):
    rep = json.loads((RESULTS / f"{name}.json").read_text())
    out = plot_report(rep, tmp_path / f"{name}.png")
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 10_000
    if name.startswith("multiturn"):
        ax = multiturn_figure(rep).axes[0]
        runs = 2 if "reuse_on" in rep else 1
        assert len(ax.lines) == 2 * runs               # p50 and p99 per run


def test_bench_plot_refuses_what_is_not_a_report(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"hello": 1}))
    assert main(["bench", "plot", str(bad), "--png", str(tmp_path / "x.png")]) == 1
    assert "not a bench memory or bench multiturn report" in capsys.readouterr().err
    assert main(["bench", "plot", str(tmp_path / "missing.json"), "--png",
                 str(tmp_path / "y.png")]) == 1
    assert "cannot read the report" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_a_turn_without_a_successful_request_leaves_a_gap(tmp_path):
    rep = json.loads((RESULTS / "multiturn_long_h200.json").read_text())
    for run in (rep["reuse_on"], rep["reuse_off"]):
        run["per_turn"][2]["ttft_s"] = {"mean": None, "p50": None, "p99": None, "max": None}
    out = plot_report(rep, tmp_path / "gap.png")
    assert out.read_bytes()[:8] == PNG
    rep["reuse_on"]["per_turn"] = rep["reuse_off"]["per_turn"] = []
    assert plot_report(rep, tmp_path / "empty.png").exists()
