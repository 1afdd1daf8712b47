"""FP8 weights at few rows: the FP8 x FP8 kernel with in-kernel block-quantized activations
(``kernels/fp8_skinny``, what the engine runs below ``fp8_gemm.W8A8_MIN_ROWS``) against the
W8A16 read of the same e4m3 codes it ran before (``quant_gemm``, the device's tuned tiles) and
bf16 cuBLAS, at LLaDA-8B's projection shapes, timed inside CUDA graphs.

    python benchmarks/step/study_fp8_skinny.py --out study_fp8_skinny_h100.json

Each call reads a different copy of the weights (copies cycled so that no GEMM finds its
weights in L2: a step's layers do not), so the times are HBM reads as in a step. For each shape
and row count: bf16, the engine's W8A16 with its tiles, then ``fp8_skinny`` over ``GRID``, every
tile checked against the reference once. The summary adds the four shapes x 32 layers.
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from flash_dllm.kernels import fp8_gemm, fp8_skinny, quant_gemm, tuned_configs
from sweep_quant_gemm import SHAPES, graph_time

GRID = {"SPLIT_K": [1, 2, 4, 8], "BLOCK_N": [64, 128], "num_stages": [4, 6],
        "num_warps": [4]}        # (8 warps: never won the weight-only kernels)
LAYERS = 32                                   # LLaDA-8B
COPY_MB = 160                                 # weights cycled per shape (L2 is 50 MB)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[32])
    ap.add_argument("--reps", type=int, default=24)
    ap.add_argument("--quick", action="store_true", help="a few tiles only")
    ap.add_argument("--configs-out", default=None,
                    help="also write the best tiles as DIR/fp8_skinny/<device>.json (the "
                         "kernel's tuned-file format, kernels/tuned_configs)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    grid = GRID if not a.quick else {"SPLIT_K": [1, 2, 4, 8], "BLOCK_N": [64, 128],
                                     "num_stages": [4], "num_warps": [4]}
    cases = []
    for name, N, K in SHAPES:
        w = torch.randn(N, K, device=dev, generator=g) * 0.02
        q, s = fp8_gemm.quantize_weight(w)
        wb = w.to(torch.bfloat16)
        copies = max(2, int(COPY_MB * 2 ** 20 // q.numel()))
        qs = [q.clone() for _ in range(copies)]
        wbs = [wb.clone() for _ in range(max(2, copies // 2))]
        for M in a.rows:
            x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
            ref = fp8_skinny.reference(x, q, s, None).float()
            exact = F.linear(x.float(), w)
            row = {"shape": name, "M": M, "N": N, "K": K, "fp8_bytes": q.numel(),
                   "bf16_us": graph_time(lambda i: F.linear(x, wbs[i % len(wbs)]), a.reps,
                                         indexed=True)}
            wq = s.view(-1, 1)
            row["w8a16_us"] = graph_time(
                lambda i: quant_gemm.op(x, qs[i % copies], wq, None, 8), a.reps, indexed=True)
            row["w8a16_rel_err"] = _rel(quant_gemm.op(x, q, wq, None, 8), exact)
            row["w8a8_block_rel_err"] = _rel(ref, exact)
            row["skinny"] = []
            for combo in itertools.product(*grid.values()):
                c = {"BLOCK_M": max(16, min(64, 1 << (M - 1).bit_length())),
                     **dict(zip(grid, combo))}
                try:
                    out = fp8_skinny.fp8_skinny(x, q, s, None, c)
                except Exception as e:            # (a tile the compiler refuses)
                    row["skinny"].append({"config": c, "error": str(e)[:200]})
                    continue
                diff = ((out.float() - ref).norm() / ref.norm()).item()
                us = graph_time(lambda i: fp8_skinny.fp8_skinny(x, qs[i % copies], s, None, c),
                                a.reps, indexed=True)
                row["skinny"].append({"config": c, "us": us, "diff_vs_reference": diff})
            ok = [r for r in row["skinny"] if "us" in r]
            best = min(ok, key=lambda r: r["us"])
            row["skinny_best_us"], row["skinny_best_config"] = best["us"], best["config"]
            row["max_diff_vs_reference"] = max(r["diff_vs_reference"] for r in ok)
            cases.append(row)
            gb = row["fp8_bytes"] / 1e3
            print(f"{name:8s} M={M:3d} bf16 {row['bf16_us']:6.1f}  w8a16 {row['w8a16_us']:6.1f} "
                  f"({gb / row['w8a16_us']:.0f} GB/s)  skinny {best['us']:6.1f} "
                  f"({gb / best['us']:.0f} GB/s) {best['config']}  diff "
                  f"{row['max_diff_vs_reference']:.1e}  err w8a16 {row['w8a16_rel_err']:.3f} "
                  f"w8a8 {row['w8a8_block_rel_err']:.3f}", flush=True)
    summary = {}
    for M in a.rows:
        rs = [r for r in cases if r["M"] == M]
        summary[str(M)] = {k: LAYERS * sum(r[f"{k}_us"] for r in rs) / 1e3
                           for k in ("bf16", "w8a16", "skinny_best")}
        print(f"M={M}: {LAYERS} layers, ms a step: {summary[str(M)]}")
    report = {"device_name": torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "timing": "mean per launch inside one CUDA graph, weights cycled past L2",
              "grid": grid, "cases": cases, "layers": LAYERS, "step_gemm_ms": summary}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2))
    if a.configs_out:
        name = torch.cuda.get_device_name(dev)
        configs: dict = {}
        for r in cases:
            configs.setdefault(fp8_skinny.problem_key(r["N"], r["K"]), {})[str(r["M"])] = \
                r["skinny_best_config"]
        path = tuned_configs.config_path("fp8_skinny", name, a.configs_out)
        tuned_configs.write(path, "fp8_skinny", name, configs,
                            "benchmarks/step/study_fp8_skinny.py")
        print(f"tuned tiles: {path}")


def _rel(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.float() - exact).norm() / exact.norm()).item()


if __name__ == "__main__":
    main()
