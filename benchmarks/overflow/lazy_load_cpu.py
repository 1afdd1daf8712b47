"""Lazy loading for requests larger than the GPU pool (issue 14, CPU-sized): accuracy and bytes
streamed per answer token against the exact overflow path, on the demo model's arith suite.

    python3 benchmarks/overflow/lazy_load_cpu.py \
        --out benchmarks/results/overflow/lazy_load_cpu.json

Every request is made larger than the pool: page size 4, a pool of 9 pages (about a quarter of
a ~141-token canvas), the rest in host memory (``--kv-overflow-gb``). ``--lazy-load-budget F``
then loads only the share F of the host pages that the active block attended to most, at the
steps after each block's measuring step (``--lazy-load-predictor mass``), or those of the
largest attention bounds from the latest step's queries and per-page key summaries (``quest``). Both decode rules: threshold (a block takes ~2
steps, so few steps are lazy) and vanilla (one token per step, most steps lazy). The reference
row without a budget is exact (it equals the all-in-GPU engine token for token).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.entrypoints.llm import LLM
from flash_dllm.evals.runner import run_eval
from flash_dllm.evals.tasks import get_suite


def run_one(budget: float | None, decode: str, n: int, sentinel: float | None = None,
            predictor: str = "mass") -> dict:
    llm = LLM(engine_config=EngineConfig(page_size=4, num_kv_pages=9, kv_overflow_gb=0.01,
                                         lazy_load_budget=budget, lazy_load_sentinel=sentinel,
                                         lazy_load_predictor=predictor))
    params = SamplingParams(max_tokens=64, block_length=32, cache="dual", decode=decode)
    r = run_eval(llm, get_suite("arith"), n, params, progress=False)
    st = llm.engine.runner.overflow.stats
    return {"decode": decode, "lazy_load_budget": budget, "lazy_load_sentinel": sentinel,
            "lazy_load_predictor": predictor,
            "accuracy": r["accuracy"],
            "forwards_per_sample": r.get("forwards_per_sample"), "n": n,
            "overflow_steps": st["steps"], "h2d_bytes": st["h2d_bytes"],
            "d2h_bytes": st["d2h_bytes"], "skipped_pages": st["skipped_pages"],
            "measuring_steps": st["measuring_steps"], "sentinel_checks": st["sentinel_checks"],
            "sentinel_triggers": st["sentinel_triggers"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25, 0.1])
    p.add_argument("--sentinels", type=float, nargs="*", default=[0.5],
                   help="--lazy-load-sentinel values, each run at every budget too")
    p.add_argument("--decode", nargs="+", default=["threshold", "vanilla"])
    p.add_argument("--predictors", nargs="+", default=["mass", "quest"],
                   choices=["mass", "quest"], help="--lazy-load-predictor values")
    a = p.parse_args()
    rows = []
    for decode in a.decode:
        runs = [(None, None, "mass")] + [(b, j, pr) for pr in a.predictors for b in a.budgets
                                         for j in [None, *a.sentinels]]
        for budget, sentinel, predictor in runs:
            row = run_one(budget, decode, a.n, sentinel, predictor)
            ref = next((r for r in rows if r["decode"] == decode
                        and r["lazy_load_budget"] is None), None)
            if ref is not None:
                row["h2d_vs_exact"] = row["h2d_bytes"] / max(ref["h2d_bytes"], 1)
                row["accuracy_change_points"] = 100 * (row["accuracy"] - ref["accuracy"])
            rows.append(row)
            print(f"{decode:9s} {predictor:5s} budget {str(budget):5s} sentinel "
                  f"{str(sentinel):5s}: accuracy "
                  f"{100 * row['accuracy']:5.1f} % h2d {row['h2d_bytes'] / 2**20:8.2f} MiB  "
                  f"skipped pages {row['skipped_pages']}  sentinel "
                  f"{row['sentinel_triggers']}/{row['sentinel_checks']}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"suite": "arith", "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
