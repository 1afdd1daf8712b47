"""CUDA graphs of the runner: one key type, one cache (capture policy + LRU + memory pool), one
capture helper, and the forward capture mode.

The runner has two capture modes, both keyed by ``GraphKey`` in one ``GraphCache``:

- ``forward`` (``ForwardGraphs`` below): the model forward of a step, replayed with the step's
  index tensors copied into the graph's static buffers. Steps with verification rows or probes
  (their special rows are shaped per step) always run eagerly.
- ``step`` (``engine/step_graph.py``): a whole steady greedy step (forward, LM head, proposal,
  commit rule, commit) as one graph.

A shape is captured at its ``first_capture``-th sighting (default the second: a shape that never
comes back costs no capture); a ``large`` one (more rows per request than a decode step, whose
shape follows the prompt lengths) one sighting later, and never once a warm-up made the server
ready; steps of more than ``max_tokens`` rows in
all never (a captured graph would hold their activations in the pool for good, and at that size
launches cost nothing next to the GEMMs). At most ``max_graphs`` are kept, the least recently used
dropped. All graphs share one memory pool: they never run at the same time.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Callable

import torch

from flash_dllm.engine.compile_watch import KERNEL_COMPILES
from flash_dllm.layers.attention_backend import PagedAttentionMetadata

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
    HEAVY_FLOPS = 1e12           # a forward this big is GEMM-bound (~1.5 ms on an H200)

    def __init__(self, max_graphs: int, first_capture: int = 2) -> None:
        self.max_graphs = max_graphs
        self.first_capture = first_capture
        self.graphs: OrderedDict[GraphKey, object] = OrderedDict()
        self.seen: dict[GraphKey, int] = {}
        self.pool = None                 # the shared memory pool, created at the first capture
        # rows from which a forward is GEMM-bound (``set_model``); never by default
        self.heavy_tokens: float = float("inf")

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
        if large and KERNEL_COMPILES.ready and tokens >= self.heavy_tokens:
            # NOTE: after a warm-up made the server ready, a large shape (a refresh whose rows
            # follow the prompt lengths) whose forward is GEMM-bound runs eagerly: measured on
            # the LLaDA-8B shape, capturing them kept stalling the batch (a capture costs about
            # two forwards) and evicted the decode graphs that do come back, while at 1-2K rows
            # launches cost nothing next to the GEMMs. A small model's refresh is launch-bound
            # at any size here: those are still captured (the demo model: 51 vs 35 req/s)
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
        if KERNEL_COMPILES.ready:      # a capture while requests wait: say which shape, and why
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


@dataclass
class _ForwardGraph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    positions: torch.Tensor
    meta: PagedAttentionMetadata   # static index tensors
    out: torch.Tensor              # [T, d] pre-norm hidden states, overwritten by each replay


class ForwardGraphs:
    """The ``forward`` capture mode: ``forward(ids, positions, meta)`` returns the model's hidden
    states for a step, from a graph when one is captured for its shape (``meta.mass`` is set as an
    eager run sets it)."""

    def __init__(self, model, cache: GraphCache, max_rows: int = 128,
                 max_tokens: int = 8192) -> None:
        self.model = model
        self.cache = cache
        self.max_rows = max_rows
        self.max_tokens = max_tokens
        self.stats = {"graph_replays": 0, "graph_captures": 0, "eager_forwards": 0}

    @staticmethod
    def key(ids: torch.Tensor, meta: PagedAttentionMetadata) -> GraphKey:
        return GraphKey("forward", (ids.shape[0], meta.cu_q.shape[0], meta.block_table.shape[1],
                                    meta.max_q, meta.max_k, meta.mass_layer))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                meta: PagedAttentionMetadata) -> torch.Tensor:
        if meta.special or not ids.is_cuda or ids.shape[0] > self.max_tokens:
            return self.eager(ids, positions, meta)
        key = self.key(ids, meta)
        g = self.cache.get(key)
        if g is None:
            # NOTE: a decode-sized step (<= max_rows rows per request) is captured when its shape
            # comes back a second time; a larger one (a full-canvas refresh, a prefix-mode suffix)
            # only the third time: its shape follows the prompt lengths and often never returns,
            # and a capture costs about two forwards.
            if not self.cache.sighted(key, large=meta.max_q > self.max_rows,
                                      tokens=ids.shape[0]):
                return self.eager(ids, positions, meta)
            g = self._capture(key, ids, positions, meta)
        else:
            self._load(g, ids, positions, meta)
        g.graph.replay()
        self.stats["graph_replays"] += 1
        meta.mass = g.meta.mass
        return g.out

    def eager(self, ids, positions, meta) -> torch.Tensor:
        self.stats["eager_forwards"] += 1
        return self.model.hidden(ids, positions, meta)

    @staticmethod
    def _load(g: _ForwardGraph, ids, positions, meta: PagedAttentionMetadata) -> None:
        g.ids.copy_(ids)
        g.positions.copy_(positions)
        for name in ("slots", "cu_q", "seq_lens", "block_table"):
            getattr(g.meta, name).copy_(getattr(meta, name))

    def _capture(self, key: GraphKey, ids, positions, meta: PagedAttentionMetadata
                 ) -> _ForwardGraph:
        static = replace(meta, slots=meta.slots.clone(), cu_q=meta.cu_q.clone(),
                         seq_lens=meta.seq_lens.clone(), block_table=meta.block_table.clone(),
                         segments=[], mass=None)
        s_ids, s_pos = ids.clone(), positions.clone()
        # the warm-up writes this step's own K/V; the replay that follows rewrites the same
        _, graph, out = self.cache.capture(lambda: self.model.hidden(s_ids, s_pos, static))
        g = _ForwardGraph(graph, s_ids, s_pos, static, out)
        self.cache.add(key, g)
        self.stats["graph_captures"] += 1
        return g
