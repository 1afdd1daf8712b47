"""Fused residual add + RMSNorm.

``normed = weight * rmsnorm(x + residual)``, ``new_residual = x + residual``, with the semantics of
``flash_dllm.layers.norm.RMSNorm``: the sum is rounded to the activation dtype (as the unfused
``h = x + attn(...)`` is), the norm runs in float32, and the result is cast back to the activation
dtype *before* the weight multiply (LLaDA/OLMo and Qwen2 both do so; the order changes bf16
rounding).

Kernel: one program per row, the whole row in registers (d <= 16384). One read of x, residual and
weight, one write of normed and new_residual: 5 * d * bytes moved, the minimum for the fused op.
"""
from __future__ import annotations

import torch

from flash_dllm.kernels._triton import (
    FLOAT_DTYPES,
    HAS_TRITON,
    check,
    check_device,
    check_dtype,
    interpreting,
    next_pow2,
    pdl_args,
    use_triton,
)

INTERPRET = interpreting()  # see _triton: fixed when this module is imported

if HAS_TRITON:
    import triton
    import triton.language as tl

    from flash_dllm.kernels._triton import pdl_wait

    @triton.jit
    def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, d, stride_x, stride_r, stride_o,
                        stride_ro, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            h = (x + r).to(res_out_ptr.dtype.element_ty)       # rounded like the unfused add
            tl.store(res_out_ptr + row * stride_ro + cols, h, mask=mask)
            x = h.to(tl.float32)
        var = tl.sum(x * x, axis=0) / d
        y = (x * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)   # cast BEFORE the weight
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        out = (w * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference, line for line ``layers.norm.RMSNorm`` after the residual add."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype), x


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None, num_warps: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, d], weight [d], residual [T, d] or None -> (normed [T, d], new_residual [T, d]).

    Rows may be strided (views into a larger buffer); the last dim must be contiguous. ``normed``
    has dtype ``promote(weight, x)`` as the reference's ``weight * h`` has. ``num_warps``: the
    launch's (None: by the row width; sweeps).
    """
    check(HAS_TRITON, "rmsnorm_triton: triton is not importable")
    check(x.dim() == 2, f"rmsnorm: x must be [T, d], got shape {tuple(x.shape)}")
    T, d = x.shape
    check(weight.shape == (d,), f"rmsnorm: weight must be [{d}], got {tuple(weight.shape)}")
    check_dtype("rmsnorm: x", x, FLOAT_DTYPES)
    check_dtype("rmsnorm: weight", weight, FLOAT_DTYPES)
    check(x.stride(1) == 1, f"rmsnorm: x's last dim must be contiguous, strides {x.stride()}")
    check(weight.is_contiguous(), "rmsnorm: weight must be contiguous")
    check(d <= 16384, f"rmsnorm: d={d} > 16384 does not fit one program's registers")
    tensors = [x, weight]
    if residual is not None:
        check(residual.shape == x.shape, f"rmsnorm: residual {tuple(residual.shape)} != x "
                                         f"{tuple(x.shape)}")
        check(residual.dtype == x.dtype, f"rmsnorm: residual dtype {residual.dtype} != x dtype "
                                         f"{x.dtype}")
        check(residual.stride(1) == 1, "rmsnorm: residual's last dim must be contiguous")
        tensors.append(residual)
    check_device("rmsnorm", INTERPRET, *tensors)
    out = torch.empty((T, d), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    if T == 0:
        return out, res_out
    block = next_pow2(d)
    r = residual if residual is not None else x
    _rmsnorm_kernel[(T,)](
        x, r, weight, out, res_out, d, x.stride(0), r.stride(0), out.stride(0), res_out.stride(0),
        float(eps), HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=num_warps or (4 if block <= 1024 else (8 if block <= 4096 else 16)),
        **pdl_args(x))
    return out, res_out


def op(x: torch.Tensor, weight: torch.Tensor, eps: float,
       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] (residual likewise or None) -> (normed, new_residual) of x's shape.

    Dispatch: Triton on CUDA tensors, the PyTorch reference otherwise."""
    if not use_triton(x, weight):
        return rmsnorm_reference(x, weight, eps, residual)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])                                  # [T, d]
    r2 = residual.reshape(-1, shape[-1]) if residual is not None else None
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if r2 is not None and r2.stride(1) != 1:
        r2 = r2.contiguous()
    out, res = rmsnorm_triton(x2, weight, eps, r2)
    return out.view(shape), res.view(shape)
