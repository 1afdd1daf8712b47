"""Host-side index math of a paged step: page slots, block-causal splits, aligned packing (numpy).

Split out of ``layers/attention_backend.py`` (which builds the step's metadata from them).
"""
from __future__ import annotations

import numpy as np


def split_blocks(table: np.ndarray, canvas_lens: list[int], pos: np.ndarray, cu: list[int],
                 block_size: int) -> tuple[np.ndarray, list[int], list[int]]:
    """Block-causal attention as bidirectional attention over shorter canvases: each request's
    rows (a contiguous window, ``pos`` in order) are cut at block bounds, and the rows of block
    k attend, through the request's own block table, to its first ``min(L, (k + 1) *
    block_size)`` keys only: their own block and every earlier one. Returns the split (block
    table rows, key counts, row boundaries); the packed rows keep their order, so the output
    needs no reordering, and the paged kernels need no mask."""
    rows, lens, bounds = [], [], [0]
    for b in range(len(canvas_lens)):
        a, e = cu[b], cu[b + 1]
        if e == a:
            rows.append(b)
            lens.append(canvas_lens[b])
            bounds.append(e)
            continue
        blk = pos[a:e] // block_size                        # non-decreasing: one window
        cuts = np.flatnonzero(np.diff(blk)) + 1
        for s, t_end, k in zip(np.r_[0, cuts], np.r_[cuts, e - a], blk[np.r_[0, cuts]]):
            rows.append(b)
            lens.append(min(canvas_lens[b], (int(k) + 1) * block_size))
            bounds.append(a + int(t_end))
    return table[rows], lens, bounds


def _align4(n: int) -> int:
    """``n`` int32 elements rounded up to a 16-byte boundary."""
    return -(-n // 4) * 4


def page_slots(table: np.ndarray, req: np.ndarray, pos: np.ndarray, page_size: int
               ) -> np.ndarray:
    """The page slot of each packed row (request ``req``, canvas position ``pos``), on the host:
    ``table[req, pos // page_size] * page_size + pos % page_size``."""
    return table[req, pos // page_size] * page_size + pos % page_size
