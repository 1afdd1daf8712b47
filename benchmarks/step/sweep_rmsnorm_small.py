"""Sweep: the add + RMSNorm kernel's warps at a batch-1 step's few rows, in CUDA graphs.

A batch-1 SDAR-4B step runs 73 of them on 4 rows (2 us each, 0.14 ms of its 4.1 ms:
``profile_sdar4b_b1_h100.json``): latency, not bandwidth. Each graph replays 64 calls cycling
through 8 buffer sets; the report has us per call for each width, rows and ``num_warps``. Usage::

    python3 benchmarks/step/sweep_rmsnorm_small.py --out benchmarks/results/step/sweep_rmsnorm_small_h100.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from flash_dllm.kernels import rmsnorm
from sweep_quant_gemm import graph_time  # (the same timing: benchmarks/step)


def graph_t(fn, iters: int = 64) -> float:
    return graph_time(fn, iters, replays=5, indexed=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    report = {"device_name": torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "rows": []}
    for d, T in ((2560, 4), (4096, 32), (2048, 32)):
        xs = [torch.randn(T, d, device=dev, dtype=torch.bfloat16) for _ in range(8)]
        rs = [torch.randn(T, d, device=dev, dtype=torch.bfloat16) for _ in range(8)]
        w = torch.randn(d, device=dev, dtype=torch.bfloat16)
        want = rmsnorm.rmsnorm_reference(xs[0], w, 1e-6, rs[0])[0]
        for warps in (None, 1, 2, 4, 8, 16):
            out = rmsnorm.rmsnorm_triton(xs[0], w, 1e-6, rs[0], num_warps=warps)[0]
            err = (out.float() - want.float()).abs().max().item()
            t = graph_t(lambda i: rmsnorm.rmsnorm_triton(xs[i % 8], w, 1e-6, rs[i % 8],
                                                          num_warps=warps))
            row = {"d": d, "rows": T, "num_warps": warps or "default", "us": round(t, 3),
                   "max_err": err}
            print(json.dumps(row), flush=True)
            report["rows"].append(row)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
