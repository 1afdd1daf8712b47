"""``flash-dllm eval``: accuracy and decoding cost on the project's task suites."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.config import DECODE_POLICIES
from flash_dllm.entrypoints.args import EngineArgs, add_sampling_flags, sampling_from_args
from flash_dllm.evals.tasks import SUITES


def add_parser(sub) -> None:
    e = sub.add_parser("eval", help="score the model on a task suite")
    e.add_argument("--suite", choices=sorted(SUITES), default="arith")
    e.add_argument("--n", type=int, default=100, help="held-out problems (default 100)")
    e.add_argument("--problem-seed", dest="eval_seed", type=int, default=0, help="test-set seed")
    e.add_argument("--chat", action="store_true", help="wrap questions in the chat template")
    e.add_argument("--repeat", action="store_true",
                   help="ask every question twice and score the second answers (with "
                        "--prefix-reuse the second run reuses the first one's KV pages)")
    e.add_argument("--json", default=None, help="write the report here")
    e.add_argument("--matrix", action="store_true",
                   help="run every (cache x decode) pair; prints a table, writes JSON and a PNG")
    e.add_argument("--plot", default=None, help="PNG path for --matrix (default: next to --json)")
    e.add_argument("--no-progress", action="store_true")
    EngineArgs.add_cli_args(e)
    add_sampling_flags(e)
    e.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from flash_dllm.entrypoints.llm import LLM
    from flash_dllm.evals.report import matrix_table, plot_matrix
    from flash_dllm.evals.runner import run_eval, summary_line

    if a.n < 1:
        raise ValueError(f"--n must be >= 1, got {a.n}")
    base = sampling_from_args(a)
    args = EngineArgs.from_cli_args(a)
    llm = LLM(args.model, device=args.device, dtype=args.dtype,
              engine_config=args.engine_config(),
              tensor_parallel_size=args.tensor_parallel_size)
    combos = ([(c, d) for c in CACHE_MODES for d in DECODE_POLICIES] if a.matrix
              else [(base.cache, base.decode)])
    reports = []
    for cache, decode in combos:
        # the verify-only sentinels apply to the verify rows of a matrix only
        only_verify = {} if decode == "verify" else {"entropy_max": None, "perturb_sigma": None}
        params = sampling_from_args(a, cache=cache, decode=decode, **only_verify)
        r = run_eval(llm, a.suite, a.n, params, seed=a.eval_seed, chat=a.chat,
                     progress=not a.no_progress, repeat=a.repeat)
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
