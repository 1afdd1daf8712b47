"""Mixture-of-experts SwiGLU experts: ``op`` (a plain PyTorch reference of its signature)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def op(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
       topk_weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t]))`` with
    ``e = topk_ids[t, k]``, accumulated in float32 and returned in ``x``'s dtype.

    x [T, d]; w_gate_up [E, 2I, d] (gate rows first); w_down [E, d, I]; topk_ids [T, k] int;
    topk_weights [T, k] float32 -> [T, d]."""
    T, d = x.shape
    k = topk_ids.shape[1]
    out = torch.zeros(T, d, dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1)                               # [T*k]: slot t*k + j
    order = torch.argsort(flat, stable=True)                  # slots grouped by expert
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
    weights = topk_weights.reshape(-1).float()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start:start + n]
        start += n
        rows = slots // k                                     # the tokens routed to expert e
        h = x[rows].float() @ w_gate_up[e].float().t()        # [n, 2I]
        gate, up = h.chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w_down[e].float().t()       # [n, d]
        out.index_add_(0, rows, y * weights[slots, None])
    return out.to(x.dtype)
