"""Placement policies side by side (issue 14, CPU-sized): the same multi-turn chat sessions
against an in-process server whose GPU page pool (L0) is too small for every session's history,
once per ``--kv-placement`` and pool size; prefix-cache hit rate, TTFT and wall time.

    python3 benchmarks/placement/placement_cpu.py \
        --out benchmarks/results/placement/placement_cpu.json

Demo model on the CPU, ``cache=flash`` (the mode that measures attention, which ema and kag
learn from), threshold 0.9, 6 users x 4 turns, 32-token answers. The workload is real chat
traffic, not a synthetic trace: which pages come back is decided by which session speaks next.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

POLICIES = ("lru", "ema", "kag")


def run_one(policy: str, pages: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "flash_dllm.cli", "bench", "multiturn",
               "--users", str(args.users), "--turns", str(args.turns), "--cache", "flash",
               "--decode", "threshold", "--threshold", "0.9", "--max-tokens", "32",
               "--num-kv-pages", str(pages), "--kv-placement", policy, "--json", str(out)]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        r = json.loads(out.read_text())
    m = r["server_metrics"]
    return {"policy": policy, "num_kv_pages": pages, "errors": r["errors"],
            "hit_rate": m["prefix_cache_hit_rate"], "query_tokens": m["prefix_cache_query_tokens"],
            "hit_tokens": m["prefix_cache_hit_tokens"], "ttft_p50_s": r["ttft_s"]["p50"],
            "ttft_mean_s": r["ttft_s"]["mean"], "wall_s": r["wall_s"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--pages", type=int, nargs="+", default=[96, 128],
                   help="L0 sizes in pages (the sessions need ~160 for every hit)")
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--repeat", type=int, default=2, help="runs of every case (default 2)")
    a = p.parse_args()
    rows = []
    for run in range(a.repeat):
        for pages in a.pages:
            for policy in POLICIES:
                row = {"run": run, **run_one(policy, pages, a)}
                rows.append(row)
                print(f"run {run} pages {pages:4d} {policy:4s}: hit rate {row['hit_rate']:.3f}  "
                      f"TTFT p50 {row['ttft_p50_s']:.3f} s  wall {row['wall_s']:.1f} s",
                      flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"users": a.users, "turns": a.turns, "rows": rows},
                                      indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
