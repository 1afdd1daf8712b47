"""A step's inputs on the general path: which ids and positions the forward reads, where each
request's rows are, and the attention metadata; built from the plan on the host.

Every function builds its index arrays with numpy and sends them in ONE host->device copy
(``flash_dllm.transfer.h2d``, pinned and asynchronous on CUDA); device-side gathers only where the
positions themselves live on the device (flash top-k, sentinel refresh, verification rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flash_dllm.decoding import drift
from flash_dllm.decoding.sampling import RowGroup
from flash_dllm.layers.attention_backend import Segment
from flash_dllm.transfer import h2d
from flash_dllm.worker.verify_step import VerifyPlan, plan_verification


def same_batch(cached: list | None, batch: list) -> bool:
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


class BlockTables:
    """[B, width] int32 page ids of a batch's requests, rebuilt only when the batch changes
    (pages are fixed from admission to release)."""

    def __init__(self) -> None:
        # NOTE: holds the requests, so their ids cannot be reused while compared
        self._last: tuple[list, np.ndarray] | None = None

    def get(self, batch: list, pages: list[list[int]], width: int) -> np.ndarray:
        if self._last is not None and same_batch(self._last[0], batch):
            return self._last[1]
        table = np.zeros((len(batch), width), dtype=np.int32)
        for b, row in enumerate(pages):
            table[b, :len(row)] = row
        self._last = (list(batch), table)
        return table

    def forget(self, request_id: str) -> None:
        """Drop the cached table if it holds the request (released: do not keep it alive)."""
        if self._last is not None and any(r.request_id == request_id for r in self._last[0]):
            self._last = None

    @property
    def cached(self) -> bool:
        return self._last is not None


def ids_positions(arena: torch.Tensor, arena_rows: list[int], ids: list, parts: list,
                  blk_host: np.ndarray, dev: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray | None, torch.Tensor]:
    """The step's packed token ids and positions, and the arena indices ``blk_host`` of the
    active blocks on the device. ``parts``: host ranges ``(q0, q1)`` and device index tensors,
    in order; ``ids``: ``(arena row, q0, q1)`` for each range, device id tensors for the rest.
    When every part is a host range (one per request, in batch order), positions, the ids'
    arena indices and ``blk_host`` cross in ONE host->device copy and the ids are one gather
    from the arena (``[rows, max_position]``); the host positions are returned for the
    attention metadata."""
    W = arena.shape[1]
    if all(isinstance(p, tuple) for p in parts):
        pos, n = range_positions(parts)
        T = pos.shape[0]
        rows = np.array(arena_rows, dtype=np.int64)
        both = h2d(np.concatenate([pos, pos + np.repeat(rows * W, n), blk_host]), torch.long, dev)
        return arena.view(-1)[both[T:2 * T]], both[:T], pos, both[2 * T:]
    ids_t = torch.cat([arena[x[0], x[1]:x[2]] if isinstance(x, tuple) else x for x in ids])
    pos_t = torch.cat([torch.arange(p[0], p[1], device=dev) if isinstance(p, tuple) else p
                       for p in parts])
    return ids_t, pos_t, None, h2d(blk_host, torch.long, dev)


def flash_extras(batch: list, states: list, windows: list[tuple[int, int]], dev: torch.device
                 ) -> dict[int, torch.Tensor]:
    """cache="flash": for each flash request (by batch index) with a previous step, the
    ``flash_budget`` cached positions outside its window ``[q0, q1)`` that got the most
    attention mass in that step, ascending. One batched topk per previous-step mass tensor
    (normally one per step); a request's very first step recomputes its whole canvas."""
    groups: dict[tuple[int, int], list[int]] = {}
    for b, (r, st) in enumerate(zip(batch, states)):
        if r.params.cache == "flash" and st.mass_src is not None:
            q0, q1 = windows[b]
            # reused pages [0, reused_len) are read-only: never among the recomputed positions
            k = min(r.params.flash_budget, r.canvas_len - (q1 - q0) - r.reused_len)
            if k > 0:      # same source and same k per topk call (ties: see select_top_k)
                groups.setdefault((id(st.mass_src[0]), k), []).append(b)
    out: dict[int, torch.Tensor] = {}
    for (_, k), members in groups.items():
        src = states[members[0]].mass_src[0]                          # [rows, keys]
        row, q0, q1, length, reused = h2d(
            [[states[b].mass_src[1] for b in members], [windows[b][0] for b in members],
             [windows[b][1] for b in members], [batch[b].canvas_len for b in members],
             [batch[b].reused_len for b in members]],
            torch.long, dev)[:, :, None]                              # one copy: 5 x [members, 1]
        rows = src[row[:, 0]]
        col = torch.arange(rows.shape[1], device=dev)[None, :]
        # NOTE: -1 for the window (mass >= 0 elsewhere), -inf past the canvas and in the reused
        # (read-only) prefix: never chosen while k <= canvas - window - reused, the budget above
        rows = rows.masked_fill((col >= q0) & (col < q1), -1.0)
        rows = rows.masked_fill((col >= length) | (col < reused), float("-inf"))
        top = torch.topk(rows, k, dim=-1).indices.sort(dim=-1).values   # [members, k]
        for j, b in enumerate(members):
            out[b] = top[j]
    return out


@dataclass
class StepInputs:
    """The general path's packed step: forward inputs, attention metadata, and where each
    request's masked slots are (``n_slot`` slots in batch order; request b owns slots
    ``bounds[b]``)."""

    ids: torch.Tensor              # [T] token ids
    positions: torch.Tensor        # [T] canvas positions
    meta: object                   # the attention backend's metadata (the model's ``ctx``)
    n_slot: int
    slot_req: torch.Tensor         # [n_slot] request index of each masked slot
    slot_pos: torch.Tensor         # [n_slot] its canvas position
    slot_rows: torch.Tensor        # [n_slot] the hidden row predicting it
    slot_flat: torch.Tensor        # [n_slot] its index in the flattened arena
    blk_idx: torch.Tensor          # [B * max_bl] the active blocks in the flattened arena
    max_bl: int
    bounds: list[tuple[int, int]]
    groups: list[RowGroup]
    plans: list[VerifyPlan | None]
    windows: list[tuple[int, int]]
    segments: list[Segment]
    flash: list[int]               # batch indices of cache="flash" requests


def pack_step(runner, plan, states: list) -> StepInputs:
    """Pack the plan's requests into one forward (no padding: each request attends to its own
    canvas through the metadata). Consumes each state's pending sentinel refresh."""
    batch = plan.requests
    dev, shift = runner.device, runner.cfg.logit_shift
    mask_id = runner.cfg.mask_token_id
    counts = [r.num_masked for r in batch]
    n_slot = sum(counts)
    windows = [s.window for s in plan.seqs]
    extras = flash_extras(batch, states, windows, dev)
    ids, positions, segments = [], [], []
    groups, bounds, plans, row_base = [], [], [], []
    cu, uncached = [0], []          # per-request row boundaries; verify row ranges
    n_tok = s0 = 0
    for b, (req, st, cnt) in enumerate(zip(batch, states, counts)):
        q0, q1 = windows[b]
        extra = extras.get(b)
        if st.refresh is not None:     # KV-consistency sentinel: also recompute these keys
            r = st.refresh[((st.refresh < q0) | (st.refresh >= q1))
                           & (st.refresh >= req.reused_len)]
            extra = r if extra is None else torch.cat([extra, r])
            st.refresh = None
        # the window is a contiguous slice (a view: the final cat is the only copy), its
        # positions a host range; only extra positions are gathered on the device
        n = q1 - q0 + (0 if extra is None else extra.numel())
        ids.append((st.arena_row, q0, q1))              # sliced only off the all-host path
        positions.append((q0, q1))
        if extra is not None:
            ids.append(st.canvas[extra])
            positions.append(extra)
        seg = Segment(n_tok, n_tok + n, None, req.request_id, pages=st.page_row,
                      length=req.canvas_len)
        segments.append(seg)
        row_base.append(n_tok - shift - q0)     # packed row predicting slot p: p + base
        n_tok += n
        vplan = plan_verification(req, st, shift, n_tok)      # last forward's drafts, folded in
        if vplan is not None and vplan.block is not None:
            ids.append(vplan.block.ids)
            positions.append(vplan.block.positions)
            seg.verify = vplan.rows
            uncached.append((n_tok, n_tok + vplan.block.num_rows))
            n_tok += vplan.block.num_rows
        cu.append(n_tok)
        plans.append(vplan)
        p = req.params
        groups.append(RowGroup(s0, s0 + cnt, p.temperature, p.top_k, p.top_p, st.generator))
        bounds.append((s0, s0 + cnt))
        s0 += cnt

    # per-request vectors, one host->device copy: block starts, row bases, arena rows, lengths
    B, W = len(batch), runner.arena.shape[1]
    lens = [r.params.block_length for r in batch]
    per_req = h2d([[r.block_start for r in batch], row_base, [st.arena_row for st in states],
                   lens], torch.long, dev)
    # the active blocks in the arena, [B, max_bl] (a shorter block repeats its last slot; those
    # columns are masked out below and ignored by the host)
    max_bl = max(lens)
    base = np.array([st.arena_row * W + r.block_start for r, st in zip(batch, states)],
                    dtype=np.int64)
    blk_host = (base[:, None] + np.minimum(np.arange(max_bl)[None, :],
                                           np.array(lens)[:, None] - 1)).ravel()
    ids_t, pos_t, pos_host, blk_t = ids_positions(runner.arena, [st.arena_row for st in states],
                                                  ids, positions, blk_host, dev)
    # every request's masked slots at once: one nonzero over the active blocks (one gather from
    # the arena), sized by the host-kept MASK counts (no device->host sync)
    masked = runner.arena.view(-1)[blk_t].view(B, max_bl) == mask_id
    if len(set(lens)) > 1:
        masked &= torch.arange(max_bl, device=dev)[None, :] < per_req[3][:, None]
    where = torch.nonzero_static(masked, size=n_slot)                    # [n_slot, 2]
    slot_req, slot_off = where[:, 0], where[:, 1]
    slot_pos = per_req[0][slot_req] + slot_off                           # canvas slots
    for req, seg, (s, e), (q0, _) in zip(batch, segments, bounds, windows):
        seg.slots = pos_t[seg.start:seg.end]
        if req.params.kv_jaccard_min is not None:
            seg.probe = slot_pos[s:e] - q0
    flash = [i for i, r in enumerate(batch) if r.params.cache == "flash"]
    last = runner.cfg.num_layers - 1
    meta = runner.backend.build(runner.block_table(plan), [r.canvas_len for r in batch], pos_t,
                                pos_host, cu, uncached, segments, probe_layer=last,
                                mass_layer=last if flash or drift.wants_mass(batch) else None)
    return StepInputs(ids_t, pos_t, meta, n_slot, slot_req, slot_pos,
                      slot_pos + per_req[1][slot_req], per_req[2][slot_req] * W + slot_pos,
                      blk_t, max_bl, bounds, groups, plans, windows, segments, flash)
