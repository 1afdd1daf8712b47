"""Skinny GEMM study: how fast can a 32/64-row linear layer of LLaDA-8B stream its weights?

For each linear shape of one LLaDA-8B layer (fused qkv, o, fused gate_up, down) and the LM head,
at M rows, times (CUDA events, ``triton.testing.do_bench``, L2 flushed between runs):
- ``cublas``: ``F.linear(x, W)`` (what the engine runs today);
- ``cublas_t``: ``(W @ x.T).T`` (cuBLAS sees N = M, a different heuristic);
- ``tunableop``: ``F.linear`` with PyTorch TunableOp choosing among cuBLASLt algorithms (if available);
- ``triton``: ``benchmarks/studies/skinny_gemm.py`` over a sweep of tile configs (best reported).
GB/s counts the weight bytes only (x and y are < 1 % at these shapes); the copy bandwidth measured
the same way is the roofline. Writes a JSON report and prints a table.

    python benchmarks/step/bench_gemm.py --out out/gemm_h200.json [--rows 32 64] [--quick]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "studies"))

import skinny_gemm  # noqa: E402 - benchmarks/studies/skinny_gemm.py

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288), "lm_head": (126464, 4096)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    import triton
    from triton.testing import do_bench
    dev = torch.device("cuda")
    torch.manual_seed(0)
    t0 = time.time()
    # copy roofline: a 1 GiB device-to-device copy
    a = torch.empty(1 << 29, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), rep=200)
    copy_gbs = 2 * a.numel() * 2 / ms / 1e6
    del a, b
    print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    if args.quick:
        grid = [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=4, num_stages=st)
                for bn, bk, sk, st in itertools.product((32, 64), (128,), (1, 2), (4,))]
    else:
        grid = [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=w, num_stages=st)
                for bn, bk, sk, w, st in itertools.product((32, 64), (128, 256), (1, 2, 4), (4, 8),
                                                           (3, 5))]
    rows = []
    for M in args.rows:
        for name, (N, K) in SHAPES.items():
            W = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x, W).float()
            wbytes = N * K * 2
            res = {"M": M, "name": name, "N": N, "K": K, "weight_mb": wbytes / 1e6}
            res["cublas_ms"] = do_bench(lambda: F.linear(x, W), rep=50)
            res["cublas_t_ms"] = do_bench(lambda: (W @ x.T).T, rep=50)
            try:
                torch.cuda.tunable.enable(True)
                torch.cuda.tunable.tuning_enable(True)
                F.linear(x, W)
                torch.cuda.synchronize()
                torch.cuda.tunable.tuning_enable(False)
                res["tunableop_ms"] = do_bench(lambda: F.linear(x, W), rep=50)
            except Exception as e:  # noqa: BLE001 - report, do not stop the study
                res["tunableop_error"] = repr(e)[:200]
            finally:
                try:
                    torch.cuda.tunable.enable(False)
                except Exception:  # noqa: BLE001
                    pass
            best = None
            for cfg in grid:
                if cfg["BLOCK_N"] >= N:
                    continue
                try:
                    y = skinny_gemm.skinny_gemm(x, W, cfg)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    if err > 2e-2:
                        continue
                    t = do_bench(lambda: skinny_gemm.skinny_gemm(x, W, cfg), rep=30)
                except Exception as e:  # noqa: BLE001 - some tiles do not fit in shared memory
                    print("  skip", cfg, repr(e)[:80])
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg, err)
            t = do_bench(lambda: skinny_gemm.skinny_gemm(x, W), rep=50)
            res["triton_default_ms"] = t
            res["triton_default_cfg"] = skinny_gemm.default_config(M, N, K)
            if best:
                res["triton_best_ms"], res["triton_best_cfg"], res["triton_err"] = best
            for k in [k for k in res if k.endswith("_ms")]:
                res[k.replace("_ms", "_gbs")] = wbytes / res[k] / 1e6
            rows.append(res)
            print(json.dumps(res), flush=True)
            del W, x
    # one layer (qkv + o + gate_up + down) x 32 + lm head, per method
    summary = {}
    for M in args.rows:
        for meth in ("cublas", "cublas_t", "tunableop", "triton_best", "triton_default"):
            key = meth + "_ms"
            rs = [r for r in rows if r["M"] == M]
            if not all(key in r for r in rs):
                continue
            layer = sum(r[key] for r in rs if r["name"] != "lm_head")
            summary[f"M{M}_{meth}_model_ms"] = 32 * layer + next(r[key] for r in rs
                                                               if r["name"] == "lm_head")
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "copy_gbs": copy_gbs, "rows": rows,
           "summary": summary, "seconds": time.time() - t0}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
