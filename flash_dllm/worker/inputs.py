"""A step's inputs on the general path: which ids and positions the forward reads, where each
request's rows are, and the attention metadata; built from the plan on the host.

Every function builds its index arrays with numpy and sends them in ONE host->device copy
(``flash_dllm.transfer.h2d``, pinned and asynchronous on CUDA); device-side gathers only where the
positions themselves live on the device (flash top-k, sentinel refresh, verification rows).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.decoding.policies import DECODE_POLICIES
from flash_dllm.decoding.sampling import RowGroup
from flash_dllm.layers.attention_backend import Segment
from flash_dllm.transfer import h2d
from flash_dllm.worker.extensions import has_hook


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


@dataclass
class StepInputs:
    """The general path's packed step: forward inputs, attention metadata, and where each
    request's masked slots are (``n_slot`` slots in batch order; request b owns slots
    ``bounds[b]``). ``ext``: the step extensions' scratch (by extension name)."""

    batch: list
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
    plans: list                    # each request's policy ``extra_rows`` (None: none)
    windows: list[tuple[int, int]]
    segments: list[Segment]
    ext: dict = field(default_factory=dict)


def _extra_positions(batch, states, windows, extensions, dev) -> dict[int, torch.Tensor]:
    """Positions each request recomputes besides its window: its cache mode's (``flash``'s
    top-k), then the active extensions' (the KV sentinel's refresh, consumed)."""
    extras: dict[int, torch.Tensor] = {}
    by_mode: dict[str, list[int]] = {}
    for b, r in enumerate(batch):
        by_mode.setdefault(r.params.cache, []).append(b)
    for name, members in by_mode.items():
        extras.update(CACHE_MODES[name].extra_positions(members, batch, states, windows, dev))
    for ext, members in extensions:
        if not has_hook(ext, "extra_positions"):
            continue
        for b in members:
            r = ext.extra_positions(batch[b], states[b], windows[b])
            if r is not None:
                extras[b] = r if b not in extras else torch.cat([extras[b], r])
    return extras


@dataclass
class _Rows:
    """The packed rows of a step, request by request (``pack_step``'s host part)."""

    ids: list = field(default_factory=list)         # (arena row, q0, q1) or device id tensors
    positions: list = field(default_factory=list)   # (q0, q1) or device position tensors
    segments: list = field(default_factory=list)
    groups: list = field(default_factory=list)
    bounds: list = field(default_factory=list)
    plans: list = field(default_factory=list)
    row_base: list = field(default_factory=list)
    cu: list = field(default_factory=lambda: [0])   # per-request row boundaries
    uncached: list = field(default_factory=list)    # extra (policy) row ranges


def scored(req) -> int:
    """The slots of ``req``'s active block whose proposals its policy reads: the masked ones, or
    every answer slot of the block for a policy that edits decoded tokens."""
    if req.edits:
        return req.params.block_length - req.lead
    return req.num_masked


def _pack_rows(batch, states, windows, extras, shift: int) -> _Rows:
    """Each request's window (and extra positions), then its policy's extra rows."""
    out = _Rows()
    ids, positions, segments = out.ids, out.positions, out.segments
    groups, bounds, plans, row_base = out.groups, out.bounds, out.plans, out.row_base
    cu, uncached = out.cu, out.uncached
    n_tok = s0 = 0
    for b, (req, st) in enumerate(zip(batch, states)):
        cnt = scored(req)
        q0, q1 = windows[b]
        extra = extras.get(b)
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
        # the policy's rows (verify: the last forward's drafts, folded in)
        extra_rows = DECODE_POLICIES[req.params.decode].extra_rows(req, st, shift, n_tok)
        if extra_rows is not None and extra_rows.block is not None:
            ids.append(extra_rows.block.ids)
            positions.append(extra_rows.block.positions)
            seg.verify = extra_rows.rows
            uncached.append((n_tok, n_tok + extra_rows.block.num_rows))
            n_tok += extra_rows.block.num_rows
        cu.append(n_tok)
        plans.append(extra_rows)
        p = req.params
        groups.append(RowGroup(s0, s0 + cnt, p.temperature, p.top_k, p.top_p, st.generator))
        bounds.append((s0, s0 + cnt))
        s0 += cnt
    return out


def pack_step(runner, plan, states: list, extensions: list) -> StepInputs:
    """Pack the plan's requests into one forward (no padding: each request attends to its own
    canvas through the metadata). ``extensions``: the step extensions active on the plan."""
    batch = plan.requests
    dev, shift = runner.device, runner.cfg.logit_shift
    mask_id = runner.cfg.mask_token_id
    n_slot = sum(scored(r) for r in batch)
    windows = [s.window for s in plan.seqs]
    extras = _extra_positions(batch, states, windows, extensions, dev)
    rows = _pack_rows(batch, states, windows, extras, shift)
    ids, positions, segments, row_base = rows.ids, rows.positions, rows.segments, rows.row_base

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
    if any(r.edits for r in batch):     # (an editing policy scores every answer slot)
        lead = np.array([r.lead if r.edits else max_bl for r in batch], dtype=np.int64)
        masked |= torch.arange(max_bl, device=dev)[None, :] >= h2d(lead, torch.long, dev)[:, None]
    if len(set(lens)) > 1:
        masked &= torch.arange(max_bl, device=dev)[None, :] < per_req[3][:, None]
    where = torch.nonzero_static(masked, size=n_slot)                    # [n_slot, 2]
    slot_req, slot_off = where[:, 0], where[:, 1]
    slot_pos = per_req[0][slot_req] + slot_off                           # canvas slots
    for seg in segments:
        seg.slots = pos_t[seg.start:seg.end]
    step = StepInputs(batch, ids_t, pos_t, None, n_slot, slot_req, slot_pos,
                      slot_pos + per_req[1][slot_req], per_req[2][slot_req] * W + slot_pos,
                      blk_t, max_bl, rows.bounds, rows.groups, rows.plans, windows, segments)
    for ext, members in extensions:
        if has_hook(ext, "pack"):
            ext.pack(step, members)
    last = runner.cfg.num_layers - 1
    mass = any(ext.wants_mass for ext, _ in extensions)
    step.meta = runner.backend.build(runner.block_table(plan), [r.canvas_len for r in batch],
                                     pos_t, pos_host, rows.cu, rows.uncached, segments,
                                     probe_layer=last, mass_layer=last if mass else None,
                                     block_size=runner.cfg.attention.block_size)
    return step
