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

from flash_dllm.cache.io.lazy_load import (KEY_SUMMARIES, LAZY_PREDICTORS, LazyPlan, plan_lazy,
                                          sentinel_overlap)
from flash_dllm.cache.io.overflow_placement import OVERFLOW_PLACEMENTS, ResidentSet
from flash_dllm.cache.io.overflow_stage import OverflowMetadata, _StepCopies
from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.core.plan import OverflowPlan
from flash_dllm.decoding.registry import DECODE_POLICIES
from flash_dllm.layers.attention_backend import PagedAttentionMetadata
from flash_dllm.transfer import h2d

__all__ = ["OverflowKV", "OverflowMemoryError", "OverflowMetadata", "OverflowState",
           "overflow_unsupported"]

def overflow_unsupported(params) -> str | None:
    """Why a request with these sampling params cannot run as an overflow request (None: it
    can). What it may use: a cache mode whose prompt K/V stay cached between steps
    (``CacheMode.streams_overflow``: one that recomputes the whole canvas every step would write
    every page every step); the features that read the pool directly (a policy's extra rows,
    sentinel probes, flash's per-key mass) are not wired to the stage."""
    if not CACHE_MODES[params.cache].streams_overflow:
        ok = [name for name in CACHE_MODES if CACHE_MODES[name].streams_overflow]
        return (f"cache={params.cache!r} (requests larger than the GPU KV pool run with cache "
                f"{' or '.join(ok)})")
    if DECODE_POLICIES[params.decode].adds_rows:
        return (f"decode={params.decode!r} (requests larger than the GPU KV pool run no extra "
                "verification rows)")
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
                 lazy_sentinel: float | None = None, lazy_predictor: str = "mass",
                 placement: str = "lru", placement_top_k: int = 8) -> None:
        if lazy_predictor not in LAZY_PREDICTORS:
            raise ValueError(f"lazy_load_predictor must be one of {LAZY_PREDICTORS}, got "
                             f"{lazy_predictor!r}")
        if placement not in OVERFLOW_PLACEMENTS:
            raise ValueError(f"kv_placement must be one of {OVERFLOW_PLACEMENTS}, got "
                             f"{placement!r}")
        # which pages stay resident (``cache/io/overflow_placement.py``): it needs the measuring
        # steps' evidence, so only under lazy loading (where it is also the only thing it moves)
        self.placement = placement if lazy_budget is not None else "lru"
        self.placement_top_k = placement_top_k
        L, ps, H, D = num_layers, page_size, kv_heads, head_dim
        self.num_layers = L
        self.page_shape = (ps, H, D)
        self.dtype, self.device = dtype, device
        self.stage = torch.empty(2, 2, max_pages, ps, H, D, dtype=dtype, device=device)
        # quest's key summaries, (min, max) of every page per layer: made with the stage, before
        # the pool is sized, so they come out of its budget (layers / (2 page_size) times the
        # stage: as large as it for LLaDA-8B at pages of 16, 2 GiB at 64K tokens) instead of
        # failing a long request's first measuring step for want of memory
        self.summary = (torch.empty(L, 2, max_pages, H, D, dtype=dtype, device=device)
                        if lazy_budget is not None and KEY_SUMMARIES[lazy_predictor] else None)
        self.page_layer_bytes = ps * H * D * self.stage.element_size() * 2        # K + V, one layer
        self.host_bytes = host_bytes
        self._host: torch.Tensor | None = None          # flat pinned bytes
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.lazy_budget = lazy_budget
        self.lazy_sentinel = lazy_sentinel
        self.lazy_predictor = lazy_predictor
        self.key_summaries = KEY_SUMMARIES[lazy_predictor]     # (quest) else the mass (mass)
        self.stats = {"steps": 0, "h2d_bytes": 0, "d2h_bytes": 0, "skipped_pages": 0,
                      "measuring_steps": 0, "sentinel_checks": 0, "sentinel_triggers": 0,
                      # lazy steps: pages of largest score attended (summed over steps; per
                      # layer, averaged) and of those the resident ones (L0 hits); placement
                      "lazy_wanted": 0.0, "lazy_hits": 0.0, "replacements": 0,
                      "pages_moved": 0, "placement_s": 0.0}

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

    def new_state(self, request_id: str, plan: OverflowPlan) -> "OverflowState":
        """The runner's state of an overflow request at its first step: its host buffer, its
        resident pool pages and its placement (the positional split until evidence moves it)."""
        n = plan.num_pages
        return OverflowState(request_id, self.host_buffer(plan.spill),
                             h2d(plan.resident, torch.long, self.device), order=np.arange(n),
                             placement=ResidentSet(self.placement, n, self.placement_top_k))

    def step(self, meta: PagedAttentionMetadata, plan: OverflowPlan, state: OverflowState,
             window: tuple[int, int], canvas_len: int,
             active: tuple[int, int] = (0, 0)) -> "OverflowMetadata":
        """The step's metadata: ``meta`` (built over the logical page ids ``0..n-1``) reading and
        writing the stage. ``window``: the positions the step recomputes (all of them are
        written at every layer); ``active``: the positions the block's later steps write (the
        placement keeps their pages resident).

        A step that rewrites every page (the dual cache's block refresh) first lets the
        placement re-choose which pages stay resident (``overflow_placement.ResidentSet``; no
        byte moves for it: the refresh writes each page to its new home). The block table and
        the write slots are then mapped from logical pages to stage slots (``state.order``).

        Lazy loading (``lazy_budget`` F): after a block's refresh, its first step loads every
        page and measures (last layer) how much attention the active block's rows give each
        page; its later steps attend to the resident pages plus the share F of the pages they
        do not write that received the most, loading the host pages among those and the host
        pages the step writes (``select_pages``); their attention skips the others
        (approximate). With ``lazy_sentinel``, each lazy step also measures its loaded pages;
        ``observe`` forces a new measuring step when they drift.

        With ``lazy_predictor="quest"`` the measuring step also keeps a key summary of every
        page at every layer, and every step after it bounds, from that summary and its own
        queries, how much attention each page could get at each layer (``quest_scores``): the
        next step loads, **per layer**, the pages of the largest bounds, so a page the block's
        first step ignored is loaded once the queries turn to it, and each layer gets the pages
        it attends to (one choice for all layers, from the last layer, served the others badly:
        ``benchmarks/FINDINGS.md``)."""
        ps = self.page_shape[0]
        s, n = plan.spill, plan.num_pages
        self.stats["steps"] += 1
        if window[0] <= 0 and window[1] >= canvas_len:
            self._place(state, s, (active[0] // ps, -(-active[1] // ps)), meta.block_table)
        p0, p1 = max(0, window[0] // ps), min(n, -(-window[1] // ps))
        written = (p0, p1)
        wmask = np.zeros(n, dtype=bool)
        wmask[state.slot_of[p0:p1]] = True                  # stage order
        host = state.order[:s]
        full = rewrites_host(window, host, ps, canvas_len)
        lazy, ranges = self._loads(meta, plan, state, canvas_len, wmask, written, full)
        out = OverflowMetadata.wrap(meta, _StepCopies(self, plan, state.host, state.resident_idx,
                                                      ranges, wmask))
        if state.table_dev is not None:              # logical pages -> stage slots
            sl = meta.slots.long()
            out.block_table = state.table_dev
            out.slots = (state.slot_dev[sl // ps] * ps + sl % ps).to(meta.slots.dtype)
        self._measure(out, state, lazy, full, n, canvas_len)
        return out

    def _loads(self, meta, plan: OverflowPlan, state: OverflowState, canvas_len: int,
               wmask: np.ndarray, written: tuple[int, int], full: bool) -> tuple:
        """Which host pages the step loads: (its lazy plan or None, the host page ranges to
        copy: one list for every layer, or one per layer under quest)."""
        s = plan.spill
        lazy, layers = None, state.layers
        if full:
            # a new block: measured again (and its refresh does not hold the old key summaries)
            state.page_mass = state.lazy = state.layers = state.summary = state.score = None
            return None, []
        if self.lazy_budget is None or state.page_mass is None:
            return None, [(0, s)]
        lazy = state.lazy
        if state.score is not None:              # quest: per layer, after every step
            if layers is None or layers[0].written != written or state.score_new:
                layers = state.layers = [
                    self._lazy_step(state, state.score[i], wmask, plan, canvas_len,
                                    meta.block_table, written)
                    for i in range(self.num_layers)]
                state.score_new = False
            return layers[-1], [p.ranges for p in layers]   # the last layer's: the sentinel's
        if lazy is None or lazy.written != written:  # once per block (and window)
            lazy = state.lazy = self._lazy_step(state, state.page_mass, wmask, plan,
                                                canvas_len, meta.block_table, written)
        return lazy, lazy.ranges

    def _measure(self, out: "OverflowMetadata", state: OverflowState, lazy, full: bool, n: int,
                 canvas_len: int) -> None:
        """What the step measures (the attention per page of a measuring step, quest's key
        summaries, the sentinel's loaded pages) and the lazy step's reduced block table."""
        if self.lazy_budget is not None and not full and state.page_mass is None:
            out.mass_layer = self.num_layers - 1   # every page here: where the block attends
            out.mass_pages = n
            self.stats["measuring_steps"] += 1
            if self.key_summaries:
                state.summary = state.score = state.layers = None
                out.quest, out.quest_measure = state, True
                ps = self.page_shape[0]
                if canvas_len % ps:
                    out.quest_tail = (int(state.slot_of[n - 1]), canvas_len % ps)
        elif state.summary is not None and not full:
            out.quest = state
        if lazy is not None:
            plans = state.layers if state.score is not None else [lazy]
            self.stats["lazy_wanted"] += sum(p.wanted for p in plans) / len(plans)
            self.stats["lazy_hits"] += sum(p.hits for p in plans) / len(plans)
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

    def _place(self, state: OverflowState, spill: int, active: tuple[int, int],
               like: torch.Tensor) -> None:
        """At a step that rewrites every page: the placement's new stage order, if any."""
        t0 = state.placement.seconds
        order = state.placement.choose(spill, active)
        self.stats["placement_s"] += state.placement.seconds - t0
        if order is None or np.array_equal(order, state.order):
            return
        n = order.shape[0]
        moved = int(np.setdiff1d(order[spill:], state.order[spill:]).size)
        self.stats["replacements"] += int(moved > 0)         # the resident set changed
        self.stats["pages_moved"] += moved
        state.order = order
        state.slot_of = np.empty(n, dtype=np.int64)
        state.slot_of[order] = np.arange(n)
        table = np.zeros(like.shape, dtype=np.int32)
        table[0, :n] = state.slot_of
        state.table_dev = h2d(table, torch.int32, self.device)
        state.slot_dev = h2d(state.slot_of, torch.long, self.device)

    def _lazy_step(self, state: OverflowState, score: np.ndarray, written: np.ndarray,
                   plan: OverflowPlan, canvas_len: int, like: torch.Tensor,
                   key: tuple[int, int]) -> LazyPlan:
        n = plan.num_pages
        return plan_lazy(score, self.lazy_budget, written, plan.spill, self.page_shape[0],
                         canvas_len, int(state.slot_of[n - 1]), like, key)

    def _evidence(self, state: OverflowState, mass_logical: np.ndarray) -> None:
        t0 = state.placement.seconds
        state.placement.observe(mass_logical)
        self.stats["placement_s"] += state.placement.seconds - t0

    def observe_score(self, state: OverflowState, score: np.ndarray) -> None:
        """Take a step's quest bounds [layers, n] (stage order): the next lazy step chooses from
        them. The measuring step's (the block's first) are also the placement's evidence:
        each layer's share of its bounds, averaged over layers (its choices are per layer, so
        the last layer's mass alone predicts them badly)."""
        if state.score is None:
            share = score / np.maximum(score.sum(1, keepdims=True), 1e-30)
            self._evidence(state, share.mean(0)[state.slot_of])          # logical order
        state.score, state.score_new = score, True

    def observe(self, state: OverflowState, lazy: LazyPlan | None, mass: np.ndarray
                ) -> tuple[bool, bool]:
        """Take a step's attention mass per page of its block table (``mass`` [pages]):
        a measuring step's (``lazy`` None; logical order) becomes the block's ``page_mass`` (in
        stage order) and the placement's evidence; a lazy step's (per page of its compacted
        table) is the sentinel's. Returns (checked, triggered)."""
        if lazy is None:
            state.page_mass = mass[state.order]
            if not self.key_summaries:
                self._evidence(state, mass)
            return False, False
        j = sentinel_overlap(state.page_mass, lazy.keep, lazy.watched, mass)
        self.stats["sentinel_checks"] += 1
        if j >= self.lazy_sentinel:
            return True, False
        self.stats["sentinel_triggers"] += 1
        state.page_mass = state.lazy = None      # the next step loads every page, measures
        state.summary = state.score = state.layers = None
        return True, True


def rewrites_host(window: tuple[int, int], host: np.ndarray, page_size: int,
                  canvas_len: int) -> bool:
    """Whether a step recomputing the positions ``window`` rewrites every key of the host pages
    ``host`` (logical ids; none: trivially), so it loads none of them."""
    return host.size == 0 or (window[0] <= int(host.min()) * page_size and
                              window[1] >= min((int(host.max()) + 1) * page_size, canvas_len))


@dataclass
class OverflowState:
    """The runner's state of the running overflow request: its host buffer, the pool page of
    each resident page, where each logical page lives, and (lazy loading) the attention mass
    each page received from the active block's rows at the first step after the block's
    refresh (``OverflowKV.new_state`` makes it)."""

    request_id: str
    host: torch.Tensor
    resident_idx: torch.Tensor              # [n - spill] long, on the device
    # stage slot -> logical page (slots < spill: host slots) and back; the block table and
    # the slot map of that order on the device (None while it is the identity)
    order: np.ndarray = None
    placement: ResidentSet = None
    slot_of: np.ndarray = None
    table_dev: torch.Tensor | None = None
    slot_dev: torch.Tensor | None = None
    page_mass: np.ndarray | None = None     # [n] float, host, stage order
    lazy: LazyPlan | None = None            # the current block's lazy loads
    # lazy_predictor="quest": every page's key summary per layer (device, stage order) from
    # the block's measuring step, the latest step's bounds [layers, n] (host; ``score_new``:
    # not yet turned into lazy plans) and the lazy plan of each layer
    summary: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    score: np.ndarray | None = None
    score_new: bool = False
    layers: list[LazyPlan] | None = None

    def __post_init__(self) -> None:
        if self.slot_of is None:
            self.slot_of = np.argsort(self.order)


