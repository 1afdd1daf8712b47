"""Instructions per value of the fp8 page write's store kernel (``kernels/rope_cache_fp8``'s
``_quant_store``: k rotated again, k and v quantised with their pages' final scales, codes
stored), compiled for sm_90 on any machine (no GPU), as ``sass_attention_loop.py`` counts the
attention: the codes rounded in software (the default) and by the e4m3 cast alone (``HW_ROUND``,
``FLASH_DLLM_KV_FP8_HW_ROUND=1``). LLaDA-8B's shape: 32 kv heads, head dim 128, page size 16,
fp32 rotary math, one row a program (4 warps), every stride divisible by 16.

    python benchmarks/step/sass_kv_fp8_write.py --out benchmarks/results/step/sass_kv_fp8_write_cpu.json

A static count, not a time: at batch 64 (2048 rows a layer) the kernel's 16.8 M values a layer
are 50 MB of traffic, ~17 us at the H100's copy rate, while 53 instructions a value are ~30 us
at its issue rate (findings/quantization.md).
"""
from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flash_dllm.kernels import rope_cache_fp8
from sass_quant_loop import disassemble, opcode   # (benchmarks/step)

HKV, HALF = 32, 64
PTRS = {"k_ptr": "*bf16", "v_ptr": "*bf16", "pos_ptr": "*i64", "slot_ptr": "*i64",
        "inv_freq_ptr": "*fp32", "kc_ptr": "*u8", "vc_ptr": "*u8", "ks_ptr": "*fp32",
        "vs_ptr": "*fp32", "flag_ptr": "*i32"}


def count(hw_round: bool) -> dict:
    fn = rope_cache_fp8._quant_store
    names = list(inspect.signature(fn.fn).parameters)
    const = dict(PAGE_SIZE=16, HALF=HALF, BLOCK_HALF=HALF, BLOCK_HKV=HKV, FP32_MATH=True,
                 HW_ROUND=hw_round, PDL=False)
    sig = {n: "constexpr" if n in const else PTRS.get(n, "i32") for n in names}
    idx = {n: i for i, n in enumerate(names)}
    src = ASTSource(fn=fn, signature=sig, constexprs={(idx[k],): v for k, v in const.items()},
                    attrs={(idx[n],): [["tt.divisibility", 16]] for n in names
                           if n.startswith("stride")})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "enable_fp_fusion": False})
    body = [txt for _, txt in disassemble(k.asm["cubin"])[0]]
    ops: dict[str, int] = {}
    for ins in body:
        ops[opcode(ins)] = ops.get(opcode(ins), 0) + 1
    values = HKV * HALF * 2 * 2                                 # k and v, both halves
    return {"hw_round": hw_round, "instructions": len(body),
            "thread_instructions_per_value": round(len(body) * 4 * 32 / values, 1),
            "cvt_e4m3": "cvt.rn.satfinite.e4m3x2.f32" in k.asm["ptx"],
            "top_opcodes": dict(sorted(ops.items(), key=lambda x: -x[1])[:16])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = [count(False), count(True)]
    for r in rows:
        print(f"hw_round={r['hw_round']!s:5}  {r['instructions']} instructions, "
              f"{r['thread_instructions_per_value']} a value, cvt.rn e4m3: {r['cvt_e4m3']}")
    if a.out:
        Path(a.out).write_text(json.dumps({"target": "sm_90", "triton": triton.__version__,
                                           "kv_heads": HKV, "head_dim": 2 * HALF,
                                           "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
