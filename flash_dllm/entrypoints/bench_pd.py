"""``flash-dllm bench pd``: its flags, and the engines it compares (``bench/pd.py`` runs it)."""
from __future__ import annotations

import argparse

from flash_dllm.bench import write_report
from flash_dllm.entrypoints.args import EngineArgs, positive_int


def add_pd_parser(bsub) -> None:
    from flash_dllm.bench.pd import PARTS

    p = bsub.add_parser("pd", help="prefill/decode disaggregation: KV transfer layouts, the "
                                   "staging allocator, role switching, and a mixed workload "
                                   "served colocated against disaggregated (JSON report)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                   help="which parts to run (default: all)")
    p.add_argument("--transfer-tokens", type=positive_int, default=512,
                   help="transfer: prompt tokens of LLaDA-8B-shaped KV moved (default: 512)")
    p.add_argument("--transfer-backend", choices=["gloo", "nccl"], default="gloo",
                   help="transfer: gloo (CPU processes) or nccl (needs 2 GPUs)")
    p.add_argument("--prefill-workers", type=positive_int, default=1)
    p.add_argument("--decode-workers", type=positive_int, default=1)
    p.add_argument("--requests", type=positive_int, default=24, help="serve: requests")
    p.add_argument("--rate", type=float, default=4.0, help="serve: arrivals per second")
    p.add_argument("--long-frac", type=float, default=0.25,
                   help="serve: share of long prompts (default: 0.25)")
    p.add_argument("--long-prompt", type=positive_int, default=384,
                   help="serve: tokens of a long prompt (default: 384)")
    p.add_argument("--short-prompt", type=positive_int, default=16,
                   help="serve: tokens of a short prompt (default: 16)")
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--block-length", type=positive_int, default=32)
    p.add_argument("--model-shape", default=None,
                   help="serve: a random-init model of this shape (llada-8b, dream-7b, demo) "
                        "instead of --model")
    p.add_argument("--pd-timeout", type=float, default=60.0,
                   help="serve: seconds a KV transfer may take (default: 60)")
    p.add_argument("--pd-staging-gb", type=float, default=0.25,
                   help="serve: each worker's staging buffer; a request's KV must fit "
                        "(default: 0.25)")
    p.add_argument("--pd-transport", choices=["auto", "gloo", "nccl", "ipc", "nixl"],
                   default="auto", help="serve: how KV moves between workers (see serve)")
    p.add_argument("--pd-layer-groups", type=positive_int, default=1,
                   help="serve: pipelined sends in this many layer groups (default: 1)")
    p.add_argument("--json", default=None, help="write the report here")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=cmd_bench_pd)


def cmd_bench_pd(a: argparse.Namespace) -> int:
    from flash_dllm.bench.pd import run_pd_bench, table
    from flash_dllm.entrypoints.loader import load_engine, load_random_engine
    from flash_dllm.entrypoints.pd_launch import launch

    if not a.rate > 0 or not 0 <= a.long_frac <= 1:
        raise ValueError("--rate must be > 0 and --long-frac in [0, 1]")
    args = EngineArgs.from_cli_args(a)

    def colocated():
        if a.model_shape:
            return load_random_engine(a.model_shape, args).engine
        return load_engine(args).engine

    def disaggregated():
        return launch(args, a.prefill_workers, a.decode_workers, timeout_s=a.pd_timeout,
                      staging_gb=a.pd_staging_gb, model_shape=a.model_shape,
                      layer_groups=a.pd_layer_groups,
                      backend=None if a.pd_transport == "auto" else a.pd_transport)

    report = run_pd_bench(tuple(a.parts), device=args.device,
                          transfer_tokens=a.transfer_tokens, transfer_backend=a.transfer_backend,
                          log=lambda line: print(line, flush=True),
                          make_colocated=colocated, make_disaggregated=disaggregated,
                          prefill_workers=a.prefill_workers, decode_workers=a.decode_workers,
                          requests=a.requests, rate=a.rate, long_frac=a.long_frac,
                          long_len=a.long_prompt, short_len=a.short_prompt,
                          max_tokens=a.max_tokens, block_length=a.block_length)
    write_report(report, a.json)
    print(table(report))
    return 0
