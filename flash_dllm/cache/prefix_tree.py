"""Radix tree of cached KV pages: which token prefixes have a cached block (no torch).

Cross-request prefix reuse (multi-turn chat: a follow-up prompt starts with the previous turn's
prompt and answer). When a request finishes, the pages covering a page-aligned prefix of its
tokens stay behind as cached **blocks**; a later request whose prompt starts with the same tokens
reuses them instead of recomputing. This tree only indexes token prefixes -> blocks and knows
which blocks may be evicted; the tier manager (``cache/tiers.py``) owns where a block's bytes live
and decides when to evict, and it frees the blocks of the nodes this tree hands back.

One node is one page of ``page_size`` tokens; its path from the root is the prefix it caches. Its
``key`` chains the keys of every earlier page and the tree's ``namespace`` (model, dtype, layout,
page size, cache mode, offload dtype... hashed by the caller), so a key names one prefix under one
engine configuration and can name the page's copies below L0.

NOTE (invariants, verified by ``check()``):
- only whole pages are cached, and a node exists only under its parent: every cached prefix's
  shorter page-aligned prefixes are cached too, so the tree shrinks from its leaves only;
- ``key = blake2b(parent.key + namespace + tokens as int64 little-endian, digest_size=16)``; the
  root's key is derived from the namespace alone, so the key of page i chains every earlier page;
- a node with ``ref > 0`` is in use by a running request: it is never removed, and neither is any
  ancestor of it (an ancestor has a child, so it is not a leaf);
- the evictable index holds exactly the leaves with ``ref == 0``, keyed by their ``last_access``.

NOTE (evictable index): a heap of ``(last_access, seq, node)`` with lazy invalidation. A node's
live entry is ``node._entry``; any other entry of it in the heap is stale and skipped when popped.
A node gets a new entry when it becomes an evictable leaf or its ``last_access`` changes while it is
one; it loses it when it gains a child, is locked, or is removed. ``ref`` and ``last_access`` are
read-only outside the tree (``lock``/``unlock``/``touch``/``match``/``insert`` write them) so the
heap keys never go out of date. Stale entries are compacted away once they outnumber live ones,
so eviction costs O(log n) per node, never a scan of the tree.
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import numbers
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_ROOT_PERSON = b"flash-dllm/root"         # blake2b personalisation of the root key (<= 16 bytes)
_COMPACT_SLACK = 1024                     # stale heap entries tolerated beyond the live count


def _digest(data: bytes, **kw: Any) -> bytes:
    return hashlib.blake2b(data, digest_size=16, **kw).digest()


class Node:
    """One cached page: ``tokens`` (the page's ids) under ``parent``; ``block`` is the caller's
    handle (the tier manager's record of where the bytes are), opaque to the tree."""

    __slots__ = ("tokens", "parent", "children", "key", "depth", "block",
                 "_ref", "_last_access", "_entry")

    def __init__(self, tokens: tuple[int, ...], parent: Node | None, key: bytes, depth: int,
                 block: Any, last_access: float) -> None:
        self.tokens = tokens
        self.parent = parent                      # None: the root, or a removed node
        self.children: dict[tuple[int, ...], Node] = {}
        self.key = key
        self.depth = depth                        # page index; the root is -1
        self.block = block
        self._ref = 0
        self._last_access = last_access
        self._entry: tuple[float, int, Node] | None = None   # live heap entry (evictable leaf)

    @property
    def ref(self) -> int:
        """Running requests using this page (``PrefixTree.lock``/``unlock``)."""
        return self._ref

    @property
    def last_access(self) -> float:
        return self._last_access

    @property
    def num_tokens(self) -> int:
        """Tokens of the prefix this node ends: ``(depth + 1) * page_size``."""
        return (self.depth + 1) * len(self.tokens)

    def __repr__(self) -> str:
        return (f"Node(depth={self.depth}, key={self.key.hex()[:12]}, ref={self._ref}, "
                f"children={len(self.children)}, block={self.block!r})")


class PrefixTree:
    """Pages of ``page_size`` tokens, keyed under ``namespace`` (bytes identifying the engine's
    cache configuration; two trees with different namespaces never share a key)."""

    def __init__(self, page_size: int, namespace: bytes) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
        if not isinstance(namespace, bytes) or not namespace:
            raise ValueError("namespace must be non-empty bytes (a hash of the engine's cache "
                             f"configuration), got {namespace!r}")
        self.page_size = page_size
        self.namespace = namespace
        self._pack = struct.Struct(f"<{page_size}q").pack
        self.root = Node((), None, _digest(namespace, person=_ROOT_PERSON), -1, None, 0.0)
        self._size = 0
        self._heap: list[tuple[float, int, Node]] = []
        self._live = 0                            # nodes whose _entry is set
        self._seq = itertools.count()

    # ---------------------------------------------------------------------------------- queries
    def match(self, tokens: Sequence[int], now: float | None = None) -> list[Node]:
        """The longest chain of cached nodes equal to the first full pages of ``tokens`` (root
        excluded, in order). Takes no lock; with ``now``, stamps the matched nodes' access time."""
        node, out = self.root, []
        for page in self._pages(tokens):
            node = node.children.get(page)
            if node is None:
                break
            out.append(node)
        if now is not None:
            self.touch(out, now)
        return out

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        """The keys the full pages of ``tokens`` have (or would have) in this tree, cached or not:
        what names their copies below L0."""
        key, out = self.root.key, []
        for page in self._pages(tokens):
            key = self._key(key, page)
            out.append(key)
        return out

    def evictable(self, limit: int | None = None) -> list[Node]:
        """Leaves with ``ref == 0``, least recently used first (at most ``limit``). Removing a
        leaf may make its parent one: ``evict_lru`` follows that cascade, this list does not."""
        if limit is not None:
            _check_count("limit", limit)
        live = [e for e in self._heap if e[2]._entry is e]
        chosen = sorted(live) if limit is None else heapq.nsmallest(limit, live)
        return [e[2] for e in chosen]

    def nodes(self) -> Iterator[Node]:
        """Every node, parents before children (root excluded)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def __len__(self) -> int:
        return self._size

    @property
    def num_tokens_cached(self) -> int:
        return self._size * self.page_size

    # -------------------------------------------------------------------------------- mutations
    def insert(self, tokens: Sequence[int], blocks: Sequence[Any],
               now: float | None = None) -> list[tuple[Node, bool]]:
        """Make sure nodes exist for the first ``len(blocks)`` full pages of ``tokens``.

        Returns ``(node, adopted)`` per page: ``adopted`` is True for a new node holding the given
        block, False for an existing node (its block is kept; the caller frees its duplicate).
        ``None`` in ``blocks`` is allowed only for pages already cached. Every node on the path
        gets ``last_access = now`` (default ``time.monotonic()``). Nothing changes on an error.
        """
        blocks = list(blocks)
        pages = self._pages(tokens)
        if len(blocks) > len(pages):
            raise ValueError(f"insert of {len(blocks)} block(s) but tokens hold only {len(pages)} "
                             f"full page(s) ({len(tokens)} tokens, page_size {self.page_size})")
        now = time.monotonic() if now is None else _check_time(now)
        pages = pages[:len(blocks)]
        node, existing = self.root, []
        for page in pages:
            child = node.children.get(page)
            if child is None:
                break
            existing.append(child)
            node = child
        for i in range(len(existing), len(pages)):
            if blocks[i] is None:
                raise ValueError(f"insert: page {i} is not cached and its block is None (None is "
                                 "only for pages that already have a node)")
        out = [(n, False) for n in existing]
        if len(existing) < len(pages):
            self._drop(node)                      # it gains a child: no longer a leaf
            for i in range(len(existing), len(pages)):
                child = Node(pages[i], node, self._key(node.key, pages[i]), node.depth + 1,
                             blocks[i], now)
                node.children[pages[i]] = child
                out.append((child, True))
                node = child
            self._size += len(pages) - len(existing)
            self._push(node)                      # only the last new node is a leaf
        self._stamp(existing, now)
        return out

    def lock(self, nodes: Iterable[Node]) -> None:
        """Mark ``nodes`` in use by one more running request (``ref += 1`` each)."""
        nodes = list(nodes)
        for n in nodes:
            self._check_attached(n, "lock")
        for n in nodes:
            n._ref += 1
            self._drop(n)

    def unlock(self, nodes: Iterable[Node]) -> None:
        """Drop one reference per listed node; raises (and changes nothing) below zero."""
        counts: dict[Node, int] = {}
        for n in nodes:
            self._check_attached(n, "unlock")
            counts[n] = counts.get(n, 0) + 1
        for n, k in counts.items():
            if k > n._ref:
                raise ValueError(f"unlock of the node at depth {n.depth} below zero: {k} "
                                 f"unlock(s), ref {n._ref}")
        for n, k in counts.items():
            n._ref -= k
            if n._ref == 0 and not n.children:
                self._push(n)

    def touch(self, nodes: Iterable[Node], now: float) -> None:
        """Set ``last_access = now`` on each node."""
        now = _check_time(now)
        nodes = list(nodes)
        for n in nodes:
            self._check_attached(n, "touch")
        self._stamp(nodes, now)

    def remove(self, node: Node) -> None:
        """Remove one leaf that no request uses; the caller frees its block."""
        self._check_attached(node, "remove")
        if node.children:
            raise ValueError(f"cannot remove the node at depth {node.depth}: it has "
                             f"{len(node.children)} child(ren) (the tree shrinks from its leaves)")
        if node._ref:
            raise ValueError(f"cannot remove the node at depth {node.depth}: it is in use "
                             f"(ref {node._ref})")
        self._detach(node)

    def evict_lru(self, n: int,
                  can_evict: Callable[[Node], bool] | None = None) -> list[Node]:
        """Remove up to ``n`` nodes, each the least recently used evictable leaf at its turn
        (among those ``can_evict`` accepts; it must not change the tree). A parent left without
        children joins the candidates. Returns the removed nodes in removal order."""
        _check_count("n", n)
        heap, removed, skipped = self._heap, [], []
        try:
            while len(removed) < n and heap:
                entry = heapq.heappop(heap)
                node = entry[2]
                if node._entry is not entry:      # stale: re-stamped, locked, grew, or removed
                    continue
                if can_evict is not None:
                    skipped.append(entry)         # live entries out of the heap go back below,
                    if not can_evict(node):       # even if can_evict raises
                        continue
                    skipped.pop()
                self._detach(node)
                removed.append(node)
        finally:
            for entry in skipped:
                heapq.heappush(heap, entry)
        return removed

    # ------------------------------------------------------------------------------ consistency
    def check(self) -> None:
        """Verify every invariant of the module docstring; raises ``AssertionError`` naming the
        first violation (tests call this after every operation)."""
        root = self.root
        _expect(root.parent is None and root.depth == -1 and root.tokens == ()
                and root._ref == 0 and root._entry is None, "root is not a bare root")
        _expect(root.key == _digest(self.namespace, person=_ROOT_PERSON),
                "root key is not derived from the namespace")
        in_heap = {id(e) for e in self._heap}
        count = live = 0
        stack = [root]
        while stack:
            node = stack.pop()
            for tokens, child in node.children.items():
                where = f"node at depth {node.depth + 1} ({child!r})"
                count += 1
                _expect(child.parent is node, f"{where}: parent link is wrong")
                _expect(child.tokens == tokens and isinstance(tokens, tuple)
                        and len(tokens) == self.page_size
                        and all(type(t) is int for t in tokens),
                        f"{where}: tokens are not its page of {self.page_size} ints")
                _expect(child.depth == node.depth + 1, f"{where}: depth is {child.depth}")
                _expect(child.key == self._key(node.key, tokens), f"{where}: key does not chain")
                _expect(child._ref >= 0, f"{where}: ref {child._ref} < 0")
                evictable = not child.children and child._ref == 0
                entry = child._entry
                _expect((entry is not None) == evictable,
                        f"{where}: evictable={evictable} but indexed={entry is not None}")
                if entry is not None:
                    live += 1
                    _expect(entry[2] is child and id(entry) in in_heap
                            and entry[0] == child._last_access,
                            f"{where}: its heap entry is missing or out of date")
                stack.append(child)
        _expect(count == self._size, f"{count} nodes reachable, size says {self._size}")
        _expect(live == self._live, f"{live} evictable leaves, index says {self._live}")
        heap = self._heap
        _expect(all(heap[(i - 1) // 2] <= heap[i] for i in range(1, len(heap))),
                "the evictable heap is not a heap")

    # -------------------------------------------------------------------------------- internals
    def _key(self, parent_key: bytes, page: tuple[int, ...]) -> bytes:
        return _digest(parent_key + self.namespace + self._pack(*page))

    def _pages(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        """The full pages of ``tokens`` as tuples of Python ints (validated: int64 ids)."""
        if isinstance(tokens, (str, bytes, bytearray)):
            raise ValueError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
        try:
            n = len(tokens) // self.page_size * self.page_size
            head = tokens[:n]
        except TypeError:
            raise ValueError("tokens must be a sequence of ints (list, tuple, array), got "
                             f"{type(tokens).__name__}") from None
        ids = head.tolist() if hasattr(head, "tolist") else list(head)   # numpy -> Python ints
        if not all(type(t) is int for t in ids):
            for i, t in enumerate(ids):
                if isinstance(t, bool) or not hasattr(t, "__index__"):
                    raise ValueError(f"tokens[{i}] must be an int, got {t!r}")
                ids[i] = t.__index__()
        if ids and not (_INT64_MIN <= min(ids) and max(ids) <= _INT64_MAX):
            raise ValueError(f"token ids must fit in int64, got range [{min(ids)}, {max(ids)}]")
        ps = self.page_size
        return [tuple(ids[i:i + ps]) for i in range(0, n, ps)]

    def _check_attached(self, node: Node, op: str) -> None:
        if (not isinstance(node, Node) or node.parent is None
                or node.parent.children.get(node.tokens) is not node):
            raise ValueError(f"cannot {op} {node!r}: not a node of this tree "
                             "(the root, or removed)")

    def _stamp(self, nodes: list[Node], now: float) -> None:
        for n in nodes:
            n._last_access = now
            if n._entry is not None:              # an evictable leaf: its heap key moves
                self._push(n)

    def _push(self, node: Node) -> None:
        if node._entry is None:
            self._live += 1
        node._entry = entry = (node._last_access, next(self._seq), node)
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * self._live + _COMPACT_SLACK:
            self._heap[:] = [e for e in self._heap if e[2]._entry is e]   # in place: evict_lru
            heapq.heapify(self._heap)                                     # holds a reference

    def _drop(self, node: Node) -> None:
        if node._entry is not None:
            node._entry = None
            self._live -= 1

    def _detach(self, node: Node) -> None:
        """Unlink an evictable leaf; its parent may become one."""
        parent = node.parent
        del parent.children[node.tokens]
        node.parent = None
        self._drop(node)
        self._size -= 1
        if parent is not self.root and not parent.children and parent._ref == 0:
            self._push(parent)

    def __repr__(self) -> str:
        return (f"PrefixTree(page_size={self.page_size}, nodes={self._size}, "
                f"evictable={self._live})")


def _check_count(name: str, v: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {v!r}")


def _check_time(now: float) -> float:
    if isinstance(now, bool) or not isinstance(now, numbers.Real) or math.isnan(now):
        raise ValueError(f"now must be a number (monotonic seconds), got {now!r}")
    return float(now)


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(f"PrefixTree invariant broken: {what}")
