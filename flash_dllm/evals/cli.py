"""``flash-dllm eval``: accuracy and decoding cost on the project's task suites."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.config import DECODE_POLICIES
from flash_dllm.evals.tasks import SUITES


def add_eval_parser(sub) -> None:
    from flash_dllm.cli import add_model_flags, add_sampling_flags

    e = sub.add_parser("eval", help="score the model on a task suite")
    e.add_argument("--suite", choices=sorted(SUITES), default="arith")
    e.add_argument("--n", type=int, default=100, help="held-out problems (default 100)")
    e.add_argument("--problem-seed", dest="eval_seed", type=int, default=0, help="test-set seed")
    e.add_argument("--chat", action="store_true", help="wrap questions in the chat template")
    e.add_argument("--json", default=None, help="write the report here")
    e.add_argument("--matrix", action="store_true",
                   help="run every (cache x decode) pair; prints a table, writes JSON and a PNG")
    e.add_argument("--plot", default=None, help="PNG path for --matrix (default: next to --json)")
    e.add_argument("--no-progress", action="store_true")
    add_model_flags(e)
    add_sampling_flags(e)
    e.set_defaults(func=cmd_eval)


def cmd_eval(a: argparse.Namespace) -> int:
    from flash_dllm.cli import load_llm, sampling_from_args
    from flash_dllm.evals.runner import run_eval, summary_line

    if a.n < 1:
        raise ValueError(f"--n must be >= 1, got {a.n}")
    base = sampling_from_args(a)
    llm = load_llm(a)
    combos = ([(c, d) for c in CACHE_MODES for d in DECODE_POLICIES] if a.matrix
              else [(base.cache, base.decode)])
    reports = []
    for cache, decode in combos:
        # the verify-only sentinels apply to the verify rows of a matrix only
        only_verify = {} if decode == "verify" else {"entropy_max": None, "perturb_sigma": None}
        params = sampling_from_args(a, cache=cache, decode=decode, **only_verify)
        r = run_eval(llm, a.suite, a.n, params, seed=a.eval_seed, chat=a.chat,
                     progress=not a.no_progress)
        reports.append(r)
        print(summary_line(r), file=sys.stderr if a.matrix else sys.stdout)
    if a.matrix:
        print(matrix_table(reports))
    report = {"rows": reports} if a.matrix else reports[0]
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {a.json}", file=sys.stderr)
    if a.matrix:
        png = a.plot or (str(Path(a.json).with_suffix(".png")) if a.json else f"eval_{a.suite}.png")
        plot_matrix(reports, png)
        print(f"wrote {png}", file=sys.stderr)
    return 0


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
