"""``flash-dllm bench step|serve``: the benchmark commands (their logic lives in ``flash_dllm/bench``)."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from flash_dllm.entrypoints.args import EngineArgs


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    s = bsub.add_parser("serve", help="async HTTP load generator with a JSON report")
    s.add_argument("--url", default=None,
                   help="server to load (e.g. http://127.0.0.1:8000); default: start one "
                        "in-process for --model on a free loopback port")
    s.add_argument("--concurrency", type=int, default=16, help="clients in flight")
    s.add_argument("--requests", type=int, default=64, help="requests in all")
    s.add_argument("--endpoint", choices=["completions", "chat", "generate"], default="completions")
    s.add_argument("--prompt", default=None,
                   help="one prompt for every request (default: held-out arith questions)")
    s.add_argument("--sequential", action="store_true",
                   help="first send the same requests one after another; report the speed-up")
    s.add_argument("--api-key", default=None)
    s.add_argument("--json", default=None, help="also write the report here")
    g = s.add_argument_group("request knobs (sent in the body; unset: the server's defaults)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--block-length", type=int, default=None)
    g.add_argument("--steps", type=int, default=None)
    g.add_argument("--decode", default=None)
    g.add_argument("--cache", default=None)
    g.add_argument("--threshold", type=float, default=None)
    g.add_argument("--temperature", type=float, default=0.0)
    EngineArgs.add_cli_args(s)
    s.set_defaults(func=cmd_bench_serve)

    t = bsub.add_parser("step", help="time one denoising forward of a random-init model")
    t.add_argument("--model-shape", default="llada-8b", help="llada-8b, dream-7b or demo")
    t.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    t.add_argument("--cache", nargs="+", default=["prefix", "dual", "flash"],
                   choices=["none", "prefix", "dual", "flash"])
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
    t.add_argument("--json", default=None, help="write the report here")
    t.set_defaults(func=cmd_bench_step)


def cmd_bench_step(a: argparse.Namespace) -> int:
    from flash_dllm.bench.step import run_bench, write_report
    from flash_dllm.models.loader import resolve_device

    for name in ("steps", "prompt_len", "gen_len", "block_length"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if any(b < 1 for b in a.batch):
        raise ValueError("--batch values must be >= 1")
    resolve_device(a.device)
    report = run_bench(a.model_shape, a.batch, a.cache, a.device, a.dtype, a.prompt_len,
                       a.gen_len, a.block_length, a.steps, a.warmup,
                       progress=lambda line: print(line, file=sys.stderr),
                       cuda_graphs=not a.no_cuda_graphs,
                       flash_budget=a.flash_budget, decode=a.decode,
                       fused_step=not a.no_fused_step, fused_max_rows=a.fused_step_max_rows)
    write_report(report, a.json)
    print(f"floor {report['floor_ms']:.2f} ms (weights {report['weight_bytes'] / 1e9:.2f} GB at "
          f"{report['copy_bandwidth_GBps']:.0f} GB/s); matmul {report['matmul_TFLOPs']:.1f} TFLOP/s")
    from flash_dllm.bench.step import row_line
    for r in report["rows"]:
        print(row_line(r))
    return 0


def _prompts(a: argparse.Namespace) -> list[str]:
    if a.prompt is not None:
        return [a.prompt]
    from flash_dllm.evals.tasks import get_suite
    return [p.prompt for p in get_suite("arith").test_problems(max(a.requests, 1), seed=0)]


def cmd_bench_serve(a: argparse.Namespace) -> int:
    from flash_dllm.bench.serve import InProcessServer, bench
    from flash_dllm.entrypoints.serve import build_server_app

    if a.concurrency < 1 or a.requests < 1:
        raise ValueError("--concurrency and --requests must be >= 1")
    knobs = {k: v for k, v in dict(max_tokens=a.max_tokens, block_length=a.block_length,
                                   steps=a.steps, decode=a.decode, cache=a.cache,
                                   threshold=a.threshold, temperature=a.temperature).items()
             if v is not None}
    prompts = _prompts(a)

    def go(url: str) -> dict:
        return asyncio.run(bench(url, prompts, a.requests, a.concurrency, a.endpoint, knobs,
                                 a.api_key, a.sequential))

    if a.url is not None:
        report = go(a.url)
    else:
        a.served_model_name, a.max_body_bytes = None, 1 << 20
        app, aeng, name = build_server_app(a)
        with InProcessServer(app, aeng) as srv:
            report = go(srv.url)
        report["model"] = name
        report["server"] = "in-process"
    text = json.dumps(report, indent=2)
    print(text)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(text + "\n", encoding="utf-8")
        print(f"wrote {a.json}", file=sys.stderr)
    return 0 if report["errors"] == 0 else 1
