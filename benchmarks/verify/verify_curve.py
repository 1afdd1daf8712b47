"""Flash-Verify accuracy / forwards curve: gamma x rule against threshold and the exact sampler.

For each suite and cache mode it runs, on the same held-out problems:
- the exact sampler (cache none, vanilla, one token per step) — the accuracy reference;
- threshold decoding at every tau (same cache mode) — the forwards reference;
- verify at every tau x gamma x rule x max_verify (same cache mode).
It writes ``<out>.json`` (every run's report without samples, plus ratios and, per suite x cache,
the ``frontier``: the verify run with the fewest forwards among those within one point of the
exact sampler, against the fewest forwards threshold needs for the same accuracy) and
``<out>.png`` (accuracy against forwards per sample and against seconds per sample, one row per
suite x cache), and prints a table last.

    python benchmarks/verify/verify_curve.py --n 200                       # demo model, CPU
    python benchmarks/verify/verify_curve.py --caches none dual --jobs 4 --threads 2
    python benchmarks/verify/verify_curve.py --model proxy-dream --suites chain --caches dual \
        --tau 0.5 0.7 0.8 0.9 0.95 0.99 --device cuda --max-num-seqs 1   # a Pareto sweep, H200
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
    from flash_dllm.evals.tasks import SUITES
    runs = []
    for suite in a.suites:
        # unset --max-tokens: the suite's own canvas (64 for arith/code, 256 for chain/code-long)
        base = dict(max_tokens=a.max_tokens or SUITES[suite].gen_length,
                    block_length=a.block_length)
        if not a.no_exact:
            runs.append(dict(suite=suite, name="exact", cache="none",
                             params=dict(base, decode="vanilla", cache="none")))
        for cache in a.caches:
            for tau in a.tau:
                runs.append(dict(suite=suite, name="threshold", cache=cache, tau=tau,
                                 params=dict(base, decode="threshold", threshold=tau,
                                             cache=cache)))
            for tau in a.tau:
                for rule in a.rules:
                    for g in a.gammas:
                        for mv in a.max_verify:
                            runs.append(dict(
                                suite=suite, name=_verify_name(rule, g, tau, mv, a), cache=cache,
                                rule=rule, gamma=g, tau=tau, max_verify=mv,
                                params=dict(base, decode="verify", threshold=tau, gamma=g,
                                            verify_rule=rule, max_verify=mv, cache=cache,
                                            entropy_max=a.entropy_max,
                                            perturb_sigma=a.perturb_sigma)))
    return runs


def _verify_name(rule: str, gamma: float, tau: float, max_verify, a) -> str:
    """``verify-<rule>-<gamma>``, plus the tau / max_verify when several are swept."""
    name = f"verify-{rule}-{gamma}"
    if len(a.tau) > 1:
        name += f"-t{tau}"
    if len(a.max_verify) > 1:
        name += f"-m{max_verify}"
    return name


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
        _LLM = LLM(job["model"], device=job["device"], dtype=job["dtype"],
                   max_num_seqs=job["max_num_seqs"] or job["n"])
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
    r.update({k: job[k] for k in ("name", "cache", "rule", "gamma", "tau", "max_verify")
              if k in job})
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
                    and x["cache"] == r["cache"] and x.get("tau") == r.get("tau")), None)
        sps = r["decode_seconds"] / r["n"]
        row = {"suite": r["suite"], "cache": r["cache"], "run": r["name"], "tau": r.get("tau"),
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
        label = r["name"] + (f"-t{r['tau']}" if r["name"] == "threshold" else "")
        lines.append(f"{r['suite']:5s} {r['cache']:6s} {label:22s} {100 * r['accuracy']:6.2f} "
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


def _match(v: dict, thr: list[dict]) -> dict:
    """Verify run ``v`` against the threshold run with the fewest forwards among those at least as
    accurate: the ratios, or ``threshold_reaches`` False when none is (verify ahead at any cost)."""
    match = [t for t in thr if t["accuracy"] >= v["accuracy"] - 1e-9]
    ref = min(match, key=lambda t: t["forwards_per_sample"]) if match else None
    sps = v["decode_seconds"] / v["n"]
    e = {"run": v["name"], "accuracy": v["accuracy"], "forwards": v["forwards_per_sample"],
         "seconds_per_sample": sps, "threshold_reaches": ref is not None}
    if ref is not None:
        rsps = ref["decode_seconds"] / ref["n"]
        e.update(threshold_tau=ref.get("tau"), threshold_accuracy=ref["accuracy"],
                 threshold_forwards=ref["forwards_per_sample"], threshold_seconds_per_sample=rsps,
                 forwards_ratio=v["forwards_per_sample"] / ref["forwards_per_sample"],
                 wall_ratio=sps / rsps if rsps > 0 else None)
    return e


def frontier(rows: list[dict], exact_given: dict | None = None) -> list[dict]:
    """Issue 17's figures, per suite x cache. ``verify``: every verify run against the threshold
    run with the fewest forwards among those at least as accurate (``forwards_ratio``;
    ``wall_ratio`` compares their seconds per sample). ``best``: of the verify runs within one
    point of the exact sampler (an exact run, else ``exact_given[suite]``, i.e.
    ``--exact-accuracy``), the one with the fewest forwards, with its match; no best without an
    exact accuracy."""
    out = []
    for suite, cache in sorted({(r["suite"], r["cache"]) for r in rows if r["name"] != "exact"}):
        exact = next((r for r in rows if r["suite"] == suite and r["name"] == "exact"), None)
        given = (exact_given or {}).get(suite)
        if exact is None and given is not None:
            exact = {"accuracy": given}
        same = [r for r in rows if r["suite"] == suite and r["cache"] == cache]
        thr = [r for r in same if r["name"] == "threshold"]
        ver = [r for r in same if r.get("rule")]
        e = {"suite": suite, "cache": cache,
             "exact_accuracy": exact["accuracy"] if exact else None,
             "exact_from": None if exact is None else ("run" if given is None or "n" in exact
                                                       else "--exact-accuracy"),
             "verify": [_match(v, thr) for v in ver]}
        if exact is not None:
            ok = [v for v in ver if v["accuracy"] >= exact["accuracy"] - 0.01 - 1e-9]
            e["within_one_point"] = len(ok)
            if ok:
                best = min(ok, key=lambda v: (v["forwards_per_sample"], -v["accuracy"]))
                m = _match(best, thr)
                e.update(best=m.pop("run"), **{f"best_{k}" if k in (
                    "accuracy", "forwards", "seconds_per_sample") else k: v
                    for k, v in m.items()})
        out.append(e)
    return out


def _label(ax, text: str, x: float, y: float, used: dict, below: bool = False) -> None:
    """Queue a point's label; ``_place_labels`` draws them once the panel's limits are known."""
    used.setdefault("pending", []).append((text, x, y, below))


def _place_labels(ax, used: dict) -> None:
    """Draw the queued labels, each at the nearest offset from its point (above or below it,
    its own side first; then to its left) where its box stays inside the axes and overlaps no
    marker and no label placed before. Boxes are estimated in points from the axes' size on the
    figure and the text's length (6 pt font)."""
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    sx, sy = (x1 - x0) or 1.0, (y1 - y0) or 1.0
    pos = ax.get_position()                     # axes in figure fractions
    fw, fh = ax.figure.get_size_inches() * 72   # figure in points
    aw, ah = pos.width * fw, pos.height * fh
    pending = used.get("pending", [])
    pts = [((x - x0) / sx * aw, (y - y0) / sy * ah) for _, x, y, _ in pending]
    placed = [(px - 3, py - 3, px + 3, py + 3) for px, py in pts]          # the markers
    for (text, x, y, below), (px, py) in zip(pending, pts):
        w, h = 3.9 * len(text) + 2, 7.0
        ups = [3 + 8 * k for k in range(12)]
        downs = [-(10 + 8 * k) for k in range(12)]
        dys = [d for pair in zip(downs, ups) for d in pair] if below else \
            [d for pair in zip(ups, downs) for d in pair]
        tries = [(4, dy) for dy in dys] + [(-w - 4, dy) for dy in dys[:4]]
        for dx, dy in tries:
            box = (px + dx, py + dy, px + dx + w, py + dy + h)
            inside = box[0] >= 0 and box[1] >= 0 and box[2] <= aw and box[3] <= ah
            if inside and not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3]
                                  and b[1] < box[3] for b in placed):
                break
        else:
            dx, dy = tries[0]
        placed.append((px + dx, py + dy, px + dx + w, py + dy + h))
        ax.annotate(text, (x, y), fontsize=6, xytext=(dx, dy), textcoords="offset points")


def _plot(rows: list[dict], path: Path, exact_given: dict | None = None) -> None:
    import matplotlib.pyplot as plt

    fig = figure(rows, exact_given)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure(rows: list[dict], exact_given: dict | None = None):
    """The sweep's figure: per (suite, cache) panel, accuracy against forwards and against
    seconds, every point labelled (``_place_labels``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["suite"], r["cache"]) for r in rows if r["name"] != "exact"})
    fronts = {(f["suite"], f["cache"]): f for f in frontier(rows, exact_given)}
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 4.6 * len(panels)), squeeze=False)
    todo = []
    for (suite, cache), pair in zip(panels, axes):
        exact = next((r for r in rows if r["suite"] == suite and r["name"] == "exact"), None)
        given = (exact_given or {}).get(suite)
        thr = sorted((r for r in rows if r["suite"] == suite and r["cache"] == cache
                      and r["name"] == "threshold"), key=lambda r: r.get("tau") or 0)
        front = fronts[(suite, cache)]
        many_tau = len({r.get("tau") for r in rows if r.get("rule")}) > 1
        for ax, metric in zip(pair, ("forwards", "seconds")):
            def x_of(r):
                return (r["forwards_per_sample"] if metric == "forwards"
                        else r["decode_seconds"] / r["n"])
            used: dict = {}
            if exact is not None or given is not None:
                acc = 100 * (exact["accuracy"] if exact is not None else given)
                what = (f"exact ({x_of(exact):.3g} {metric})" if exact is not None
                        else "exact (given, not run here)")
                ax.axhline(acc, color="gray", ls="--", lw=1, label=what)
                ax.axhspan(acc - 1, acc, color="gray", alpha=0.1)
            ref = front.get(f"threshold_{metric}" if metric == "forwards"
                            else "threshold_seconds_per_sample")
            if ref:
                k = 0.7 if metric == "forwards" else 0.8
                ax.axvline(k * ref, color="tab:red", ls=":", lw=1,
                           label=f"{k} x threshold at equal accuracy")
            if metric == "forwards" and thr:
                ax.axvline(min(r["forwards_floor_per_sample"] for r in thr), color="tab:green",
                           ls=":", lw=1, label="floor: 1 forward per decoded block")
            if thr:
                ax.plot([x_of(r) for r in thr], [100 * r["accuracy"] for r in thr], "s-",
                        color="black", ms=5, label="threshold (τ)", zorder=3)
                for r in thr:
                    _label(ax, f"τ{r.get('tau')}", x_of(r), 100 * r["accuracy"], used, below=True)
            for rule, color in zip(RULES, ("tab:blue", "tab:orange")):
                pts = sorted((r for r in rows if r["suite"] == suite and r["cache"] == cache
                              and r.get("rule") == rule), key=lambda r: (r.get("tau") or 0,
                                                                         r["gamma"]))
                if not pts:
                    continue
                style = "o" if many_tau else "o-"
                ax.plot([x_of(r) for r in pts], [100 * r["accuracy"] for r in pts], style,
                        color=color, ms=4, label=f"verify {rule}")
                for r in pts:
                    lab = f"γ{r['gamma']}" + (f"/τ{r.get('tau')}" if many_tau else "")
                    _label(ax, lab, x_of(r), 100 * r["accuracy"], used)
            sent = {k: v for k, v in pts_params(rows, suite, cache).items() if v is not None}
            n = thr[0]["n"] if thr else (exact["n"] if exact else 0)
            ax.set_title(f"{suite}, cache={cache} (n={n})"
                         + (f"\nverify with {sent}" if sent else ""), fontsize=9)
            ax.set_xlabel("forwards per sample" if metric == "forwards"
                          else "seconds per sample (decode)")
            ax.set_ylabel("accuracy (%)")
            ax.grid(alpha=0.3)
            ax.margins(x=0.12)              # room for the rightmost points' labels
            ax.legend(fontsize=7)
            todo.append((ax, used))
    fig.tight_layout()
    for ax, used in todo:        # once the layout has fixed each panel's size
        _place_labels(ax, used)
    return fig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="checkpoint folder or name (default: the demo model)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (one process: --jobs 1)")
    ap.add_argument("--dtype", default="auto", help="auto: float32 on the CPU, bfloat16 on a GPU")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="requests decoded together (default: --n; 1 = batch-1 wall time)")
    ap.add_argument("--suites", nargs="+", default=["arith", "code"])
    ap.add_argument("--caches", nargs="+", default=["none"])
    ap.add_argument("--gammas", nargs="+", type=float, default=list(GAMMAS))
    ap.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    ap.add_argument("--tau", type=float, nargs="+", default=[0.9],
                    help="threshold(s): threshold and verify run at each")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="canvas (default: the suite's, 64 for arith/code, 256 for the long ones)")
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--max-verify", type=int, nargs="+", default=[None],
                    help="drafts verified per forward, each a run (default: the block length)")
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
    ap.add_argument("--out", default="benchmarks/results/verify/verify_curve",
                    help="writes OUT.json and OUT.png")
    ap.add_argument("--replot", default=None, help="only redraw the PNG of an existing JSON")
    ap.add_argument("--exact-accuracy", nargs="+", default=[], metavar="SUITE=ACC",
                    help="with --no-exact: the exact sampler's accuracy per suite measured "
                         "elsewhere (e.g. a checkpoint's train_log.json), for the frontier")
    a = ap.parse_args(argv)
    if a.device != "cpu" and a.jobs > 1:
        ap.error("--jobs > 1 runs several processes: CPU only")
    try:
        given = {k: float(v) for k, v in (x.split("=", 1) for x in a.exact_accuracy)}
    except ValueError:
        ap.error(f"--exact-accuracy takes SUITE=ACC (a fraction), got {a.exact_accuracy}")
    for k, v in given.items():
        if not 0.0 <= v <= 1.0:
            ap.error(f"--exact-accuracy {k}={v}: an accuracy is a fraction in [0, 1]")
        if k not in a.suites and not a.replot:
            ap.error(f"--exact-accuracy names suite {k!r}, which is not in --suites {a.suites}")
    if given and not a.no_exact and not a.replot:
        ap.error("--exact-accuracy stands in for the exact runs: use it with --no-exact")
    if a.replot:
        src = Path(a.replot)
        rep = json.loads(src.read_text(encoding="utf-8"))
        _plot(rep["runs"], src.with_suffix(".png"), given or rep["meta"].get("exact_accuracy"))
        return 0
    from flash_dllm.models.loader import model_path
    model = str(model_path(a.model))
    jobs = [dict(j, model=model, n=a.n, seed=a.seed, threads=a.threads, warmup=not a.no_warmup,
                 repeat=a.repeat, device=a.device, dtype=a.dtype, max_num_seqs=a.max_num_seqs)
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
            "device": a.device, "dtype": a.dtype, "max_num_seqs": a.max_num_seqs,
            "command": " ".join(sys.argv), "exact_accuracy": given or None,
            "seconds": time.perf_counter() - t0}
    fronts = frontier(rows, given)
    out.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "frontier": fronts, "runs": rows}, indent=2),
        encoding="utf-8")
    _plot(rows, out.with_suffix(".png"), given)
    print(table)
    for f in fronts:
        if f["exact_accuracy"] is None:
            ratios = [v["forwards_ratio"] for v in f["verify"] if v["threshold_reaches"]]
            print(f"{f['suite']} {f['cache']}: no exact accuracy (run it, or --exact-accuracy); "
                  f"verify at equal accuracy uses {min(ratios, default=float('nan')):.3f}x "
                  f"threshold's forwards at best")
            continue
        if "best" not in f:
            print(f"{f['suite']} {f['cache']}: no verify run within one point of exact")
            continue
        ratio = ("threshold never that accurate" if not f["threshold_reaches"] else
                 f"forwards {f['forwards_ratio']:.3f}x, wall {f['wall_ratio']:.3f}x threshold "
                 f"tau {f['threshold_tau']} ({100 * f['threshold_accuracy']:.1f} %)")
        print(f"{f['suite']} {f['cache']}: best verify {f['best']} "
              f"({100 * f['best_accuracy']:.1f} %, {f['best_forwards']:.2f} fwd): {ratio}")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
