"""How the float32 paged attention kernel multiplies (issue 21): time and error of
``paged_attention_triton`` on float32 inputs for each ``tl.dot`` precision and key tile, against
the float64 PyTorch reference. LLaDA-8B heads (32 x 128), page size 16, scattered pages.

    python benchmarks/step/paged_attention_fp32.py \
        --out benchmarks/results/step/paged_attention_fp32_precision_h200.json

"ieee" (fp32 products on the CUDA cores) was the default until 2026-12-02; "tf32x3" (three
tensor-core products of split TF32 operands) is the default now; "tf32" is one product.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import paged_reference as paged  # noqa: E402 - tests/paged_reference.py: layout helpers
from flash_dllm.kernels import paged_attention as pa  # noqa: E402

CASES = [(1, 32, 1024), (32, 32, 1024), (32, 128, 256)]          # (requests, queries, keys)
VARIANTS = [("ieee", 64, 4), ("tf32x3", 64, 4), ("ieee", 32, 4), ("tf32", 64, 4)]


def main() -> int:
    from triton.testing import do_bench

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dev, H, Hkv, D, S = "cuda", 32, 32, 128, 16
    rows, default = [], pa.FP32_PRECISION
    for B, qn, L in CASES:
        need = paged.pages_needed(L, S)
        g = torch.Generator(device="cpu").manual_seed(0)
        perm = torch.randperm(B * need, generator=g).tolist()
        table = paged.block_table([perm[i * need:(i + 1) * need] for i in range(B)], dev)
        cache = torch.randn((1, 2, B * need, S, Hkv, D), generator=g).to(dev)
        kc, vc = paged.layer_kv(cache, 0)
        q = torch.randn((B * qn, H, D), generator=g).to(dev)
        cu = torch.arange(0, B * qn + 1, qn, dtype=torch.int32, device=dev)
        lens = torch.full((B,), L, dtype=torch.int32, device=dev)
        args = (q, kc, vc, cu, lens, table)
        ref = pa.paged_attention_reference(*[t.double() if t.is_floating_point() else t
                                             for t in args]).float()
        try:
            for prec, bn, nw in VARIANTS:
                pa.FP32_PRECISION = prec
                got = pa.paged_attention_triton(*args, qn, block_n=bn, num_warps=nw)
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                ms = do_bench(lambda: pa.paged_attention_triton(*args, qn, block_n=bn,
                                                                num_warps=nw), warmup=5, rep=30)
                row = dict(B=B, q=qn, L=L, prec=prec, block_n=bn, num_warps=nw, ms=ms,
                           rel_err=err)
                print(row, flush=True)
                rows.append(row)
        finally:
            pa.FP32_PRECISION = default     # the module's setting, whatever happened
    Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
