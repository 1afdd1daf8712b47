"""Per-slot proposals: the token a masked slot would take, and the model's confidence in it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flash_dllm.kernels import argmax_confidence


@dataclass(frozen=True)
class RowGroup:
    """Rows ``start:end`` of the logits belong to one request with these sampling knobs."""

    start: int
    end: int
    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus top-p to -inf (the best token always survives)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def propose(logits: torch.Tensor, groups: list[RowGroup],
            forbid: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> (tokens [N] long, confidence [N] float32).

    ``forbid`` (the MASK id) is never proposed: committing MASK would leave a slot masked forever.

    Temperature 0 is argmax. Temperature > 0 samples from softmax(filtered logits / T) by
    Gumbel-max with the request's own generator. Confidence is the softmax probability of the
    chosen token under the *unfiltered, untempered* logits, computed as LLaDA's reference does
    (softmax then gather), so confidence ties break the same way.

    Greedy rows take one fused pass over the logits (``kernels/argmax_confidence``: Triton on
    CUDA, the same math as below on the CPU); sampled groups then overwrite their own rows.
    """
    # NOTE: every row's greedy proposal comes from the same kernel whatever the other rows'
    # policies are, so a greedy request's confidences never depend on who shares its batch
    tokens, confidence = argmax_confidence.op(logits, forbid)
    for g in groups:
        if g.temperature <= 0.0 or g.end <= g.start:
            continue
        rows = logits[g.start:g.end].float()
        choose = rows
        if forbid is not None:
            choose = rows.clone()
            choose[:, forbid] = float("-inf")
        choose = filter_top_k_top_p(choose, g.top_k, g.top_p) / g.temperature
        u = torch.rand(choose.shape, generator=g.generator, device=choose.device,
                       dtype=torch.float64).clamp_(min=1e-20)
        gumbel = -torch.log(-torch.log(u))
        tok = (choose.double() + gumbel).argmax(dim=-1)
        tokens[g.start:g.end] = tok
        # NOTE: the normaliser keeps the forbidden id's mass, as the reference's softmax does.
        conf = torch.softmax(rows, dim=-1).gather(-1, tok[:, None]).squeeze(-1)
        confidence[g.start:g.end] = conf
    return tokens, confidence
