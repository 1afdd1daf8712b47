"""A/B of ``flash-dllm bench step`` between a base revision and this checkout, on one device.

    python3 benchmarks/step/ab_step.py --base REV --out REPORT.json [--pairs 3] \
        -- BENCH-STEP-ARGS...

The base revision's ``flash_dllm`` package is extracted with ``git archive`` into a temporary
folder; the two versions then run alternately (base, new, base, new, ...) so that drift of the
machine (clocks, temperature) falls on both. The report holds every run's rows and, per
(cache, batch), the median step time of each side and their ratio. Example (issue 16's check
that the tensor-parallel code costs nothing at size 1):

    python3 benchmarks/step/ab_step.py --base af2e518 \\
        --out benchmarks/results/tensor-parallel/step_tp1_ab_h200.json \\
        -- --cache dual flash --batch 1 64
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_side(tree: Path, args: list[str], out: Path) -> dict:
    """One ``bench step`` run with the package of ``tree`` (its own folder first on the path)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "flash_dllm.cli", "bench", "step", *args, "--json", str(out)]
    subprocess.run(cmd, cwd=tree, env=env, check=True)
    return json.loads(out.read_text())


def summarise(runs: dict[str, list[dict]], base: str, new: str, args: list[str]) -> dict:
    """Per (cache, batch): each side's step times, medians and the new/base ratio."""
    cases: dict[tuple, dict] = {}
    for side, reports in runs.items():
        for rep in reports:
            for r in rep["rows"]:
                c = cases.setdefault((r["cache"], r["batch"]), {"base_ms": [], "new_ms": []})
                c[f"{side}_ms"].append(r["ms"])
    rows = []
    for (cache, batch), c in sorted(cases.items()):
        mb, mn = statistics.median(c["base_ms"]), statistics.median(c["new_ms"])
        rows.append({"cache": cache, "batch": batch, "base_ms": c["base_ms"],
                     "new_ms": c["new_ms"], "base_median_ms": mb, "new_median_ms": mn,
                     "new_over_base": mn / mb})
    first = next(iter(runs["new"]))
    return {"base": base, "new": new, "bench_step_args": args,
            "device_name": first.get("device_name"), "torch": first.get("torch"),
            "model_shape": first.get("model_shape"), "pairs": len(runs["new"]),
            "rows": rows, "runs": runs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="git revision to compare against")
    p.add_argument("--base-tree", default=None,
                   help="a folder holding that revision's flash_dllm package, for a machine "
                        "without the git history (git archive REV flash_dllm | tar -x -C DIR)")
    p.add_argument("--out", required=True, help="report path")
    p.add_argument("--pairs", type=int, default=3, help="alternating base/new pairs (default 3)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER,
                   help="after --: arguments for 'flash-dllm bench step'")
    a = p.parse_args()
    args = [x for x in a.bench_args if x != "--"]
    new = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, text=True,
                         capture_output=True).stdout.strip() or "this checkout"
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if a.base_tree is not None:
            base_tree = Path(a.base_tree).resolve()
        else:
            base_tree = tmp / "base"
            base_tree.mkdir()
            archive = subprocess.run(["git", "archive", a.base, "flash_dllm"], cwd=ROOT,
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(base_tree)], input=archive, check=True)
        for i in range(a.pairs):
            for side, tree in (("base", base_tree), ("new", ROOT)):
                print(f"--- pair {i + 1}/{a.pairs}: {side}", flush=True)
                runs[side].append(run_side(tree, args, tmp / f"{side}_{i}.json"))
    report = summarise(runs, a.base, new, args)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    for r in report["rows"]:
        print(f"{r['cache']:6s} batch {r['batch']:3d}: base {r['base_median_ms']:8.2f} ms  "
              f"new {r['new_median_ms']:8.2f} ms  new/base {r['new_over_base']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
