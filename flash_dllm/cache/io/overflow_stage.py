"""The GPU stage of a request larger than the pool: one step's copies around each layer's
attention (``_StepCopies``) and the step's attention metadata (``OverflowMetadata``). The
layout and the order of the copies are ``cache/io/kv_overflow.py``'s docstring.

Everything here is in **stage order**: stage slots ``0..spill-1`` hold the host pages (host
slot ``j`` is stage slot ``j``), ``spill..n-1`` the resident ones (stage slot ``s + i`` is pool
page ``resident_idx[i]``); the step's block table maps the request's logical pages to stage
slots (``OverflowState.order``, chosen by ``cache/io/overflow_placement.py``).
"""
from __future__ import annotations

import numpy as np
import torch

from flash_dllm.cache.io.lazy_load import LazyPlan, quest_layer_scores, runs
from flash_dllm.layers.attention_backend import PagedAttentionMetadata


class _StepCopies:
    """One step's copies around each layer's attention (see the module docstring)."""

    def __init__(self, kv, plan, host: torch.Tensor, resident_idx: torch.Tensor, load: list,
                 written: np.ndarray) -> None:
        self.kv, self.plan, self.host = kv, plan, host
        self.res_idx = resident_idx                   # [n - spill] long: pool page per page
        # host page ranges host -> stage: one list for every layer, or one list per layer
        self.load = load
        self.per_layer = bool(load) and isinstance(load[0], list)
        s = plan.spill
        # ``written`` [n] (stage order): the host ranges go back to host memory, the resident
        # ranges (stage slots) to their pool pages
        self.spill_written = runs(written[:s])
        self.res_written = [(a + s, b + s) for a, b in runs(written[s:])]
        self.loaded: dict[int, torch.cuda.Event] = {}

    def kv_of(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        st = self.kv.stage[layer % 2]
        return st[0], st[1]

    def load_of(self, layer: int) -> list[tuple[int, int]]:
        if layer >= self.kv.num_layers:
            return []
        return self.load[layer] if self.per_layer else self.load

    def _load(self, layer: int) -> None:
        """Host -> stage of layer ``layer``'s spilled pages (copy stream on CUDA)."""
        load = self.load_of(layer)
        if not load:
            return
        st = self.kv.stage[layer % 2]
        cs = self.kv.copy_stream
        if cs is None:
            for a, b in load:
                st[:, a:b].copy_(self.host[layer, :, a:b])
        else:
            cs.wait_stream(torch.cuda.current_stream(self.kv.device))
            with torch.cuda.stream(cs):
                for a, b in load:
                    st[0, a:b].copy_(self.host[layer, 0, a:b], non_blocking=True)
                    st[1, a:b].copy_(self.host[layer, 1, a:b], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(cs)
            self.loaded[layer] = ev
        self.kv.stats["h2d_bytes"] += sum(b - a for a, b in load) * self.kv.page_layer_bytes

    def before(self, pool: torch.Tensor, layer: int) -> None:
        if layer == 0:
            self._load(0)
        self._load(layer + 1)       # into the other buffer, once layer - 1 is done with it
        s, n = self.plan.spill, self.plan.num_pages
        st = self.kv.stage[layer % 2]
        if n > s:                   # resident pages: pool -> stage (a gather on the device)
            torch.index_select(pool[layer, 0], 0, self.res_idx, out=st[0, s:n])
            torch.index_select(pool[layer, 1], 0, self.res_idx, out=st[1, s:n])
        ev = self.loaded.pop(layer, None)
        if ev is not None:
            torch.cuda.current_stream(self.kv.device).wait_event(ev)

    def after(self, pool: torch.Tensor, layer: int) -> None:
        st = self.kv.stage[layer % 2]
        s = self.plan.spill
        for c, d in self.res_written:               # written resident pages: stage -> pool
            idx = self.res_idx[c - s:d - s]
            pool[layer, 0].index_copy_(0, idx, st[0, c:d])
            pool[layer, 1].index_copy_(0, idx, st[1, c:d])
        if not self.spill_written:
            return
        cs = self.kv.copy_stream                  # written host pages: stage -> host
        if cs is None:
            for a, b in self.spill_written:
                self.host[layer, :, a:b].copy_(st[:, a:b])
        else:
            # NOTE: on the copy stream after this layer's compute; the buffer's next user
            # (layer + 2) waits for it: its host copy is queued on the same stream later,
            # and ``before`` makes the compute stream wait for that copy's event
            cs.wait_stream(torch.cuda.current_stream(self.kv.device))
            with torch.cuda.stream(cs):
                for a, b in self.spill_written:
                    self.host[layer, 0, a:b].copy_(st[0, a:b], non_blocking=True)
                    self.host[layer, 1, a:b].copy_(st[1, a:b], non_blocking=True)
                if not self.load_of(layer + 2):   # nothing else orders the buffer's reuse
                    ev = torch.cuda.Event()
                    ev.record(cs)
                    self.loaded[layer + 2] = ev
        self.kv.stats["d2h_bytes"] += (sum(b - a for a, b in self.spill_written)
                                       * self.kv.page_layer_bytes)

    def finish(self) -> None:
        """After the forward: the compute stream waits for the last write-backs (the next
        step's loads read them; a request's release must not free a buffer in flight)."""
        if self.kv.copy_stream is not None:
            torch.cuda.current_stream(self.kv.device).wait_stream(self.kv.copy_stream)


class OverflowMetadata(PagedAttentionMetadata):
    """``PagedAttentionMetadata`` of an overflow request's step: every layer reads and writes the
    stage (``_StepCopies``), with the copies around it."""

    copies: _StepCopies
    mass_pages: int = 0                # pages of the block table ``mass`` covers
    lazy: LazyPlan | None = None       # a lazy step the sentinel checks
    # lazy_predictor="quest": the request's state (its key summaries; ``quest_measure``: make
    # them from this step, every layer) and the bounds this step's queries give each page
    quest: object = None                             # the request's OverflowState
    quest_measure: bool = False
    quest_tail: tuple[int, int] | None = None        # (stage slot, valid slots): partial page
    quest_score: torch.Tensor | None = None          # [layers, n] after the forward
    # quest's lazy steps: each layer's compacted block table (``None`` table: every page), and
    # the step's own (block_table, seq_lens, max_k) for those
    layer_plans: list[LazyPlan] | None = None
    full_table: tuple | None = None

    @classmethod
    def wrap(cls, meta: PagedAttentionMetadata, copies: "_StepCopies") -> "OverflowMetadata":
        if meta.special or meta.mass_layer is not None:     # (lazy loading sets its own)
            raise ValueError("an overflow request's step has no verification, probe or "
                             "mass rows")
        out = cls.__new__(cls)
        out.__dict__.update(meta.__dict__)
        out.copies = copies
        return out

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.copies.kv_of(layer)

    def attention(self, attn, layer: int, x: torch.Tensor, positions: torch.Tensor
                  ) -> torch.Tensor:
        self.copies.before(self.kv, layer)
        if self.layer_plans is not None:
            p = self.layer_plans[layer]
            self.block_table, self.seq_lens, self.max_k = (
                self.full_table if p.table is None else (p.table, p.seq_lens, p.max_k))
        out = super().attention(attn, layer, x, positions)
        num_layers = self.copies.kv.num_layers
        if self.quest is not None:
            if layer == 0:
                self._scores = []
            self._scores.append(quest_layer_scores(self, attn, layer, x, positions))
        self.copies.after(self.kv, layer)
        if layer == num_layers - 1:
            self.copies.finish()
            if self.quest is not None:
                self.quest_score = torch.stack(self._scores)
        return out
