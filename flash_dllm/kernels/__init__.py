"""Triton kernels, one op per file: kernel + launcher (asserts layout) + PyTorch reference.

Layers call kernels only through ``OPS`` (or the re-exported functions): each ``op`` runs Triton on
CUDA tensors when ``triton`` is importable and the PyTorch reference otherwise (CPU, no triton,
or ``FLASH_DLLM_DISABLE_TRITON=1``). ``kernels/`` never imports ``layers/`` or ``cache/``.

| name              | what                                                  | file               |
|-------------------|-------------------------------------------------------|--------------------|
| `rmsnorm`         | fused residual add + RMSNorm (fp32 math)              | rmsnorm.py         |
| `rope_cache`      | RoPE on q/k + K/V write into paged cache slots        | rope_cache.py      |
| `qkv_rope_cache`  | QKV GEMM + RoPE + K/V page write, few rows            | qkv_rope_cache.py  |
| `paged_attention` | paged bidirectional varlen attention (+ key mass, split-KV) | paged_attention.py |
| `argmax_confidence` | greedy proposal from logits: argmax + its softmax prob | argmax_confidence.py |
| `silu_mul`        | SwiGLU's silu(gate) * up in one pass                  | silu_mul.py        |
| `kv_pages`        | pack / unpack KV pages page-first (tiers, transfers; fp8 / int8) | kv_pages.py |
| `checksum`        | 128-bit checksum of byte rows at memory bandwidth (page records) | checksum.py |
| `fused_moe`       | routed SwiGLU experts: expert-sorted grouped GEMMs, fused epilogues | fused_moe.py |
| `fixed_gemm`      | a GEMM with one tile for every shape (batch-invariant rows: `deterministic` on a GPU) | fixed_gemm.py |

Kernels with their own dispatch (not in ``OPS``): the quantized GEMMs (``quant_gemm``, its decoders
``quant_decode``, ``fp8_gemm``, ``fp8_skinny``, ``fused_moe_quant``), ``skinny_gemm`` (few-row bf16 GEMMs and
SwiGLU's fused activation, on only where a sweep's tuned entry says it beats cuBLAS; called
through ``layers/linear.dense``), ``fixed_gemm`` and ``rope_cache_fp8``. Study kernels the engine
does not use (a fused LM head + confidence, the first skinny GEMM) live in ``benchmarks/studies/``.
"""
from __future__ import annotations

from flash_dllm.kernels import (
    argmax_confidence,
    checksum,
    fused_moe,
    kv_pages,
    paged_attention,
    qkv_rope_cache,
    rmsnorm,
    rope_cache,
    silu_mul,
)
from flash_dllm.kernels._triton import HAS_TRITON, use_triton

OPS = {
    "rmsnorm": rmsnorm.op,
    "rope_cache": rope_cache.op,
    "paged_attention": paged_attention.op,
    "qkv_rope_cache": qkv_rope_cache.op,
    "argmax_confidence": argmax_confidence.op,
    "silu_mul": silu_mul.op,
    "kv_pages": kv_pages.op,
    "checksum": checksum.op,
    "fused_moe": fused_moe.op,
}
REFERENCES = {
    "rmsnorm": rmsnorm.rmsnorm_reference,
    "rope_cache": rope_cache.rope_cache_reference,
    "paged_attention": paged_attention.paged_attention_reference,
    "qkv_rope_cache": qkv_rope_cache.qkv_rope_cache_reference,
    "argmax_confidence": argmax_confidence.argmax_confidence_reference,
    "silu_mul": silu_mul.silu_mul_reference,
    "kv_pages": kv_pages.pack_pages_reference,
    "checksum": checksum.checksum_rows_reference,
    "fused_moe": fused_moe.fused_moe_reference,
}

fused_add_rmsnorm = rmsnorm.op
rope_and_cache = rope_cache.op
paged_attention_op = paged_attention.op

__all__ = [
    "HAS_TRITON",
    "OPS",
    "REFERENCES",
    "fused_add_rmsnorm",
    "paged_attention_op",
    "rope_and_cache",
    "use_triton",
]
