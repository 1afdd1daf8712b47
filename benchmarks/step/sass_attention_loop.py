"""Instructions per key of the paged attention kernel's K/V loop (``kernels/paged_attention``),
compiled for sm_90 on any machine (no GPU), as ``sass_quant_loop.py`` counts the quantized GEMMs:
bf16 pages, fp8 pages (bf16 dots) and fp8 pages with fp16 dots (``f16``), for key tiles of 64 /
128 / 256, 4 / 8 warps and 1-3 stages, 32 query rows (the LLaDA-8B dual step's block), head dim
128, page size 16, no split, every stride divisible by 16 (as Triton specializes them).

    python benchmarks/step/sass_attention_loop.py --out benchmarks/results/step/sass_attention_loop_cpu.json

Each row: the loop's SASS instructions (per thread), warp instructions a key (x warps / keys a
tile), the local-memory spills (LDL / STL) and the shared memory the compiler reserved. A static
count, not a time: at batch 64 the bf16 kernel is bound by HBM, so fewer instructions a key
matter only where issuing them is what bounds it (findings/quantization.md).
"""
from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flash_dllm.kernels import paged_attention
from sass_quant_loop import loop_sass, opcode   # (benchmarks/step)

CONSTS = ("PAGE_SIZE", "BLOCK_M", "BLOCK_N", "BLOCK_D", "TRACK", "PREC", "SPLIT", "FP8", "HP",
          "PDL", "F16")
PTRS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16",
        "mass_ptr": "*fp32", "cu_q_ptr": "*i32", "len_k_ptr": "*i32", "bt_ptr": "*i32",
        "part_ptr": "*fp32", "lse_ptr": "*fp32", "ks_ptr": "*fp32", "vs_ptr": "*fp32"}
TILES = ((64, 4, 1), (64, 4, 2), (128, 4, 1), (128, 4, 2), (128, 4, 3), (128, 8, 2),
         (256, 8, 2))


def compile_loop(arm: str, bn: int, warps: int, stages: int, bm: int = 32) -> dict:
    fn = paged_attention._paged_attn_kernel
    names = list(inspect.signature(fn.fn).parameters)
    fp8 = arm != "bf16"
    sig = {n: "constexpr" if n in CONSTS else
           ("*u8" if fp8 and n in ("k_ptr", "v_ptr") else PTRS[n]) if n in PTRS else
           "fp32" if n == "qk_scale" else "i32" for n in names}
    const = dict(PAGE_SIZE=16, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=128, TRACK=False, PREC="tf32",
                 SPLIT=False, FP8=fp8, HP=1, PDL=False, F16=arm == "fp8_f16")
    aligned = [n for n in names if n.startswith("stride") or n in ("D", "CHUNK")] + \
        ["q_ptr", "k_ptr", "v_ptr", "o_ptr"]
    idx = {n: i for i, n in enumerate(names)}
    src = ASTSource(fn=fn, signature=sig, constexprs={(idx[k],): v for k, v in const.items()},
                    attrs={(idx[k],): [["tt.divisibility", 16]] for k in aligned})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    body = loop_sass(k.asm["cubin"])
    ops: dict[str, int] = {}
    for ins in body:
        ops[opcode(ins)] = ops.get(opcode(ins), 0) + 1
    return {"arm": arm, "block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages,
            "loop_instructions": len(body),
            "warp_instructions_per_key": round(len(body) * warps / bn, 1),
            "spills": {"LDL": ops.get("LDL", 0), "STL": ops.get("STL", 0)},
            "shared_bytes": k.metadata.shared,
            "opcodes": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:16])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = []
    for arm in ("bf16", "fp8", "fp8_f16"):
        for bn, warps, stages in TILES:
            r = compile_loop(arm, bn, warps, stages)
            rows.append(r)
            print(f"{arm:8s} BLOCK_N {bn:3d} warps {warps} stages {stages}: "
                  f"{r['loop_instructions']:5d} a tile, {r['warp_instructions_per_key']:6.1f} "
                  f"warp instructions a key, spills {r['spills']}", flush=True)
    report = {"what": "SASS instructions in the paged attention kernel's K/V loop, sm_90, 32 "
                      "query rows, head dim 128, page size 16, no split",
              "triton": triton.__version__, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
