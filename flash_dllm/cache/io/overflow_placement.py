"""Which pages of a request larger than the GPU pool stay in the pool (``--kv-placement`` for
``cache/io/kv_overflow.py``'s requests; with ``--lazy-load-budget``).

Such a request keeps ``n - spill`` of its ``n`` pages in the pool and ``spill`` in pinned host
memory. With exact attention every step reads every page, so which pages stay changes no byte
(``benchmarks/FINDINGS.md``, "Placement cannot cut full-loading bytes"). Under lazy loading a
step attends to the resident pages plus the pages of largest predicted attention and loads only
those of them that live on the host: keeping the most attended pages resident loads fewer.

- ``lru`` keeps the positional split the request was admitted with: its last pages (the
  answer's, the ones written most recently) resident, the first ``spill`` on the host.
- ``ema`` keeps the pages of largest moving-average attention mass (each measuring step's mass,
  last layer, the active block's rows, normalised to sum 1; older evidence decays by
  ``DECAY`` per measurement).
- ``kag`` keeps the most central pages of the request's KV access graph
  (``cache/access_graph.py``: pages linked when one block's queries attend to both; PageRank
  with teleport in proportion to the decayed mass).

The choice is made at a step that rewrites every page (a block refresh): the refresh writes
each page to its new home, so moving the resident set costs no byte. The pages the block's
later steps rewrite are always resident (the active block; under the prefix cache also the
masked suffix, and for Dream's shifted logits the page before the block), the others by
score; host pages are laid out by decreasing score, so the pages a lazy step most likely
loads are adjacent (fewer, larger copies).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from flash_dllm.cache.access_graph import AccessGraph

@dataclass(frozen=True)
class Placement:
    """A ``kv_placement`` policy's traits: whether it ever moves pages by the attention evidence
    (``lru`` keeps its last pages) and whether it keeps the KV access graph (``kag``'s PageRank;
    else the moving average of the mass)."""
    moves: bool
    graph: bool


PLACEMENTS = {"lru": Placement(moves=False, graph=False),
              "ema": Placement(moves=True, graph=False),
              "kag": Placement(moves=True, graph=True)}
OVERFLOW_PLACEMENTS = tuple(PLACEMENTS)          # (config.py's kv_placement choices, tested)


class ResidentSet:
    """One overflow request's placement evidence and choice (host side, per request)."""

    DECAY = 0.9

    def __init__(self, policy: str, num_pages: int, top_k: int = 8) -> None:
        if policy not in OVERFLOW_PLACEMENTS:
            raise ValueError(f"kv_placement must be one of {OVERFLOW_PLACEMENTS}, got {policy!r}")
        self.policy, self.n = policy, num_pages
        self.traits = PLACEMENTS[policy]
        self.ema = np.zeros(num_pages)
        self.graph = (AccessGraph(capacity=num_pages, top_k=top_k, decay=self.DECAY)
                      if self.traits.graph else None)
        self.observed = 0
        self.seconds = 0.0                   # evidence and choice, host time
        self.stability = 1.0                 # kag: share of the top pages kept between updates

    @property
    def active(self) -> bool:
        """Whether this policy ever moves pages (``lru`` never does)."""
        return self.traits.moves

    def observe(self, mass: np.ndarray) -> None:
        """A measuring step's attention mass per logical page [n]."""
        if not self.active:
            return
        t0 = time.perf_counter()
        m = np.clip(np.nan_to_num(np.asarray(mass, dtype=np.float64)[:self.n]), 0.0, None)
        if m.sum() > 0:
            m = m / m.sum()
        self.ema = self.DECAY * self.ema + m
        if self.graph is not None:
            self.graph.update(np.arange(self.n), m)
            self.stability = self.graph.stability(min(16, self.n))
        self.observed += 1
        self.seconds += time.perf_counter() - t0

    def scores(self) -> np.ndarray:
        if self.graph is not None:
            return self.graph.pagerank().cpu().numpy()[:self.n].astype(np.float64)
        return self.ema

    def choose(self, spill: int, active: tuple[int, int]) -> np.ndarray | None:
        """The stage order (stage slot -> logical page) to use from the next step: host slots
        ``0..spill-1`` (by decreasing score), then the resident pages in logical order: the
        pages ``[active[0], active[1])`` (those the block's later steps rewrite, as many as
        fit), then the others of largest score. None: keep the current order (``lru``, or no
        evidence yet)."""
        if not self.active or self.observed == 0:
            return None
        t0 = time.perf_counter()
        n, r = self.n, self.n - spill
        a0, a1 = max(0, active[0]), min(n, active[1])
        forced = np.arange(a0, a1)[:r]
        score = self.scores().copy()
        # ties: later pages first (as the positional split, which keeps the tail)
        rank = np.lexsort((-np.arange(n), -score))
        rest = [int(p) for p in rank if not a0 <= p < a1][:r - len(forced)]
        resident = sorted(list(forced) + rest)     # (one set, one order: no needless remap)
        is_res = np.zeros(n, dtype=bool)
        is_res[resident] = True
        host = [int(p) for p in rank if not is_res[p]]        # decreasing score
        self.seconds += time.perf_counter() - t0
        return np.asarray(host + resident, dtype=np.int64)
