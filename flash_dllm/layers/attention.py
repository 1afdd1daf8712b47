"""Bidirectional self-attention: the module holds the projections, the step's context does the rest.

``Attention.forward`` calls ``ctx.attention(module, layer, x, positions)`` and applies the output
projection. What "the rest" is (projection + RoPE + where K/V are written + which keys each query
sees) is the context's job, so every context takes the normed input ``x``:

- ``DenseContext`` (here): a padded batch ``[B, L]`` attends to itself (training, parity tests,
  the exact reference). An optional key mask hides padding.
- ``PagedAttentionMetadata`` (``layers/attention_backend.py``): the engine's attention backend
  for one step over the shared KV page pool.

The two helpers below compute the exact attention of a few special rows (``decode="verify"``
rows, sentinel probes); the paged backend and the tests' dense oracle both use them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flash_dllm.layers.rotary import Rotary


class DenseContext:
    """Every query of a row attends to every (unmasked) key of the same row."""

    def __init__(self, key_mask: torch.Tensor | None = None) -> None:
        self.key_mask = key_mask  # [B, L] bool, True = real token

    def attention(self, attn: Attention, layer: int, x: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
        q, k, v = attn.project(x)                              # q: [B, L, H, D], k/v: [B, L, Hkv, D]
        q, k = attn.rotary(q, positions), attn.rotary(k, positions)
        mask = None
        if self.key_mask is not None:
            mask = self.key_mask[:, None, None, :]            # [B, 1, 1, L]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            enable_gqa=q.shape[2] != k.shape[2])               # [B, H, L, D]
        return out.transpose(1, 2).flatten(2)                  # [B, L, H*D]


def masked_attention(q: torch.Tensor, k1: torch.Tensor, v1: torch.Tensor, k2: torch.Tensor,
                     v2: torch.Tensor, allow: torch.Tensor) -> torch.Tensor:
    """Attention of a few rows over two key sets without concatenating them (the first is a whole
    canvas cache, which is read in place): q [R, H, D], k1/v1 [L, Hkv, D], k2/v2 [M, Hkv, D],
    allow [R, L + M] bool -> [R, H * D]."""
    R, H, D = q.shape
    L, Hkv = k1.shape[0], k1.shape[1]
    g = H // Hkv
    qh = q.reshape(R, Hkv, g, D).permute(1, 2, 0, 3).reshape(Hkv, g * R, D)   # [Hkv, g*R, D]
    s = torch.cat([qh @ k1.permute(1, 2, 0), qh @ k2.permute(1, 2, 0)], dim=-1)  # [Hkv, g*R, L+M]
    s = s.float().view(Hkv, g, R, -1) * D ** -0.5
    p = s.masked_fill(~allow, float("-inf")).softmax(-1).to(q.dtype).view(Hkv, g * R, -1)
    o = p[..., :L] @ v1.transpose(0, 1) + p[..., L:] @ v2.transpose(0, 1)      # [Hkv, g*R, D]
    return o.view(Hkv, g, R, D).permute(2, 0, 1, 3).reshape(R, H * D)


def masked_attention_batched(q: torch.Tensor, k1: torch.Tensor, v1: torch.Tensor,
                             k2: torch.Tensor, v2: torch.Tensor, allow: torch.Tensor
                             ) -> torch.Tensor:
    """``masked_attention`` for B requests at once, with static shapes (the fused verify step's
    CUDA graph): q [B, R, H, D], k1/v1 [B, L, Hkv, D] (each request's canvas keys, padded to one
    length L), k2/v2 [B, M, Hkv, D], allow [B, R, L + M] bool -> [B, R, H * D]. Every row must
    allow at least one key (a row that allows none is NaN). The same operations in the same
    order as ``masked_attention``, one request per batch entry."""
    B, R, H, D = q.shape
    L, Hkv = k1.shape[1], k1.shape[2]
    g = H // Hkv
    qh = q.reshape(B, R, Hkv, g, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, g * R, D)
    s = torch.cat([qh @ k1.permute(0, 2, 3, 1), qh @ k2.permute(0, 2, 3, 1)], dim=-1)
    s = s.float().view(B, Hkv, g, R, -1) * D ** -0.5                   # [B, Hkv, g, R, L + M]
    p = s.masked_fill(~allow[:, None, None], float("-inf")).softmax(-1).to(q.dtype)
    p = p.view(B, Hkv, g * R, -1)
    o = p[..., :L] @ v1.transpose(1, 2) + p[..., L:] @ v2.transpose(1, 2)   # [B, Hkv, g*R, D]
    return o.view(B, Hkv, g, R, D).permute(0, 3, 1, 2, 4).reshape(B, R, H * D)


def attention_weights(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Softmax attention weights averaged over heads: q [R, H, D], k [L, Hkv, D] -> [R, L]."""
    R, H, D = q.shape
    Hkv = k.shape[1]
    qh = q.reshape(R, Hkv, H // Hkv, D).permute(1, 2, 0, 3).reshape(Hkv, -1, D)  # [Hkv, g*R, D]
    p = ((qh @ k.permute(1, 2, 0)).float() * D ** -0.5).softmax(-1)             # [Hkv, g*R, L]
    return p.view(H, R, -1).mean(0)


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 rotary: Rotary) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.rotary = rotary

        self.qkv_proj: nn.Linear | None = None      # set by fuse(): q, k, v in one GEMM

    @torch.no_grad()
    def fuse(self) -> None:
        """Inference: replace q/k/v_proj by one Linear over their concatenated weights (one GEMM
        that streams the weights once, instead of three launches). The separate weights are
        freed; the math is unchanged."""
        if self.qkv_proj is not None:
            return
        parts = (self.q_proj, self.k_proj, self.v_proj)
        w = torch.cat([p.weight for p in parts])
        fused = nn.Linear(w.shape[1], w.shape[0], bias=self.q_proj.bias is not None,
                          device=w.device, dtype=w.dtype)
        fused.weight.copy_(w)
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
        del w
        self.q_proj = self.k_proj = self.v_proj = None
        self.qkv_proj = fused

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., d] -> q [..., H, D], k [..., Hkv, D], v [..., Hkv, D] (un-rotated)."""
        lead = x.shape[:-1]                                   # [B, L] or [T]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
            return q.view(*lead, H, D), k.view(*lead, Hkv, D), v.view(*lead, Hkv, D)
        return (self.q_proj(x).view(*lead, H, D), self.k_proj(x).view(*lead, Hkv, D),
                self.v_proj(x).view(*lead, Hkv, D))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, layer: int, ctx) -> torch.Tensor:
        return self.o_proj(ctx.attention(self, layer, x, positions))
