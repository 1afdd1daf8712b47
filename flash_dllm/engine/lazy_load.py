"""Lazy loading for requests larger than the GPU pool (``--lazy-load-budget``, approximate):
which host pages a step loads, and the sentinel that says when that choice went stale.

``engine/kv_overflow.py`` runs it: after a block's refresh, a **measuring step** loads every
page and measures (last layer) the attention mass the active block's rows give each page; the
block's later **lazy steps** load only the pages ``select_pages`` picks from that mass and
attend to those (plus the GPU-resident ones). With ``--lazy-load-sentinel J`` every lazy step
also measures the mass its loaded pages get; when the ``SENTINEL_TOP_K`` most attended of them
overlap those of the measuring step by less than ``J`` (Jaccard), the block's attention has
moved, and the next step is a measuring step again: it loads every page (the skipped ones
included) and chooses anew.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flash_dllm.kernels.paged_attention import seqlen_bound
from flash_dllm.transfer import h2d


@dataclass
class LazyPlan:
    """A lazy step's loads, kept for the block's later steps with the same written pages."""

    written: tuple[int, int]
    ranges: list[tuple[int, int]]
    table: torch.Tensor | None = None       # compacted [1, width] block table (device)
    seq_lens: torch.Tensor | None = None
    max_k: int = 0
    skipped: int = 0
    keep: np.ndarray | None = None          # logical page of each page of ``table``
    watched: np.ndarray | None = None       # indices into ``keep``: the sentinel's pages


# pages in the lazy-load sentinel's top sets (at most half the watched pages: a set of them all
# never changes)
SENTINEL_TOP_K = 8


def sentinel_overlap(ref: np.ndarray, keep: np.ndarray, watched: np.ndarray,
                     mass: np.ndarray) -> float:
    """Jaccard overlap of the ``SENTINEL_TOP_K`` most attended watched pages now (``mass``, per
    page of the compacted table ``keep``) and at the block's measuring step (``ref``, per
    logical page). Ties break towards the lower page."""
    k = max(1, min(SENTINEL_TOP_K, len(watched) // 2))
    now = set(watched[np.argsort(-mass[watched], kind="stable")[:k]].tolist())
    then = set(watched[np.argsort(-ref[keep[watched]], kind="stable")[:k]].tolist())
    return len(now & then) / len(now | then)


def select_pages(mass: np.ndarray, budget: float, written: tuple[int, int]
                 ) -> list[tuple[int, int]]:
    """Which spilled pages a lazy step loads, as sorted disjoint ranges ``[a, b)``: every
    spilled page in ``written`` (the step rewrites part of it, so all of it must be there to go
    back), plus the ``ceil(budget * spill)`` other pages of most attention ``mass`` [spill],
    chosen in chunks of ``ceil(spill / 256)`` pages (fewer, larger copies).

    NOTE: the written pages are left out of the ranking: the active block attends to itself
    most, so ranked with the rest they took the whole budget and the prompt's pages were all
    skipped (demo arith, threshold: 88 % at budgets 0.25 and 0.1 alike, against 98 %)."""
    s = mass.shape[0]
    w0, w1 = max(0, written[0]), max(0, min(s, written[1]))
    ranked = np.ones(s, dtype=bool)
    ranked[w0:w1] = False
    chunk = -(-s // 256)
    n_chunks = -(-s // chunk)
    starts = np.arange(0, s, chunk)
    # a chunk's mass: its ranked pages' sum (a chunk of written pages only comes last)
    per_chunk = np.where(np.logical_or.reduceat(ranked, starts),
                         np.add.reduceat(np.where(ranked, mass, 0.0), starts), -np.inf)
    take = min(n_chunks, -(-int(np.ceil(budget * s)) // chunk))
    pick = np.zeros(s, dtype=bool)
    for c in np.argsort(-per_chunk, kind="stable")[:take]:
        pick[c * chunk:(c + 1) * chunk] = True
    pick[w0:w1] = True
    ranges, a = [], None
    for i, p in enumerate(pick.tolist() + [False]):
        if p and a is None:
            a = i
        elif not p and a is not None:
            ranges.append((a, i))
            a = None
    return ranges


# which pages a lazy step loads: ``mass`` (the attention each page got at the block's measuring
# step, for every lazy step of the block) or ``quest`` (re-chosen after every lazy step from an
# upper bound of the attention its queries can give each page, from per-page key summaries)
LAZY_PREDICTORS = ("mass", "quest")


def key_summary(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page, per-channel minimum and maximum of the (rotated) keys: [pages, page_size, Hkv,
    D] -> ([pages, Hkv, D], [pages, Hkv, D]) in the keys' dtype (Quest's page summary: with
    every layer's kept, 2 / page_size of the spilled keys' bytes; min and max are exact in any
    dtype)."""
    return keys.amin(1), keys.amax(1)


def quest_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """How much attention the query rows ``q`` [T, H, D] (rotated) can give each page at most,
    from its key summary ``kmin``/``kmax`` [pages, Hkv, D]: per head, an upper bound of every
    row's logit, ``sum_d max(q_d * k_d)`` over the corners of the rows' and the page's boxes
    (``q_d`` in [min, max] over the rows, ``k_d`` in [kmin_d, kmax_d]); then per page the sum
    over heads of ``exp(scale * (bound - the head's largest bound))``. -> [pages] float32, > 0.

    NOTE: one bound for all rows (the box over the rows) instead of Quest's per-row bounds: it
    is looser but costs H x pages x D instead of T x H x pages x D (an 8B model's 64K-token
    request: 4k pages)."""
    T, H, D = q.shape
    Hkv = kmin.shape[1]
    qf = q.float()
    qlo, qhi = qf.amin(0), qf.amax(0)                                  # [H, D]
    lo = kmin.float().repeat_interleave(H // Hkv, dim=1).transpose(0, 1)   # [H, pages, D]
    hi = kmax.float().repeat_interleave(H // Hkv, dim=1).transpose(0, 1)
    a, b = qlo[:, None, :], qhi[:, None, :]
    corner = torch.maximum(torch.maximum(a * lo, a * hi), torch.maximum(b * lo, b * hi))
    bound = corner.sum(-1) * D ** -0.5                                  # [H, pages]
    return (bound - bound.amax(-1, keepdim=True)).exp().sum(0)


def quest_scores_reference(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """What ``quest_scores`` bounds, computed exactly: per head, the largest logit any row of
    ``q`` [T, H, D] gives any key of each page ``keys`` [pages, page_size, Hkv, D] ->
    [H, pages] (tests: the bound must be >= this)."""
    T, H, D = q.shape
    P, ps, Hkv, _ = keys.shape
    k = keys.float().repeat_interleave(H // Hkv, dim=2)                # [P, ps, H, D]
    logits = torch.einsum("thd,pshd->htps", q.float(), k) * D ** -0.5
    return logits.amax(1).amax(-1)                                     # [H, P]


def plan_lazy(mass: np.ndarray, budget: float, written: tuple[int, int], spill: int,
              num_pages: int, page_size: int, canvas_len: int, like: torch.Tensor) -> LazyPlan:
    """The spilled pages a lazy step loads (``select_pages`` on ``mass`` [spill]) and, when some
    are skipped, the compacted block table its attention reads: the kept spilled pages, then
    the resident ones (the partial last page stays last). ``like``: the step's block table
    (shape and device)."""
    ps, s, n = page_size, spill, num_pages
    ranges = select_pages(mass, budget, written)
    if ranges == [(0, s)]:
        return LazyPlan(written, ranges)
    keep = [p for a, b in ranges for p in range(a, b)] + list(range(s, n))
    # the sentinel watches the loaded host pages it could have skipped (not the written)
    w0, w1 = written
    watched = [i for i, p in enumerate(keep) if p < s and not w0 <= p < w1]
    keys = (len(keep) - 1) * ps + (canvas_len - (n - 1) * ps)
    table = np.zeros(like.shape, dtype=np.int32)
    table[0, :len(keep)] = keep
    return LazyPlan(written, ranges, h2d(table, torch.int32, like.device),
                    h2d([keys], torch.int32, like.device), seqlen_bound(keys),
                    s - sum(b - a for a, b in ranges), np.asarray(keep),
                    np.asarray(watched) if len(watched) >= 2 else None)


def quest_layer_scores(meta, attn, layer: int, x: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
    """The bounds of a step's queries at ``layer`` on every spilled page [spill] (an overflow
    step's ``OverflowMetadata``; on a measuring step, whose stage holds every page, the
    layer's key summary is made first)."""
    s = meta.copies.plan.spill
    if meta.quest_measure:
        if layer == 0:
            meta.quest.summary = []
        meta.quest.summary.append(key_summary(meta.copies.kv_of(layer)[0][:s]))
    q, _, _ = attn.project(x)
    q = attn.rotary(q, positions)
    score = quest_scores(q, *meta.quest.summary[layer])
    if meta.tp is not None:                  # every rank chooses the same pages
        meta.tp.reduce_heads(score)
    return score
