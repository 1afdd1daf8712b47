"""KV access graph (KAG): cached KV pages as nodes, co-attention as weighted edges, PageRank as
the pages' importance (issue 14).

Evidence arrives once per decoded block (the set of pages a block attends to is stable across
its denoising steps): ``update(nodes, mass)`` takes the attention mass each page of one request
received over the block. Every node's mass is a moving average (old evidence decays by
``decay`` per update); the ``top_k`` pages of the block that received the most mass are linked
pairwise (they were attended by the same queries), with weight min(mass_i, mass_j) added to the
decayed weight already there. A node keeps at most ``top_k`` neighbours (the heaviest), so the
graph is ``capacity x top_k`` tensors on one device.

``pagerank`` is power iteration over the directed neighbour lists (teleport to nodes in
proportion to their mass, dangling nodes' rank redistributed the same way), checked against
``networkx.pagerank`` on random graphs in the tests. It is recomputed only when an update
changed the graph. ``stability(k)`` is the share of the k most central nodes that were also
the k most central at the previous computation (``flash_dllm_kag_stability_ratio``).
"""
from __future__ import annotations

import time

import torch


class AccessGraph:
    def __init__(self, capacity: int = 1024, top_k: int = 8, decay: float = 0.9,
                 device: str | torch.device = "cpu") -> None:
        if capacity < 1 or top_k < 1 or not 0.0 <= decay <= 1.0:
            raise ValueError(f"AccessGraph: capacity >= 1, top_k >= 1 and decay in [0, 1], got "
                             f"{capacity}, {top_k}, {decay}")
        self.top_k, self.decay, self.device = top_k, decay, torch.device(device)
        self.mass = torch.zeros(capacity, device=self.device)
        self.nbr = torch.full((capacity, top_k), -1, dtype=torch.long, device=self.device)
        self.w = torch.zeros((capacity, top_k), device=self.device)
        self._rank: torch.Tensor | None = None
        self._prev_top: torch.Tensor | None = None
        self._dirty = True
        self.stats = {"updates": 0, "pagerank_runs": 0, "pagerank_seconds": 0.0,
                      "last_stability": 1.0}

    @property
    def capacity(self) -> int:
        return self.mass.shape[0]

    def _grow(self, n: int) -> None:
        cap = self.capacity
        while cap < n:
            cap *= 2
        extra = cap - self.capacity
        self.mass = torch.cat([self.mass, self.mass.new_zeros(extra)])
        self.nbr = torch.cat([self.nbr, self.nbr.new_full((extra, self.top_k), -1)])
        self.w = torch.cat([self.w, self.w.new_zeros((extra, self.top_k))])
        if self._rank is not None:
            self._rank = torch.cat([self._rank, self._rank.new_zeros(extra)])

    # ------------------------------------------------------------------------------ evidence
    def update(self, nodes, mass) -> None:
        """One block's evidence: ``mass[i]`` is the attention mass page ``nodes[i]`` received
        (ids ``0 <= id``; the graph grows to hold them)."""
        nodes = torch.as_tensor(nodes, dtype=torch.long, device=self.device).flatten()
        mass = torch.as_tensor(mass, dtype=torch.float32, device=self.device).flatten()
        if nodes.numel() != mass.numel():
            raise ValueError(f"update: {nodes.numel()} nodes but {mass.numel()} masses")
        if nodes.numel() == 0:
            return
        if int(nodes.min()) < 0:
            raise ValueError("update: node ids must be >= 0")
        if not bool(torch.isfinite(mass).all()) or bool((mass < 0).any()):
            raise ValueError("update: masses must be finite and >= 0")
        self._grow(int(nodes.max()) + 1)
        self.mass.mul_(self.decay)
        self.w.mul_(self.decay)
        self.mass.index_add_(0, nodes, mass)
        k = min(self.top_k, nodes.numel())
        top = torch.topk(mass, k).indices
        ids, ms = nodes[top].tolist(), mass[top].tolist()
        for a in range(k):                              # k <= top_k: a few pairs per block
            for b in range(k):
                if a != b and ids[a] != ids[b]:
                    self._add_edge(ids[a], ids[b], min(ms[a], ms[b]))
        self.stats["updates"] += 1
        self._dirty = True

    def _add_edge(self, i: int, j: int, weight: float) -> None:
        row, wr = self.nbr[i], self.w[i]
        hit = (row == j).nonzero()
        if hit.numel():
            wr[hit[0, 0]] += weight
            return
        slot = int(torch.argmin(torch.where(row < 0, torch.full_like(wr, -1.0), wr)))
        if row[slot] < 0 or wr[slot] < weight:          # a free slot, or a lighter edge to drop
            row[slot], wr[slot] = j, weight

    def forget(self, node: int) -> None:
        """A page left the cache: its node and every edge to it go."""
        if node >= self.capacity:
            return
        self.mass[node] = 0.0
        self.nbr[node] = -1
        self.w[node] = 0.0
        gone = self.nbr == node
        self.nbr[gone] = -1
        self.w[gone] = 0.0
        self._dirty = True

    # ------------------------------------------------------------------------------ centrality
    def edges(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(src, dst, weight) of every directed edge."""
        src = torch.arange(self.capacity, device=self.device).unsqueeze(1).expand_as(self.nbr)
        keep = (self.nbr >= 0) & (self.w > 0)
        return src[keep], self.nbr[keep], self.w[keep]

    def pagerank(self, alpha: float = 0.85, tol: float = 1e-8, max_iter: int = 200
                 ) -> torch.Tensor:
        """Rank of every node (sums to 1 over nodes with mass or edges; 0 elsewhere)."""
        if not self._dirty and self._rank is not None:
            return self._rank
        t0 = time.perf_counter()
        n = self.capacity
        src, dst, w = self.edges()
        out = torch.zeros(n, device=self.device).index_add_(0, src, w)
        alive = (self.mass > 0) | (out > 0)
        alive[dst] = True
        rank = torch.zeros(n, device=self.device)
        if bool(alive.any()):
            p = torch.where(alive, self.mass, torch.zeros_like(self.mass))
            p = p / p.sum() if float(p.sum()) > 0 else alive.float() / alive.sum()
            rank = alive.float() / alive.sum()
            share = w / out[src]
            dangling = alive & (out == 0)
            for _ in range(max_iter):
                nxt = torch.zeros(n, device=self.device).index_add_(0, dst, rank[src] * share)
                nxt = alpha * (nxt + rank[dangling].sum() * p) + (1 - alpha) * p
                err = float((nxt - rank).abs().sum())
                rank = nxt
                if err < n * tol:
                    break
        self._rank = rank
        self._dirty = False
        self.stats["pagerank_runs"] += 1
        self.stats["pagerank_seconds"] += time.perf_counter() - t0
        return rank

    def top(self, k: int) -> torch.Tensor:
        """The ``k`` most central nodes (fewer if fewer have any rank)."""
        rank = self.pagerank()
        k = min(k, int((rank > 0).sum()))
        return torch.topk(rank, k).indices if k else rank.new_zeros(0, dtype=torch.long)

    def stability(self, k: int) -> float:
        """Share of the current top ``k`` that was in the top ``k`` at the previous call (1.0 at
        the first call and when the graph did not change)."""
        top = self.top(k)
        prev, self._prev_top = self._prev_top, top
        if prev is None or top.numel() == 0:
            ratio = 1.0
        else:
            ratio = float(torch.isin(top, prev).float().mean())
        self.stats["last_stability"] = ratio
        return ratio
