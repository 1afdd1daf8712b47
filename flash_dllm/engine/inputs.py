"""Packing a step's index tensors on the host: which ids, positions, page slots and block-table
rows the forward reads. Pure functions of the batch (plus a block-table cache), so ``Engine.step``
reads as the schedule it is and these can be tested and changed on their own.

Every function builds its index arrays with numpy and sends them in ONE host->device copy
(``flash_dllm.transfer.h2d``, pinned and asynchronous on CUDA); device-side gathers only where the
positions themselves live on the device (flash top-k, sentinel refresh, verification rows).
"""
from __future__ import annotations

import numpy as np
import torch

from flash_dllm.engine.request import Request
from flash_dllm.kernels.paged_attention import seqlen_bound
from flash_dllm.layers.attention import PagedBatch
from flash_dllm.transfer import h2d


def same_batch(cached: list[Request] | None, batch: list[Request]) -> bool:
    """Is ``batch`` exactly the cached list of requests (by identity, in order)? The step caches
    key on this and hold the requests, so an id cannot be reused while compared."""
    return cached is not None and len(cached) == len(batch) and all(
        a is b for a, b in zip(cached, batch))


def range_positions(parts: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Host ranges ``[(q0, q1), ...]`` -> (their positions concatenated [T], lengths [B])."""
    q0 = np.array([p[0] for p in parts], dtype=np.int64)
    n = np.array([p[1] - p[0] for p in parts], dtype=np.int64)
    pos = np.arange(int(n.sum()), dtype=np.int64) + np.repeat(q0 - (np.cumsum(n) - n), n)
    return pos, n


def page_slots(table: np.ndarray, req: np.ndarray, pos: np.ndarray, page_size: int
               ) -> np.ndarray:
    """The page slot of each packed row (request ``req``, canvas position ``pos``): the host
    twin of ``cache.paged.slot_mapping``."""
    return table[req, pos // page_size] * page_size + pos % page_size


def ids_positions(arena: torch.Tensor, batch: list[Request], ids: list, parts: list,
                  blk_host: np.ndarray | None, dev: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray | None, torch.Tensor | None]:
    """The step's packed token ids and positions, and the arena indices ``blk_host`` of the
    active blocks on the device. ``parts``: host ranges ``(q0, q1)`` and device index tensors,
    in order; ``ids``: ``(request, q0, q1)`` for each range, device id tensors for the rest.
    When every part is a host range (one per request, in batch order), positions, the ids'
    arena indices and ``blk_host`` cross in ONE host->device copy and the ids are one gather
    from the arena (``[rows, max_position]``); the host positions are returned for
    ``paged_batch``."""
    nb = 0 if blk_host is None else blk_host.shape[0]
    if all(isinstance(p, tuple) for p in parts):
        pos, n = range_positions(parts)
        T = pos.shape[0]
        rows = np.array([r.arena_row for r in batch], dtype=np.int64)
        host = [pos, pos + np.repeat(rows * arena.shape[1], n)]
        if blk_host is not None:
            host.append(blk_host)
        both = h2d(np.concatenate(host), torch.long, dev)
        return arena.view(-1)[both[T:2 * T]], both[:T], pos, both[2 * T:] if nb else None
    ids_t = torch.cat([x[0].canvas[x[1]:x[2]] if isinstance(x, tuple) else x for x in ids])
    pos_t = torch.cat([torch.arange(p[0], p[1], device=dev) if isinstance(p, tuple) else p
                       for p in parts])
    return ids_t, pos_t, None, None if blk_host is None else h2d(blk_host, torch.long, dev)


def flash_extras(batch: list[Request], windows: list[tuple[int, int]], dev: torch.device
                 ) -> dict[int, torch.Tensor]:
    """cache="flash": for each flash request (by batch index) with a previous step, the
    ``flash_budget`` cached positions outside its window ``[q0, q1)`` that got the most
    attention mass in that step, ascending. One batched topk per previous-step mass tensor
    (normally one per step); a request's very first step recomputes its whole canvas."""
    groups: dict[tuple[int, int], list[int]] = {}
    for b, r in enumerate(batch):
        if r.params.cache == "flash" and r.mass_src is not None:
            q0, q1 = windows[b]
            k = min(r.params.flash_budget, r.canvas_len - (q1 - q0))
            if k > 0:      # same source and same k per topk call (ties: see select_top_k)
                groups.setdefault((id(r.mass_src[0]), k), []).append(b)
    out: dict[int, torch.Tensor] = {}
    for (_, k), members in groups.items():
        src = batch[members[0]].mass_src[0]                           # [rows, keys]
        row, q0, q1, length = h2d(
            [[batch[b].mass_src[1] for b in members], [windows[b][0] for b in members],
             [windows[b][1] for b in members], [batch[b].canvas_len for b in members]],
            torch.long, dev)[:, :, None]                              # one copy: 4 x [members, 1]
        rows = src[row[:, 0]]
        col = torch.arange(rows.shape[1], device=dev)[None, :]
        # NOTE: -1 for the window (mass >= 0 elsewhere), -inf past the canvas: never chosen
        # while k <= canvas - window, which the budget below guarantees
        rows = rows.masked_fill((col >= q0) & (col < q1), -1.0)
        rows = rows.masked_fill(col >= length, float("-inf"))
        top = torch.topk(rows, k, dim=-1).indices.sort(dim=-1).values   # [members, k]
        for j, b in enumerate(members):
            out[b] = top[j]
    return out


class BlockTables:
    """[B, width] int32 page ids of a batch's requests, rebuilt only when the batch changes
    (pages are fixed from admission to release)."""

    def __init__(self) -> None:
        # NOTE: holds the requests, so their ids cannot be reused while compared
        self._last: tuple[list[Request], np.ndarray] | None = None

    def get(self, batch: list[Request], width: int) -> np.ndarray:
        if self._last is not None and same_batch(self._last[0], batch):
            return self._last[1]
        table = np.zeros((len(batch), width), dtype=np.int32)
        for b, r in enumerate(batch):
            table[b, :len(r.pages)] = r.pages
        self._last = (list(batch), table)
        return table

    def forget(self, req: Request) -> None:
        """Drop the cached table if it holds ``req`` (released: do not keep it alive)."""
        if self._last is not None and any(r is req for r in self._last[0]):
            self._last = None

    @property
    def cached(self) -> bool:
        return self._last is not None


def paged_batch(kv: torch.Tensor, inv_freq: torch.Tensor, page_size: int, table: np.ndarray,
                batch: list[Request], positions: torch.Tensor, pos_host: np.ndarray | None,
                cu: list[int], uncached: list[tuple[int, int]], dev: torch.device) -> PagedBatch:
    """The step's index tensors on the paged cache (``table``: ``BlockTables.get``). When every
    packed position is a host range (``pos_host``: no flash top-k, sentinel refresh or
    verification rows), slots, block table, ``cu_q`` and ``seq_lens`` are computed on the host
    and cross in ONE int32 copy.

    NOTE: the table is always as wide as the longest possible canvas (the kernels read only each
    request's own columns), so a step's shape, hence its CUDA graph, does not depend on how long
    the requests' canvases happen to be."""
    ps = page_size
    B, width = table.shape
    T = positions.shape[0]
    host = np.zeros(T + (B + 1) + B + B * width, dtype=np.int32)
    host[2 * B + 1 + T:].reshape(B, width)[:] = table
    host[T:T + B + 1] = cu
    host[T + B + 1:T + 2 * B + 1] = [r.canvas_len for r in batch]
    if pos_host is not None:           # one request per range, in batch order
        host[:T] = page_slots(table, np.repeat(np.arange(B), np.diff(cu)), pos_host, ps)
    dev_all = h2d(host, torch.int32, dev)
    cu_t, lens_t = dev_all[T:T + B + 1], dev_all[T + B + 1:T + 2 * B + 1]
    table_t = dev_all[T + 2 * B + 1:].view(B, width)
    counts = [b - a for a, b in zip(cu, cu[1:])]
    if pos_host is not None:
        slots = dev_all[:T]
    else:
        req_idx = torch.repeat_interleave(torch.arange(B, device=dev),
                                          h2d(counts, torch.long, dev), output_size=T)
        slots = table_t[req_idx, positions // ps].long() * ps + positions % ps
        for a, b in uncached:           # verification rows: never written to the cache
            slots[a:b] = -1
    return PagedBatch(kv, slots, cu_t, lens_t, table_t, max(counts), inv_freq,
                      seqlen_bound(max(r.canvas_len for r in batch)))
