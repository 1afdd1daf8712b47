"""The weight-only int8 / int4 GEMM (``kernels/quant_gemm``) against bf16 cuBLAS at LLaDA-8B's
projection shapes, and a tile sweep of the skinny (batch-1) case.

    python benchmarks/step/sweep_quant_gemm.py --out sweep_quant_gemm_h100.json [--budget-s 150]

For each projection (fused q/k/v, o, fused gate/up, down) and rows M (32: a batch-1 dual step;
256 / 512 / 2048: bigger batches): bf16 ``F.linear``; the weight-only kernel with its default
tiles; the dequantize-once path (``dequantize_triton`` + ``F.linear``, what ``quant_gemm.op``
takes from ``DEQUANT_MIN_ROWS`` rows); FP8 weights (``fp8_gemm.op``: ``torch._scaled_mm`` with
per-token activation scales). Then, at M = 32, a sweep of BLOCK_N x BLOCK_K x SPLIT_K x
num_warps for each bit width until ``--budget-s`` is spent (each new tile compiles), reporting
the best tiles per shape against the defaults. Times are CUDA-event means over ``--reps``
launches after a warm-up; GB/s is the packed weight bytes (scales included) per second.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flash_dllm.kernels import fp8_gemm, quant_gemm

# LLaDA-8B: (name, N, K) of the fused q/k/v, o, fused gate/up and down projections
SHAPES = [("qkv", 3 * 4096, 4096), ("o", 4096, 4096), ("gate_up", 2 * 12288, 4096),
          ("down", 4096, 12288)]
ROWS = [32, 256, 512, 2048]
SWEEP = {"BLOCK_N": [32, 64, 128], "BLOCK_K": [64, 128], "SPLIT_K": [1, 2, 4, 8],
         "num_warps": [4, 8]}


def timed(fn, reps: int) -> float:
    """Mean microseconds per call (CUDA events), after two warm-up calls."""
    fn()
    fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps * 1e3


def packed_bytes(q: torch.Tensor, s: torch.Tensor) -> int:
    return q.numel() * q.element_size() + s.numel() * s.element_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="seconds for the M = 32 tile sweep (compiles included)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    weights, cases = {}, []
    for name, N, K in SHAPES:
        w = (torch.randn(N, K, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        packs = {bits: quant_gemm.quantize(w, bits, a.group) for bits in (8, 4)}
        f8 = fp8_gemm.quantize_weight(w) if fp8_gemm.supported(dev) else None
        weights[name] = (w, packs, f8)
        for M in ROWS:
            x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
            row = {"shape": name, "M": M, "N": N, "K": K,
                   "bf16_us": timed(lambda: F.linear(x, w), a.reps),
                   "bf16_bytes": w.numel() * 2}
            if f8 is not None:
                row["fp8_us"] = timed(lambda: fp8_gemm.op(x, f8[0], f8[1], None), a.reps)
            for bits, (q, s) in packs.items():
                row[f"int{bits}_bytes"] = packed_bytes(q, s)
                row[f"int{bits}_default_config"] = quant_gemm.default_config(
                    M, N, K, a.group, quant_gemm._num_sms(dev))
                row[f"int{bits}_kernel_us"] = timed(
                    lambda: quant_gemm.weight_only_triton(x, q, s, None, bits), a.reps)
                row[f"int{bits}_dequant_gemm_us"] = timed(
                    lambda: F.linear(x, quant_gemm.dequantize_triton(q, s, bits, x.dtype)),
                    a.reps)
            cases.append(row)
            print(f"{name:8s} M={M:5d}: bf16 {row['bf16_us']:8.1f} us"
                  + (f"  fp8 {row['fp8_us']:8.1f}" if "fp8_us" in row else "")
                  + "".join(f"  int{b} kernel {row[f'int{b}_kernel_us']:8.1f} / dequant+gemm "
                            f"{row[f'int{b}_dequant_gemm_us']:8.1f}" for b in (8, 4)),
                  flush=True)
    # the skinny case's tiles, until the budget is spent
    sweep, t0, stopped = [], time.monotonic(), False
    grid = list(itertools.product(*SWEEP.values()))
    for bits in (8, 4):
        for combo in grid:
            if time.monotonic() - t0 > a.budget_s:
                stopped = True
                break
            cfg = dict(zip(SWEEP, combo), BLOCK_M=32, num_stages=3)
            for name, N, K in SHAPES:
                q, s = weights[name][1][bits]
                x = torch.randn(32, K, device=dev, generator=g).to(torch.bfloat16)
                try:
                    us = timed(lambda: quant_gemm.weight_only_triton(x, q, s, None, bits, cfg),
                               a.reps)
                except Exception as e:                 # a tile that does not compile / fit
                    us = None
                    print(f"int{bits} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                sweep.append({"bits": bits, "shape": name, "config": cfg, "us": us})
    best = {}
    for r in sweep:
        if r["us"] is None:
            continue
        key = f"int{r['bits']}_{r['shape']}"
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    for key, r in sorted(best.items()):
        base = next(c for c in cases if c["shape"] == r["shape"] and c["M"] == 32)
        r["default_us"] = base[f"int{r['bits']}_kernel_us"]
        r["bf16_us"] = base["bf16_us"]
        r["GBps"] = base[f"int{r['bits']}_bytes"] / r["us"] / 1e3
        print(f"best {key}: {r['us']:.1f} us ({r['GBps']:.0f} GB/s) {r['config']}; default "
              f"{r['default_us']:.1f} us; bf16 {r['bf16_us']:.1f} us", flush=True)
    report = {"device_name": torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "group": a.group, "reps": a.reps, "dequant_min_rows": quant_gemm.DEQUANT_MIN_ROWS,
              "cases": cases, "sweep_budget_s": a.budget_s, "sweep_stopped_early": stopped,
              "sweep_points": len(sweep), "best_at_32_rows": best, "sweep": sweep}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
