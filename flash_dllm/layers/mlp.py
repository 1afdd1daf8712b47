"""SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flash_dllm.layers.linear import concat_linears, dense, dense_swiglu


class SwiGLU(nn.Module):
    # inference: rows per chunk of a large packed batch (a full-canvas refresh of batch 32 has
    # 32 x 1024 rows; 2048-row chunks keep its [rows, 2 x intermediate] activations at 100 MB
    # for LLaDA-8B, and GEMMs of 2048 rows still run at full rate)
    CHUNK_ROWS = 2048
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.gate_up_proj: nn.Linear | None = None   # set by fuse()

    @torch.no_grad()
    def fuse(self) -> None:
        """Inference: gate and up projections in one GEMM (see ``Attention.fuse``)."""
        if self.gate_up_proj is not None or any(
                type(p) is not nn.Linear for p in (self.gate_proj, self.up_proj)):
            return                  # fused already, or quantized unfused (see Attention.fuse)
        fused = concat_linears((self.gate_proj, self.up_proj))
        self.gate_proj = self.up_proj = None
        self.gate_up_proj = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dim() == 2 and x.shape[0] > self.CHUNK_ROWS and not torch.is_grad_enabled()):
            # NOTE: a full-canvas refresh of a large batch has tens of thousands of rows; the
            # [rows, 2 x intermediate] activations would dominate peak memory. Row chunks give the
            # same values (each row is independent) with a bounded working set.
            out = torch.empty_like(x)
            for i in range(0, x.shape[0], self.CHUNK_ROWS):
                out[i:i + self.CHUNK_ROWS] = self._rows(x[i:i + self.CHUNK_ROWS])
            return out
        return self._rows(x)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            return dense(self.down_proj, dense_swiglu(self.gate_up_proj, x))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
