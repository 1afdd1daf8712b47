"""CUDA graphs for the paged forward: one captured graph per step shape, replayed with new inputs.

A step's shape is ``(tokens, requests, block-table width, max rows per request, key-count bound,
mass layer)``. In
steady decoding that shape repeats every step (``dual``: each request recomputes its block; the
first step of a block is a different shape), so a shape is captured the second time it is seen
and replayed from then on (larger steps than ``max_rows`` rows per request: the third time;
steps of more than ``max_tokens`` rows in all: never); at most ``max_graphs`` are kept (least
recently used dropped). ``GraphCache`` holds that policy; ``engine/fused_step.py`` uses it too.
All graphs share one memory pool: they never run at the same time.

Everything the forward reads comes from the step's small index tensors (ids, positions, slots,
``cu_q``, ``seq_lens``, block table), copied into the graph's static buffers before each replay;
the KV pool itself is one tensor that never moves. Steps with verification rows or probes (their
special rows are shaped per step) always run eagerly.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from flash_dllm.layers.attention import PagedBatch, PagedContext


class GraphCache:
    """The captured graphs of one runner (``GraphRunner``, ``FusedStep``) and the capture policy
    they share: a shape is captured at its ``first_capture``-th sighting (default the second: a
    shape that never comes back costs no capture), a ``large`` one (more rows per request than a
    decode step: its shape follows the prompt lengths) one sighting later; at most
    ``max_graphs`` are kept, the least recently used dropped."""

    MAX_SEEN = 4096              # uncaptured shapes remembered (refresh shapes follow prompts)

    def __init__(self, max_graphs: int, first_capture: int = 2) -> None:
        self.max_graphs = max_graphs
        self.first_capture = first_capture
        self.graphs: OrderedDict[tuple, object] = OrderedDict()
        self.seen: dict[tuple, int] = {}

    def get(self, key: tuple):
        """The graph captured for ``key`` (now the most recently used), or None."""
        g = self.graphs.get(key)
        if g is not None:
            self.graphs.move_to_end(key)
        return g

    def sighted(self, key: tuple, large: bool = False) -> bool:
        """Count one more sighting of the uncaptured shape ``key``; True when it is time to
        capture it."""
        if len(self.seen) >= self.MAX_SEEN:
            self.seen.clear()
        n = self.seen.get(key, 0) + 1
        self.seen[key] = n
        return n >= self.first_capture + large

    def add(self, key: tuple, graph) -> None:
        self.graphs[key] = graph
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    positions: torch.Tensor
    batch: PagedBatch            # static index tensors
    ctx: PagedContext
    out: torch.Tensor            # [T, d] pre-norm hidden states, overwritten by each replay


class GraphRunner:
    def __init__(self, model, max_graphs: int = 32, max_rows: int = 128,
                 max_tokens: int = 8192) -> None:
        self.model = model
        self.max_rows = max_rows
        self.max_tokens = max_tokens
        self.cache = GraphCache(max_graphs)
        self.pool = None
        self.stats = {"graph_replays": 0, "graph_captures": 0, "eager_forwards": 0}

    @staticmethod
    def key(ids: torch.Tensor, batch: PagedBatch, mass_layer: int | None) -> tuple:
        return (ids.shape[0], batch.cu_q.shape[0], batch.block_table.shape[1], batch.max_q,
                batch.max_k, mass_layer)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, ctx: PagedContext
                ) -> torch.Tensor:
        """The model's hidden states for this step; ``ctx.mass`` is set as an eager run sets it."""
        # NOTE: a step of more than max_tokens rows (a large batch's full-canvas refresh) always
        # runs eagerly: a captured graph would hold its activations in the graph pool for good,
        # and at that size launches cost nothing next to the GEMMs.
        if ctx.special or not ids.is_cuda or ids.shape[0] > self.max_tokens:
            return self._eager(ids, positions, ctx)
        key = self.key(ids, ctx.batch, ctx.mass_layer)
        g = self.cache.get(key)
        if g is None:
            # NOTE: a decode-sized step (<= max_rows rows per request) is captured when its shape
            # comes back a second time; a larger one (a full-canvas refresh, a prefix-mode suffix)
            # only the third time: its shape follows the prompt lengths and often never returns,
            # and a capture costs about two forwards.
            if not self.cache.sighted(key, large=ctx.batch.max_q > self.max_rows):
                return self._eager(ids, positions, ctx)
            g = self._capture(key, ids, positions, ctx)
        else:
            self._load(g, ids, positions, ctx.batch)
        g.graph.replay()
        self.stats["graph_replays"] += 1
        ctx.mass = g.ctx.mass
        return g.out

    def _eager(self, ids, positions, ctx) -> torch.Tensor:
        self.stats["eager_forwards"] += 1
        return self.model.hidden(ids, positions, ctx)

    @staticmethod
    def _load(g: _Graph, ids, positions, batch: PagedBatch) -> None:
        g.ids.copy_(ids)
        g.positions.copy_(positions)
        for name in ("slots", "cu_q", "seq_lens", "block_table"):
            getattr(g.batch, name).copy_(getattr(batch, name))

    def _capture(self, key, ids, positions, ctx: PagedContext) -> _Graph:
        b = ctx.batch
        static = replace(b, slots=b.slots.clone(), cu_q=b.cu_q.clone(), seq_lens=b.seq_lens.clone(),
                         block_table=b.block_table.clone())
        sctx = PagedContext(static, mass_layer=ctx.mass_layer)
        s_ids, s_pos = ids.clone(), positions.clone()
        # NOTE: a warm-up on a side stream before capture (what torch.cuda.graphs asks for); it runs
        # this very step, so the K/V it writes are the step's own.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.model.hidden(s_ids, s_pos, sctx)
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model.hidden(s_ids, s_pos, sctx)
        g = _Graph(graph, s_ids, s_pos, static, sctx, out)
        self.cache.add(key, g)
        self.stats["graph_captures"] += 1
        return g
