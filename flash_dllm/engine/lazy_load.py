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
