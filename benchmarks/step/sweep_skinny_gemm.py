"""The skinny bf16 GEMM (``kernels/skinny_gemm``) against cuBLAS at few rows, weights read from
HBM, and the tuned config that turns it on where it wins.

    python benchmarks/step/sweep_skinny_gemm.py --out sweep_skinny_gemm_h100.json \
        [--write-config DIR] [--budget-s 150]

For each model shape's four projections (fused q/k/v, o, fused gate/up with SwiGLU's activation
in the same launch, down) and each row bucket (``--rows``): cuBLAS ``F.linear`` (gate/up: plus
``silu_mul``, the pair it replaces) and the kernel's tiles (the whole ``GRID`` at the first
bucket, the best ``--keep`` at the others), every time the mean per launch of launches captured
in one CUDA graph that cycle through enough copies of the weight (>= ``--stream-mb`` in all) that
each launch reads its weight from HBM, as a step does (one copy replayed stays in the 50 MB L2
and flatters small weights). ``--write-config DIR``: per (shape, bucket) the best tiles where
they beat cuBLAS by ``--margin``, else an empty entry (cuBLAS), as
``DIR/skinny_gemm/<device>.json`` (``FLASH_DLLM_KERNEL_CONFIGS=DIR`` uses it uncommitted).
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from sweep_quant_gemm import graph_time, save  # noqa: E402  (the same timing and report)

from flash_dllm.kernels import silu_mul, skinny_gemm  # noqa: E402

# (model, projection, N (output width; gate/up: the intermediate size), K, silu)
SHAPES = {
    "sdar-4b": [("qkv", 6144, 2560, False), ("o", 2560, 4096, False),
                ("gate_up", 9728, 2560, True), ("down", 2560, 9728, False)],
    "llada-8b": [("qkv", 12288, 4096, False), ("o", 4096, 4096, False),
                 ("gate_up", 12288, 4096, True), ("down", 4096, 12288, False)],
}
GRID = {"SPLIT_K": [1, 2, 4, 8], "BLOCK_K": [128, 256], "BLOCK_N": [16, 32, 64],
        "num_stages": [3, 4, 5], "num_warps": [4]}   # (BLOCK_N 128 never won on an H100)


def copies(nbytes: int, stream_mb: float) -> int:
    return max(2, -(-int(stream_mb * 2 ** 20) // nbytes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--keep", type=int, default=4)
    ap.add_argument("--stream-mb", type=float, default=400.0)
    ap.add_argument("--margin", type=float, default=0.03,
                    help="the kernel must beat cuBLAS by this fraction to be turned on")
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--write-config", metavar="DIR")
    a = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    t_end = time.monotonic() + a.budget_s
    tiles = [dict(zip(GRID, c)) for c in itertools.product(*GRID.values())]
    cases, configs, stopped = [], {}, False
    for model in a.models:
        for name, N, K, silu in SHAPES[model]:
            rows_w = 2 * N if silu else N
            n = copies(rows_w * K * 2, a.stream_mb)
            ws = [torch.randn(rows_w, K, device=dev, dtype=dt) * 0.02 for _ in range(n)]
            best_tiles = tiles
            for bucket, M in enumerate(a.rows):
                x = torch.randn(M, K, device=dev, dtype=dt)
                if silu:
                    def base(w):
                        return silu_mul.op(F.linear(x, w))
                else:
                    def base(w):
                        return F.linear(x, w)
                cublas = graph_time(lambda: [base(w) for w in ws], 2) / n
                scored = []
                for t in best_tiles:
                    if time.monotonic() > t_end:
                        stopped = True
                        break
                    cfg = {**t, "BLOCK_M": 16 if M <= 16 else 32}
                    try:
                        got = skinny_gemm.skinny_triton(x, ws[0], None, silu, cfg)
                        err = (got.float() - base(ws[0]).float()).abs().max().item()
                        us = graph_time(lambda: [skinny_gemm.skinny_triton(x, w, None, silu, cfg)
                                                 for w in ws], 2) / n
                    except Exception as e:                  # a tile that does not compile
                        print(f"{model} {name} M={M} {cfg}: {type(e).__name__}: "
                              f"{str(e)[:100]}", flush=True)
                        continue
                    scored.append((us, cfg, err))
                scored.sort(key=lambda p: p[0])
                if bucket == 0:
                    best_tiles = [{k: v for k, v in c.items() if k != "BLOCK_M"}
                                  for _, c, _ in scored[:a.keep]]
                win = scored[0] if scored else None
                on = win is not None and win[0] < (1 - a.margin) * cublas
                key = skinny_gemm.problem_key(N, K, silu)
                configs.setdefault(key, {})[str(M)] = win[1] if on else {}
                mb = rows_w * K * 2 / 1e6
                row = {"model": model, "shape": name, "M": M, "N": N, "K": K, "silu": silu,
                       "weight_MB": mb, "copies": n, "cublas_us": cublas,
                       "cublas_GBps": mb / cublas * 1e3, "tiles_timed": len(scored),
                       "kernel_us": win and win[0], "kernel_GBps": win and mb / win[0] * 1e3,
                       "kernel_config": win and win[1], "max_abs_err": win and win[2],
                       "turned_on": on}
                cases.append(row)
                print(f"{model:8s} {name:7s} M={M:3d}: cuBLAS {cublas:7.1f} us "
                      f"({row['cublas_GBps']:5.0f} GB/s)  kernel "
                      + (f"{win[0]:7.1f} us ({row['kernel_GBps']:5.0f} GB/s) {win[1]}"
                         if win else "-") + ("  ON" if on else ""), flush=True)
            del ws
    name = torch.cuda.get_device_name(dev)
    report = {"device_name": name, "torch": torch.__version__,
              "timing": "mean per launch in one CUDA graph cycling through weight copies",
              "stream_mb": a.stream_mb, "margin": a.margin, "budget_s": a.budget_s,
              "stopped_early": stopped, "cases": cases, "winners": configs}
    save(report, a.out, a.write_config, "skinny_gemm", name, configs,
         "benchmarks/step/sweep_skinny_gemm.py (CUDA graphs, weights from HBM)")


if __name__ == "__main__":
    main()
