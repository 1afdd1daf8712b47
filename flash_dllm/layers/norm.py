"""RMSNorm computed in float32, as both LLaDA (OLMo) and Qwen2 do."""
from __future__ import annotations

import torch
from torch import nn

from flash_dllm.kernels import rmsnorm as rmsnorm_op


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def add_rmsnorm(x: torch.Tensor, norm: RMSNorm, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)`` (``residual=None``: ``(norm(x), x)``).

    Inference on CUDA runs the fused Triton kernel (one read, one write per row); with autograd on
    (training) or on the CPU it is ``RMSNorm``'s own arithmetic, bit for bit."""
    if torch.is_grad_enabled():
        h = x if residual is None else x + residual
        return norm(h), h
    return rmsnorm_op.op(x, norm.weight, norm.eps, residual)
