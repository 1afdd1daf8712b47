"""``flash-dllm bench overflow``: its flags (the benchmark is ``bench/overflow.py``)."""
from __future__ import annotations

import argparse

from flash_dllm.bench import write_report


def add_overflow_parser(bsub) -> None:
    o = bsub.add_parser("overflow", help="one request larger than the GPU KV pool "
                                         "(--kv-overflow-gb): step time against its bound")
    o.add_argument("--model-shape", default="demo", help="llada-8b, dream-7b or demo")
    o.add_argument("--device", default="cpu")
    o.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    o.add_argument("--prompt-len", type=int, default=2048)
    o.add_argument("--gen-len", type=int, default=32)
    o.add_argument("--block-length", type=int, default=32)
    o.add_argument("--resident", type=float, default=0.25,
                   help="share of the request's KV pages the GPU pool holds (default: "
                        "%(default)s)")
    o.add_argument("--page-size", type=int, default=16)
    o.add_argument("--cache", default="dual", choices=["dual", "prefix"])
    o.add_argument("--steps-per-block", type=int, default=None,
                   help="denoising steps per block (default: one token per step)")
    o.add_argument("--lazy-load-budget", type=float, default=None,
                   help="also time the request under lazy loading at this budget, once per "
                        "--kv-placement")
    o.add_argument("--kv-placement", nargs="+", default=["ema"], choices=["lru", "ema", "kag"],
                   help="with --lazy-load-budget: which pages stay resident (default: ema, "
                        "the engine's default there)")
    o.add_argument("--lazy-load-predictor", default="quest", choices=["mass", "quest"])
    o.add_argument("--json", default=None, help="write the report here")
    o.set_defaults(func=cmd_bench_overflow)


def cmd_bench_overflow(a: argparse.Namespace) -> int:
    from flash_dllm.bench.overflow import run_overflow_bench, table
    from flash_dllm.models.loader import resolve_device

    for name in ("prompt_len", "gen_len", "block_length", "page_size"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    resolve_device(a.device)
    report = run_overflow_bench(a.model_shape, a.device, a.dtype, a.prompt_len, a.gen_len,
                                a.block_length, a.resident, a.page_size, a.cache,
                                progress=lambda m: print(m, flush=True),
                                steps_per_block=a.steps_per_block,
                                lazy_budget=a.lazy_load_budget,
                                placements=tuple(a.kv_placement),
                                lazy_predictor=a.lazy_load_predictor)
    write_report(report, a.json)
    print(table(report))
    return 0
