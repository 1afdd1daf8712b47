"""The dense projections' one call site rule: ``dense(mod, x)`` is ``mod(x)``, except that a plain
``nn.Linear`` goes through ``kernels/skinny_gemm.linear`` (cuBLAS, unless a sweep measured the
skinny kernel faster for this shape and row count on this device). Quantized projections
(``layers/quant.py``) and anything else run their own forward."""
from __future__ import annotations

import torch
from torch import nn

from flash_dllm.kernels import skinny_gemm


def dense(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if type(mod) is nn.Linear:
        return skinny_gemm.linear(x, mod.weight, mod.bias)
    return mod(x)
