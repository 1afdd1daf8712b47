"""Skinny GEMM: ``y = x @ W^T`` for few rows (a batch-1 dLLM step has 32), bound by reading W.

STUDY, not used by the engine (moved out of ``flash_dllm/kernels``):
``benchmarks/step/bench_gemm.py`` measured it against cuBLAS on LLaDA-8B shapes
(``benchmarks/results/step/gemm_h200.json``) and cuBLAS was as fast; see
``benchmarks/findings/step.md``. Tests: ``python3 -m pytest benchmarks/studies -q``.

With 32 rows a linear layer does 64 FLOPs per weight byte read at most, so its time is the time to
stream W from HBM. cuBLAS tiles for compute (large M tiles, few CTAs over N) and streams an 8B
model's weights at ~2.8 TB/s of the H200's 4.2 TB/s in a 32-row step (``../shared/BENCH.md``).
This kernel tiles for bandwidth instead: one program per ``BLOCK_N`` output columns (and per
``SPLIT_K`` slice of the reduction when N alone gives too few programs), the x tile reused from
L2, W streamed through a deep software pipeline. ``SPLIT_K > 1`` accumulates float32 partials with
atomics into a zeroed buffer and casts once.

Layout: x ``[M, K]`` row-major, W ``[N, K]`` row-major (``nn.Linear.weight``), y ``[M, N]``. The
reference is ``torch.nn.functional.linear``; ``op`` dispatches to Triton on CUDA for
``M <= MAX_ROWS`` and to the reference otherwise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flash_dllm.kernels._triton import (
    FLOAT_DTYPES,
    HAS_TRITON,
    check,
    check_device,
    check_dtype,
    interpreting,
    use_triton,
)

INTERPRET = interpreting()  # see _triton: fixed when this module is imported
MAX_ROWS = 64               # above this cuBLAS's compute tiles win

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       K_PER_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, UPCAST: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        k_lo = pid_k * K_PER_SPLIT
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        x_ptrs = x_ptr + rm[:, None] * stride_xm + (k_lo + rk)[None, :]
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]
        for k in range(0, K_PER_SPLIT, BLOCK_K):
            k_ok = (k_lo + k + rk) < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:     # the interpreter's half-precision tl.dot is wrong (Triton 3.9)
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(x, tl.trans(w))
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok)
        else:
            tl.atomic_add(y_ptrs, acc, mask=ok)


def skinny_gemm_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """PyTorch reference: ``x @ weight.T``."""
    return F.linear(x, weight)


def default_config(M: int, N: int, K: int, num_sms: int = 132) -> dict:
    """Tile sizes for a bandwidth-bound shape: enough programs to cover every SM a few times."""
    block_n = 32 if N <= 8192 else 64
    programs = triton.cdiv(N, block_n) if HAS_TRITON else 1
    split_k = 1
    while programs * split_k < 2 * num_sms and split_k < 8 and K // (split_k * 2) >= 512:
        split_k *= 2
    return dict(BLOCK_N=block_n, BLOCK_K=128, SPLIT_K=split_k, num_warps=4, num_stages=4)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """Launch the kernel. ``config``: BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages (defaults
    from ``default_config``)."""
    check(HAS_TRITON, "skinny_gemm: triton is not installed")
    check_device("skinny_gemm", INTERPRET, x, weight)
    check_dtype("x", x, FLOAT_DTYPES)
    check(weight.dtype == x.dtype, f"skinny_gemm: weight dtype {weight.dtype} != x dtype {x.dtype}")
    check(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1],
          f"skinny_gemm: x [M, K] and weight [N, K] expected, got {tuple(x.shape)} and "
          f"{tuple(weight.shape)}")
    check(x.stride(1) == 1 and weight.stride(1) == 1, "skinny_gemm: rows must be contiguous")
    M, K = x.shape
    N = weight.shape[0]
    check(1 <= M <= MAX_ROWS, f"skinny_gemm: M must be in [1, {MAX_ROWS}], got {M}")
    cfg = dict(default_config(M, N, K))
    cfg.update(config or {})
    split = cfg["SPLIT_K"]
    block_k = cfg["BLOCK_K"]
    k_per_split = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    block_m = max(16, triton.next_power_of_2(M))
    if split == 1:
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    else:
        y = torch.zeros(M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), split)
    _skinny_kernel[grid](x, weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
                         k_per_split, BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k,
                         SPLIT_K=split, UPCAST=INTERPRET, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y if split == 1 else y.to(x.dtype)


def op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` over any leading dims: Triton for few rows on CUDA, else the reference."""
    rows = x.numel() // x.shape[-1]
    if use_triton(x, weight) and 1 <= rows <= MAX_ROWS and x.dtype in (torch.float16,
                                                                         torch.bfloat16):
        y = skinny_gemm(x.reshape(rows, x.shape[-1]), weight)
        return y.view(*x.shape[:-1], weight.shape[0])
    return skinny_gemm_reference(x, weight)
