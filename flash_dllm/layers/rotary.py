"""Rotary position embedding, rotate-half form, frequencies computed in float32."""
from __future__ import annotations

import torch
from torch import nn


def capturing_graph(t: torch.Tensor) -> bool:
    """Whether ``t``'s device stream is capturing a CUDA graph now."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class Rotary(nn.Module):
    """Applies RoPE to q/k given explicit integer positions (tokens need not be contiguous).

    ``rotary_dim`` (default ``head_dim``): only the first ``rotary_dim`` values of each head
    rotate (rotate-half pairing inside that slice, frequencies ``1 / theta^(2i / rotary_dim)``);
    the rest pass through unchanged. LLaDA2 rotates half of each head (``partial_rotary_factor``
    0.5), as transformers' partial-rotary models (GPT-NeoX, Phi, GLM) do."""

    def __init__(self, head_dim: int, theta: float, apply_in_fp32: bool,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not (0 < rotary_dim <= head_dim and rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], "
                             f"got {rotary_dim}")
        self.apply_in_fp32 = apply_in_fp32
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        # NOTE: a plain attribute, not a buffer: `model.to(bfloat16)` would round a buffer, and the
        # frequencies must stay float32 (both reference implementations compute them so).
        self._inv_freq = {
            "cpu": 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32,
                                                 device="cpu") / rotary_dim))}

    def _freqs(self, device: torch.device) -> torch.Tensor:
        key = str(device)
        if key not in self._inv_freq:
            self._inv_freq[key] = self._inv_freq["cpu"].to(device)
        return self._inv_freq[key]

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: every layer of one forward passes the same `positions` tensor (and q and k both
        # need it), so the tables are computed once per forward, not 2 x layers times.
        # NOTE (CUDA graphs): a capture runs its forward twice with the same static `positions`
        # (a warm-up, then the capture). A hit across the two would hand the graph the warm-up's
        # tables: memory outside the graph that only this cache keeps alive, freed by the next
        # forward; the replays then read freed memory (wrong rotations, or an illegal memory
        # access once the allocator gave it back: the LLaDA2 crash of issue 39). So the cache
        # only serves the capture state that filled it.
        capturing = capturing_graph(positions)
        cached = getattr(self, "_last", None)
        if cached is not None and cached[0] is positions and cached[3] == capturing:
            return cached[1], cached[2]
        freqs = positions.float().unsqueeze(-1) * self._freqs(positions.device)  # [..., R/2]
        emb = torch.cat((freqs, freqs), dim=-1)                        # [..., R] (rotary_dim)
        cos, sin = emb.cos(), emb.sin()
        self._last = (positions, cos, sin, capturing)
        return cos, sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [..., tokens, heads, head_dim]; positions: [..., tokens] (broadcastable)."""
        if self.rotary_dim < x.shape[-1]:
            r = self.rotary_dim
            return torch.cat([self._rotate(x[..., :r], positions), x[..., r:]], dim=-1)
        return self._rotate(x, positions)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE over all of ``x``'s last dimension (``rotary_dim`` values)."""
        cos, sin = self.cos_sin(positions)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)       # [..., tokens, 1, rotary_dim]
        if self.apply_in_fp32:
            xf = x.float()
            return (xf * cos + self._rotate_half(xf) * sin).to(x.dtype)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return x * cos + self._rotate_half(x) * sin
