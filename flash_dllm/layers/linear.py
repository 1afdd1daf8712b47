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


@torch.no_grad()
def concat_linears(parts) -> nn.Linear:
    """One ``nn.Linear`` over ``parts``' weights (and biases) stacked along the outputs: q/k/v's
    and gate/up's fused GEMM (``fuse()``). The int4 codes a checkpoint carried for them
    (``ckpt_codes``, ``models/loader``) are stacked the same way."""
    w = torch.cat([p.weight for p in parts])
    bias = all(p.bias is not None for p in parts)
    fused = nn.Linear(w.shape[1], w.shape[0], bias=bias, device=w.device, dtype=w.dtype)
    fused.weight.copy_(w)
    if bias:
        fused.bias.copy_(torch.cat([p.bias for p in parts]))
    codes = [getattr(p, "ckpt_codes", {}).get("weight") for p in parts]
    if all(c is not None for c in codes):            # (one checkpoint: one group size)
        fused.ckpt_codes = {"weight": (torch.cat([c[0] for c in codes]),
                                       torch.cat([c[1] for c in codes]), codes[0][2])}
    return fused
