"""A GEMM whose tiles never change: ``y = x @ w^T (+ b)`` with the same reduction order for a row
whatever the row count, so a token's projection does not depend on what else shares the batch
(issue 44: ``EngineConfig.deterministic`` on a GPU; ``layers/batch_invariant`` routes the step's
2-D ``F.linear`` here while it is on).

cuBLAS picks its kernel, its tile and its split-K from the shape, so the same row multiplied
alone and inside a larger batch can differ in the last bits. Here every launch uses ``TILE``: one
program per ``[BLOCK_M, BLOCK_N]`` output tile walks K in ``BLOCK_K`` steps from 0 to K in
order, accumulating ``tl.dot`` products in fp32; no split-K, no atomics, no shape-dependent
choice. A row's output therefore depends only on its own ``x`` row and ``w``: the rows of a
launch are independent (padding rows of a tile are masked loads of 0 and never stored).

The cost is the GEMM cuBLAS would have chosen better (a skinny batch-1 step gets no split-K; a
large batch no larger tiles): measure it with ``bench step --deterministic`` (run_gpu.sh
``deterministic``). The reference is ``F.linear`` (values agree to the dtype's rounding; they are
not bitwise equal, which is not the property this kernel is for).
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
    describe,
    interpreting,
    use_triton,
)

INTERPRET = interpreting()  # see _triton: fixed when this module is imported
TILE = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _fixed_gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                           stride_om, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
                           PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        r_ok, c_ok = rows < M, cols < N
        x_row = x_ptr + rows[:, None].to(tl.int64) * stride_xm
        w_row = w_ptr + cols[:, None].to(tl.int64) * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):                        # always from 0, in order
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(x_row + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_row + ks[None, :], mask=c_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:       # the interpreter's half-precision tl.dot is wrong (see quant_gemm)
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(x, tl.trans(w), input_precision=PREC)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & c_ok[None, :])


def fixed_gemm_reference(x: torch.Tensor, w: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, bias)


def fixed_gemm_triton(x: torch.Tensor, w: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous) @ w [N, K]^T (+ bias [N]) -> [M, N] in x's dtype."""
    check(HAS_TRITON, "fixed_gemm: triton is not importable")
    check(x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1] and x.stride(1) == 1
          and w.stride(1) == 1, f"fixed_gemm: x [M, K] and w [N, K] with contiguous rows, got "
                                f"{describe(x)} and {describe(w)}")
    check_dtype("fixed_gemm: x", x, FLOAT_DTYPES)
    check(w.dtype == x.dtype, f"fixed_gemm: w must be {x.dtype}, got {w.dtype}")
    check(bias is None or (bias.shape == (w.shape[0],) and bias.is_contiguous()),
          f"fixed_gemm: bias must be None or [{w.shape[0]}], got {describe(bias)}")
    check_device("fixed_gemm", INTERPRET, x, w, *(() if bias is None else (bias,)))
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    t = TILE
    grid = (triton.cdiv(N, t["BLOCK_N"]), triton.cdiv(M, t["BLOCK_M"]))
    _fixed_gemm_kernel[grid](
        x, w, bias if bias is not None else w, out, M, N, K, x.stride(0), w.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, UPCAST=INTERPRET,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=t["BLOCK_M"],
        BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"], num_warps=t["num_warps"],
        num_stages=t["num_stages"])
    return out


def op(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with fixed tiles over any leading dims: Triton on CUDA, ``F.linear``
    elsewhere."""
    if not use_triton(x, w):
        return fixed_gemm_reference(x, w, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = fixed_gemm_triton(x2, w if w.stride(1) == 1 else w.contiguous(), bias)
    return out.view(*lead, w.shape[0])                       # (0 rows: -1 is ambiguous)
