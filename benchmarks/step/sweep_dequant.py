"""The many-row path's dequantize kernel (``quant_decode._dequant_kernel``) timed in CUDA graphs
at LLaDA-8B's gate/up and down shapes (int4 words, int4 bytes, int8; group 128): one scale a row
(``ROW_SCALE``, the tile inside its group) against the per-column scale gather, by BLOCK_N and
warps; every variant checked bitwise against ``dequantize_triton``. GB/s counts the bf16 written
and the codes read.

    python3 benchmarks/step/sweep_dequant.py benchmarks/results/step/sweep_dequant_h100.json
"""
import json
import sys

import torch
import triton

from flash_dllm.kernels import quant_decode as qd
from flash_dllm.kernels import quant_gemm
from sweep_quant_gemm import graph_time  # (the same timing: benchmarks/step)

dev = torch.device("cuda")
res = []
CASES = (("gate_up int4 words", 24576, 4096, 4, True), ("down int4 words", 4096, 12288, 4, True),
         ("gate_up int4 bytes", 24576, 4096, 4, False), ("gate_up int8", 24576, 4096, 8, False))
for name, N, K, bits, words in CASES:
    w = torch.randn(N, K, device=dev) * 0.02
    q, s = quant_gemm.quantize(w, bits, 128)
    if words:
        q = qd.interleave_int4(q).view(torch.int32)
    ref = qd.dequantize_triton(q, s, bits, torch.bfloat16)
    for bn in (32, 64):
        for nw in (4, 8):
            for row in (False, True):
                out = torch.empty(N, K, dtype=torch.bfloat16, device=dev)
                f = lambda: qd._dequant_kernel[(triton.cdiv(N, bn), K // 128)](
                    q, s, out, N, K, q.stride(0), s.stride(0), out.stride(0), GROUP=128, BITS=bits,
                    BLOCK_N=bn, BLOCK_K=128, WORDS=words, ROW_SCALE=row, num_warps=nw)
                f(); torch.cuda.synchronize()
                assert torch.equal(out, ref), (name, bn, nw, row)
                us = graph_time(f, 10)
                gbs = (N * K * 2 + q.numel() * q.element_size()) / us / 1e3
                res.append({"case": name, "BLOCK_N": bn, "num_warps": nw, "ROW_SCALE": row,
                            "us": us, "GBps": gbs})
                print(f"{name:20s} bn {bn} warps {nw} row_scale {int(row)}: {us:7.1f} us "
                      f"({gbs:5.0f} GB/s)", flush=True)
json.dump({"device_name": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": res,
           "timing": "mean per launch inside CUDA graphs"}, open(sys.argv[1], "w"), indent=1)
