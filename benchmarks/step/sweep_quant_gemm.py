"""The weight-only int8 / int4 / fp8 GEMM (``kernels/quant_gemm``) against bf16 cuBLAS at LLaDA-8B's
projection shapes, timed inside CUDA graphs, and a tile sweep whose winners can be written as the
device's tuned config (``kernels/configs/quant_gemm/<device>.json``).

    python benchmarks/step/sweep_quant_gemm.py --out sweep_quant_gemm_h100.json \
        [--budget-s 240] [--write-config DIR]

1. For each projection (fused q/k/v, o, fused gate/up, down) and rows M (``--rows``): bf16
   ``F.linear``; the weight-only kernel with its current tiles (a tuned file's when one is found,
   else ``default_config``); the dequantize-once path (``dequantize_triton`` + ``F.linear``, what
   ``quant_gemm.op`` takes from ``DEQUANT_MIN_ROWS`` rows); FP8 weights both ways: their e4m3
   codes in the weight-only kernel (``fp8_kernel_us``: the fused MoE's fp8 experts' read; the
   dense layers' small calls run ``fp8_skinny`` now, timed by ``study_fp8_skinny.py``) and x
   quantized per token on FP8 tensor cores (``fp8_w8a8_us``: ``fp8_scaled_mm``).
2. The sweep, for each code (int8, fp8, int4): every tile of ``GRID`` at the first row bucket (each new tile
   compiles once; N and K are runtime arguments, so the four shapes share it), then the best
   ``--keep`` tiles of that bucket at every other bucket below ``DEQUANT_MIN_ROWS``, until
   ``--budget-s`` is spent. int4 sweeps its default nibble read (``INT4_READ``).
3. ``--write-config DIR``: the best tiles per (shape, bucket) as ``DIR/quant_gemm/<device>.json``
   (``FLASH_DLLM_KERNEL_CONFIGS=DIR`` makes the engine use them before they are committed).

Every time is the mean per launch of ``--reps`` launches captured in one CUDA graph and replayed
(no launch or Python cost: what a step's graph pays); GB/s is the packed weight bytes (scales
included) per second. The first version of this script timed eager launches: its split-K and
fp8 figures carried their extra kernels' launch costs (findings/quantization.md).
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flash_dllm.kernels import fp8_gemm, quant_gemm, tuned_configs

# LLaDA-8B: (name, N, K) of the fused q/k/v, o, fused gate/up and down projections
SHAPES = [("qkv", 3 * 4096, 4096), ("o", 4096, 4096), ("gate_up", 2 * 12288, 4096),
          ("down", 4096, 12288)]
ROWS = [32, 64, 128, 256, 2048]
# (the first key varies slowest: tiles without a K split first, the budget may stop the grid)
GRID = {"SPLIT_K": [1, 2, 4, 8], "BLOCK_K": [64, 128], "BLOCK_N": [32, 64, 128],
        "num_warps": [4], "num_stages": [3],     # (8 warps never won a bucket on the H100)
        "SWAP": [0, 1]}                          # (the transposed dots: W @ x^T)


def graph_time(fn, reps: int, replays: int = 3, indexed: bool = False) -> float:
    """Mean microseconds per call of ``fn``, ``reps`` calls captured in one CUDA graph and the
    graph replayed ``replays`` times. ``indexed``: ``fn(i)`` gets the call's index (cycling
    through buffers), else ``fn()``. The other step studies time with this too."""
    call = fn if indexed else (lambda i: fn())
    call(0)                                            # compile / warm up outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call(1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            call(i)
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / (replays * reps) * 1e3


def packed_bytes(q: torch.Tensor, s: torch.Tensor) -> int:
    return q.numel() * q.element_size() + s.numel() * s.element_size()


def block_m(M: int) -> int:
    return min(64, max(16, 1 << max(0, (M - 1).bit_length())))


CODES = ("int8", "fp8", "int4")          # what the packed weights hold (quant_gemm.code_name)
SHARE = {"int8": 0.25, "fp8": 0.25, "int4": 0.5}     # of the sweep's budget (int4: 3 reads)
CODE_BITS = {"int8": 8, "fp8": 8, "int4": 4}          # fp8: one scale per row (its group is K)


def tiles(code: str, grid: dict | None = None) -> list[dict]:
    grid = grid or GRID
    out = [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]
    if code == "int4":        # the default nibble read only (the others have no bit-recipe
        out = [{"JOIN": quant_gemm.INT4_READ, **t} for t in out]    # decoder: the baseline
    return out                                                      # table times them)


def baseline(weights, rows, reps, group, dev) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(1)
    cases = []
    for name, N, K in SHAPES:
        w, packs, f8 = weights[name]
        for M in rows:
            x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
            row = {"shape": name, "M": M, "N": N, "K": K, "bf16_bytes": w.numel() * 2,
                   "bf16_us": graph_time(lambda: F.linear(x, w), reps)}
            if f8 is not None:                 # activations quantized too: FP8 tensor cores
                row["fp8_w8a8_us"] = graph_time(
                    lambda: fp8_gemm.fp8_scaled_mm(x, f8[0], f8[1], None), reps)
            for code, (q, s, bits) in packs.items():
                cfg = (quant_gemm.tuned_config(M, N, K, K // s.shape[1], bits, dev, code)
                       or quant_gemm.default_config(M, N, K, K // s.shape[1],
                                                    quant_gemm._num_sms(dev)))
                row[f"{code}_bytes"] = packed_bytes(q, s)
                row[f"{code}_config"] = cfg
                row[f"{code}_kernel_us"] = graph_time(
                    lambda: quant_gemm.weight_only_triton(x, q, s, None, bits, cfg), reps)
                row[f"{code}_swap_kernel_us"] = graph_time(
                    lambda: quant_gemm.weight_only_triton(x, q, s, None, bits,
                                                          {**cfg, "SWAP": 1 - cfg.get("SWAP", 0)}),
                    reps)
                for j in ((0, 1, 2) if code == "int4" else ()):   # every nibble read, same tiles
                    row[f"int4_read{j}_kernel_us"] = graph_time(
                        lambda: quant_gemm.weight_only_triton(x, q, s, None, bits,
                                                              {**cfg, "JOIN": j}), reps)
                if code != "fp8":
                    row[f"{code}_dequant_gemm_us"] = graph_time(
                        lambda: F.linear(x, quant_gemm.dequantize_triton(q, s, bits, x.dtype)),
                        reps)
            cases.append(row)
            print(f"{name:8s} M={M:5d}: bf16 {row['bf16_us']:7.1f} us"
                  + (f"  fp8 w8a8 {row['fp8_w8a8_us']:7.1f}" if "fp8_w8a8_us" in row else "")
                  + "".join(f"  {c} {row[f'{c}_kernel_us']:7.1f} (swapped "
                            f"{row[f'{c}_swap_kernel_us']:.1f})" for c in packs)
                  + "".join(f"  {c} dequant+gemm {row[f'{c}_dequant_gemm_us']:7.1f}"
                            for c in packs if c != "fp8"), flush=True)
    return cases


def time_tile(weights, code, M, cfg, reps, dev) -> dict[str, float | None]:
    """Microseconds per shape for one tile (None where it fails to compile or launch)."""
    out = {}
    for name, N, K in SHAPES:
        q, s, bits = weights[name][1][code]
        x = torch.randn(M, K, device=dev).to(torch.bfloat16)
        try:
            out[name] = graph_time(
                lambda: quant_gemm.weight_only_triton(x, q, s, None, bits, cfg), reps)
        except Exception as e:                     # a tile that does not compile or fit
            out[name] = None
            print(f"{code} M={M} {cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
    return out


def sweep(weights, buckets, reps, budget_s, keep, dev, codes=CODES, grid: dict | None = None
          ) -> tuple[list[dict], bool]:
    """``SHARE`` of the budget per code (int4's grid is three times the others': its ``JOIN``
    reads); the codes the weights hold (fp8 only on a card with FP8)."""
    points, stopped = [], False
    codes = [c for c in codes if c in weights[SHAPES[0][0]][1]]
    for code in codes:
        t0, first, rest = time.monotonic(), buckets[0], buckets[1:]
        budget = budget_s * SHARE[code] / sum(SHARE[c] for c in codes)
        scored = []
        for tile in tiles(code, grid):
            if time.monotonic() - t0 > budget * 0.7:          # leave time for the buckets
                stopped = True
                break
            cfg = {**tile, "BLOCK_M": block_m(first)}
            us = time_tile(weights, code, first, cfg, reps, dev)
            points.append({"code": code, "M": first, "config": cfg, "us": us})
            if all(v is not None for v in us.values()):
                scored.append((sum(us.values()), tile))
        best = [t for _, t in sorted(scored, key=lambda p: p[0])[:keep]]
        for M in rest:
            for tile in best:
                if time.monotonic() - t0 > budget:
                    stopped = True
                    break
                for bm in sorted({block_m(M), 64} if M > 64 else {block_m(M)}):
                    cfg = {**tile, "BLOCK_M": bm}
                    points.append({"code": code, "M": M, "config": cfg,
                                   "us": time_tile(weights, code, M, cfg, reps, dev)})
    return points, stopped


def winners(points, group) -> dict:
    """configs[key][M] = the fastest tile measured for that shape and bucket."""
    best: dict[tuple, tuple[float, dict]] = {}
    for p in points:
        for name, us in p["us"].items():
            if us is None:
                continue
            k = (p["code"], name, p["M"])
            if k not in best or us < best[k][0]:
                best[k] = (us, p["config"])
    configs: dict[str, dict[str, dict]] = {}
    for (code, name, M), (us, cfg) in best.items():
        N, K = next((n, k) for s, n, k in SHAPES if s == name)
        key = quant_gemm.problem_key(CODE_BITS[code], N, K, K if code == "fp8" else group, code)
        configs.setdefault(key, {})[str(M)] = cfg
    return configs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS,
                    help="rows of the baseline table")
    ap.add_argument("--buckets", type=int, nargs="+", default=[32, 1, 8, 64, 128, 256],
                    help="row buckets of the sweep (the first: the full grid)")
    ap.add_argument("--keep", type=int, default=6, help="tiles carried to the other buckets")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="seconds for the sweep (compiles included)")
    ap.add_argument("--codes", nargs="+", choices=CODES, default=list(CODES),
                    help="the codes to sweep (the baseline table times them all)")
    ap.add_argument("--grid", type=json.loads, metavar="JSON",
                    help='tile values to sweep instead of GRID, e.g. \'{"SPLIT_K": [2, 4], '
                         '"BLOCK_K": [128], "BLOCK_N": [64], "SWAP": [0, 1]}\'')
    ap.add_argument("--write-config", metavar="DIR",
                    help="write the winners as DIR/quant_gemm/<device>.json")
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    weights = {}
    for name, N, K in SHAPES:
        w = (torch.randn(N, K, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        packs = {code: (*quant_gemm.quantize(w, CODE_BITS[code], a.group), CODE_BITS[code])
                 for code in ("int8", "int4")}
        f8 = fp8_gemm.quantize_weight(w) if fp8_gemm.supported(dev) else None
        if f8 is not None:               # e4m3 codes, one scale per row (fp8 MoE experts' read)
            packs["fp8"] = (f8[0], f8[1].view(-1, 1), 8)
        weights[name] = (w, packs, f8)
    cases = baseline(weights, a.rows, a.reps, a.group, dev)
    points, stopped = sweep(weights, a.buckets, a.reps, a.budget_s, a.keep, dev, a.codes,
                            a.grid)
    configs = winners(points, a.group)
    name = torch.cuda.get_device_name(dev)
    for key, rows in sorted(configs.items()):
        print(key, {m: rows[m] for m in sorted(rows, key=int)}, flush=True)
    report = {"device_name": name, "torch": torch.__version__, "group": a.group,
              "reps": a.reps, "timing": "mean per launch inside one CUDA graph",
              "dequant_min_rows": quant_gemm.DEQUANT_MIN_ROWS, "cases": cases,
              "sweep_budget_s": a.budget_s, "sweep_stopped_early": stopped,
              "sweep_points": len(points), "winners": configs, "sweep": points}
    save(report, a.out, a.write_config, "quant_gemm", name, configs,
         "benchmarks/step/sweep_quant_gemm.py (timed in CUDA graphs)")


def save(report: dict, out: str, config_dir: str | None, kernel: str, device_name: str,
         configs: dict, source: str) -> None:
    """A sweep's report as JSON at ``out``; with ``config_dir`` its winners as the kernel's
    tuned-config file for the device there (``FLASH_DLLM_KERNEL_CONFIGS=config_dir``)."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2))
    if config_dir:
        path = tuned_configs.config_path(kernel, device_name, config_dir)
        tuned_configs.write(path, kernel, device_name, configs, source)
        print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
