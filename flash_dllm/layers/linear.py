"""The dense projections' one call site rule: ``dense(mod, x)`` is ``mod(x)``, except that a plain
``nn.Linear`` goes through ``kernels/skinny_gemm.linear`` (cuBLAS, unless a sweep measured the
skinny kernel faster for this shape and row count on this device). Quantized projections
(``layers/quant.py``) and anything else run their own forward."""
from __future__ import annotations

import torch
from torch import nn

from flash_dllm.kernels import silu_mul, skinny_gemm


def dense(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if type(mod) is nn.Linear:
        return skinny_gemm.linear(x, mod.weight, mod.bias)
    return mod(x)


def dense_swiglu(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused gate/up projection ``mod`` ([W_gate; W_up]): one launch
    where a sweep found ``skinny_gemm.silu_gate_up`` faster (a bias-free ``nn.Linear``), else
    ``mod(x)`` and one ``silu_mul`` kernel."""
    if type(mod) is nn.Linear and mod.bias is None:
        h = skinny_gemm.silu_gate_up(x, mod.weight)
        if h is not None:
            return h
    return silu_mul.op(mod(x))
