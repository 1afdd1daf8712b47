"""Queue-ahead prefetch on and off, multi-turn chat on the CPU with a disk tier.

    python3 benchmarks/kv-tiers/prefetch_cpu.py \
        --out benchmarks/results/kv-tiers/prefetch_multiturn_cpu.json

Runs ``flash-dllm bench multiturn`` (demo model, 8 users x 4 turns, 2 running slots, so turns
wait for admission; a small GPU-side pool, a small host tier and a disk tier, so histories go to
disk between turns) with ``--kv-prefetch`` and ``--no-kv-prefetch``, alternating, ``--runs``
times each, for each host-tier size of ``--kv-cpu-gb``. Records, per run, the prefetch outcomes,
prefix-cache hit tokens per tier, TTFT and throughput; and the medians per setting. The
multi-turn runs go through the HTTP server, so the order in which turns reach the engine, hence
what is cached where, differs from run to run: compare medians.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKLOAD = ["--users", "8", "--turns", "4", "--history-tokens", "96", "--max-num-seqs", "2",
            "--num-kv-pages", "40", "--kv-disk-gb", "0.05", "--max-tokens", "32",
            "--block-length", "32", "--cache", "dual", "--decode", "threshold"]


def one_run(prefetch: bool, cpu_gb: float, tmp: Path) -> dict:
    disk, out = tmp / "kv.bin", tmp / "report.json"
    disk.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "flash_dllm.cli", "bench", "multiturn", *WORKLOAD,
           "--kv-cpu-gb", str(cpu_gb), "--kv-disk-path", str(disk), "--json", str(out),
           "--kv-prefetch" if prefetch else "--no-kv-prefetch"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    rep = json.loads(out.read_text())
    sm = rep["server_metrics"]
    return {"prefetch": prefetch, "kv_cpu_gb": cpu_gb, "ok": rep["ok"],
            "prefetch_pages": sm["kv_prefetch_pages"], "hit_tokens": sm["prefix_cache_hit_tokens"],
            "ttft_p50_s": rep["ttft_s"]["p50"], "ttft_mean_s": rep["ttft_s"]["mean"],
            "throughput_rps": rep["throughput_rps"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--kv-cpu-gb", type=float, nargs="+", default=[0.006, 0.012])
    a = p.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as d:
        for cpu in a.kv_cpu_gb:
            for _ in range(a.runs):
                for on in (True, False):
                    runs.append(one_run(on, cpu, Path(d)))
                    print(json.dumps(runs[-1]), file=sys.stderr)
    med = lambda xs: round(statistics.median(xs), 4)   # noqa: E731
    summary = []
    for cpu in a.kv_cpu_gb:
        for on in (True, False):
            rs = [r for r in runs if r["kv_cpu_gb"] == cpu and r["prefetch"] == on]
            summary.append({
                "kv_cpu_gb": cpu, "prefetch": on, "runs": len(rs),
                "ttft_p50_s": med([r["ttft_p50_s"] for r in rs]),
                "ttft_mean_s": med([r["ttft_mean_s"] for r in rs]),
                "throughput_rps": med([r["throughput_rps"] for r in rs]),
                "hit_tokens_l1": med([r["hit_tokens"]["l1"] for r in rs]),
                "hit_tokens_l2": med([r["hit_tokens"]["l2"] for r in rs]),
                "prefetch_issued": sum(r["prefetch_pages"].get("issued", 0) for r in rs),
                "prefetch_on_time": sum(r["prefetch_pages"].get("on_time", 0) for r in rs),
                "prefetch_late": sum(r["prefetch_pages"].get("late", 0) for r in rs),
                "prefetch_useless": sum(r["prefetch_pages"].get("useless", 0) for r in rs)})
    report = {"workload": WORKLOAD, "summary": summary, "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    for row in summary:
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
