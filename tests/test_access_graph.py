"""KV access graph (issue 14): evidence, edges, PageRank against networkx as the oracle."""
from __future__ import annotations

import random

import pytest
import torch

from flash_dllm.cache.access_graph import AccessGraph

nx = pytest.importorskip("networkx")


def oracle(g: AccessGraph, alpha: float) -> dict[int, float]:
    src, dst, w = g.edges()
    G = nx.DiGraph()
    alive = {i for i in range(g.capacity) if float(g.mass[i]) > 0}
    alive |= set(src.tolist()) | set(dst.tolist())
    G.add_nodes_from(alive)
    for s, d, x in zip(src.tolist(), dst.tolist(), w.tolist()):
        G.add_edge(s, d, weight=x)
    p = {i: float(g.mass[i]) for i in alive}
    if sum(p.values()) == 0:
        p = None
    return nx.pagerank(G, alpha=alpha, personalization=p, weight="weight", tol=1e-12,
                       max_iter=1000)


@pytest.mark.parametrize("seed", range(8))
def test_pagerank_matches_networkx(seed):
    rng = random.Random(seed)
    g = AccessGraph(capacity=4, top_k=rng.choice([2, 4, 8]), decay=rng.choice([0.5, 0.9, 1.0]))
    for _ in range(rng.randint(1, 30)):
        nodes = rng.sample(range(40), rng.randint(1, 10))
        g.update(nodes, [rng.random() * (rng.random() < 0.9) for _ in nodes])
    alpha = rng.choice([0.5, 0.85])
    ours = g.pagerank(alpha=alpha, tol=1e-12, max_iter=1000)
    want = oracle(g, alpha)
    for i in range(g.capacity):
        assert float(ours[i]) == pytest.approx(want.get(i, 0.0), abs=1e-6), i
    assert float(ours.sum()) == pytest.approx(1.0, abs=1e-5)


def test_edges_mass_decay_and_neighbour_cap():
    g = AccessGraph(capacity=2, top_k=2, decay=0.5)
    g.update([0, 1, 2], [3.0, 2.0, 1.0])        # top 2 of the block: 0 and 1 link, weight 2
    src, dst, w = g.edges()
    assert sorted(zip(src.tolist(), dst.tolist(), w.tolist())) == [(0, 1, 2.0), (1, 0, 2.0)]
    assert g.capacity == 4 and g.mass[:3].tolist() == [3.0, 2.0, 1.0]
    g.update([0, 2], [1.0, 4.0])                 # old evidence halves, 0-2 joins
    assert g.mass[:3].tolist() == [2.5, 1.0, 4.5]
    e = {(s, d): x for s, d, x in zip(*[t.tolist() for t in g.edges()])}
    assert e[(0, 1)] == 1.0 and e[(0, 2)] == 1.0 and e[(2, 0)] == 1.0
    g.update([0, 3], [5.0, 5.0])                 # 0 keeps its 2 heaviest neighbours
    row = {int(n) for n in g.nbr[0] if n >= 0}
    assert len(row) == 2 and 3 in row


def test_pagerank_cached_until_changed_and_stability():
    g = AccessGraph(top_k=4)
    for _ in range(3):
        g.update([0, 1, 2, 3], [4.0, 3.0, 2.0, 1.0])
    r1 = g.pagerank()
    assert g.pagerank() is r1 and g.stats["pagerank_runs"] == 1
    assert g.stability(2) == 1.0 and set(g.top(2).tolist()) == {0, 1}
    for _ in range(20):                              # the centre moves to 5, 6
        g.update([5, 6, 7], [9.0, 9.0, 1.0])
    assert g.stats["pagerank_runs"] == 1 and g.stability(2) == 0.0
    assert set(g.top(2).tolist()) == {5, 6} and g.stats["pagerank_runs"] == 2
    g.forget(5)
    assert 5 not in g.nbr.flatten().tolist() and float(g.pagerank()[5]) == 0.0


def test_bad_input_names_the_problem():
    g = AccessGraph()
    with pytest.raises(ValueError, match="2 nodes but 1 masses"):
        g.update([0, 1], [1.0])
    with pytest.raises(ValueError, match="finite and >= 0"):
        g.update([0], [float("nan")])
    with pytest.raises(ValueError, match=">= 0"):
        g.update([-1], [1.0])
    with pytest.raises(ValueError, match="decay in"):
        AccessGraph(decay=2.0)
    g.update([], [])                                  # nothing to do
    assert g.top(3).numel() == 0


def test_empty_and_single_node():
    g = AccessGraph()
    g.update([7], [2.0])
    r = g.pagerank()
    assert float(r[7]) == pytest.approx(1.0) and g.top(5).tolist() == [7]
