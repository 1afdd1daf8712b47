"""CUDA graphs of the runner: one key type, one cache (capture policy + LRU + memory pool), one
capture helper, and the forward capture mode.

The runner has two capture modes, both keyed by ``GraphKey`` in one ``GraphCache``:

- ``forward`` (``ForwardGraphs`` below): the model forward of a step, replayed with the step's
  index tensors copied into the graph's static buffers. Steps with verification rows or probes
  (their special rows are shaped per step) always run eagerly.
- ``step`` (``worker/fused_step.py``): a whole steady greedy step (forward, LM head, proposal,
  commit rule, commit) as one graph; verify steps too (``decoding/policies/verify_fused.py``:
  their drafts padded to a fixed count, so their verification rows have a static shape).

A shape is captured at its ``first_capture``-th sighting (default the second: a shape that never
comes back costs no capture); a ``large`` one (more rows per request than a decode step, whose
shape follows the prompt lengths) one sighting later; steps of more than ``max_tokens`` rows in
all never (a captured graph would hold their activations in the pool for good, and at that size
launches cost nothing next to the GEMMs). Once a warm-up made the server ready (``ready``),
nothing is captured any more: a shape without a graph runs eagerly (issue 21: a capture costs
about two forwards while the whole batch waits). At most ``max_graphs`` are kept, the least
recently used dropped. All graphs share one memory pool: they never run at the same time.

**Padded forward shapes.** A forward graph is keyed on buckets, not on the step's exact shape, so
that a few graphs captured before ready serve every step after it: rows ``T`` rounded up to a
power of two (only below ``GraphCache.heavy_tokens`` rows, while eager launches would cost the
host more than the padded forward costs the GPU; a larger forward runs eagerly, its launches
hidden behind its GEMMs), requests ``B``
to a power of two, the longest query ``max_q`` to a power of two (the attention grid; programs
past a request's rows exit at once). The real requests fill the first ``B`` request slots, the
slots after them are empty (no rows, no keys), and one last **dummy request** owns the padding
rows ``[T, T_pad)``: they write their K/V to a scratch page no request owns (the pool has one more
page than its ledger) and attend only to it. Every layer works row by row outside attention, so
padding rows never touch a real row; the caller gets the first ``T`` rows back.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Callable

import torch

from flash_dllm.kernels._triton import next_pow2
from flash_dllm.layers.attention_backend import PagedAttentionMetadata
from flash_dllm.worker.compile_watch import KERNEL_COMPILES

log = logging.getLogger("flash_dllm.compile")


@dataclass(frozen=True)
class GraphKey:
    """What a captured graph is specialised to: its capture ``mode`` and static ``shape``."""

    mode: str                  # "forward" | "step"
    shape: tuple


def _describe(key) -> str:
    return f"{key.mode} {key.shape}" if isinstance(key, GraphKey) else repr(key)


class GraphCache:
    """The captured graphs of one runner and the capture policy they share."""

    MAX_SEEN = 4096              # uncaptured shapes remembered (refresh shapes follow prompts)
    # NOTE: a forward of more FLOPs than this runs eagerly (exact rows, no padding). Eager
    # launches cost the host ~20 ms per forward of the LLaDA-8B shape (32 layers, ~2.7k ops),
    # which a GPU only hides behind a forward of >~10 TFLOP. At 1e12 (rows >= 62 for 8B) its
    # batch-1 step (~110 rows, 5.8 ms of GPU work) took 23.7 ms (issue 21,
    # profile_batch_step_llada8b_h200.json); at 4e12 (rows < 250 for 8B) such a step replays a
    # graph padded to at most 256 rows (~8 ms of GPU work), still below the eager host time.
    HEAVY_FLOPS = 4e12

    def __init__(self, max_graphs: int, first_capture: int = 2) -> None:
        self.max_graphs = max_graphs
        self.first_capture = first_capture
        self.graphs: OrderedDict[GraphKey, object] = OrderedDict()
        self.seen: dict[GraphKey, int] = {}
        self.pool = None                 # the shared memory pool, created at the first capture
        # rows from which a forward is GEMM-bound (``set_model``); never by default
        self.heavy_tokens: float = float("inf")
        # set when a warm-up made the server ready: from then on nothing is captured
        self.ready = False

    def set_model(self, num_params: int) -> None:
        """Rows from which a forward of a ``num_params``-parameter model is GEMM-bound."""
        self.heavy_tokens = self.HEAVY_FLOPS / (2 * max(1, num_params))

    def get(self, key: GraphKey):
        """The graph captured for ``key`` (now the most recently used), or None."""
        g = self.graphs.get(key)
        if g is not None:
            self.graphs.move_to_end(key)
        return g

    def sighted(self, key: GraphKey, large: bool = False, tokens: int = 0) -> bool:
        """Count one more sighting of the uncaptured shape ``key`` (a step of ``tokens`` rows);
        True when it is time to capture it."""
        if self.ready:
            # NOTE: after a warm-up made the server ready nothing is captured: a capture stalls
            # the whole batch for about two forwards (measured on the LLaDA-8B shape, captures
            # of refresh shapes also evicted decode graphs that do come back). The warm-up
            # captured the padded buckets serving needs (``ForwardGraphs.warm``); a shape
            # outside them runs eagerly and is counted (``eager_forwards``)
            return False
        if len(self.seen) >= self.MAX_SEEN:
            self.seen.clear()
        n = self.seen.get(key, 0) + 1
        self.seen[key] = n
        return n >= self.first_capture + large

    def add(self, key: GraphKey, graph) -> None:
        self.graphs[key] = graph
        dropped = None
        while len(self.graphs) > self.max_graphs:
            dropped = self.graphs.popitem(last=False)[0]
        if self.ready or KERNEL_COMPILES.ready:   # a capture while requests wait: say which
            log.warning("CUDA graph captured after ready: %s (%d kept%s)", _describe(key),
                        len(self.graphs), "" if dropped is None else
                        f"; dropped the least recently used {_describe(dropped)}")

    def capture(self, fn: Callable[[], torch.Tensor]
                ) -> tuple[torch.Tensor, torch.cuda.CUDAGraph, torch.Tensor]:
        """Run ``fn`` once on a side stream (the warm-up ``torch.cuda.graph`` asks for: it *is*
        the step, so what it writes is the step's own), then capture it. Returns (the warm-up's
        output, a clone: later replays overwrite the static one; the graph; its static output)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            first = fn().clone()
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return first, graph, out


@dataclass(frozen=True)
class PaddedShape:
    """The bucket a forward graph is captured for (see the module's NOTE on padding)."""

    T: int            # rows
    B: int            # request slots for real requests (the dummy request comes after them)
    max_q: int        # attention grid bound on each request's rows
    max_k: int        # bound on key counts (already a power of two, or 0)


MIN_ROWS = 16         # the smallest row bucket


def padded_shape(T: int, B: int, max_q: int, max_k: int, heavy_tokens: float = float("inf"),
                 max_tokens: int | None = None) -> PaddedShape:
    """The bucket of a step of ``T`` rows over ``B`` requests: rows to a power of two while below
    ``heavy_tokens`` (and ``max_tokens``), else exact; requests and ``max_q`` to powers of two."""
    Tp = next_pow2(max(T, MIN_ROWS))
    if T >= heavy_tokens or (max_tokens is not None and Tp > max_tokens):
        Tp = T
    return PaddedShape(Tp, next_pow2(max(B, 1)), next_pow2(max(max_q, MIN_ROWS)), max_k)


def pad_step(ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata,
             shape: PaddedShape, scratch_page: int):
    """New tensors: the step ``(ids, positions, meta)`` padded to ``shape``; padding rows and the
    dummy request use ``scratch_page`` (which no request owns). Returns (ids, positions, meta)."""
    T, B = ids.shape[0], meta.seq_lens.shape[0]
    if shape.T < T or shape.B < B or shape.max_q < meta.max_q:
        raise ValueError(f"pad_step: a step of {T} rows, {B} requests, max_q {meta.max_q} does "
                         f"not fit the bucket {shape}")
    ps, dev = meta.kv.shape[3], ids.device
    n = shape.T - T
    i32 = dict(dtype=torch.int32, device=dev)
    ids_p = torch.cat([ids, torch.zeros(n, dtype=ids.dtype, device=dev)])
    pos_p = torch.cat([positions, torch.zeros(n, dtype=positions.dtype, device=dev)])
    slots = torch.cat([meta.slots, torch.full((n,), scratch_page * ps, dtype=meta.slots.dtype,
                                              device=dev)])
    # empty request slots B..shape.B-1 (their cu entries all T), then the dummy's end
    cu = torch.cat([meta.cu_q.to(torch.int32), torch.full((shape.B - B,), T, **i32),
                    torch.full((1,), shape.T, **i32)])
    lens = torch.cat([meta.seq_lens.to(torch.int32), torch.zeros(shape.B - B, **i32),
                      torch.ones(1, **i32)])
    width = meta.block_table.shape[1]
    table = torch.cat([meta.block_table.to(torch.int32),
                       torch.full((shape.B - B + 1, width), scratch_page, **i32)])
    meta_p = replace(meta, slots=slots, cu_q=cu, seq_lens=lens, block_table=table,
                     max_q=shape.max_q, max_k=shape.max_k, segments=[], mass=None)
    return ids_p, pos_p, meta_p


@dataclass
class _ForwardGraph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    positions: torch.Tensor
    meta: PagedAttentionMetadata   # static index tensors
    out: torch.Tensor              # [T, d] pre-norm hidden states, overwritten by each replay
    pads: bool = False             # captured padded (a dummy request owns the padding rows)


class ForwardGraphs:
    """The ``forward`` capture mode: ``forward(ids, positions, meta)`` returns the model's hidden
    states for a step, from a graph when one is captured for its padded shape (``meta.mass`` is
    set as an eager run sets it)."""

    def __init__(self, model, cache: GraphCache, max_rows: int = 128,
                 max_tokens: int = 16384, scratch_page: int | None = None) -> None:
        self.model = model
        self.cache = cache
        self.max_rows = max_rows
        self.max_tokens = max_tokens
        # a page of the pool no request owns: padding rows write their K/V there (None: no
        # padding, every graph keyed on the exact shape)
        self.scratch_page = scratch_page
        self.stats = {"graph_replays": 0, "graph_captures": 0, "eager_forwards": 0}

    def shape(self, ids: torch.Tensor, meta: PagedAttentionMetadata) -> PaddedShape:
        T, B = ids.shape[0], meta.seq_lens.shape[0]
        if self.scratch_page is None:
            return PaddedShape(T, B, meta.max_q, meta.max_k)
        return padded_shape(T, B, meta.max_q, meta.max_k, self.cache.heavy_tokens,
                            self.max_tokens)

    @staticmethod
    def key(shape: PaddedShape, meta: PagedAttentionMetadata) -> GraphKey:
        return GraphKey("forward", (shape.T, shape.B, meta.block_table.shape[1], shape.max_q,
                                    shape.max_k, meta.mass_layer))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                meta: PagedAttentionMetadata) -> torch.Tensor:
        if meta.special or not ids.is_cuda or ids.shape[0] > self.max_tokens:
            return self.eager(ids, positions, meta)
        shape = self.shape(ids, meta)
        key = self.key(shape, meta)
        g = self.cache.get(key)
        if g is None:
            # NOTE: a decode-sized step (<= max_rows rows per request) is captured when its shape
            # comes back a second time; a larger one (a full-canvas refresh, a prefix-mode suffix)
            # only the third time: its shape follows the prompt lengths and often never returns,
            # and a capture costs about two forwards.
            if not self.cache.sighted(key, large=meta.max_q > self.max_rows,
                                      tokens=ids.shape[0]):
                return self.eager(ids, positions, meta)
            g = self._capture(key, shape, ids, positions, meta)
        else:
            self._load(g, ids, positions, meta)
        g.graph.replay()
        self.stats["graph_replays"] += 1
        T, B = ids.shape[0], meta.seq_lens.shape[0]
        meta.mass = None if g.meta.mass is None else g.meta.mass[:B]
        return g.out[:T]

    def eager(self, ids, positions, meta) -> torch.Tensor:
        self.stats["eager_forwards"] += 1
        return self.model.hidden(ids, positions, meta)

    def _load(self, g: _ForwardGraph, ids, positions, meta: PagedAttentionMetadata) -> None:
        """Copy a step into the graph's static inputs; padding rows and empty request slots are
        reset (stale slots would make the padding rows write into a real request's page)."""
        T, B = ids.shape[0], meta.seq_lens.shape[0]
        s = g.meta
        g.ids[:T].copy_(ids)
        g.positions[:T].copy_(positions)
        s.slots[:T].copy_(meta.slots)
        s.cu_q[:B + 1].copy_(meta.cu_q)
        s.seq_lens[:B].copy_(meta.seq_lens)
        s.block_table[:B].copy_(meta.block_table)
        if g.pads:
            ps = s.kv.shape[3]
            s.slots[T:].fill_(self.scratch_page * ps)
            s.cu_q[B + 1:-1].fill_(T)           # empty slots; the last entry (the dummy's end)
            s.seq_lens[B:-1].fill_(0)           # and the dummy's key count never change

    def _capture(self, key: GraphKey, shape: PaddedShape, ids, positions,
                 meta: PagedAttentionMetadata) -> _ForwardGraph:
        pads = self.scratch_page is not None
        if pads:
            s_ids, s_pos, static = pad_step(ids, positions, meta, shape, self.scratch_page)
        else:
            static = replace(meta, slots=meta.slots.clone(), cu_q=meta.cu_q.clone(),
                             seq_lens=meta.seq_lens.clone(), block_table=meta.block_table.clone(),
                             segments=[], mass=None)
            s_ids, s_pos = ids.clone(), positions.clone()
        # the warm-up writes this step's own K/V; the replay that follows rewrites the same
        _, graph, out = self.cache.capture(lambda: self.model.hidden(s_ids, s_pos, static))
        g = _ForwardGraph(graph, s_ids, s_pos, static, out, pads)
        self.cache.add(key, g)
        self.stats["graph_captures"] += 1
        return g

    def warm(self, shapes: list[PaddedShape], template: PagedAttentionMetadata,
             mass_layer: int | None = None) -> int:
        """Capture graphs for ``shapes`` not captured yet, from steps of dummy rows only (all on
        the scratch page): the warm-up's way to cover buckets its requests did not reach.
        ``template``: any step's metadata (pool, block-table width, rotary, tensor parallelism).
        Returns the number captured."""
        if self.scratch_page is None:
            return 0
        dev = template.kv.device
        # a step of no real request: pad_step makes every row the dummy request's
        empty = replace(template, slots=torch.zeros(0, dtype=torch.int32, device=dev),
                        cu_q=torch.zeros(1, dtype=torch.int32, device=dev),
                        seq_lens=torch.zeros(0, dtype=torch.int32, device=dev),
                        block_table=template.block_table[:0], max_q=1,
                        segments=[], mass_layer=mass_layer, mass=None)
        ids = torch.zeros(0, dtype=torch.long, device=dev)
        n = 0
        for shape in shapes:
            key = self.key(shape, empty)
            if key in self.cache.graphs or shape.T > self.max_tokens:
                continue
            self._capture(key, shape, ids, ids, empty)
            n += 1
        return n
