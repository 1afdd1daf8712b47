"""Commit rules: which proposed tokens a step keeps. Pure functions of confidences."""
from __future__ import annotations

import torch


def group_ids(n: int, bounds: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """Row -> index (in ``bounds`` order) of the group whose ``[start, end)`` holds it, -1 for rows
    of no listed group: the layout ``select_threshold`` and the verify rules take."""
    gid = torch.full((n,), -1, dtype=torch.long, device=device)
    for g, (start, end) in enumerate(bounds):
        gid[start:end] = g
    return gid


def select_top_k(confidence: torch.Tensor, positions: torch.Tensor, group_bounds: list[tuple[int, int]],
                 k_per_group: list[int], canvas_lens: list[int]) -> torch.Tensor:
    """LLaDA ``vanilla``: in each group commit its ``k`` most confident slots.

    NOTE: confident models saturate float32 probabilities at exactly 1.0, so ties are common and
    the tie-break decides the commit order. We reproduce the reference's: ``torch.topk`` over a row
    the length of the canvas, -inf everywhere but the candidate slots. This costs one small topk
    per request; a vectorised rule would break ties differently.
    """
    keep = torch.zeros_like(confidence, dtype=torch.bool)
    for (start, end), k, length in zip(group_bounds, k_per_group, canvas_lens):
        if end <= start or k <= 0:
            continue
        row = torch.full((length,), float("-inf"), dtype=confidence.dtype, device=confidence.device)
        row[positions[start:end]] = confidence[start:end]
        chosen = torch.topk(row, min(k, end - start)).indices           # canvas positions
        local = torch.zeros(length, dtype=torch.bool, device=confidence.device)
        local[chosen] = True
        keep[start:end] = local[positions[start:end]]
    return keep


def select_threshold(confidence: torch.Tensor, group_ids: torch.Tensor, num_groups: int,
                     threshold: torch.Tensor) -> torch.Tensor:
    """Fast-dLLM ``threshold``: every slot with confidence >= its group's threshold, and always the
    group's single most confident slot (the earliest on ties), so each step makes progress.

    confidence [N], group_ids [N] (0..num_groups-1), threshold [num_groups] -> keep [N] bool.
    """
    n = confidence.shape[0]
    best = torch.full((num_groups,), float("-inf"), dtype=confidence.dtype, device=confidence.device)
    best = best.scatter_reduce(0, group_ids, confidence, reduce="amax")
    idx = torch.arange(n, device=confidence.device)
    cand = torch.where(confidence == best[group_ids], idx, torch.full_like(idx, n))
    first = torch.full((num_groups,), n, dtype=idx.dtype, device=idx.device)
    first = first.scatter_reduce(0, group_ids, cand, reduce="amin")
    return (confidence >= threshold[group_ids]) | (idx == first[group_ids])
