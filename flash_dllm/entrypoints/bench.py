"""``flash-dllm bench step|serve``: the benchmark commands (their logic lives in ``flash_dllm/bench``)."""
from __future__ import annotations

import argparse
import asyncio
import json

from flash_dllm.bench import write_report
from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.config import LM_HEAD_SUFFIX, QUANT_MODES
from flash_dllm.entrypoints.args import EngineArgs, require_matplotlib
from flash_dllm.entrypoints.bench_client import (add_request_knobs, check_server, request_knobs,
                                                 run_against)
from flash_dllm.entrypoints.bench_multiturn import add_multiturn_parser
from flash_dllm.entrypoints.bench_overflow import add_overflow_parser
from flash_dllm.entrypoints.bench_pd import add_pd_parser
from flash_dllm.entrypoints.bench_soak import add_soak_parser
from flash_dllm.entrypoints.bench_plot import add_plot_parser, write_png
from flash_dllm.entrypoints.serve import SERVE_DEFAULTS
from flash_dllm.worker.warmup import WARMUP_LEVELS


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    s = bsub.add_parser("serve", help="async HTTP load generator with a JSON report")
    s.add_argument("--url", default=None,
                   help="server to load (e.g. http://127.0.0.1:8000); default: start one "
                        "in-process for --model on a free loopback port")
    s.add_argument("--concurrency", type=int, nargs="+", default=[16],
                   help="clients in flight; several values run one after another against the "
                        "same server (one report with a run per value)")
    s.add_argument("--requests", type=int, nargs="+", default=[64],
                   help="requests per run; one value per --concurrency value gives each run "
                        "its own (steady state needs many times the concurrency; concurrency 1 "
                        "needs few)")
    s.add_argument("--endpoint", choices=["completions", "chat", "generate"], default="completions")
    s.add_argument("--prompt", default=None,
                   help="one prompt for every request (default: held-out arith questions)")
    s.add_argument("--sequential", action="store_true",
                   help="first send the same requests one after another; report the speed-up")
    s.add_argument("--api-key", default=None)
    s.add_argument("--client-process", action=argparse.BooleanOptionalAction, default=True,
                   help="with the in-process server, run the load generator in a process of "
                        "its own, as a real client is (default); --no-client-process runs it "
                        "in the server's process, where it competes with the engine thread for "
                        "the GIL")
    s.add_argument("--model-shape", default=None,
                   help="the in-process server runs a random-init model of this shape "
                        "(llada-8b, dream-7b, demo) instead of --model: real costs, noise "
                        "answers")
    s.add_argument("--json", default=None,
                   help="write the report here (stdout then shows a one-line summary per run "
                        "instead of the report)")
    s.add_argument("--warmup", choices=WARMUP_LEVELS, default=None,
                   help="the in-process server's warm-up before ready (see 'serve --help'; "
                        "default: full on a GPU, none on the CPU)")
    g = add_request_knobs(s, max_tokens=64)
    g.add_argument("--no-stream", action="store_true",
                   help="ask for whole answers (no per-token events; TTFT = latency): how much "
                        "of the serving cost is streaming")
    EngineArgs.add_cli_args(s, defaults=SERVE_DEFAULTS)
    s.set_defaults(func=cmd_bench_serve)

    mem = bsub.add_parser("memory", help="KV page moves between GPU, pinned host memory and "
                                         "disk against plain copies of the same bytes")
    mem.add_argument("--model-shape", default="demo", help="llada-8b, dream-7b or demo")
    mem.add_argument("--device", default="cpu")
    mem.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    mem.add_argument("--pages", type=int, default=64, help="pages moved per measurement")
    mem.add_argument("--page-size", type=int, default=16)
    mem.add_argument("--reps", type=int, default=5)
    mem.add_argument("--offload-dtype", nargs="+", default=["bf16", "fp8", "int8"],
                     choices=["bf16", "fp8", "int8"])
    mem.add_argument("--disk-path", default=None,
                     help="also measure the disk tier on this (scratch) file")
    mem.add_argument("--disk-mb", type=int, default=256)
    mem.add_argument("--disk-reps", type=int, default=5,
                     help="alternating (store, sequential) disk passes; medians are reported "
                          "(default: %(default)s)")
    mem.add_argument("--group-pages", type=int, nargs="+", default=None,
                     help="pages per pipelined group of a store / load; several values: one "
                          "row per value and offload dtype (default: the engine's, 16)")
    mem.add_argument("--json", default=None, help="write the report here")
    mem.add_argument("--png", default=None, help="draw the report's figure here (matplotlib)")
    mem.set_defaults(func=cmd_bench_memory)

    add_plot_parser(bsub)

    t = bsub.add_parser("step", help="time one denoising forward of a random-init model")
    t.add_argument("--model-shape", default="llada-8b", help="llada-8b, dream-7b, llada2-mini, llada2-flash, sdar-4b, "
                        "sdar-30b-a3b, llada-moe-7b or demo")
    t.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    t.add_argument("--cache", nargs="+", default=["prefix", "dual", "flash"],
                   choices=list(CACHE_MODES),
                   help="cache modes to time (default: prefix dual flash; block-causal shapes "
                        "such as llada2-mini and sdar-4b: block, the exact block cache)")
    t.add_argument("--prompt-len", type=int, default=512)
    t.add_argument("--gen-len", type=int, default=512)
    t.add_argument("--block-length", type=int, default=32)
    t.add_argument("--steps", type=int, default=50, help="timed steps per case")
    t.add_argument("--warmup", type=int, default=5)
    t.add_argument("--device", default="cuda")
    t.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    t.add_argument("--no-cuda-graphs", action="store_true", help="run the forward eagerly")
    t.add_argument("--flash-budget", type=int, default=None,
                   help="cache=flash: top-k positions recomputed per step (default: SamplingParams')")
    t.add_argument("--decode", default="vanilla", choices=["vanilla", "threshold"],
                   help="commit rule (a random model commits one token per step under both)")
    t.add_argument("--no-fused-step", action="store_true",
                   help="keep the forward graph + eager proposal/commit path (the fused step "
                        "is on by default here: this benchmark times steady-state steps)")
    t.add_argument("--fused-step-max-rows", type=int, default=None,
                   help="EngineConfig.fused_step_max_rows (batch x block rows a fused step may "
                        "have; default 2048)")
    t.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many GPUs (rank r on cuda:r; worker "
                        "processes are started here); figures are rank 0's (default: 1)")
    t.add_argument("--routing", default="model", choices=["model", "uniform"],
                   help="MoE shapes: the random router's own choices (default; its rows crowd "
                        "onto few experts), or each row's experts drawn uniformly, as a "
                        "balanced trained router spreads them (the step reads as many experts "
                        "as the real model would)")
    t.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="KV page pool element type (EngineConfig.kv_cache_dtype)")
    t.add_argument("--deterministic", action="store_true",
                   help="batch-invariant numerics (EngineConfig.deterministic: fixed-tile "
                        "GEMMs and kernel launches on a GPU, padded rows on the CPU): what "
                        "they cost per step")
    t.add_argument("--multi-step", type=int, default=None,
                   help="EngineConfig.multi_step: steady vanilla steps one engine step may "
                        "launch ahead of the host (default: the engine's, 4 with CUDA graphs; "
                        "1: one forward per engine step). A call of n forwards counts as n "
                        "steps of its time / n")
    t.add_argument("--fused-first-steps", action="store_true",
                   help="EngineConfig.fused_first_steps: block-cache block-start steps as "
                        "fused steps too (off by default until timed)")
    t.add_argument("--quantization", nargs="+", default=["none"],
                   choices=["none", *QUANT_MODES, *(m + LM_HEAD_SUFFIX for m in QUANT_MODES)],
                   help="weight modes to time, one model each, rows side by side (e.g. none "
                        "fp8 int8 int4; MODE+head: the LM head quantized too, "
                        "--quantize-lm-head); each row's weight-read floor is from its mode's "
                        "stored bytes (default: none, the --dtype weights)")
    t.add_argument("--quantization-group-size", type=int, default=128,
                   help="int8 / int4: inputs per scale (default: %(default)s)")
    t.add_argument("--json", default=None, help="write the report here")
    t.set_defaults(func=cmd_bench_step)
    add_multiturn_parser(bsub)
    add_pd_parser(bsub)
    add_overflow_parser(bsub)
    add_soak_parser(bsub)


def cmd_bench_memory(a: argparse.Namespace) -> int:
    from flash_dllm.bench.memory import run_memory_bench, table
    from flash_dllm.models.loader import resolve_device

    for name in ("pages", "page_size", "reps", "disk_mb", "disk_reps"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if a.group_pages is not None and min(a.group_pages) < 1:
        raise ValueError(f"--group-pages must be >= 1, got {a.group_pages}")
    resolve_device(a.device)
    if a.png:
        require_matplotlib("--png")      # before the run, not after it
    report = run_memory_bench(a.model_shape, a.device, a.dtype, a.pages, a.page_size, a.reps,
                              tuple(a.offload_dtype), a.disk_path, a.disk_mb,
                              tuple(a.group_pages) if a.group_pages else None, a.disk_reps)
    write_report(report, a.json)
    print(table(report))
    write_png(report, a.png)
    return 0


def cmd_bench_step(a: argparse.Namespace) -> int:
    from flash_dllm.bench.step import run_bench
    from flash_dllm.models.loader import resolve_device

    for name in ("steps", "prompt_len", "gen_len", "block_length"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if any(b < 1 for b in a.batch):
        raise ValueError("--batch values must be >= 1")
    if a.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {a.tensor_parallel_size}")
    if a.multi_step is not None and a.multi_step < 1:
        raise ValueError(f"--multi-step must be >= 1, got {a.multi_step}")
    resolve_device(a.device)
    report = run_bench(a.model_shape, a.batch, a.cache, a.device, a.dtype, a.prompt_len,
                       a.gen_len, a.block_length, a.steps, a.warmup,
                       # each row is printed once, when its case finishes (a long GPU run
                       # shows its progress); the summary line follows the last row
                       progress=lambda line: print(line, flush=True),
                       cuda_graphs=not a.no_cuda_graphs,
                       flash_budget=a.flash_budget, decode=a.decode,
                       fused_step=not a.no_fused_step, fused_max_rows=a.fused_step_max_rows,
                       tensor_parallel_size=a.tensor_parallel_size, routing=a.routing,
                       kv_cache_dtype=a.kv_cache_dtype, deterministic=a.deterministic,
                       quantization=a.quantization, group_size=a.quantization_group_size,
                       multi_step=a.multi_step, fused_first_steps=a.fused_first_steps)
    write_report(report, a.json)
    print(f"floor {report['floor_ms']:.2f} ms (weights {report['weight_bytes'] / 1e9:.2f} GB at "
          f"{report['copy_bandwidth_GBps']:.0f} GB/s); matmul {report['matmul_TFLOPs']:.1f} TFLOP/s")
    for mode, w in report["weights_by_quantization"].items():
        if mode != "none":
            print(f"  {mode}: floor {w['floor_ms']:.2f} ms (weights {w['weight_bytes'] / 1e9:.2f} "
                  "GB)")
    return 0


def _prompts(a: argparse.Namespace) -> list[str]:
    if a.prompt is not None:
        return [a.prompt]
    from flash_dllm.evals.tasks import get_suite
    return [p.prompt for p in get_suite("arith").test_problems(max(*a.requests, 1), seed=0)]


def cmd_bench_serve(a: argparse.Namespace) -> int:
    from flash_dllm.bench.serve import (
        InProcessServer,
        bench,
        bench_in_subprocess,
        startup_report,
    )
    from flash_dllm.entrypoints.serve import build_server_app

    if len(a.requests) not in (1, len(a.concurrency)):
        raise ValueError(f"--requests takes one value, or one per --concurrency value "
                         f"({len(a.concurrency)}), got {len(a.requests)}")
    counts = list(zip(a.concurrency, a.requests * (len(a.concurrency) // len(a.requests))))
    if min(a.concurrency) < 1 or min(a.requests) < 1:
        raise ValueError("--concurrency and --requests must be >= 1")
    knobs = {"max_tokens": a.max_tokens, **request_knobs(a), "temperature": a.temperature}
    if a.no_stream:
        knobs["stream"] = False
    prompts = _prompts(a)

    in_process_client = a.url is not None or not a.client_process

    def go(url: str) -> dict:
        if in_process_client:
            async def runs():
                return [await bench(url, prompts, n, c, a.endpoint, knobs, a.api_key,
                                    a.sequential) for c, n in counts]
            out = asyncio.run(runs())
        else:
            out = [bench_in_subprocess(url, prompts, n, c, a.endpoint, knobs,
                                       a.api_key, a.sequential) for c, n in counts]
        start = asyncio.run(startup_report(url))
        if len(out) == 1:
            report = out[0]
        else:
            report = {"runs": out, "errors": sum(r["errors"] for r in out)}
        report["startup"] = start
        return report

    if a.url is not None:
        check_server(a.url)
        report = run_against(a.url, go)
    else:
        a.served_model_name, a.max_body_bytes = None, 1 << 20
        app, aeng, name = build_server_app(a)
        with InProcessServer(app, aeng) as srv:
            report = go(srv.url)
        report["model"] = name
        if getattr(aeng.engine, "dtype", None) is not None:   # (a disaggregated front end: none)
            report["dtype"] = str(aeng.engine.dtype).removeprefix("torch.")
        report["server"] = "in-process"
        report["client"] = "in-process" if in_process_client else "own process"
    if write_report(report, a.json):        # the file has it all: a summary on stdout
        for run in report.get("runs", [report]):
            print(serve_summary(run))
        print(f"wrote {a.json}")
    else:
        print(json.dumps(report, indent=2))
    return 0 if report["errors"] == 0 else 1


def serve_summary(run: dict) -> str:
    """One line of a ``bench serve`` run: what ran, how fast, how many failed."""
    lat, ttft = run.get("latency_s") or {}, run.get("ttft_s") or {}
    return (f"{run['requests']} requests at concurrency {run['concurrency']}: "
            f"{run['errors']} errors, {run['throughput_rps']:.2f} req/s, "
            f"{run['output_tokens_per_s']:.1f} tokens/s, latency p50 {lat.get('p50') or 0:.3f} s, "
            f"TTFT p50 {ttft.get('p50') or 0:.3f} s")


# ---------------------------------------------------------------------------------- multiturn
