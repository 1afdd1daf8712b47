"""benchmarks/verify/verify_curve.py's frontier figures (issue 17's done-when ratios), on made-up
runs."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = (Path(__file__).resolve().parents[1] / "benchmarks" / "verify"
         / "verify_curve.py")
_spec = importlib.util.spec_from_file_location("verify_curve", _PATH)
vc = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("verify_curve", vc)
_spec.loader.exec_module(vc)


def _run(name, acc, fwd, secs, tau=None, rule=None, gamma=None, cache="dual", suite="chain"):
    r = {"suite": suite, "cache": cache, "name": name, "accuracy": acc, "n": 10,
         "forwards_per_sample": fwd, "decode_seconds": 10 * secs, "tau": tau}
    if rule:
        r.update(rule=rule, gamma=gamma)
    return r


def test_frontier_picks_the_cheapest_verify_within_a_point_and_its_threshold_match():
    rows = [_run("exact", 0.80, 256, 5.0, cache="none"),
            _run("threshold", 0.60, 40, 1.0, tau=0.5),
            _run("threshold", 0.79, 80, 2.0, tau=0.9),
            _run("threshold", 0.80, 100, 2.5, tau=0.99),
            _run("verify-agree-0.8", 0.795, 50, 1.5, tau=0.7, rule="agree", gamma=0.8),
            _run("verify-agree-0.6", 0.70, 30, 0.9, tau=0.5, rule="agree", gamma=0.6),   # < -1 pt
            _run("verify-agree-0.9", 0.80, 60, 1.6, tau=0.9, rule="agree", gamma=0.9)]
    (f,) = vc.frontier(rows)
    assert (f["suite"], f["cache"], f["within_one_point"], len(f["verify"])) == ("chain", "dual", 2, 3)
    assert f["best"] == "verify-agree-0.8" and f["best_forwards"] == 50
    # the fewest threshold forwards at >= 79.5 %: tau 0.99 (80 %), not tau 0.9 (79 %)
    assert f["threshold_tau"] == 0.99 and f["forwards_ratio"] == 0.5
    assert abs(f["wall_ratio"] - 1.5 / 2.5) < 1e-12 and f["threshold_reaches"]


def test_frontier_when_threshold_never_gets_there_or_nothing_qualifies():
    rows = [_run("exact", 0.80, 256, 5.0, cache="none"),
            _run("threshold", 0.70, 40, 1.0, tau=0.9),
            _run("verify-agree-0.8", 0.80, 50, 1.5, tau=0.9, rule="agree", gamma=0.8)]
    (f,) = vc.frontier(rows)
    assert f["threshold_reaches"] is False and "forwards_ratio" not in f
    (g,) = vc.frontier(rows[:2])
    assert g["within_one_point"] == 0 and "best" not in g


def test_configs_sweep_tau_and_max_verify_with_the_suites_canvas():
    a = vc.argparse.Namespace(suites=["chain", "arith"], caches=["dual"], tau=[0.7, 0.9],
                              gammas=[0.8], rules=["agree"], max_verify=[None, 4],
                              max_tokens=None, block_length=32, no_exact=False,
                              entropy_max=None, perturb_sigma=None)
    runs = vc._configs(a)
    assert {r["params"]["max_tokens"] for r in runs if r["suite"] == "chain"} == {256}
    assert {r["params"]["max_tokens"] for r in runs if r["suite"] == "arith"} == {64}
    per_suite = [r for r in runs if r["suite"] == "chain"]
    assert [r["name"] for r in per_suite].count("threshold") == 2
    names = {r["name"] for r in per_suite if r.get("rule")}
    assert names == {"verify-agree-0.8-t0.7-mNone", "verify-agree-0.8-t0.7-m4",
                     "verify-agree-0.8-t0.9-mNone", "verify-agree-0.8-t0.9-m4"}


def test_frontier_takes_an_exact_accuracy_measured_elsewhere():
    rows = [_run("threshold", 0.90, 10, 1.0, tau=0.9),
            _run("verify-agree-0.8", 0.93, 8, 0.9, tau=0.9, rule="agree", gamma=0.8),
            _run("verify-agree-0.6", 0.90, 6, 0.8, tau=0.9, rule="agree", gamma=0.6)]
    (f,) = vc.frontier(rows, {"chain": 0.935})
    assert f["exact_from"] == "--exact-accuracy" and f["within_one_point"] == 1
    assert f["best"] == "verify-agree-0.8" and f["threshold_reaches"] is False
    (g,) = vc.frontier(rows)               # nothing given: no best, every run still matched
    assert g["exact_from"] is None and "best" not in g
    assert [v.get("forwards_ratio") for v in g["verify"]] == [None, 0.6]
    assert g["verify"][0]["threshold_reaches"] is False


def test_gamma_labels_of_coinciding_points_do_not_overlap():
    """Issue 42's newcomer list: verify points that land on the same spot (same accuracy and
    forwards, other gammas) get labels that neither overlap each other nor the threshold's, and
    stay inside their axes."""
    import pytest
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    rows = [_run("exact", 0.80, 256, 5.0, cache="none"),
            _run("threshold", 0.78, 60, 1.0, tau=0.9), _run("threshold", 0.80, 80, 1.4, tau=0.99)]
    rows += [_run(f"verify-agree-{g}", 0.78, 60, 1.0, tau=0.9, rule="agree", gamma=g)
             for g in (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)]
    for r in rows:
        r.update(forwards_floor_per_sample=8.0, params={})
    fig = vc.figure(rows)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    try:
        for ax in fig.axes:
            frame = ax.get_window_extent(renderer)
            boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in ax.texts]
            assert len(boxes) == 8
            for i, (text, b) in enumerate(boxes):
                assert frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 \
                    and b.y1 <= frame.y1, text
                assert not any(b.overlaps(o) for _, o in boxes[i + 1:]), text
    finally:
        plt.close(fig)
