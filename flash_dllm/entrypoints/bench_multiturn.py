"""``flash-dllm bench multiturn``: multi-turn chat sessions against a server (the benchmark is
``bench/multiturn.py``)."""
from __future__ import annotations

import argparse
import asyncio
import gc
import sys

from flash_dllm.bench import write_report
from flash_dllm.entrypoints.args import EngineArgs, require_matplotlib
from flash_dllm.entrypoints.bench_client import (add_request_knobs, check_server,
                                                 request_knobs, run_against)
from flash_dllm.entrypoints.bench_plot import write_png
from flash_dllm.entrypoints.serve import SERVE_DEFAULTS


def add_multiturn_parser(bsub) -> None:
    m = bsub.add_parser(
        "multiturn", help="multi-turn chat sessions: per-turn TTFT, prefix-cache hits per tier",
        description="USERS concurrent chat sessions of TURNS turns each over a growing history "
                    "(POST /v1/chat/completions, streamed). Reports TTFT per turn, throughput, "
                    "and the server's prefix-cache / KV-tier counters over the run. A session "
                    "whose next prompt + --max-tokens would exceed the server's max_model_len "
                    "stops there (recorded under 'stopped', not an error).")
    m.add_argument("--url", default=None,
                   help="server to load (e.g. http://127.0.0.1:8000); default: start one "
                        "in-process for --model on a free loopback port")
    m.add_argument("--users", type=int, default=8,
                   help="concurrent sessions (default: %(default)s)")
    m.add_argument("--turns", type=int, default=4, help="turns per session (default: %(default)s)")
    m.add_argument("--history-tokens", type=int, default=128,
                   help="size of each session's opening system message, in tokens estimated as "
                        "history-tokens x --chars-per-token characters of seeded synthetic text "
                        "(default: %(default)s)")
    m.add_argument("--chars-per-token", type=float, default=1.0,
                   help="characters per token for that estimate: 1.0 for the demo model's "
                        "character tokenizer, ~4 for English BPE (default: %(default)s)")
    m.add_argument("--idle-s", type=float, default=0.0,
                   help="seconds a session sleeps between turns, so other sessions' traffic can "
                        "push its KV out of GPU memory (default: %(default)s)")
    m.add_argument("--session-seed", type=int, default=0,
                   help="seed of the synthetic histories and questions (default: %(default)s)")
    m.add_argument("--shared-prefix", action="store_true",
                   help="all sessions open with the same system message (cross-user reuse)")
    m.add_argument("--compare", action="store_true",
                   help="run the same sessions against two in-process servers, prefix reuse on "
                        "and --no-prefix-reuse, and report per-turn TTFT of both and off/on")
    m.add_argument("--no-warmup", action="store_true", help="skip the uncounted warm-up request")
    m.add_argument("--timeout-s", type=float, default=600.0,
                   help="per-request HTTP timeout (default: %(default)s)")
    m.add_argument("--keep-texts", action="store_true",
                   help="keep each answer's text in the report's records")
    m.add_argument("--api-key", default=None)
    m.add_argument("--json", default=None, help="also write the JSON report here")
    m.add_argument("--png", default=None, help="draw TTFT per turn and throughput here "
                                               "(matplotlib)")
    add_request_knobs(m, max_tokens=32,
                      max_tokens_help="answer tokens per turn (default: %(default)s)")
    m.add_argument("--model-shape", default=None,
                   help="in-process only: serve a random-init model of this shape (llada-8b, "
                        "dream-7b) with the demo tokenizer, instead of --model (timing only)")
    m.add_argument("--model-max-len", type=int, default=None,
                   help="with --model-shape: at least this many positions (LLaDA-8B's config "
                        "says 4096; longer histories need more)")
    EngineArgs.add_cli_args(m, defaults=SERVE_DEFAULTS)
    m.set_defaults(func=cmd_bench_multiturn)


def _has_prefix_reuse(a: argparse.Namespace) -> bool:
    import dataclasses

    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return "prefix_reuse" in names and hasattr(a, "prefix_reuse")


def _tiers_off(ns: argparse.Namespace) -> None:
    """Host / disk tiers hold cached pages for reuse: the no-reuse server runs without them."""
    import dataclasses

    from flash_dllm.config import EngineConfig

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    for name in ("kv_cpu_gb", "kv_disk_gb", "kv_disk_path"):
        if hasattr(ns, name) and name in defaults:
            setattr(ns, name, defaults[name])


def cmd_bench_multiturn(a: argparse.Namespace) -> int:
    import copy

    from flash_dllm.bench.multiturn import MultiturnConfig, compare_turns, run_multiturn, table
    from flash_dllm.bench.serve import InProcessServer
    from flash_dllm.entrypoints.serve import build_server_app

    knobs = request_knobs(a)
    cfg = MultiturnConfig(users=a.users, turns=a.turns, history_tokens=a.history_tokens,
                          chars_per_token=a.chars_per_token, max_tokens=a.max_tokens,
                          idle_s=a.idle_s, seed=a.session_seed, shared_prefix=a.shared_prefix,
                          temperature=a.temperature, knobs=knobs, timeout_s=a.timeout_s)
    if a.compare and a.url is not None:
        raise ValueError("--compare starts two in-process servers; it cannot be used with --url")
    if a.png:
        require_matplotlib("--png")      # before the run, not after it

    def go(url: str) -> dict:
        return asyncio.run(run_multiturn(url, cfg, a.api_key, warmup=not a.no_warmup,
                                         keep_texts=a.keep_texts))

    def in_process(ns: argparse.Namespace) -> dict:
        ns.served_model_name, ns.max_body_bytes = None, 1 << 20
        app, aeng, name = build_server_app(ns)
        with InProcessServer(app, aeng) as srv:
            rep = go(srv.url)
        rep.update(model=name, server="in-process")
        if hasattr(ns, "prefix_reuse"):
            rep["prefix_reuse"] = ns.prefix_reuse
        return rep

    if a.url is not None:
        check_server(a.url)
        report = run_against(a.url, go)
    elif a.compare and _has_prefix_reuse(a):
        on, off = copy.copy(a), copy.copy(a)
        on.prefix_reuse, off.prefix_reuse = True, False
        _tiers_off(off)
        r_on = in_process(on)
        gc.collect()            # the first server's KV pool goes back before the second sizes its
        r_off = in_process(off)
        report = {"reuse_on": r_on, "reuse_off": r_off, "compare": compare_turns(r_on, r_off),
                  "errors": r_on["errors"] + r_off["errors"]}
    else:
        report = in_process(a)
        if a.compare:
            msg = ("--compare skipped: this build's EngineArgs has no prefix_reuse flag "
                   "(--no-prefix-reuse); ran with the engine's defaults only")
            report["compare"] = {"skipped": msg}
            print(msg, file=sys.stderr)
    if write_report(report, a.json):
        print(f"wrote {a.json}", file=sys.stderr)
    print(table(report))
    write_png(report, a.png)
    return 0 if report["errors"] == 0 else 1
