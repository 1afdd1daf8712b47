"""Commit rules: which proposed tokens a step keeps. Pure functions of confidences."""
from __future__ import annotations

import torch

from flash_dllm.transfer import h2d


def group_ids(n: int, bounds: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """Row -> index (in ``bounds`` order) of the group whose ``[start, end)`` holds it, -1 for rows
    of no listed group: the layout ``select_threshold`` and the verify rules take."""
    # NOTE: built on the host and copied once (a fill per group would be one launch per request)
    gid = [-1] * n
    for g, (start, end) in enumerate(bounds):
        gid[start:end] = [g] * (end - start)
    return h2d(gid, torch.long, torch.device(device))


def select_top_k(confidence: torch.Tensor, positions: torch.Tensor, group_bounds: list[tuple[int, int]],
                 k_per_group: list[int], canvas_lens: list[int]) -> torch.Tensor:
    """LLaDA ``vanilla``: in each group commit its ``k`` most confident slots.

    NOTE: confident models saturate float32 probabilities at exactly 1.0, so ties are common and
    the tie-break decides the commit order. We reproduce the reference's: ``torch.topk`` over a row
    the length of the canvas, -inf everywhere but the candidate slots (rows of equal length and
    equal k are stacked into one topk call; padding rows to a common length, or taking the first k
    of a larger topk, could change the tie order).
    """
    keep = torch.zeros_like(confidence, dtype=torch.bool)
    dev = confidence.device
    # NOTE: rows are batched only with rows of the same length AND the same k: topk(x, kmax)[:k]
    # may pick other tied elements than topk(x, k)
    by_len: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for (start, end), k, length in zip(group_bounds, k_per_group, canvas_lens):
        if end > start and k > 0:
            by_len.setdefault((length, min(k, end - start)), []).append((start, end))
    if not by_len:
        return keep
    # Every group's row lives in ONE [G, longest] buffer filled by one scatter; each (length, k)
    # batch runs its topk on its rows' first ``length`` columns (a view: the same values in the
    # same order as the row the per-request rule builds, so ties break the same way), and the
    # chosen positions of all batches are scattered back at once. What a distinct canvas length
    # costs is its topk and one copy (serving mixes many prompt lengths; it cost ~12 launches).
    slot: list[int] = []
    grow: list[int] = []
    row = 0
    for groups in by_len.values():
        for s, e in groups:
            slot += range(s, e)
            grow += [row] * (e - s)
            row += 1
    n, G = len(slot), row
    longest = max(length for length, _ in by_len)
    kmax = max(k for _, k in by_len)
    idx = h2d(slot + grow, torch.long, dev)         # one host->device copy
    slot_d, grow_d = idx[:n], idx[n:]
    pos = positions[slot_d]
    rows = torch.full((G, longest), float("-inf"), dtype=confidence.dtype, device=dev)
    rows[grow_d, pos] = confidence[slot_d]
    # unused entries point at a dump column past the end, so the one scatter never collides
    chosen = torch.full((G, kmax), longest, dtype=torch.long, device=dev)
    a = 0
    for (length, k), groups in by_len.items():
        b = a + len(groups)
        chosen[a:b, :k] = torch.topk(rows[a:b, :length], k, dim=-1).indices
        a = b
    local = torch.zeros((G, longest + 1), dtype=torch.bool, device=dev).scatter_(1, chosen, True)
    keep[slot_d] = local[grow_d, pos]
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


# ------------------------------------------------------------------ graph-safe (static shapes)
# The same rules on a [B, block] layout with static shapes and no host work inside the call, so a
# whole step can be captured in a CUDA graph (``worker/fused_step.py``). Each agrees exactly with
# its general twin above on the same inputs (tests/test_fused_step.py).

def threshold_rows(conf: torch.Tensor, masked: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """``select_threshold`` on each row's masked slots (every row has one): conf >= tau[b], and
    always the row's first slot of the highest confidence. conf/masked [B, bl], tau [B] -> keep."""
    B, bl = conf.shape
    c = torch.where(masked, conf, -1.0).view(-1)               # probabilities are >= 0
    gid = torch.arange(B, device=c.device).repeat_interleave(bl)
    return select_threshold(c, gid, B, tau.to(c.dtype)).view(B, bl) & masked


def top_k_rows(conf: torch.Tensor, masked: torch.Tensor, perm: torch.Tensor,
               bstart: torch.Tensor, groups: tuple) -> torch.Tensor:
    """``select_top_k`` on a [B, bl] layout: per (canvas length, k) group one topk over rows the
    length of the canvas, -inf but at the masked slots (k <= masked slots, so only those are
    chosen). ``groups``: (length, k, a, e) over ``perm[a:e]`` (row indices of the group);
    ``bstart`` [B]: each row's block start. conf/masked [B, bl] -> keep."""
    B, bl = conf.shape
    dev = conf.device
    c = torch.where(masked, conf, float("-inf"))
    pos = bstart[:, None] + torch.arange(bl, device=dev)             # [B, bl] canvas slots
    keep = torch.zeros(B, bl, dtype=torch.bool, device=dev)
    for length, k, a, e in groups:
        members = perm[a:e]
        rows = torch.full((e - a, length), float("-inf"), dtype=c.dtype, device=dev)
        rows.scatter_(1, pos[members], c[members])
        chosen = torch.topk(rows, k, dim=-1).indices - bstart[members][:, None]
        keep[members] = torch.zeros(e - a, bl, dtype=torch.bool, device=dev).scatter_(
            1, chosen, True)
    return keep
