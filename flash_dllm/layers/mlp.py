"""SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flash_dllm.kernels import skinny_gemm
from flash_dllm.layers.linear import concat_linears, dense, dense_swiglu
from flash_dllm.layers.norm import add_rmsnorm


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


def add_norm_mlp(o_proj: nn.Module, a: torch.Tensor, residual: torch.Tensor, norm,
                 mlp: nn.Module, next_norm=None
                 ) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """The rest of a layer after its attention ``a``, as ``DiffusionTransformer.hidden`` runs
    it: ``h = o_proj(a) + residual``, ``h2 = h + mlp(norm(h))``; returns ``(next_norm(h2),
    h2)`` (``(None, h2)`` without a next norm: the last layer). The adds and norms live in
    the GEMMs around them (``kernels/skinny_gemm``): the output projection adds the residual
    and sums each column tile's squares, the SwiGLU gate/up GEMM norms its input as it loads
    it, the down projection adds ``h`` and its row blocks' last tile norms ``h2``: two RMSNorm
    launches fewer per layer. None (the caller runs the unfused layer) unless the output
    projection and gate/up take the skinny kernel for these rows (``tuned_config``: a CUDA
    device with tuned tiles, few rows, no autograd, not deterministic), are plain and the MLP
    a fused SwiGLU; the down projection falls back alone (GEMM, then ``add_rmsnorm``). A
    norm's mean square adds per-tile sums, not the row in one pass: rarely one bf16 ulp off
    the norm kernel's."""
    gate_up = getattr(mlp, "gate_up_proj", None) if type(mlp) is SwiGLU else None
    if (type(o_proj) is not nn.Linear or type(gate_up) is not nn.Linear
            or gate_up.bias is not None or norm.weight.dtype != a.dtype
            or residual.shape[:-1] != a.shape[:-1] or residual.dtype != a.dtype):
        return None
    a2 = a.reshape(-1, a.shape[-1])
    cfg_o = skinny_gemm.tuned_config(a2, o_proj.weight.shape[0], False)
    cfg_gu = (skinny_gemm.tuned_config(residual, gate_up.weight.shape[0] // 2, True)
              if cfg_o is not None else None)
    if cfg_gu is None:
        return None
    shape = residual.shape
    res2 = residual.reshape(-1, shape[-1]).contiguous()
    h, sums = skinny_gemm.skinny_triton(a2.contiguous(), o_proj.weight, o_proj.bias,
                                        config=cfg_o, residual=res2)
    act = skinny_gemm.skinny_triton(h, gate_up.weight, None, True, cfg_gu,
                                    norm_in=(sums, norm.weight, norm.eps))
    down = mlp.down_proj
    if next_norm is None:
        return None, (dense(down, act) + h).view(shape)
    cfg_d = (skinny_gemm.tuned_config(act, down.weight.shape[0], False)
             if type(down) is nn.Linear and next_norm.weight.dtype == h.dtype else None)
    out = (skinny_gemm.skinny_triton(act, down.weight, down.bias, config=cfg_d, residual=h,
                                     norm_out=(next_norm.weight, next_norm.eps))
           if cfg_d is not None else None)
    if out is None:
        normed, h2 = add_rmsnorm(dense(down, act), next_norm, h)
    else:
        h2, _, normed = out
    return normed.view(shape), h2.view(shape)
