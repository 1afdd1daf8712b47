"""Requests larger than the GPU page pool: the pages that fit stay in the pool, the rest stream
over PCIe from pinned host memory, layer by layer, at every step (``--kv-overflow-gb``).

A dual-cache step attends to every cached key of its request, so a request whose KV exceeds L0
must bring its missing pages to the GPU at every step: tiers buy capacity here, not a faster step.
The bound is the all-in-GPU step time plus the non-resident bytes over the pinned-copy rate
(``flash-dllm bench overflow`` measures both in one run); this module's job is to stay close to
it: each non-resident byte crosses once per step, and the copies run under the compute.

Layout. Such a request (an **overflow request**, at most one running at a time, alone: see the
scheduler) has ``n`` logical pages; the first ``spill`` live in a pinned host buffer laid out
layer-major, ``[layers, 2, spill, page_size, kv_heads, head_dim]``, so one layer's K (or V) of
every spilled page is ONE contiguous copy; the other ``n - spill`` are ordinary pool pages (the
KV manager's ledger holds them). On the GPU a **stage** ``[2, 2, n_max, page_size, kv_heads,
head_dim]`` holds one layer of the whole request in logical page order, twice (double buffer):
the step's attention metadata points its block table at ``0..n-1`` and its slots at the canvas
positions, and ``layer_kv(l)`` returns buffer ``l % 2``, so the kernels are the pool path's own.

Per layer ``l`` (``_StepCopies.before`` / ``after``, around the layer's attention):

1. on the copy stream, after the compute stream finished layer ``l - 1`` (whose buffer layer
   ``l + 1`` reuses): the spilled pages of layer ``l + 1`` host -> stage (two copies);
2. on the compute stream: the resident pages of layer ``l`` pool -> stage (a gather), then wait
   for layer ``l``'s host copy;
3. the layer's attention writes the step's fresh K/V into the stage and attends to it;
4. written pages go home: resident ones stage -> pool on the compute stream, spilled ones stage
   -> host on the copy stream (a block's refresh, and steps whose active block lies in the
   spilled pages).

A step whose recomputed window covers every spilled position (the prefill) loads nothing.
On the CPU the same code runs without streams (every copy in order).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flash_dllm.engine.lazy_load import (LAZY_PREDICTORS, LazyPlan, plan_lazy,
                                         quest_layer_scores, sentinel_overlap)
from flash_dllm.engine.plan import OverflowPlan
from flash_dllm.layers.attention_backend import PagedAttentionMetadata

# what an overflow request may use: its prompt K/V must stay cached between steps (a cache mode
# that recomputes the whole canvas every step would write every page every step), and the
# features that read the pool directly (verification rows, sentinel probes, flash's per-key
# mass) are not wired to the stage
OVERFLOW_CACHE_MODES = ("dual", "prefix")


def overflow_unsupported(params) -> str | None:
    """Why a request with these sampling params cannot run as an overflow request (None: it
    can)."""
    if params.cache not in OVERFLOW_CACHE_MODES:
        return (f"cache={params.cache!r} (requests larger than the GPU KV pool run with cache "
                f"{' or '.join(OVERFLOW_CACHE_MODES)})")
    if params.decode == "verify":
        return "decode='verify' (requests larger than the GPU KV pool do not verify drafts)"
    if params.kv_jaccard_min is not None:
        return "kv_jaccard_min (the KV sentinel does not run on requests larger than the pool)"
    if params.drift_min is not None:
        return "drift_min (the drift trigger does not run on requests larger than the pool)"
    return None


class OverflowMemoryError(RuntimeError):
    """The pinned host memory for a request larger than the pool could not be had: that
    request fails (finish_reason "error"), the engine goes on."""


class OverflowKV:
    """The runner's overflow machinery: the GPU stage (allocated with the runner, so the pool is
    sized around it), one pinned host buffer (grown on demand, kept for the next overflow
    request, at most ``host_bytes``) and the copy stream."""

    def __init__(self, num_layers: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, max_pages: int,
                 host_bytes: int, lazy_budget: float | None = None,
                 lazy_sentinel: float | None = None, lazy_predictor: str = "mass") -> None:
        if lazy_predictor not in LAZY_PREDICTORS:
            raise ValueError(f"lazy_load_predictor must be one of {LAZY_PREDICTORS}, got "
                             f"{lazy_predictor!r}")
        L, ps, H, D = num_layers, page_size, kv_heads, head_dim
        self.num_layers = L
        self.page_shape = (ps, H, D)
        self.dtype, self.device = dtype, device
        self.stage = torch.empty(2, 2, max_pages, ps, H, D, dtype=dtype, device=device)
        self.page_layer_bytes = ps * H * D * self.stage.element_size() * 2        # K + V, one layer
        self.host_bytes = host_bytes
        self._host: torch.Tensor | None = None          # flat pinned bytes
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.lazy_budget = lazy_budget
        self.lazy_sentinel = lazy_sentinel
        self.lazy_predictor = lazy_predictor
        self.stats = {"steps": 0, "h2d_bytes": 0, "d2h_bytes": 0, "skipped_pages": 0,
                      "measuring_steps": 0, "sentinel_checks": 0, "sentinel_triggers": 0}

    @property
    def max_pages(self) -> int:
        return self.stage.shape[2]

    def host_bytes_for(self, spill: int) -> int:
        return spill * self.num_layers * self.page_layer_bytes

    def host_buffer(self, spill: int) -> torch.Tensor:
        """``[layers, 2, spill, page_size, kv_heads, head_dim]`` pinned (a view of the kept
        buffer; its previous contents are garbage until the request's prefill writes them)."""
        need = self.host_bytes_for(spill)
        if need > self.host_bytes:
            raise ValueError(f"an overflow of {spill} pages needs {need} bytes of host memory, "
                             f"more than kv_overflow_gb allows ({self.host_bytes})")
        if self._host is None or self._host.numel() < need:
            self._host = None                                     # free the old one first
            if self.cuda and hasattr(torch._C, "_host_emptyCache"):
                # NOTE: PyTorch's pinned allocator rounds a buffer up to a power of two and
                # keeps a freed one pinned: give it back before pinning a bigger one
                torch._C._host_emptyCache()
            try:
                self._host = self._pin(need)
            except RuntimeError as e:
                raise OverflowMemoryError(
                    f"could not pin {need / 2**30:.2f} GiB of host memory for a request larger "
                    f"than the GPU KV pool: {e}") from e
        return self._host[:need].view(self.dtype).view(self.num_layers, 2, spill,
                                                       *self.page_shape)

    def _pin(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)

    def step(self, meta: PagedAttentionMetadata, plan: OverflowPlan, state: OverflowState,
             window: tuple[int, int], canvas_len: int) -> "OverflowMetadata":
        """The step's metadata: ``meta`` (built over the logical page ids ``0..n-1``) reading and
        writing the stage. ``window``: the positions the step recomputes (all of them are
        written at every layer).

        Lazy loading (``lazy_budget``): after a block's refresh, its first step loads every page
        and measures (last layer) how much attention the active block's rows give each page;
        its later steps load only the share ``lazy_budget`` of the spilled pages that received
        the most (``select_pages``), plus the spilled pages the step writes, and their attention
        skips the others (approximate). With ``lazy_sentinel``, each lazy step also measures
        its loaded pages; ``observe`` forces a new measuring step when they drift.

        With ``lazy_predictor="quest"`` the measuring step also keeps a key summary of every
        spilled page at every layer, and every step after it bounds, from that summary and its
        own queries, how much attention each page could get at each layer (``quest_scores``):
        the next step loads, **per layer**, the pages of the largest bounds, so a page the
        block's first step ignored is loaded once the queries turn to it, and each layer gets
        the pages it attends to (one choice for all layers, from the last layer, served the
        others badly: ``benchmarks/FINDINGS.md``)."""
        ps = self.page_shape[0]
        s, n = plan.spill, plan.num_pages
        p0, p1 = window[0] // ps, -(-window[1] // ps)
        full = window[0] <= 0 and window[1] >= s * ps          # every spilled key rewritten
        self.stats["steps"] += 1
        written = (max(0, p0), min(n, p1))
        lazy, layers = None, state.layers
        if full:
            ranges = []
            # a new block: measured again (and its refresh does not hold the old key summaries)
            state.page_mass = state.lazy = state.layers = state.summary = state.score = None
        elif s == 0 or self.lazy_budget is None or state.page_mass is None:
            ranges = [(0, s)] if s else []
        else:
            lazy = state.lazy
            if state.score is not None:              # quest: per layer, after every step
                if layers is None or layers[0].written != written or state.score_new:
                    layers = state.layers = [
                        self._lazy_step(state.score[i], written, plan, canvas_len,
                                        meta.block_table) for i in range(self.num_layers)]
                    state.score_new = False
                lazy = layers[-1]                    # the last layer's: the sentinel's
                ranges = [p.ranges for p in layers]
            else:
                if lazy is None or lazy.written != written:  # once per block (and window)
                    lazy = state.lazy = self._lazy_step(state.page_mass[:s], written, plan,
                                                        canvas_len, meta.block_table)
                ranges = lazy.ranges
        out = OverflowMetadata.wrap(meta, _StepCopies(self, plan, state.host, state.resident_idx,
                                                      ranges, written))
        if self.lazy_budget is not None and not full and s and state.page_mass is None:
            out.mass_layer = self.num_layers - 1   # every page here: where the block attends
            out.mass_pages = n
            self.stats["measuring_steps"] += 1
            if self.lazy_predictor == "quest":
                state.summary = state.score = state.layers = None
                out.quest, out.quest_measure = state, True
        elif state.summary is not None and not full and s:
            out.quest = state
        if state.score is not None and lazy is not None:
            out.layer_plans = state.layers
            out.full_table = (out.block_table, out.seq_lens, out.max_k)
            self.stats["skipped_pages"] += round(sum(p.skipped for p in state.layers)
                                                 / self.num_layers)
        elif lazy is not None and lazy.table is not None:
            out.block_table, out.seq_lens, out.max_k = lazy.table, lazy.seq_lens, lazy.max_k
            self.stats["skipped_pages"] += lazy.skipped
        if lazy is not None and lazy.table is not None:
            if self.lazy_sentinel is not None and lazy.watched is not None:
                out.mass_layer = self.num_layers - 1     # the loaded pages: for the sentinel
                out.mass_pages, out.lazy = len(lazy.keep), lazy
        return out

    def _lazy_step(self, mass: np.ndarray, written: tuple[int, int], plan: OverflowPlan,
                   canvas_len: int, like: torch.Tensor) -> LazyPlan:
        return plan_lazy(mass, self.lazy_budget, written, plan.spill, plan.num_pages,
                         self.page_shape[0], canvas_len, like)

    def observe_score(self, state: OverflowState, score: np.ndarray) -> None:
        """Take a step's quest bounds [layers, spill]: the next lazy step chooses from them."""
        state.score, state.score_new = score, True

    def observe(self, state: OverflowState, lazy: LazyPlan | None, mass: np.ndarray
                ) -> tuple[bool, bool]:
        """Take a step's attention mass per page of its block table (``mass`` [pages]):
        a measuring step's (``lazy`` None) becomes the block's ``page_mass``; a lazy step's
        is the sentinel's evidence. Returns (checked, triggered)."""
        if lazy is None:
            state.page_mass = mass
            return False, False
        j = sentinel_overlap(state.page_mass, lazy.keep, lazy.watched, mass)
        self.stats["sentinel_checks"] += 1
        if j >= self.lazy_sentinel:
            return True, False
        self.stats["sentinel_triggers"] += 1
        state.page_mass = state.lazy = None      # the next step loads every page, measures
        state.summary = state.score = state.layers = None
        return True, True


@dataclass
class OverflowState:
    """The runner's state of the running overflow request: its host buffer, the pool page of
    each resident page, and (lazy loading) the attention mass each page received from the
    active block's rows at the first step after the block's refresh."""

    request_id: str
    host: torch.Tensor
    resident_idx: torch.Tensor              # [n - spill] long, on the device
    page_mass: np.ndarray | None = None     # [n] float, host
    lazy: LazyPlan | None = None            # the current block's lazy loads
    # lazy_predictor="quest": the spilled pages' key summary per layer (device) from the
    # block's measuring step, the latest step's bounds [layers, spill] (host; ``score_new``:
    # not yet turned into lazy plans) and the lazy plan of each layer
    summary: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    score: np.ndarray | None = None
    score_new: bool = False
    layers: list[LazyPlan] | None = None


class _StepCopies:
    """One step's copies around each layer's attention (see the module docstring)."""

    def __init__(self, kv: OverflowKV, plan: OverflowPlan, host: torch.Tensor,
                 resident_idx: torch.Tensor, load: list,
                 written: tuple[int, int]) -> None:
        self.kv, self.plan, self.host = kv, plan, host
        self.res_idx = resident_idx                   # [n - spill] long: pool page per page
        # spilled page ranges host -> stage: one list for every layer, or one list per layer
        self.load = load
        self.per_layer = bool(load) and isinstance(load[0], list)
        s = plan.spill
        p0, p1 = written
        # written spilled pages [a, b) go to host, written resident pages [c, d) to the pool
        self.spill_written = (p0, min(p1, s)) if p0 < s else None
        self.res_written = (max(p0, s), p1) if p1 > s else None
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
        if self.res_written is not None:          # written resident pages: stage -> pool
            c, d = self.res_written
            idx = self.res_idx[c - s:d - s]
            pool[layer, 0].index_copy_(0, idx, st[0, c:d])
            pool[layer, 1].index_copy_(0, idx, st[1, c:d])
        if self.spill_written is not None:        # written spilled pages: stage -> host
            a, b = self.spill_written
            cs = self.kv.copy_stream
            if cs is None:
                self.host[layer, :, a:b].copy_(st[:, a:b])
            else:
                # NOTE: on the copy stream after this layer's compute; the buffer's next user
                # (layer + 2) waits for it: its host copy is queued on the same stream later,
                # and ``before`` makes the compute stream wait for that copy's event
                cs.wait_stream(torch.cuda.current_stream(self.kv.device))
                with torch.cuda.stream(cs):
                    self.host[layer, 0, a:b].copy_(st[0, a:b], non_blocking=True)
                    self.host[layer, 1, a:b].copy_(st[1, a:b], non_blocking=True)
                    if not self.load_of(layer + 2):   # nothing else orders the buffer's reuse
                        ev = torch.cuda.Event()
                        ev.record(cs)
                        self.loaded[layer + 2] = ev
            self.kv.stats["d2h_bytes"] += (b - a) * self.kv.page_layer_bytes

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
    # them from this step, every layer) and the bounds this step's queries give each spilled page
    quest: OverflowState | None = None
    quest_measure: bool = False
    quest_score: torch.Tensor | None = None          # [layers, spill] after the forward
    # quest's lazy steps: each layer's compacted block table (``None`` table: every page), and
    # the step's own (block_table, seq_lens, max_k) for those
    layer_plans: list[LazyPlan] | None = None
    full_table: tuple | None = None

    @classmethod
    def wrap(cls, meta: PagedAttentionMetadata, copies: _StepCopies) -> "OverflowMetadata":
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
