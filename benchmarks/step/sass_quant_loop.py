"""Instructions per K tile of the weight-only int4 GEMM (``kernels/quant_gemm``), compiled for sm_90
on any machine (no GPU): Triton's own ``ptxas`` and ``nvdisasm`` (shipped in its wheel) give the
SASS, and the largest loop of the kernel (the K-tile loop) is counted by opcode.

    python benchmarks/step/sass_quant_loop.py --out benchmarks/results/step/sass_int4_loop_cpu.json

Rows: the int4 reads ``JOIN`` 1 (bytes, the engine's) and 3 (interleaved words), plain and
transposed dots (``SWAP``), ``BLOCK_N`` 64 / 128, 32 rows, ``BLOCK_K`` 128, group 128, split 2,
4 warps, 3 stages, bf16 x. A static count, not a time: it says what a change does to the work per
weight, the GPU says whether that is what bounds the kernel (findings/quantization.md).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flash_dllm.kernels import quant_gemm

NAMES = ["x_ptr", "q_ptr", "s_ptr", "b_ptr", "out_ptr", "part_ptr", "cnt_ptr", "M", "N", "K",
         "K_PER_SPLIT", "stride_xm", "stride_qn", "stride_sn", "stride_om", "stride_pm",
         "stride_ps", "GROUP", "BITS", "HAS_BIAS", "SPLIT", "UPCAST", "PREC", "BLOCK_M",
         "BLOCK_N", "BLOCK_K", "JOIN", "FP8", "SWAP", "PDL"]
TYPES = ["*bf16", "*u8", "*fp16", "*fp16", "*bf16", "*fp32", "*i32"] + ["i32"] * 10 \
    + ["constexpr"] * 13
ALIGNED = ["x_ptr", "q_ptr", "s_ptr", "out_ptr", "part_ptr", "cnt_ptr", "N", "K", "K_PER_SPLIT",
           "stride_xm", "stride_qn", "stride_sn", "stride_om", "stride_pm"]
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def loop_sass(cubin: bytes) -> list[str]:
    """The instructions of the largest backward-branch range (the kernel's main loop)."""
    ins, labels = disassemble(cubin)
    best: list[str] = []
    for off, txt in ins:
        tgt = re.search(r"BRA.*?(\.L_x_\d+)", txt)
        if tgt and labels.get(tgt.group(1), off + 1) < off:
            body = [t for o, t in ins if labels[tgt.group(1)] <= o <= off]
            best = body if len(body) > len(best) else best
    return best


def disassemble(cubin: bytes) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """(offset, instruction) of every SASS instruction of ``cubin``, and each label's offset."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([str(BIN / "nvdisasm"), "-c", f.name], capture_output=True,
                              text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    ins, labels, pending = [], {}, []
    for line in text.splitlines():
        lab = re.match(r"\s*(\.L_x_\d+):", line)
        if lab:
            pending.append(lab.group(1))
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            off = int(m.group(1), 16)
            for p in pending:
                labels[p] = off
            pending = []
            ins.append((off, m.group(2)))
    return ins, labels


def opcode(ins: str) -> str:
    words = ins.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    idx = {n: i for i, n in enumerate(NAMES)}
    rows = []
    for join, swap, bn in itertools.product((1, 3), (0, 1), (64, 128)):
        const = {"GROUP": 128, "BITS": 4, "HAS_BIAS": False, "SPLIT": 2, "UPCAST": False,
                 "PREC": "tf32", "BLOCK_M": 32, "BLOCK_N": bn, "BLOCK_K": 128, "JOIN": join,
                 "FP8": False, "SWAP": swap, "PDL": 0}
        src = ASTSource(fn=quant_gemm._wq_gemm_kernel, signature=dict(zip(NAMES, TYPES)),
                        constexprs={(idx[k],): v for k, v in const.items()},
                        attrs={(idx[k],): [["tt.divisibility", 16]] for k in ALIGNED})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "num_stages": 3})
        body = loop_sass(k.asm["cubin"])
        ops: dict[str, int] = {}
        for ins in body:
            ops[opcode(ins)] = ops.get(opcode(ins), 0) + 1
        weights = bn * 128 // 128                      # per thread per K tile (128 threads)
        rows.append({"JOIN": join, "SWAP": swap, "BLOCK_N": bn, "loop_instructions": len(body),
                     "weights_per_thread": weights,
                     "instructions_per_weight": round(len(body) / weights, 2),
                     "opcodes": dict(sorted(ops.items(), key=lambda kv: -kv[1]))})
        top = " ".join(f"{o}={n}" for o, n in list(rows[-1]["opcodes"].items())[:8])
        print(f"JOIN={join} SWAP={swap} BLOCK_N={bn}: {len(body)} SASS instructions a K tile "
              f"({len(body) / weights:.2f} a weight); {top}", flush=True)
    report = {"what": "SASS instructions in the int4 weight-only GEMM's K-tile loop, sm_90",
              "triton": triton.__version__, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
