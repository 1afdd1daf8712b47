"""Flash-Verify accuracy / forwards curve: gamma x rule against threshold and the exact sampler.

For each suite and cache mode it runs, on the same held-out problems:
- the exact sampler (cache none, vanilla, one token per step) — the accuracy reference;
- threshold decoding at tau (same cache mode) — the forwards reference;
- verify at tau for every gamma x rule (same cache mode).
It writes ``<out>.json`` (every run's report without samples, plus ratios) and ``<out>.png``
(accuracy against forwards per sample, one panel per suite x cache), and prints a table last.

    python benchmarks/verify_curve.py --n 200                       # demo model, CPU
    python benchmarks/verify_curve.py --caches none dual --jobs 4 --threads 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

GAMMAS = (0.6, 0.7, 0.8, 0.9, 0.95)
RULES = ("agree", "cumprod")


def _configs(a) -> list[dict]:
    base = dict(max_tokens=a.max_tokens, block_length=a.block_length)
    runs = []
    for suite in a.suites:
        if not a.no_exact:
            runs.append(dict(suite=suite, name="exact", cache="none",
                             params=dict(base, decode="vanilla", cache="none")))
        for cache in a.caches:
            runs.append(dict(suite=suite, name="threshold", cache=cache,
                             params=dict(base, decode="threshold", threshold=a.tau, cache=cache)))
            for rule in a.rules:
                for g in a.gammas:
                    runs.append(dict(suite=suite, name=f"verify-{rule}-{g}", cache=cache,
                                     rule=rule, gamma=g,
                                     params=dict(base, decode="verify", threshold=a.tau, gamma=g,
                                                 verify_rule=rule, max_verify=a.max_verify,
                                                 cache=cache, entropy_max=a.entropy_max,
                                                 perturb_sigma=a.perturb_sigma)))
    return runs


_LLM = None


def _run(job: dict) -> dict:
    global _LLM
    import torch

    from flash_dllm import LLM
    from flash_dllm.config import SamplingParams
    from flash_dllm.evals.runner import run_eval

    if job["threads"]:
        torch.set_num_threads(job["threads"])
    if _LLM is None:
        _LLM = LLM(job["model"], device="cpu", dtype="float32", max_num_seqs=job["n"])
    params = SamplingParams(**job["params"])
    if job["warmup"]:
        run_eval(_LLM, job["suite"], 4, params, seed=job["seed"] + 1, progress=False)
    r = None
    # the same decode each time; keep the fastest (CPU noise). The exact run is long enough.
    for _ in range(1 if job["name"] == "exact" else job["repeat"]):
        x = run_eval(_LLM, job["suite"], job["n"], params, seed=job["seed"], progress=False,
                     keep_samples=False)
        if r is None or x["decode_seconds"] < r["decode_seconds"]:
            r = x
    # no policy can beat one forward per decoded block: the floor under these forwards
    r["forwards_floor_per_sample"] = r["tokens_per_forward"] * r["forwards_per_sample"] / (
        params.block_length)
    r.update({k: job[k] for k in ("name", "cache", "rule", "gamma") if k in job})
    print(f"{job['suite']:5s} {job['cache']:6s} {job['name']:22s} acc={100 * r['accuracy']:6.2f}% "
          f"fwd/sample={r['forwards_per_sample']:6.2f} s/sample={r['decode_seconds'] / r['n']:.4f}",
          file=sys.stderr, flush=True)
    return r


def _table(rows: list[dict]) -> tuple[str, list[dict]]:
    lines = [(f"{'suite':5s} {'cache':6s} {'run':22s} {'acc%':>6s} {'d_acc':>6s} {'fwd/s':>7s} "
              f"{'floor':>6s} {'fwd/thr':>7s} {'s/sample':>9s} {'wall/thr':>8s} "
              f"{'wall/exact':>10s} {'accept':>7s}")]
    summary = []
    for r in rows:
        exact = next((x for x in rows if x["suite"] == r["suite"] and x["name"] == "exact"), None)
        thr = next((x for x in rows if x["suite"] == r["suite"] and x["name"] == "threshold"
                    and x["cache"] == r["cache"]), None)
        sps = r["decode_seconds"] / r["n"]
        row = {"suite": r["suite"], "cache": r["cache"], "run": r["name"],
               "accuracy": r["accuracy"],
               "accuracy_minus_exact": r["accuracy"] - exact["accuracy"] if exact else None,
               "forwards_per_sample": r["forwards_per_sample"], "seconds_per_sample": sps,
               "forwards_floor_per_sample": r["forwards_floor_per_sample"],
               "forwards_vs_threshold": (r["forwards_per_sample"] / thr["forwards_per_sample"]
                                         if thr else None),
               "wall_vs_threshold": sps / (thr["decode_seconds"] / thr["n"]) if thr else None,
               "wall_vs_exact": sps / (exact["decode_seconds"] / exact["n"]) if exact else None,
               "acceptance": (r["verify"]["accepted"] / r["verify"]["candidates"]
                              if r["verify"]["candidates"] else None)}
        summary.append(row)
        def f(v, fmt):
            return "-".rjust(len(format(0.0, fmt))) if v is None else format(v, fmt)
        dacc = None if exact is None else 100 * row["accuracy_minus_exact"]
        lines.append(f"{r['suite']:5s} {r['cache']:6s} {r['name']:22s} {100 * r['accuracy']:6.2f} "
                     f"{f(dacc, '+6.2f')} "
                     f"{r['forwards_per_sample']:7.2f} "
                     f"{r['forwards_floor_per_sample']:6.2f} "
                     f"{f(row['forwards_vs_threshold'], '7.3f')} {sps:9.4f} "
                     f"{f(row['wall_vs_threshold'], '8.3f')} {f(row['wall_vs_exact'], '10.3f')} "
                     f"{f(row['acceptance'], '7.3f')}")
    return "\n".join(lines), summary


def pts_params(rows: list[dict], suite: str, cache: str) -> dict:
    """Sentinel knobs of the verify runs of one panel (for its title)."""
    r = next((r for r in rows
              if r["suite"] == suite and r["cache"] == cache and r.get("rule")), None)
    return {} if r is None else {k: r["params"].get(k) for k in ("entropy_max", "perturb_sigma")}


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["suite"], r["cache"]) for r in rows if r["name"] != "exact"})
    ncols = min(2, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4.4 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (suite, cache) in zip(axes.flat, panels):
        exact = next((r for r in rows if r["suite"] == suite and r["name"] == "exact"), None)
        thr = next(r for r in rows if r["suite"] == suite and r["cache"] == cache
                   and r["name"] == "threshold")
        if exact is not None:
            ax.axhline(100 * exact["accuracy"], color="gray", ls="--", lw=1,
                       label=f"exact ({exact['forwards_per_sample']:.1f} fwd)")
            ax.axhspan(100 * exact["accuracy"] - 1, 100 * exact["accuracy"], color="gray",
                       alpha=0.1)
        ax.axvline(0.7 * thr["forwards_per_sample"], color="tab:red", ls=":", lw=1,
                   label="0.7 x threshold forwards")
        ax.axvline(thr["forwards_floor_per_sample"], color="tab:green", ls=":", lw=1,
                   label="floor: 1 forward per decoded block")
        ax.scatter([thr["forwards_per_sample"]], [100 * thr["accuracy"]], marker="s", s=50,
                   color="black", label="threshold τ", zorder=3)
        for rule, color in zip(RULES, ("tab:blue", "tab:orange")):
            pts = sorted((r for r in rows if r["suite"] == suite and r["cache"] == cache
                          and r.get("rule") == rule), key=lambda r: r["gamma"])
            if not pts:
                continue
            xs = [r["forwards_per_sample"] for r in pts]
            ys = [100 * r["accuracy"] for r in pts]
            ax.plot(xs, ys, "o-", color=color, label=f"verify {rule}")
            for r, x, y in zip(pts, xs, ys):
                ax.annotate(f"γ{r['gamma']}", (x, y), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
        tau = thr["params"]["threshold"]
        sent = {k: v for k, v in pts_params(rows, suite, cache).items() if v is not None}
        ax.set_title(f"{suite}, cache={cache}, τ={tau} (n={thr['n']})"
                     + (f"\nverify with {sent}" if sent else ""), fontsize=9)
        ax.set_xlabel("forwards per sample")
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the demo model)")
    ap.add_argument("--suites", nargs="+", default=["arith", "code"])
    ap.add_argument("--caches", nargs="+", default=["none"])
    ap.add_argument("--gammas", nargs="+", type=float, default=list(GAMMAS))
    ap.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    ap.add_argument("--tau", type=float, default=0.9)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--max-verify", type=int, default=None)
    ap.add_argument("--entropy-max", type=float, default=None, help="sentinel for the verify runs")
    ap.add_argument("--perturb-sigma", type=float, default=None,
                    help="sentinel for the verify runs")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0, help="test-set seed")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel (one process each)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per run (0: default)")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--no-exact", action="store_true", help="skip the exact-sampler runs")
    ap.add_argument("--repeat", type=int, default=1,
                    help="decode each run R times, keep the fastest")
    ap.add_argument("--out", default="benchmarks/results/verify_curve",
                    help="writes OUT.json and OUT.png")
    ap.add_argument("--replot", default=None, help="only redraw the PNG of an existing JSON")
    a = ap.parse_args(argv)
    if a.replot:
        src = Path(a.replot)
        _plot(json.loads(src.read_text(encoding="utf-8"))["runs"], src.with_suffix(".png"))
        return 0
    from flash_dllm.models.loader import default_model_path
    model = str(a.model or default_model_path())
    jobs = [dict(j, model=model, n=a.n, seed=a.seed, threads=a.threads, warmup=not a.no_warmup,
                 repeat=a.repeat)
            for j in _configs(a)]
    t0 = time.perf_counter()
    if a.jobs > 1:
        with ProcessPoolExecutor(a.jobs) as ex:
            rows = list(ex.map(_run, jobs))
    else:
        rows = [_run(j) for j in jobs]
    table, summary = _table(rows)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": model, "n": a.n, "tau": a.tau, "max_tokens": a.max_tokens,
            "block_length": a.block_length, "max_verify": a.max_verify, "jobs": a.jobs,
            "entropy_max": a.entropy_max, "perturb_sigma": a.perturb_sigma,
            "threads": a.threads, "repeat": a.repeat, "cpu_count": os.cpu_count(),
            "seconds": time.perf_counter() - t0}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": rows},
                                                   indent=2), encoding="utf-8")
    _plot(rows, out.with_suffix(".png"))
    print(table)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
