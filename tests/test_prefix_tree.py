"""PrefixTree: whole-page prefixes, chained namespaced keys, leaves-first LRU eviction that never
touches a locked node or its ancestors, checked against a reference model."""
from __future__ import annotations

import hashlib
import random
import struct
import time

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flash_dllm.cache.prefix_tree import Node, PrefixTree

NS = b"model=demo|dtype=bf16|page=4|mode=dual"


def _tree(page_size: int = 4, namespace: bytes = NS) -> PrefixTree:
    return PrefixTree(page_size, namespace)


# ---------------------------------------------------------------------------- match / insert
def test_shared_prefixes_branch_and_match_stops_at_divergence():
    t = _tree()
    a = list(range(12))                                   # 3 pages
    out = t.insert(a, ["a0", "a1", "a2"], now=1.0)
    assert [adopted for _, adopted in out] == [True, True, True]
    assert [n.block for n, _ in out] == ["a0", "a1", "a2"]
    assert [n.depth for n, _ in out] == [0, 1, 2] and [n.num_tokens for n, _ in out] == [4, 8, 12]
    b = list(range(8)) + [100, 101, 102, 103, 7]           # shares 2 pages, then branches
    assert t.match(b) == [out[0][0], out[1][0]]
    out_b = t.insert(b, [None, None, "b2"], now=2.0)
    assert [(n, adopted) for n, adopted in out_b[:2]] == [(out[0][0], False), (out[1][0], False)]
    assert out_b[2][1] and out_b[2][0].parent is out[1][0]
    assert len(out[1][0].children) == 2
    assert len(t) == 4 and t.num_tokens_cached == 16
    assert t.match(a) == [n for n, _ in out]
    assert t.match(b + [1, 2, 3]) == [n for n, _ in out_b]
    assert t.match([0, 1, 2, 9]) == [] and t.match([]) == []
    t.check()


def test_partial_pages_are_never_cached():
    t = _tree()
    assert t.match(list(range(11))) == []
    t.insert(list(range(11)), ["p0", "p1"])                # 11 tokens: 2 full pages, 3 left over
    assert len(t) == 2
    assert len(t.match(list(range(11)))) == 2 and len(t.match(list(range(7)))) == 1
    with pytest.raises(ValueError, match="3 block.*only 2 full page"):
        t.insert(list(range(11)), ["p0", "p1", "p2"])
    assert len(t) == 2
    t.check()


def test_duplicates_are_not_adopted_and_keep_the_cached_block():
    t = _tree()
    first = t.insert(list(range(8)), ["x", "y"], now=1.0)
    again = t.insert(list(range(8)) + [9, 9, 9, 9], ["dup-x", "dup-y", "z"], now=2.0)
    assert [a for _, a in again] == [False, False, True]
    assert [n for n, _ in again[:2]] == [n for n, _ in first]
    assert [n.block for n, _ in again] == ["x", "y", "z"]
    assert all(n.last_access == 2.0 for n, _ in again)     # the whole path was just used
    t.check()


def test_none_block_only_for_cached_pages_and_errors_change_nothing():
    t = _tree()
    t.insert(list(range(4)), ["a"])
    with pytest.raises(ValueError, match="page 1 is not cached and its block is None"):
        t.insert(list(range(12)), [None, None, "c"])
    assert len(t) == 1 and len(t.root.children) == 1
    t.check()


def test_keys_chain_every_earlier_page_and_the_namespace():
    t, u = _tree(), _tree(namespace=b"another engine")
    page = [5, 6, 7, 8]
    n1 = t.insert([1, 2, 3, 4] + page, ["a", "b"])[1][0]
    n2 = t.insert([9, 9, 9, 9] + page, ["c", "d"])[1][0]
    assert n1.tokens == n2.tokens == tuple(page) and n1.key != n2.key
    m1 = u.insert([1, 2, 3, 4] + page, ["a", "b"])[1][0]
    assert m1.key != n1.key and u.root.key != t.root.key
    # the documented formula, and a fresh tree with the same namespace agrees
    parent = n1.parent
    want = hashlib.blake2b(parent.key + NS + struct.pack("<4q", *page), digest_size=16).digest()
    assert n1.key == want and len(n1.key) == 16
    assert _tree().keys([1, 2, 3, 4] + page) == [parent.key, n1.key]
    assert t.keys([1, 2, 3, 4] + page + [0, 0]) == [n.key for n in t.match([1, 2, 3, 4] + page)]
    t.check()
    u.check()


def test_tokens_may_be_numpy_and_bad_inputs_are_named():
    t = _tree()
    arr = np.arange(10, dtype=np.int64)
    out = t.insert(arr, ["a", "b"])
    assert t.match(list(range(10))) == [n for n, _ in out] == t.match(arr.astype(np.int32))
    assert all(type(x) is int for x in out[0][0].tokens)
    for bad, what in (([0, 1, 2.5, 3], r"tokens\[2\] must be an int"),
                      ([True, 0, 0, 0], r"tokens\[0\] must be an int"),
                      ("abcd", "sequence of ints"), (5, "sequence of ints"),
                      ([0, 0, 0, 1 << 63], "int64")):
        with pytest.raises(ValueError, match=what):
            t.match(bad)
    with pytest.raises(ValueError, match="page_size"):
        PrefixTree(0, NS)
    with pytest.raises(ValueError, match="namespace"):
        PrefixTree(4, "not bytes")
    with pytest.raises(ValueError, match="namespace"):
        PrefixTree(4, b"")
    with pytest.raises(ValueError, match="now must be a number"):
        t.touch(out[0][0:1], float("nan"))


def test_match_is_a_pure_lookup_unless_given_now():
    t = _tree()
    nodes = [n for n, _ in t.insert(list(range(8)), ["a", "b"], now=1.0)]
    assert t.match(list(range(8))) == nodes
    assert [n.last_access for n in nodes] == [1.0, 1.0] and [n.ref for n in nodes] == [0, 0]
    t.match(list(range(4)), now=5.0)
    assert [n.last_access for n in nodes] == [5.0, 1.0]
    t.check()


# ---------------------------------------------------------------------------------- eviction
def _chain(t: PrefixTree, first: int, pages: int, now: float, tag: str) -> list[Node]:
    toks = [first] * 4 + list(range(4 * (pages - 1)))
    return [n for n, _ in t.insert(toks, [f"{tag}{i}" for i in range(pages)], now=now)]


def test_only_unlocked_leaves_are_evictable_and_remove_checks_it():
    t = _tree()
    a = _chain(t, 1, 3, 1.0, "a")
    assert t.evictable() == [a[2]]
    with pytest.raises(ValueError, match="depth 1: it has 1 child"):
        t.remove(a[1])
    t.lock([a[2]])
    assert t.evictable() == []
    with pytest.raises(ValueError, match=r"in use \(ref 1\)"):
        t.remove(a[2])
    t.unlock([a[2]])
    t.remove(a[2])
    assert t.evictable() == [a[1]] and len(t) == 2 and a[2].parent is None
    for op in (t.remove, lambda n: t.lock([n]), lambda n: t.touch([n], 3.0)):
        with pytest.raises(ValueError, match="not a node of this tree"):
            op(a[2])
    with pytest.raises(ValueError, match="not a node of this tree"):
        t.lock([t.root])
    t.check()


def test_locked_nodes_and_their_ancestors_are_never_evicted():
    t = _tree()
    a = _chain(t, 1, 3, 1.0, "a")
    b = [n for n, _ in t.insert([1] * 4 + [7] * 8, [None, "b1", "b2"], now=2.0)]
    assert b[0] is a[0]
    t.lock(a)                                             # a running request reuses all of a
    removed = t.evict_lru(100)
    assert removed == [b[2], b[1]]                        # only b's own pages; shared page stays
    assert len(t) == 3 and all(n.parent is not None for n in a)
    t.check()
    t.unlock(a)
    t.lock([a[1]])                                        # a middle node: its leaf may go
    assert t.evict_lru(100) == [a[2]]
    assert len(t) == 2
    t.unlock([a[1]])
    assert t.evict_lru(100) == [a[1], a[0]] and len(t) == 0
    t.check()


def test_unlock_below_zero_is_named_and_changes_nothing():
    t = _tree()
    a = _chain(t, 1, 2, 1.0, "a")
    t.lock([a[1]])
    with pytest.raises(ValueError, match="depth 1 below zero: 2 unlock"):
        t.unlock([a[1], a[1]])
    assert a[1].ref == 1
    with pytest.raises(ValueError, match="depth 0 below zero"):
        t.unlock([a[0]])
    t.unlock([a[1]])
    assert a[1].ref == 0
    with pytest.raises(AttributeError):
        a[1].ref = 3                                      # the tree is the only writer
    t.check()


def test_lru_order_and_touch():
    t = _tree()
    x = _chain(t, 1, 1, 3.0, "x")[0]
    y = _chain(t, 2, 1, 1.0, "y")[0]
    z = _chain(t, 3, 1, 2.0, "z")[0]
    assert t.evictable() == [y, z, x] and t.evictable(limit=2) == [y, z]
    t.touch([y], 10.0)
    assert t.evictable() == [z, x, y]
    t.match([1, 1, 1, 1], now=11.0)                       # x matched by a new prompt
    assert t.evict_lru(1) == [z]
    assert t.evict_lru(5) == [y, x] and len(t) == 0
    t.check()


def test_evict_lru_cascades_to_parents_left_without_children():
    t = _tree()
    a = _chain(t, 1, 3, 5.0, "a")
    other = _chain(t, 2, 1, 10.0, "o")[0]
    assert t.evict_lru(3) == [a[2], a[1], a[0]]           # the chain goes before the newer leaf
    assert t.evictable() == [other]
    t.check()


def test_can_evict_filters_and_skipped_leaves_stay_evictable():
    t = _tree()
    leaves = [_chain(t, i, 2, float(i), f"n{i}-")[1] for i in range(6)]
    pinned = {n.block for n in leaves[::2]}
    removed = t.evict_lru(100, can_evict=lambda n: n.block not in pinned)
    assert {n.block for n in removed} == {"n1-1", "n3-1", "n5-1", "n1-0", "n3-0", "n5-0"}
    assert t.evictable() == leaves[::2]
    t.check()

    def boom(node):
        raise RuntimeError("policy failed")

    with pytest.raises(RuntimeError):
        t.evict_lru(1, can_evict=boom)
    t.check()                                             # nothing lost from the index
    assert t.evictable() == leaves[::2]


def test_heap_stays_bounded_under_repeated_touches():
    t = _tree()
    leaves = [_chain(t, i, 1, 0.0, "n")[0] for i in range(10)]
    for k in range(20_000):
        t.touch([leaves[k % 10]], float(k))
    assert len(t._heap) <= 2 * 10 + 1024 + 1
    assert t.evictable()[0] is leaves[0]
    t.check()


def test_twenty_thousand_pages_ten_thousand_evictions_fast():
    rng = random.Random(0)
    t = PrefixTree(16, NS)
    systems = [[rng.randrange(50_000) for _ in range(32)] for _ in range(100)]  # shared 2 pages
    for i in range(2_000):
        toks = systems[i % 100] + [rng.randrange(50_000) for _ in range(160)]
        t.insert(toks, [i * 12 + p for p in range(12)], now=float(i))
    assert len(t) == 100 * 2 + 2_000 * 10
    t0 = time.perf_counter()
    removed = t.evict_lru(10_000)
    dt = time.perf_counter() - t0
    assert len(removed) == 10_000 and len(t) == 20_200 - 10_000
    times = [n.last_access for n in removed]
    assert times == sorted(times)                         # parents are never older than children
    assert dt < 1.0, f"10k evictions took {dt:.3f}s"
    t.check()


# ------------------------------------------------------------------------- stateful (model)
PS = 2
tokens_st = st.lists(st.integers(0, 1), max_size=9)


def _prefixes(tokens: list[int]) -> list[tuple]:
    pages = [tuple(tokens[i:i + PS]) for i in range(0, len(tokens) // PS * PS, PS)]
    return [tuple(pages[:i + 1]) for i in range(len(pages))]


def _flat(prefix: tuple) -> list[int]:
    return [t for page in prefix for t in page]


def _path(node: Node) -> tuple:
    pages = []
    while node.parent is not None:
        pages.append(node.tokens)
        node = node.parent
    return tuple(reversed(pages))


class PrefixTreeMachine(RuleBasedStateMachine):
    """The tree against a dict of cached prefixes -> {block, ref, t}."""

    def __init__(self):
        super().__init__()
        self.tree = PrefixTree(PS, b"ns")
        self.model: dict[tuple, dict] = {}
        self.locks: list[list[Node]] = []
        self.now = 0.0
        self.blocks = 0

    def _tick(self, dt: int) -> float:
        self.now += dt
        return self.now

    def _is_leaf(self, p: tuple) -> bool:
        return not any(len(q) == len(p) + 1 and q[:len(p)] == p for q in self.model)

    def _expected_match(self, tokens: list[int]) -> list[tuple]:
        out = []
        for p in _prefixes(tokens):
            if p not in self.model:
                break
            out.append(p)
        return out

    @rule(tokens=tokens_st, n=st.integers(0, 5), nones=st.lists(st.booleans(), max_size=5),
          dt=st.integers(0, 1))
    def insert(self, tokens, n, nones, dt):
        prefixes = _prefixes(tokens)
        blocks = []
        for i in range(n):
            self.blocks += 1
            blocks.append(None if i < len(nones) and nones[i] else self.blocks)
        now = self._tick(dt)
        if n > len(prefixes) or any(b is None and prefixes[i] not in self.model
                                    for i, b in enumerate(blocks)):
            with pytest.raises(ValueError):
                self.tree.insert(tokens, blocks, now=now)
            return
        out = self.tree.insert(tokens, blocks, now=now)
        assert len(out) == n
        for i, (node, adopted) in enumerate(out):
            p = prefixes[i]
            assert _path(node) == p and adopted == (p not in self.model)
            if adopted:
                self.model[p] = {"block": blocks[i], "ref": 0, "t": now}
            else:
                assert node.block == self.model[p]["block"]
                self.model[p]["t"] = now

    @rule(tokens=tokens_st, stamp=st.booleans(), dt=st.integers(0, 1))
    def match(self, tokens, stamp, dt):
        now = self._tick(dt) if stamp else None
        got = self.tree.match(tokens, now=now)
        want = self._expected_match(tokens)
        assert [_path(n) for n in got] == want
        if stamp:
            for p in want:
                self.model[p]["t"] = now

    @rule(tokens=tokens_st)
    def lock(self, tokens):
        nodes = self.tree.match(tokens)
        if nodes:
            self.tree.lock(nodes)
            self.locks.append(nodes)
            for n in nodes:
                self.model[_path(n)]["ref"] += 1

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        nodes = self.locks.pop(i % len(self.locks))
        self.tree.unlock(nodes)
        for n in nodes:
            self.model[_path(n)]["ref"] -= 1

    @rule(tokens=tokens_st)
    def unlock_unheld(self, tokens):
        free = [n for n in self.tree.match(tokens) if n.ref == 0]
        if free:
            with pytest.raises(ValueError, match="below zero"):
                self.tree.unlock(free[-1:])

    @rule(tokens=tokens_st, dt=st.integers(0, 1))
    def touch(self, tokens, dt):
        nodes = self.tree.match(tokens)
        now = self._tick(dt)
        self.tree.touch(nodes, now)
        for n in nodes:
            self.model[_path(n)]["t"] = now

    @rule(n=st.integers(0, 6), parity=st.sampled_from([None, 0, 1]))
    def evict(self, n, parity):
        def ok_model(p):
            return parity is None or self.model[p]["block"] % 2 == parity

        pred = None if parity is None else (lambda node: node.block % 2 == parity)
        by_key = {self.tree.keys(_flat(p))[-1]: p for p in self.model}
        removed = self.tree.evict_lru(n, can_evict=pred)
        assert len(removed) <= n
        for node in removed:
            p = by_key[node.key]
            cands = [q for q in self.model
                     if self._is_leaf(q) and self.model[q]["ref"] == 0 and ok_model(q)]
            assert p in cands, f"evicted {p}: not an unlocked leaf the filter accepts"
            assert self.model[p]["t"] == min(self.model[q]["t"] for q in cands), "not LRU"
            assert node.block == self.model[p]["block"] and node.parent is None
            del self.model[p]
        if len(removed) < n:
            assert not [q for q in self.model
                        if self._is_leaf(q) and self.model[q]["ref"] == 0 and ok_model(q)]

    @rule(tokens=tokens_st)
    def remove(self, tokens):
        nodes = self.tree.match(tokens)
        if not nodes:
            return
        node, p = nodes[-1], _path(nodes[-1])
        if self._is_leaf(p) and self.model[p]["ref"] == 0:
            self.tree.remove(node)
            del self.model[p]
        else:
            with pytest.raises(ValueError):
                self.tree.remove(node)

    @invariant()
    def tree_equals_model(self):
        self.tree.check()
        assert len(self.tree) == len(self.model)
        assert self.tree.num_tokens_cached == PS * len(self.model)
        for p in self.model:
            assert len(p) == 1 or p[:-1] in self.model, f"{p} cached without its parent"
        got = {_path(n): n for n in self.tree.nodes()}
        assert got.keys() == self.model.keys()
        for p, node in got.items():
            m = self.model[p]
            assert (node.block, node.ref, node.last_access) == (m["block"], m["ref"], m["t"])
        for chain in self.locks:                          # locked chains are all still cached
            assert all(n.parent is not None and n.ref > 0 for n in chain)
        ev = self.tree.evictable()
        assert {_path(n) for n in ev} == {p for p in self.model
                                          if self._is_leaf(p) and self.model[p]["ref"] == 0}
        assert [n.last_access for n in ev] == sorted(n.last_access for n in ev)


TestPrefixTreeMachine = PrefixTreeMachine.TestCase
TestPrefixTreeMachine.settings = settings(max_examples=150, stateful_step_count=40,
                                          deadline=None)
