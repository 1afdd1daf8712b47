"""Lazy loading for requests larger than the GPU pool (``--lazy-load-budget``, approximate):
which host pages a step loads, and the sentinel that says when that choice went stale.

``cache/io/kv_overflow.py`` runs it: after a block's refresh, a **measuring step** loads every
page and measures (last layer) the attention mass the active block's rows give each page; the
block's later **lazy steps** attend to the GPU-resident pages plus the share ``F`` of the
other pages that ``select_pages`` ranks highest, so they load only the host pages among
those (which pages are resident is the placement's choice, ``cache/io/overflow_placement.py``).
With ``--lazy-load-sentinel J`` every lazy step also measures the mass its loaded pages get;
when the ``SENTINEL_TOP_K`` most attended of them overlap those of the measuring step by less
than ``J`` (Jaccard), the block's attention has moved, and the next step is a measuring step
again: it loads every page (the skipped ones included) and chooses anew.
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
    keep: np.ndarray | None = None          # stage slot of each page of ``table``
    watched: np.ndarray | None = None       # indices into ``keep``: the sentinel's pages
    wanted: int = 0                         # pages of largest score the step attends to
    hits: int = 0                           # of those, the GPU-resident ones


# pages in the lazy-load sentinel's top sets (at most half the watched pages: a set of them all
# never changes)
SENTINEL_TOP_K = 8


def sentinel_overlap(ref: np.ndarray, keep: np.ndarray, watched: np.ndarray,
                     mass: np.ndarray) -> float:
    """Jaccard overlap of the ``SENTINEL_TOP_K`` most attended watched pages now (``mass``, per
    page of the compacted table ``keep``) and at the block's measuring step (``ref``, per
    stage slot). Ties break towards the lower page."""
    k = max(1, min(SENTINEL_TOP_K, len(watched) // 2))
    now = set(watched[np.argsort(-mass[watched], kind="stable")[:k]].tolist())
    then = set(watched[np.argsort(-ref[keep[watched]], kind="stable")[:k]].tolist())
    return len(now & then) / len(now | then)


def select_pages(score: np.ndarray, budget: float, written: np.ndarray, spill: int
                 ) -> tuple[list[tuple[int, int]], int, int]:
    """Which host pages a lazy step loads. Everything is in **stage order** (``kv_overflow``:
    slots ``0..spill-1`` are the host pages, the others the GPU-resident ones): ``score`` [n]
    predicts the attention each page gets, ``written`` [n] (bool) marks the pages the step
    rewrites (all of such a page must be there to go back).

    The step attends to the resident pages plus the ``k = ceil(budget * m)`` pages of largest
    score among the ``m`` pages it does not write (wherever they live), so it loads the host
    pages among those ``k`` (in chunks of ``ceil(spill / 256)`` host pages, fewer and larger
    copies: the chunks of most ranked score) and the written host pages. A placement that keeps
    the most attended pages resident (``cache/io/overflow_placement.py``) therefore loads fewer.

    Returns (sorted disjoint host-page ranges ``[a, b)``, ``k``, how many of the ``k`` are
    resident: the step's L0 hits).

    NOTE: the written pages are left out of the ranking: the active block attends to itself
    most, so ranked with the rest they took the whole budget and the prompt's pages were all
    skipped (demo arith, threshold: 88 % at budgets 0.25 and 0.1 alike, against 98 %)."""
    n, s = score.shape[0], spill
    ranked = ~np.asarray(written, dtype=bool)
    m = int(ranked.sum())
    k = min(m, int(np.ceil(budget * m - 1e-9)))
    order = np.argsort(-np.where(ranked, score, -np.inf), kind="stable")[:k]
    want = int((order < s).sum())                    # of the k, those in host memory
    pick = np.zeros(s, dtype=bool)
    if want == int(ranked[:s].sum()):                # every host page it could skip: all
        pick[:] = True
    elif want:
        chunk = -(-s // 256)
        starts = np.arange(0, s, chunk)
        r = ranked[:s]
        # a chunk's score: its ranked pages' sum (a chunk of written pages only comes last)
        per_chunk = np.where(np.logical_or.reduceat(r, starts),
                             np.add.reduceat(np.where(r, score[:s], 0.0), starts), -np.inf)
        for c in np.argsort(-per_chunk, kind="stable")[:-(-want // chunk)]:
            pick[c * chunk:(c + 1) * chunk] = True
    pick |= ~ranked[:s]
    return runs(pick), k, k - want


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """The runs of True in ``mask`` as sorted ranges ``[a, b)``."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], np.asarray(mask, dtype=np.int8), [0]))))
    return [(int(a), int(b)) for a, b in zip(edges[0::2], edges[1::2])]


# which pages a lazy step loads: ``mass`` (the attention each page got at the block's measuring
# step, for every lazy step of the block) or ``quest`` (re-chosen after every lazy step from an
# upper bound of the attention its queries can give each page, from per-page key summaries)
# (the value: whether it keeps per-page key summaries instead of the measuring step's mass)
KEY_SUMMARIES = {"mass": False, "quest": True}
LAZY_PREDICTORS = tuple(KEY_SUMMARIES)          # (config.py's lazy_load_predictor choices, tested)


def key_summary(keys: torch.Tensor, tail: tuple[int, int] | None = None,
                out: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page, per-channel minimum and maximum of the (rotated) keys: [pages, page_size, Hkv,
    D] -> ([pages, Hkv, D], [pages, Hkv, D]) in the keys' dtype (Quest's page summary: with
    every layer's kept, 2 / page_size of the spilled keys' bytes; min and max are exact in any
    dtype). ``tail`` = (page, valid slots): the canvas's partial last page, summarised over its
    first ``valid`` slots only. ``out``: the (min, max) tensors to write (preallocated).

    NOTE: the slots past the canvas were never written (the pool and the stage are
    ``torch.empty``): their bytes are anything, NaN or 1e38 included, and summarised with the
    rest they made that page's bound the largest of every head and every other page's score
    underflow to 0 (a CI run whose memory held large values)."""
    if out is None:
        kmin, kmax = keys.amin(1), keys.amax(1)
    else:
        kmin, kmax = torch.amin(keys, 1, out=out[0]), torch.amax(keys, 1, out=out[1])
    if tail is not None:
        page, valid = tail
        kmin[page], kmax[page] = keys[page, :valid].amin(0), keys[page, :valid].amax(0)
    return kmin, kmax


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


def plan_lazy(score: np.ndarray, budget: float, written: np.ndarray, spill: int,
              page_size: int, canvas_len: int, last: int, like: torch.Tensor,
              key: tuple[int, int]) -> LazyPlan:
    """The host pages a lazy step loads (``select_pages``, stage order: ``score`` and
    ``written`` [n]) and, when some are skipped, the compacted block table its attention reads:
    the kept host pages, then the resident ones, the partial last page last (``last``: the
    stage slot of the canvas's last logical page). ``like``: the step's block table (shape and
    device); ``key``: the written logical pages, by which the plan is kept for the block."""
    ps, s, n = page_size, spill, score.shape[0]
    ranges, wanted, hits = select_pages(score, budget, written, s)
    if ranges == [(0, s)]:
        return LazyPlan(key, ranges, wanted=wanted, hits=hits)
    kept = np.ones(n, dtype=bool)                   # the loaded host pages and the resident
    kept[:s] = False
    for a, b in ranges:
        kept[a:b] = True
    keep = np.flatnonzero(kept)
    if kept[last] and canvas_len % ps:              # the partial last page goes last
        keep = np.concatenate([keep[keep != last], [last]])
        keys = (len(keep) - 1) * ps + canvas_len % ps
    else:
        keys = len(keep) * ps
    # the sentinel watches the loaded host pages it could have skipped (not the written)
    watched = np.flatnonzero((keep < s) & ~np.asarray(written, dtype=bool)[keep])
    table = np.zeros(like.shape, dtype=np.int32)
    table[0, :len(keep)] = keep
    return LazyPlan(key, ranges, h2d(table, torch.int32, like.device),
                    h2d([keys], torch.int32, like.device), seqlen_bound(keys),
                    s - sum(b - a for a, b in ranges), keep,
                    watched if len(watched) >= 2 else None, wanted, hits)


def quest_layer_scores(meta, attn, layer: int, x: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
    """The bounds of a step's queries at ``layer`` on every page [n], in stage order (an
    overflow step's ``OverflowMetadata``; on a measuring step, whose stage holds every page, the
    layer's key summary is made first: of the resident pages too, so a step's largest bounds
    can fall on pages it need not load)."""
    n = meta.copies.plan.num_pages
    if meta.quest_measure:
        if layer == 0:
            meta.quest.summary = []
        buf = meta.copies.kv.summary                 # [layers, 2, max_pages, Hkv, D]
        meta.quest.summary.append(key_summary(meta.copies.kv_of(layer)[0][:n], meta.quest_tail,
                                              out=(buf[layer, 0, :n], buf[layer, 1, :n])))
    q, _, _ = attn.project(x)
    q = attn.rotary(q, positions)
    score = quest_scores(q, *meta.quest.summary[layer])
    if meta.tp is not None:                  # every rank chooses the same pages
        meta.tp.reduce_heads(score)
    return score
