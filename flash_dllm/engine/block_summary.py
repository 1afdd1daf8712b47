"""What ``Engine._apply`` reads from a step's active blocks, for the whole batch at once.

For each request's block (a row of ``blocks [B, W]``, its first ``lens[i]`` slots real, the first
``leads[i]`` of them prompt slots on a block grid): how many MASK slots are left, whether an
end-of-answer id was committed (outside the prompt), the first slot that is MASK or an end of
answer (``lens[i]`` if none), and whether the first answer slot is committed.

Two implementations of the same rule: numpy over the batch, and plain Python over the rows'
lists for small steps, where numpy's per-call cost dominated the host's step (a batch-1 block of
4 slots: ``Engine._apply`` 109 us with numpy, 41 us with the rows, on the CPU of
``benchmarks/results/step/host_time_cpu.json``; the host's step time is part of every step's
time at small batch: ``benchmarks/findings/moe.md``). They agree on every
input (``tests/test_block_summary.py``)."""
from __future__ import annotations

import numpy as np

SMALL_SLOTS = 256        # blocks.size up to this: the Python rows


def summarize(blocks: np.ndarray, lens: list[int], leads: list[int], mask_id: int,
              stop_ids: tuple[int, ...]) -> tuple[list[int], list[bool], list[int], list[bool]]:
    """``(masked, stop_in_block, first_end, first_slot)``, a list each, one entry per row."""
    if blocks.size <= SMALL_SLOTS:
        return summarize_rows(blocks.tolist(), lens, leads, mask_id, stop_ids)
    return summarize_numpy(blocks, lens, leads, mask_id, stop_ids)


def summarize_rows(rows: list[list[int]], lens, leads, mask_id: int, stop_ids):
    stops = frozenset(stop_ids)
    masked, stop_in, first_end, first_slot = [], [], [], []
    for row, n, lead in zip(rows, lens, leads):
        m, stop, end = 0, False, n
        for j in range(n):
            v = row[j]
            if v == mask_id:
                m += 1
            elif j < lead or v not in stops:
                continue
            else:
                stop = True
            if end == n and j >= lead:
                end = j
        masked.append(m)
        stop_in.append(stop)
        first_end.append(end)
        first_slot.append(row[lead] != mask_id)
    return masked, stop_in, first_end, first_slot


def summarize_numpy(blocks: np.ndarray, lens, leads, mask_id: int, stop_ids):
    is_mask = blocks == mask_id
    is_stop = np.zeros_like(is_mask)
    for sid in stop_ids:                                        # a few ids: faster than isin
        is_stop |= blocks == sid
    lens = np.asarray(lens)
    if (lens != blocks.shape[1]).any():                         # padding columns
        pad = np.arange(blocks.shape[1])[None, :] >= lens[:, None]
        is_mask &= ~pad
        is_stop &= ~pad
        ends = is_mask | is_stop | pad
    else:
        ends = is_mask | is_stop
    lead = np.asarray(leads, dtype=np.int64)                   # prompt slots (on a grid)
    if lead.any():                                              # are no end of answer
        in_prompt = np.arange(blocks.shape[1])[None, :] < lead[:, None]
        is_stop &= ~in_prompt
        ends &= ~in_prompt
    first_end = np.where(ends.any(1), ends.argmax(1), lens).tolist()
    first_slot = (~is_mask[np.arange(len(lens)), lead]).tolist()
    return is_mask.sum(1).tolist(), is_stop.any(1).tolist(), first_end, first_slot
