"""The fp8 per-token activation quantization (``fp8_gemm._quant_rows_kernel``, W8A8 from
``DEQUANT_MIN_ROWS`` rows) timed in CUDA graphs at LLaDA-8B's batch-64 GEMM inputs (2048 rows of
4096 and 12288): the row read once (``ONE_PASS``, by warps) against twice; every variant checked
bitwise against ``quantize_rows``. GB/s counts x read once and the codes written.

    python3 benchmarks/step/sweep_quant_rows.py benchmarks/results/step/sweep_quant_rows_h100.json
"""
import json
import sys

import torch

from flash_dllm.kernels import fp8_gemm
from sweep_quant_gemm import graph_time  # (the same timing: benchmarks/step)

dev = torch.device("cuda")


res = []
for K in (4096, 12288):
    x = (torch.randn(2048, K, device=dev) * 3).to(torch.bfloat16)
    qr, sr = fp8_gemm.quantize_rows(x)
    for one_pass, warps in ((False, 4), (True, 4), (True, 8), (True, 16)):
        q, s = fp8_gemm.quantize_rows_triton(x, one_pass=one_pass, num_warps=warps)
        assert torch.equal(s, sr) and torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
        us = graph_time(lambda: fp8_gemm.quantize_rows_triton(x, one_pass=one_pass,
                                                              num_warps=warps), 20)
        gbs = x.numel() * 3 / us / 1e3
        res.append({"rows": 2048, "K": K, "one_pass": one_pass, "num_warps": warps, "us": us,
                    "GBps": gbs})
        print(f"K {K:5d} one_pass {int(one_pass)} warps {warps:2d}: {us:6.1f} us ({gbs:5.0f} GB/s)",
              flush=True)
json.dump({"device_name": torch.cuda.get_device_name(), "torch": torch.__version__,
           "timing": "mean per launch inside CUDA graphs", "cases": res},
          open(sys.argv[1], "w"), indent=1)
