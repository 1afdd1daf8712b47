"""Elastic-Cache-style drift trigger against Fast-dLLM's fixed refresh at every block.

For each suite it decodes the same held-out problems with threshold decoding on a refreshing
cache (dual by default) three ways: the whole canvas recomputed at every block's first step
(``block``, fused decode steps on and off), and the drift trigger (``SamplingParams.drift_min``,
``decoding/drift.py``) at each ``--drift-min`` (``--defer``: also with ``drift_defer``, the
refresh at the next block start). It reports accuracy, forwards per sample, canvas
positions recomputed per sample (the work a refresh costs), whole-canvas refreshes per sample
and wall time, and writes ``<out>.json`` and ``<out>.png`` (accuracy against positions
recomputed, one panel per suite).

    python benchmarks/cache-modes/drift_refresh.py --model proxy-llada --suites chain --n 20  # CPU
    python benchmarks/cache-modes/drift_refresh.py --model proxy-dream --suites chain code-long \
        --n 200 --device cuda --out benchmarks/results/cache-modes/drift_refresh_dream_h200
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _runs(a) -> list[dict]:
    out = [dict(name="block", drift_min=None, drift_defer=False, fused_step=True)]
    if a.device != "cpu":              # the drift test runs on the general path: fused off too
        out.append(dict(name="block, fused off", drift_min=None, drift_defer=False,
                        fused_step=False))
    for defer in (False, True) if a.defer else (False,):
        out += [dict(name=f"drift {d:g} {'deferred' if defer else 'mid-block'}", drift_min=d,
                     drift_defer=defer, fused_step=True) for d in a.drift_min]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="proxy-llada")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--suites", nargs="+", default=["chain", "code-long"])
    ap.add_argument("--cache", default="dual", choices=["dual", "prefix"])
    ap.add_argument("--tau", type=float, default=0.9, help="threshold")
    ap.add_argument("--drift-min", type=float, nargs="+", default=[0.95, 0.98, 0.99, 0.995])
    ap.add_argument("--defer", action="store_true",
                    help="also every --drift-min with drift_defer (refresh at block starts)")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--replot", default=None, help="only redraw the PNG of an existing JSON")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--out", default="benchmarks/results/cache-modes/drift_refresh")
    a = ap.parse_args(argv)
    if a.replot:
        rep = json.loads(Path(a.replot).read_text())
        a.model, a.cache, a.tau, a.n = rep["model"], rep["cache"], rep["threshold"], rep["n"]
        a.suites = list(dict.fromkeys(r["suite"] for r in rep["rows"]))
        _derive(rep["rows"])
        Path(a.replot).write_text(json.dumps(rep, indent=1))
        _plot(rep["rows"], a, Path(a.replot).with_suffix(".png"))
        return 0

    from flash_dllm.config import EngineConfig, SamplingParams
    from flash_dllm.entrypoints.llm import LLM
    from flash_dllm.evals.runner import run_eval
    from flash_dllm.evals.tasks import SUITES

    rows, llms = [], {}
    for suite in a.suites:
        for run in _runs(a):
            key = run["fused_step"]
            if key not in llms:
                kw = {} if a.max_num_seqs is None else {"max_num_seqs": a.max_num_seqs}
                llms[key] = LLM(model=a.model, device=a.device,
                                engine_config=EngineConfig(fused_step=key, **kw))
            params = SamplingParams(max_tokens=SUITES[suite].gen_length, decode="threshold",
                                    threshold=a.tau, cache=a.cache, drift_min=run["drift_min"],
                                    drift_defer=run["drift_defer"])
            rep = run_eval(llms[key], suite, a.n, params, progress=False, keep_samples=False)
            d = rep["sentinels"]["drift"]
            row = dict(suite=suite, **run, accuracy=rep["accuracy"],
                       forwards_per_sample=rep["forwards_per_sample"],
                       positions_per_sample=rep["positions_per_sample"],
                       blocks=rep["forwards_per_block"]["blocks"],
                       drift_checks=d["checks"], drift_triggers=d["triggers"],
                       seconds=rep["seconds"], n=rep["n"])
            rows.append(row)
            _derive(rows)
            print(f"{suite:9s} {run['name']:20s} acc {row['accuracy']:6.1%}  "
                  f"fwd {row['forwards_per_sample']:6.2f}  pos {row['positions_per_sample']:7.0f}"
                  f"  ({row['positions_vs_block']:.2f}x)  failed tests "
                  f"{row['drift_triggers'] / row['n']:5.2f}  {row['seconds']:6.1f} s", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = dict(model=a.model, device=a.device, cache=a.cache, threshold=a.tau, n=a.n,
                  note="positions: canvas positions the forwards recomputed (their cache "
                       "windows); refreshes: whole-canvas recomputes per sample where the counts "
                       "give them exactly (see _derive); failed tests: drift tests that failed",
                  rows=rows)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    try:
        _plot(rows, a, out.with_suffix(".png"))
    except ImportError:
        print("matplotlib not installed: no PNG", file=sys.stderr)
    print(f"wrote {out.with_suffix('.json')}")
    return 0


def _derive(rows: list[dict]) -> None:
    """Fields computed from each row's counts: positions relative to the suite's block-refresh
    row, and whole-canvas refreshes per sample where the counts say them exactly (the block
    refresh: one per decoded block; a mid-block trigger: the prefill plus one per failed test;
    deferred, several failed tests in one block make one refresh: not counted, None)."""
    base = {r["suite"]: r for r in rows if r["name"] == "block"}
    for r in rows:
        if r["suite"] in base:
            r["positions_vs_block"] = (r["positions_per_sample"]
                                       / base[r["suite"]]["positions_per_sample"])
        if r["drift_min"] is None:
            r["refreshes_per_sample"] = r["blocks"] / r["n"] if "blocks" in r else r.get(
                "refreshes_per_sample")
        elif not r.get("drift_defer"):
            r["refreshes_per_sample"] = 1 + r["drift_triggers"] / r["n"]
        else:
            r["refreshes_per_sample"] = None
        r["failed_tests_per_sample"] = r["drift_triggers"] / r["n"]


def _near(r: dict, pts: list[dict]) -> int:
    """How many earlier points lie (almost) on ``r``: its label goes that many lines lower."""
    xs = max(p["positions_per_sample"] for p in pts) - min(p["positions_per_sample"] for p in pts)
    return sum(abs(p["positions_per_sample"] - r["positions_per_sample"]) < 0.08 * (xs or 1)
               and abs(p["accuracy"] - r["accuracy"]) < 0.006 for p in pts[:pts.index(r)])


def _plot(rows, a, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(a.suites), figsize=(6 * len(a.suites), 4.2), squeeze=False)
    for ax, suite in zip(axes[0], a.suites):
        pts = [r for r in rows if r["suite"] == suite and r["name"] != "block, fused off"]
        for r in pts:
            ax.scatter(r["positions_per_sample"], 100 * r["accuracy"],
                       marker="s" if r["drift_min"] is None else "o",
                       color="black" if r["drift_min"] is None
                       else "tab:orange" if r.get("drift_defer") else "tab:blue")
            ax.annotate(r["name"],
                        (r["positions_per_sample"], 100 * r["accuracy"]),
                        textcoords="offset points", xytext=(5, 4 - 11 * _near(r, pts)),
                        fontsize=7)
        ax.set_title(f"{a.model} {suite} ({a.cache}, threshold {a.tau:g}, n={a.n})", fontsize=9)
        ax.set_xlabel("canvas positions recomputed per sample")
        ax.set_ylabel("accuracy (%)")
        ax.margins(x=0.12, y=0.15)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
