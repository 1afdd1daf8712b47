"""``flash-dllm bench soak``: its flags (``bench/soak.py`` runs it)."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from flash_dllm.bench import write_report
from flash_dllm.entrypoints.args import positive_int


def add_soak_parser(bsub) -> None:
    from flash_dllm.bench.soak import FAULTS

    p = bsub.add_parser("soak", help="a bounded soak with faults against real 'flash-dllm "
                                     "serve' subprocesses: mixed traffic in phases, mid-stream "
                                     "disconnects, a corrupted disk-tier record, failed engine "
                                     "steps, a killed decode worker, SIGTERM then a second "
                                     "signal; outcomes, leaks, RSS and latency per phase")
    p.add_argument("--minutes", type=float, default=None,
                   help="load time over all timed phases (default: 15 on the CPU, about 19 "
                        "minutes in all with the servers' start-ups and the replay; 7 on a GPU)")
    p.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--concurrency", type=positive_int, default=8,
                   help="clients in flight (also each server's --max-num-seqs; default: 8)")
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS),
                   help="faults to inject (default: all)")
    p.add_argument("--replay", type=int, default=40,
                   help="temperature-0 answers replayed alone on a fresh server (default: 40)")
    p.add_argument("--num-kv-pages", type=positive_int, default=128,
                   help="the tiered server's L0 pool: small, so cached pages move down")
    p.add_argument("--kv-cpu-gb", type=float, default=0.002, help="its host tier (L1)")
    p.add_argument("--kv-disk-gb", type=float, default=0.01, help="its disk tier (L2)")
    p.add_argument("--workdir", default=None,
                   help="server logs and the disk tier's file (default: a temporary folder)")
    p.add_argument("--json", default=None, help="write the report here")
    p.set_defaults(func=cmd_bench_soak)


def cmd_bench_soak(a: argparse.Namespace) -> int:
    from flash_dllm.bench.soak import SoakConfig, run_soak, table

    minutes = a.minutes if a.minutes is not None else (15.0 if a.device == "cpu" else 7.0)
    if minutes <= 0:
        raise ValueError(f"--minutes must be > 0, got {minutes}")
    with tempfile.TemporaryDirectory(prefix="flash-dllm-soak-") as tmp:
        cfg = SoakConfig(minutes=minutes, model=a.model, device=a.device,
                         concurrency=a.concurrency, max_tokens=a.max_tokens,
                         faults=tuple(a.faults), replay=a.replay,
                         workdir=Path(a.workdir or tmp), num_kv_pages=a.num_kv_pages,
                         kv_cpu_gb=a.kv_cpu_gb, kv_disk_gb=a.kv_disk_gb)
        report = run_soak(cfg)
    if write_report(report, a.json):
        print(f"report: {a.json}")
    print(table(report))
    return 0 if report["all_invariants_hold"] else 1
