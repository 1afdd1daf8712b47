"""Tile sweep for the fused QKV + RoPE + page-write kernel (``kernels/qkv_rope_cache.py``).

Times a model's worth of layers back to back (one distinct weight per layer, so nothing is served
from L2, as in a real step), replayed from a CUDA graph: the fused kernel at each config, against
cuBLAS ``F.linear`` + ``rope_cache`` (what the model runs without it). Median of 5 replays.

    python benchmarks/step/sweep_qkv_rope.py --out sweep.json [--rows 32] \
        [--shape llada-8b dream-7b]
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flash_dllm.kernels import qkv_rope_cache, rope_cache  # noqa: E402

SHAPES = {"llada-8b": dict(d=4096, H=32, Hkv=32, layers=32, fp32=True),
          "dream-7b": dict(d=3584, H=28, Hkv=4, layers=28, fp32=False)}


def timed(fn, reps: int = 5) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph (as the engine runs a step: no launch
    overhead; eager launches of these ~30 us kernels would time the host instead)."""
    fn()                                                   # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[32])
    ap.add_argument("--shape", nargs="+", default=list(SHAPES))
    a = ap.parse_args()
    dev, bf = torch.device("cuda"), torch.bfloat16
    report = []
    for name in a.shape:
        s = SHAPES[name]
        D, H, Hkv, L = 128, s["H"], s["Hkv"], s["layers"]
        N = (H + 2 * Hkv) * D
        ws = [torch.randn(N, s["d"], device=dev, dtype=bf) * 0.02 for _ in range(L)]
        bias = torch.zeros(N, device=dev, dtype=bf) if name == "dream-7b" else None
        kc = torch.zeros(4096, 16, Hkv, D, device=dev, dtype=bf)
        vc = torch.zeros_like(kc)
        inv = rope_cache.inv_freq(D, 1e6, dev)
        for T in a.rows:
            x = torch.randn(T, s["d"], device=dev, dtype=bf)
            pos = torch.arange(T, device=dev) + 500
            slots = torch.randperm(4096 * 16, device=dev)[:T]

            def unfused():
                for w in ws:
                    q, k, v = rope_cache.split_qkv(F.linear(x, w, bias), H, Hkv, D)
                    rope_cache.op(q, k, v, pos, kc, vc, slots, inv, s["fp32"])
            base = timed(unfused)
            row = {"shape": name, "rows": T, "weight_MB": N * s["d"] * 2 / 1e6,
                   "cublas_plus_rope_ms": base, "configs": []}
            print(f"{name} T={T}: cuBLAS + rope_cache {base:.3f} ms for {L} layers", flush=True)
            for bc, bk, w, st in itertools.product((16, 32), (128, 256), (4, 8), (3, 4, 6)):
                cfg = dict(BLOCK_C=bc, BLOCK_K=bk, num_warps=w, num_stages=st)

                def fused():
                    for wt in ws:
                        qkv_rope_cache.qkv_rope_cache_triton(x, wt, bias, pos, kc, vc, slots, inv,
                                                             H, Hkv, s["fp32"], config=cfg)
                try:
                    ms = timed(fused)
                except Exception as e:                          # noqa: BLE001 (out of resources)
                    row["configs"].append({**cfg, "error": str(e)[:120]})
                    continue
                row["configs"].append({**cfg, "ms": ms})
            ok = [c for c in row["configs"] if "ms" in c]
            best = min(ok, key=lambda c: c["ms"])
            row["best"] = best
            row["default"] = qkv_rope_cache.default_config(T, N, s["d"], D)
            dflt = [c for c in ok if all(c[k] == row["default"][k] for k in
                                         ("BLOCK_C", "BLOCK_K", "num_warps", "num_stages"))]
            row["default_ms"] = dflt[0]["ms"] if dflt else None
            print(f"  best {best}  default {row['default_ms']}", flush=True)
            report.append(row)
        del ws
        torch.cuda.empty_cache()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
