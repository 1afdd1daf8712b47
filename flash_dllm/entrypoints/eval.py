"""``flash-dllm eval``: accuracy and decoding cost on the project's task suites."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flash_dllm.bench import write_report
from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.config import DECODE_POLICIES, SamplingParams
from flash_dllm.engine.core import resolve_params, runs_on
from flash_dllm.entrypoints.args import (EngineArgs, add_sampling_flags, require_matplotlib,
                                         sampling_from_args)
from flash_dllm.evals.tasks import SUITES


def add_parser(sub) -> None:
    e = sub.add_parser("eval", help="score the model on a task suite")
    e.add_argument("--suite", choices=sorted(SUITES) + ["jsonl"], default="arith",
                   help="arith, code: the demo model's suites; chain, code-long: the proxy "
                        "models' long-answer suites; jsonl: your own file (--data)")
    e.add_argument("--n", type=int, default=None,
                   help="problems to score (default: 100 held-out ones; jsonl: the whole file)")
    j = e.add_argument_group("--suite jsonl (one JSON object per line)")
    j.add_argument("--data", default=None, help="the .jsonl file")
    j.add_argument("--question-field", default="question",
                   help="field holding the question (default: %(default)s)")
    j.add_argument("--answer-field", default="answer",
                   help="field holding the gold answer, text or number (default: %(default)s)")
    j.add_argument("--answer-regex", default=None,
                   help="the answer in a completion: the first match (its first group if it has "
                        "one); default: the last number when the gold answer is a number, else "
                        "the whole completion")
    j.add_argument("--gold-regex", default=None,
                   help="the same applied to the gold field, e.g. '#### (.+)' for GSM8K's "
                        "answers (default: the whole field)")
    e.add_argument("--problem-seed", dest="eval_seed", type=int, default=0, help="test-set seed")
    e.add_argument("--chat", action="store_true", help="wrap questions in the chat template")
    e.add_argument("--repeat", action="store_true",
                   help="ask every question twice and score the second answers (with "
                        "--prefix-reuse the second run reuses the first one's KV pages)")
    e.add_argument("--json", default=None, help="write the report here")
    e.add_argument("--matrix", action="store_true",
                   help="run every (cache x decode) pair; prints a table, writes JSON and a PNG "
                        "(needs matplotlib: pip install -e \".[plot]\")")
    e.add_argument("--plot", default=None, help="PNG path for --matrix (default: next to --json)")
    e.add_argument("--no-progress", action="store_true")
    EngineArgs.add_cli_args(e)
    # NOTE: --max-tokens defaults to the suite's canvas, so `eval --suite chain` decodes whole
    # answers without a flag
    add_sampling_flags(e, max_tokens_default="the suite's canvas, 64 for arith, code and jsonl, "
                                             "256 for chain and code-long")
    e.set_defaults(func=run)


def _suite(a: argparse.Namespace):
    """A registered suite's name (``--n`` defaults to 100), or the ``--data`` file's suite,
    checked before any model loads: a bad line fails at once, naming it."""
    jsonl_flags = {"--data": a.data, "--answer-regex": a.answer_regex,
                   "--gold-regex": a.gold_regex}
    if a.suite != "jsonl":
        given = [k for k, v in jsonl_flags.items() if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only apply to --suite jsonl")
        a.n = 100 if a.n is None else a.n
        return a.suite
    if a.data is None:
        raise ValueError("--suite jsonl needs --data FILE (one JSON object per line)")
    from flash_dllm.evals.jsonl import JsonlSpec, load_problems, make_suite

    spec = JsonlSpec(a.data, a.question_field, a.answer_field, a.answer_regex, a.gold_regex)
    return make_suite(spec, load_problems(spec, a.n))


def run(a: argparse.Namespace) -> int:
    from flash_dllm.entrypoints.llm import LLM
    from flash_dllm.evals.report import matrix_table, plot_matrix
    from flash_dllm.evals.runner import run_eval, summary_line

    if a.n is not None and a.n < 1:
        raise ValueError(f"--n must be >= 1, got {a.n}")
    suite = _suite(a)
    if a.max_tokens is None:
        a.max_tokens = (SUITES[suite].gen_length if isinstance(suite, str)
                        else SamplingParams().max_tokens)
    if a.matrix:
        require_matplotlib()        # before any pair runs, not after all of them
    sampling_from_args(a)                 # bad flags fail before the model loads
    args = EngineArgs.from_cli_args(a)
    llm = LLM(args.model, device=args.device, dtype=args.dtype,
              engine_config=args.engine_config(),
              tensor_parallel_size=args.tensor_parallel_size)
    # the flags given, then the checkpoint's generation_config.json, then the recommended
    base = resolve_params(sampling_from_args(a, defaults=llm.sampling_defaults), llm.cfg)
    combos = ([(c, d) for c in CACHE_MODES for d in DECODE_POLICIES if runs_on(llm.cfg, c, d)]
              if a.matrix else [(base.cache, base.decode)])
    reports = []
    for cache, decode in combos:
        # a policy's own knobs (verify's sentinels) apply to that policy's rows of a matrix only
        others = {k: None for p in DECODE_POLICIES.values() for k in p.own_knobs
                  if k not in DECODE_POLICIES[decode].own_knobs}
        params = sampling_from_args(a, defaults=llm.sampling_defaults, cache=cache,
                                    decode=decode, **others)
        r = run_eval(llm, suite, a.n, params, seed=a.eval_seed, chat=a.chat,
                     progress=not a.no_progress, repeat=a.repeat)
        if a.suite == "jsonl":
            r["data"] = str(a.data)
        reports.append(r)
        print(summary_line(r), file=sys.stderr if a.matrix else sys.stdout)
    if a.matrix:
        print(matrix_table(reports))
    report = {"rows": reports} if a.matrix else reports[0]
    if write_report(report, a.json):
        print(f"wrote {a.json}", file=sys.stderr)
    if a.matrix:
        png = a.plot or (str(Path(a.json).with_suffix(".png")) if a.json else f"eval_{a.suite}.png")
        plot_matrix(reports, png)
        print(f"wrote {png}", file=sys.stderr)
    return 0
