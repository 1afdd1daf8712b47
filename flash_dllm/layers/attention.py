"""Self-attention: the module holds the projections, the step's context does the rest.

``Attention.forward`` calls ``ctx.attention(module, layer, x, positions)`` and applies the output
projection. What "the rest" is (projection + RoPE + where K/V are written + which keys each query
sees) is the context's job, so every context takes the normed input ``x``:

- ``DenseContext`` (here): a padded batch ``[B, L]`` attends to itself (training, parity tests,
  the exact reference), under the module's ``AttentionPattern``. An optional key mask hides
  padding.
- ``PagedAttentionMetadata`` (``layers/attention_backend.py``): the engine's attention backend
  for one step over the shared KV page pool.

The two helpers below compute the exact attention of a few special rows (``decode="verify"``
rows, sentinel probes); the paged backend and the tests' dense oracle both use them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flash_dllm.layers.linear import concat_linears, dense
from flash_dllm.layers.norm import RMSNorm, add_rmsnorm
from flash_dllm.layers.rotary import Rotary

ATTENTION_KINDS = ("bidirectional", "block_causal")


@dataclass(frozen=True)
class AttentionPattern:
    """Which keys a query sees: ``bidirectional`` (every key of its sequence: LLaDA, Dream,
    LLaDA-MoE) or ``block_causal`` (its own block of ``block_size`` positions and every earlier
    block: LLaDA2.x block 32, SDAR block 4).

    NOTE: blocks are counted from position 0 of the sequence: block(p) = p // block_size, so
    the prompt is cut into blocks too and the first generated tokens share a block with the
    prompt's tail whenever the prompt length is not a multiple of the block size. This is what
    LLaDA2's reference ``generate`` (modeling_llada2_moe.py) does: its mask is
    ``tril(ones(n_blocks, n_blocks))`` repeated ``block_length`` times along both axes over the
    whole canvas, prompt included, with position ids ``arange(total)``. It also makes a
    committed block's K/V depend on the tokens alone, never on where the prompt ended, so the
    exact block cache can share whole blocks between requests with equal prefixes.
    """

    kind: str = "bidirectional"
    block_size: int = 0            # block_causal only: positions per block

    def __post_init__(self) -> None:
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"AttentionPattern.kind must be one of {ATTENTION_KINDS}, "
                             f"got {self.kind!r}")
        if self.kind == "block_causal" and self.block_size < 1:
            raise ValueError(f"AttentionPattern.block_size must be >= 1 for block_causal "
                             f"attention, got {self.block_size}")
        if self.kind == "bidirectional" and self.block_size != 0:
            raise ValueError(f"AttentionPattern.block_size must be 0 for bidirectional "
                             f"attention, got {self.block_size}")

    @property
    def block_causal(self) -> bool:
        return self.kind == "block_causal"

    def __str__(self) -> str:
        return f"block_causal({self.block_size})" if self.block_causal else self.kind

    def allow(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """Which keys each query sees, from positions: q_pos [..., Lq], k_pos [..., Lk] ->
        [..., Lq, Lk] bool (True: attends); None when bidirectional (every key)."""
        if not self.block_causal:
            return None
        n = self.block_size
        return (k_pos // n).unsqueeze(-2) <= (q_pos // n).unsqueeze(-1)


BIDIRECTIONAL = AttentionPattern()


def block_causal(block_size: int) -> AttentionPattern:
    return AttentionPattern("block_causal", block_size)


class DenseContext:
    """Every query of a row attends to every (unmasked) key of the same row that the module's
    attention pattern lets it see; ``pattern`` replaces every module's own (research: a
    block-causal model at another block size, or with one block spanning the canvas)."""

    def __init__(self, key_mask: torch.Tensor | None = None,
                 pattern: AttentionPattern | None = None) -> None:
        if pattern is not None and not isinstance(pattern, AttentionPattern):
            raise ValueError(f"DenseContext pattern must be an AttentionPattern, got {pattern!r}")
        self.key_mask = key_mask  # [B, L] bool, True = real token
        self.pattern = pattern
        self._mask: tuple | None = None     # (positions, pattern, mask): one per forward

    def mask(self, pattern: AttentionPattern, positions: torch.Tensor) -> torch.Tensor | None:
        """SDPA's boolean mask, broadcastable to [B, 1, L, L] (None: every key), built once per
        forward."""
        if self._mask is not None and self._mask[0] is positions and self._mask[1] == pattern:
            return self._mask[2]
        keys = None if self.key_mask is None else self.key_mask[:, None, None, :]  # [B, 1, 1, L]
        mask = pattern.allow(positions, positions)            # [L, L] or [B, L, L]
        if mask is None:
            mask = keys
        else:
            mask = mask.unsqueeze(-3)                         # [1, L, L] or [B, 1, L, L]
            if keys is not None:
                # NOTE: a row always sees its own key: a padding row whose block holds only
                # padding keys would otherwise be all -inf (NaN), and its NaN K/V would poison
                # the next layer's real rows through 0 x NaN, although they mask it out
                eye = torch.eye(mask.shape[-1], dtype=torch.bool, device=mask.device)
                mask = (mask & keys) | eye
        self._mask = (positions, pattern, mask)
        return mask

    def attention(self, attn: Attention, layer: int, x: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
        q, k, v = attn.project(x)                              # q: [B, L, H, D], k/v: [B, L, Hkv, D]
        q, k = attn.rotary(q, positions), attn.rotary(k, positions)
        mask = self.mask(attn.pattern if self.pattern is None else self.pattern, positions)
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
    """q/k/v and output projections, the rotary embedding (``rotary``: one shared by every
    layer; partial when its ``rotary_dim`` < ``head_dim``) and which keys a query sees
    (``pattern``). ``qk_norm_eps``: per-head RMSNorm of q and k (weights ``[head_dim]``) before
    RoPE, with this epsilon (LLaDA2, Qwen3 / SDAR); None: none (LLaDA, Dream)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 rotary: Rotary, pattern: AttentionPattern = BIDIRECTIONAL,
                 qk_norm_eps: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.rotary = rotary
        self.pattern = pattern
        # NOTE: registered only when used, so LLaDA / Dream keep exactly their parameters (the
        # loader is strict, and seeded ``init_weights`` draws in parameter order)
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)

        self.qkv_proj: nn.Linear | None = None      # set by fuse(): q, k, v in one GEMM

    @torch.no_grad()
    def fuse(self) -> None:
        """Inference: replace q/k/v_proj by one Linear over their concatenated weights (one GEMM
        that streams the weights once, instead of three launches). The separate weights are
        freed; the math is unchanged."""
        parts = (self.q_proj, self.k_proj, self.v_proj)
        if self.qkv_proj is not None or any(type(p) is not nn.Linear for p in parts):
            return                  # fused already, or quantized unfused (each part its own GEMM)
        fused = concat_linears(parts)
        self.q_proj = self.k_proj = self.v_proj = None
        self.qkv_proj = fused

    def project(self, x: torch.Tensor, norm: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., d] -> q [..., H, D], k [..., Hkv, D], v [..., Hkv, D] (q/k normed when the
        module has a q/k norm and ``norm``; un-rotated)."""
        lead = x.shape[:-1]                                   # [B, L] or [T]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            q, k, v = dense(self.qkv_proj, x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.view(*lead, H, D), k.view(*lead, Hkv, D), v.view(*lead, Hkv, D)
        if self.q_norm is not None and norm:      # per head, over head_dim; at inference one
            q = add_rmsnorm(q, self.q_norm)[0]    # kernel each on CUDA (the module's own
            k = add_rmsnorm(k, self.k_norm)[0]    # arithmetic on the CPU and under autograd)
        return q, k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, layer: int, ctx) -> torch.Tensor:
        return dense(self.o_proj, ctx.attention(self, layer, x, positions))
