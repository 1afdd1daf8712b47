"""Sweep: the paged attention kernel's split and tiles at batch-1 shapes, in CUDA graphs.

A batch-1 step's attention is latency-bound (SDAR-4B block 4: 16 (query, head) rows per kv head,
~1K keys: 9.6 us + 2.4 us of split merge a layer in ``profile_sdar4b_b1_h100.json``, for ~4 MB
of K/V). This times ``paged_attention_triton`` (attention + merge) for each split count, key
tile, warps and stages at SDAR-4B's (4 queries, 32 / 8 heads) and LLaDA-8B's dual batch-1 shape
(32 queries, 32 / 32 heads), each graph cycling through 8 layers' pools so K/V come from HBM.
Usage::

    python3 benchmarks/step/sweep_attention_small.py --out benchmarks/results/step/sweep_attention_small_h100.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from flash_dllm.kernels import paged_attention
from sweep_quant_gemm import graph_time  # (the same timing: benchmarks/step)


def graph_t(fn, iters: int = 32) -> float:
    return graph_time(fn, iters, replays=5, indexed=True)

SHAPES = {"sdar4b_block4": (4, 32, 8), "llada8b_dual": (32, 32, 32)}   # queries, H, Hkv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=768)
    ap.add_argument("--bound", type=int, default=1024)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev, D, ps = torch.device("cuda"), 128, 16
    report = {"device_name": torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "keys": a.keys, "bound": a.bound, "rows": []}
    for name, (Tq, H, Hkv) in SHAPES.items():
        pages = -(-a.bound // ps)
        kcs = [torch.randn(pages, ps, Hkv, D, device=dev, dtype=torch.bfloat16) for _ in range(8)]
        vcs = [torch.randn_like(k) for k in kcs]
        q = torch.randn(Tq, H, D, device=dev, dtype=torch.bfloat16)
        cu = torch.tensor([0, Tq], dtype=torch.int32, device=dev)
        lens = torch.tensor([a.keys], dtype=torch.int32, device=dev)
        bt = torch.randperm(pages, device=dev).to(torch.int32)[None]
        want = paged_attention.paged_attention_reference(q, kcs[0], vcs[0], cu, lens, bt, Tq)
        best = None
        for splits, bn, warps, stages in itertools.product(
                (None, 2, 4, 8), (32, 64, 128), (2, 4), (1, 2)):
            kw = dict(block_n=bn, num_warps=warps, num_stages=stages, num_splits=splits)
            try:
                out = paged_attention.paged_attention_triton(q, kcs[0], vcs[0], cu, lens, bt, Tq,
                                                             max_seqlen_k=a.bound, **kw)
                err = (out.float() - want.float()).abs().max().item()
                t = graph_t(lambda i: paged_attention.paged_attention_triton(
                    q, kcs[i % 8], vcs[i % 8], cu, lens, bt, Tq, max_seqlen_k=a.bound, **kw))
            except Exception as e:                       # (a tile that does not compile)
                print(name, kw, "failed:", str(e)[:120], flush=True)
                continue
            row = {"shape": name, "splits": splits or "auto", "block_n": bn, "num_warps": warps,
                   "num_stages": stages, "us": round(t, 2), "max_err": err}
            report["rows"].append(row)
            if best is None or t < best["us"]:
                best = row
            if splits is None and bn == 64 and warps == 4 and stages == 2:
                print("default", json.dumps(row), flush=True)
        print("best", json.dumps(best), flush=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
