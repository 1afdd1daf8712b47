"""Study: the paged attention kernel on fp8 pages against bf16 pages at the batch-64 step's shape.

At batch 64 of the LLaDA-8B dual step (32 queries a request, 32 heads, 1024 keys) attention reads
64 x 1024 keys x 32 heads x 128 x 2 (K, V) values a layer: 1.07 GB on bf16 pages, which the
kernel streams at ~2.7 TB/s (12.6 ms a step, ``profile_kvauto_h100.json``); fp8 pages halve the
bytes, yet took 16.2 ms (``profile_kvfp8_h100.json``). This times ``paged_attention_triton`` on
both pools for a grid of tiles (key tile, warps, stages), and on fp8 pages with fp16 dots
(``f16``: q rounded to fp16, an e4m3 code -> fp16 is one conversion per two codes, against
bf16's two per code), each against the reference, in CUDA graphs. ``--ncu`` instead runs one
variant a few times eagerly (for ``ncu -k regex:_paged_attn``). Usage::

    python3 benchmarks/step/study_attn_fp8.py --out benchmarks/results/step/study_attn_fp8_h100.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from flash_dllm.kernels import kv_quant, paged_attention
from sweep_quant_gemm import graph_time  # (the same timing: benchmarks/step)

D, PS = 128, 16


def pools(B: int, keys: int, H: int, dev):
    pages_per = -(-keys // PS)
    n = B * pages_per
    torch.manual_seed(0)
    k = torch.randn(n, PS, H, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    # fp8 pages: one scale per (page, head), as the pool keeps them (kv_quant's own quantizer)
    ks = k.float().abs().amax(dim=(1, 3)) / kv_quant.FP8_MAX
    vs = v.float().abs().amax(dim=(1, 3)) / kv_quant.FP8_MAX
    k8 = kv_quant.quantize(k, ks[:, None, :].expand(-1, PS, -1))
    v8 = kv_quant.quantize(v, vs[:, None, :].expand(-1, PS, -1))
    bt = torch.randperm(n, device=dev).to(torch.int32).view(B, pages_per)
    return k, v, k8, v8, ks.contiguous(), vs.contiguous(), bt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--keys", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="a small grid")
    ap.add_argument("--ncu", default=None, help="bf16 | fp8 | fp8f16: run that one eagerly")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    B, Tq, H, L = a.batch, a.queries, a.heads, a.keys
    k, v, k8, v8, ks, vs, bt = pools(B, L, H, dev)
    q = torch.randn(B * Tq, H, D, device=dev, dtype=torch.bfloat16)
    cu = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * Tq
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    bound = paged_attention.seqlen_bound(L)
    arms = {"bf16": dict(k_cache=k, v_cache=v),
            "fp8": dict(k_cache=k8, v_cache=v8, k_scale=ks, v_scale=vs),
            "fp8f16": dict(k_cache=k8, v_cache=v8, k_scale=ks, v_scale=vs, f16=True)}

    def call(arm, **kw):
        c = dict(arms[arm])
        kc, vc = c.pop("k_cache"), c.pop("v_cache")
        return paged_attention.paged_attention_triton(q, kc, vc, cu, lens, bt, Tq,
                                                      max_seqlen_k=bound, **c, **kw)

    if a.ncu:
        for _ in range(4):
            call(a.ncu)
        torch.cuda.synchronize()
        return
    want = {"bf16": paged_attention.paged_attention_reference(q, k, v, cu, lens, bt, Tq),
            "fp8": paged_attention.paged_attention_reference(q, k8, v8, cu, lens, bt, Tq,
                                                             k_scale=ks, v_scale=vs)}
    kv_bytes = {"bf16": 2 * B * L * H * D * 2, "fp8": 2 * B * L * H * D}
    report = {"device_name": torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "batch": B, "queries": Tq, "keys": L,
              "heads": H, "head_dim": D, "page_size": PS, "rows": []}
    grid = (((64, 4, 2), (128, 4, 2)) if a.quick else
            ((64, 4, 2), (128, 4, 1), (128, 4, 2), (128, 4, 3), (256, 8, 2), (64, 4, 3),
             (128, 8, 2)))
    best = {}
    for (bn, warps, stages), arm in itertools.product(list(grid), arms):
        kw = dict(block_n=bn, num_warps=warps, num_stages=stages)
        ref = want["bf16" if arm == "bf16" else "fp8"]
        try:
            out = call(arm, **kw)
            err = (out.float() - ref.float()).abs().max().item()
            t = graph_time(lambda: call(arm, **kw), 8, replays=5)
        except Exception as e:                        # (a tile that does not compile / fit)
            print(arm, kw, "failed:", str(e)[:160], flush=True)
            continue
        nbytes = kv_bytes["bf16" if arm == "bf16" else "fp8"]
        row = {"arm": arm, **kw, "us": round(t, 2), "ms_32_layers": round(t * 32 / 1e3, 3),
               "TBps": round(nbytes / t / 1e6, 3), "max_err": err}
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
        if arm not in best or t < best[arm]["us"]:
            best[arm] = row
    report["best"] = best
    print("best", json.dumps(best), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
