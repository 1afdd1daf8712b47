"""The KV manager: which pages each request owns and prefix reuse across requests (no torch); the
tiers of cached pages are its tier manager's (``cache/tier_manager.py``).

NOTE (ownership): the manager is the only writer of the page ledger (``PagePool``: free list and
reference counts), of the prefix tree and, through its tier manager, of the tier records
(``cache/tiers.py``). The scheduler asks it to reserve a request's pages at admission and to
release them when the request finishes (``publish``: its full pages become cached blocks) or is
aborted; the runner only reads the page ids of the step plan and carries out the tier ops the
manager hands it (``take_ops``), reporting back (``ops_done``). A request holds one pool
reference on every page of its block table from admission to release, so a running batch always
fits (never an out-of-memory mid-flight); a cached block in L0 holds one more, so a shared page
outlives the requests that use it.

Prefix reuse (``prefix_reuse=True``): at admission the prompt's page-aligned prefix is matched in
the tree; reused pages are read-only for the request (its steps never recompute positions below
``reused_len``: the bidirectional model's K/V of a prompt depend on what follows it, so reused
K/V are approximate in the same way as Fast-dLLM's prefix cache). A reused page below L0 is
loaded (through ``Fetch`` / ``Load`` ops) only when the cost model says loading beats recomputing.

Placement evidence (``observe``): a request's attention mass per page, once per decoded block,
goes to the placement policy for the cached blocks it reuses now and for its own pages when they
become blocks at publish.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from flash_dllm.cache.page_pool import PagePool
from flash_dllm.cache.reuse_count import ReuseCount
from flash_dllm.cache.tier_manager import TierManager
from flash_dllm.cache.tiers import L0, L1, L2, MIN_TIERS, Block, CostModel, Load, make_policy


@dataclass
class Allocation:
    """A request's admission: its block table (reused pages first) and what it reuses."""

    pages: list[int]
    reused_len: int = 0                     # prompt tokens whose K/V are reused (frozen)
    hit_tiers: list[int] = field(default_factory=list)   # per reused page: the tier it came from
    loads: list[Load] = field(default_factory=list)      # reused pages that must be loaded first


def _stats(tiers: int) -> dict:
    return {"query_tokens": 0, "hit_tokens": [0] * tiers, "bytes_moved": {}, "l0_evictions": 0,
            "checksum_failures": 0, "load_failures": 0, "dropped_blocks": 0,
            "published_pages": 0,
            # queue-ahead prefetch (``prefetch``), in pages: fetched; in host memory when their
            # request was admitted (on time); still reading from disk then (late: recomputed);
            # evicted from host memory, or their fetch failed, before any request used them
            "prefetch": {"issued": 0, "on_time": 0, "late": 0, "useless": 0}}


class KVCacheManager:
    """``tier_slots``: slots of each store tier below L0, in stack order (L1 host memory, L2
    disk, ...: the offloader's ``tier_slots``)."""

    # short requests (a canvas of at most this many pages) skip the prefix tree and the tiers:
    # nothing of theirs is worth a lookup or a cached page
    SHORT_PAGES = 2

    def __init__(self, num_pages: int, page_size: int, *, prefix_reuse: bool = False,
                 namespace: bytes = b"", tier_slots: tuple[int, ...] = (),
                 placement: str = "lru", page_bytes: int = 0, clock=time.monotonic,
                 placement_top_k: int = 8) -> None:
        self.pool = PagePool(num_pages, page_size)
        self._pages: dict[str, list[int]] = {}
        self._locked: dict[str, tuple] = {}         # request id -> (tree, reused nodes)
        # one prefix tree per cache mode: a page's key chains its tokens with the model, dtype,
        # layout, page size, offload dtype (``namespace``) and the cache mode that computed it
        self.prefix_reuse = prefix_reuse
        self.namespace = namespace
        self.trees: dict[str, object] = {}
        n_tiers = max(MIN_TIERS, 1 + len(tier_slots))
        self.stats = _stats(n_tiers)
        self.tiers = TierManager(
            self.pool, tier_slots, make_policy(placement, top_k=placement_top_k),
            CostModel(page_bytes=max(page_bytes, 1), page_size=page_size, tiers=n_tiers),
            self.stats, page_bytes, self._in_use)
        # attention mass per page of a running request's own (not yet cached) pages, handed
        # to the placement policy with the blocks they become at publish (``observe``)
        self._fresh_mass: dict[str, np.ndarray] = {}
        # lookups and hits, counted once an admission's loads passed their checks
        self.reuse_count = ReuseCount(self.stats, page_size)
        self.page_bytes = page_bytes
        self.clock = clock

    # ------------------------------------------------------------------------------- queries
    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def num_used(self) -> int:
        """Pages reserved by requests (cached blocks excluded): 0 when nothing runs."""
        return len({p for pages in self._pages.values() for p in pages})

    def pages_for(self, n_tokens: int) -> int:
        return self.pool.pages_for(n_tokens)

    def can_ever_fit(self, n_tokens: int) -> bool:
        return self.pool.can_ever_fit(n_tokens)

    def pages(self, request_id: str) -> list[int] | None:
        return self._pages.get(request_id)

    def cached_pages(self) -> list[int]:
        """Cached blocks per tier [L0, L1, ..] (published copies)."""
        return self.tiers.cached_pages()

    @property
    def tier_names(self) -> tuple[str, ...]:
        """``("l0", "l1", "l2", ..)``: one metric label per tier."""
        return self.tiers.tier_names

    @property
    def l2_slots(self) -> int:
        """Slots of the first tier below host memory (0: nothing to prefetch from)."""
        return self.tiers.slots[L2]

    @property
    def policy(self):
        """The placement policy (``cache/tiers.py``): the tier manager's."""
        return self.tiers.policy

    @policy.setter
    def policy(self, policy) -> None:
        self.tiers.policy = policy

    @property
    def cost(self) -> CostModel:
        return self.tiers.cost

    # ----------------------------------------------------------------------------- admission
    def tree(self, mode: str):
        """The prefix tree of cache mode ``mode`` (created at first use)."""
        t = self.trees.get(mode)
        if t is None:
            from flash_dllm.cache.prefix_tree import PrefixTree
            t = self.trees[mode] = PrefixTree(self.page_size, self.namespace + mode.encode())
        return t

    def allocate(self, request_id: str, n_tokens: int, prompt_ids: list[int] | None = None,
                 reuse: bool = True, mode: str = "dual", align: int = 0
                 ) -> Allocation | None:
        """Reserve pages for a canvas of ``n_tokens`` tokens, reusing cached pages of
        ``prompt_ids``' prefix when ``reuse``; None when they do not fit now (never a partial
        allocation; cached blocks may have been evicted to make room, which is harmless).
        ``align``: the reused prefix is a multiple of this many tokens (a block-causal model's
        block: a position's K/V depend on its whole block, so a prefix matched to the middle of
        a block is not the same K/V)."""
        if request_id in self._pages:
            raise ValueError(f"request {request_id!r} already holds KV pages")
        n_total = self.pool.pages_for(n_tokens)
        reuse = (reuse and self.prefix_reuse and bool(prompt_ids)
                 and n_total > self.SHORT_PAGES)
        tree = self.tree(mode) if reuse else None
        nodes = self._match(tree, prompt_ids, admit=True) if reuse else []
        if align and nodes:
            q = align // math.gcd(align, self.page_size)     # pages per aligned unit
            nodes = nodes[:len(nodes) // q * q]
        protect = {nd.block for nd in nodes}
        # a hit below host memory is fetched into a host slot first: reserve them now (the
        # reuse stops at the first such hit that gets none)
        fetch: dict = {}
        for i, nd in enumerate(nodes):
            if nd.block.tier > L1:
                slot = self.tiers.slot(L1, protect)
                if slot is None:
                    nodes = nodes[:i]
                    break
                fetch[nd.block] = slot
        protect = {nd.block for nd in nodes}           # (a cut chain protects only what it uses)
        # every reused page not in L0 needs a fresh page to be loaded into
        fresh = n_total - len(nodes) + sum(1 for nd in nodes if nd.block.tier != L0)
        if self.pool.num_free < fresh:
            self.tiers.make_room(fresh - self.pool.num_free, protect)
        if self.pool.num_free < fresh:
            self.tiers.release(L1, fetch.values())
            return None
        new = self.pool.allocate(fresh * self.page_size) if fresh else []
        alloc = Allocation([], reused_len=len(nodes) * self.page_size)
        now = self.clock()
        for nd in nodes:
            b = nd.block
            tier = b.tier
            if self.tiers.prefetched.pop(b, False):
                self.stats["prefetch"]["on_time"] += 1
            alloc.hit_tiers.append(tier)
            if tier != L0:
                page = new.pop()        # the cache's reference: this allocation
                if tier > L1:
                    self.tiers.fetch(b, fetch[b])
                src = fetch[b] if tier > L1 else b.copies[L1]
                alloc.loads.append(self.tiers.load(b, src, page))
            self.policy.touch(b, now)
            alloc.pages.append(b.l0)
        self.pool.share(alloc.pages)                # the request's reference on reused pages
        alloc.pages += new
        if tree is not None:
            tree.lock(nodes)
        self._locked[request_id] = (tree, nodes)
        self._pages[request_id] = alloc.pages
        self.cancel_prefetch(request_id, admitted=True)
        self.reuse_count.admitted(request_id, len(prompt_ids) if reuse else 0, alloc.hit_tiers,
                                  alloc.loads)
        return alloc

    def allocate_overflow(self, request_id: str, n_tokens: int) -> list[int] | None:
        """A request larger than the pool (``cache/io/kv_overflow.py``): it runs alone and takes
        every pool page (its last ones; the rest of its KV lives in host memory). Returns the
        pool pages, or None while anything else holds pages or cached blocks cannot all be
        evicted yet. No prefix reuse: nothing is matched, and ``free`` must not publish."""
        if request_id in self._pages:
            raise ValueError(f"request {request_id!r} already holds KV pages")
        if self._pages or self.pool.can_ever_fit(n_tokens):
            return None
        want = self.pool.num_pages
        if self.pool.num_free < want:
            self.tiers.make_room(want - self.pool.num_free, set())
        if self.pool.num_free < want:
            return None
        pages = self.pool.allocate(want * self.page_size)
        self._pages[request_id] = pages
        self.cancel_prefetch(request_id, admitted=True)
        return pages

    def _match(self, tree, prompt_ids: list[int], admit: bool = False,
               prefetching: bool = False) -> list:
        """The reusable prefix: full pages strictly before the last prompt token (the step that
        decodes the first block recomputes from there), stopping at the first block that has no
        usable copy or whose load the cost model says loses to recomputing. ``admit``: for an
        admission (a prefetch still reading then counts as late). ``prefetching``: a copy below
        host memory is judged by the cost of loading it from there (the read happens while the
        request waits, off its critical path)."""
        limit = (len(prompt_ids) - 1) // self.page_size
        out = []
        for nd in tree.match(prompt_ids[:limit * self.page_size]):
            b = nd.block
            if b is None or b.lost or b.busy or b.tier is None:
                if admit and b is not None and self.tiers.prefetched.get(b) is False:
                    del self.tiers.prefetched[b]
                    self.stats["prefetch"]["late"] += 1       # still reading: recomputed
                break
            tier = L1 if prefetching and b.tier > L1 else b.tier
            if tier != L0 and not self.cost.worth_loading(1, tier):
                break
            out.append(nd)
        return out

    # ------------------------------------------------------------------------------ prefetch
    def prefetch(self, request_id: str, prompt_ids: list[int], mode: str,
                 max_pages: int = 64) -> int:
        """Queue-ahead prefetch for a request that waits for admission: read the copies below
        host memory of its reusable prefix into host memory now (``Fetch`` ops, run in the
        background), so that admission only has to load them from host memory. Only free host
        slots, or slots of host copies that also have a copy further down, are used; never L0
        pages. Returns the pages fetched (at most ``max_pages``, fewer when host slots run
        out). What the request's admission does not use (or ``cancel_prefetch``) counts as
        useless.

        NOTE: when a background read completes depends on the disk, so what an admission
        reuses does too: not for replicated scheduling (tensor parallelism refuses the tiers)."""
        slots = self.tiers.slots
        if not (self.prefix_reuse and slots[L1] and any(slots[L2:]) and prompt_ids
                and self.pool.pages_for(len(prompt_ids)) > self.SHORT_PAGES):
            return 0
        nodes = self._match(self.tree(mode), prompt_ids, prefetching=True)
        return self.tiers.prefetch(request_id, nodes, max_pages)

    def cancel_prefetch(self, request_id: str, admitted: bool = False) -> None:
        """The request was admitted (``admitted``) or left the queue (``TierManager``'s)."""
        self.tiers.cancel_prefetch(request_id, admitted)

    # ------------------------------------------------------------------------------- release
    def free(self, request_id: str, publish: list[int] | None = None) -> bool:
        """Release a request's pages (idempotent: False when it holds none). ``publish``: the
        token ids whose full pages become cached blocks (a finished request's final canvas
        prefix); None (abort, or reuse off) drops them."""
        pages = self._pages.pop(request_id, None)
        if pages is None:
            return False
        self.reuse_count.forget(request_id)
        tree, nodes = self._locked.pop(request_id, (None, []))
        fresh_mass = self._fresh_mass.pop(request_id, None)
        if tree is not None:                       # (None: reuse off, or a short request)
            tree.unlock(nodes)
            now = self.clock()
            for nd in nodes:
                self.policy.touch(nd.block, now)
            if publish is not None:
                new = self._publish(tree, publish, pages, len(nodes), now)
                if fresh_mass is not None and new:
                    idx = [i - len(nodes) for i, _ in new]
                    keep = [k for k, j in enumerate(idx) if j < len(fresh_mass)]
                    self.policy.observe([new[k][1] for k in keep],
                                        [float(fresh_mass[idx[k]]) for k in keep])
        self.pool.free(pages)
        return True

    def _publish(self, tree, tokens: list[int], pages: list[int], reused: int,
                 now: float) -> list[tuple[int, Block]]:
        """Cache the request's full pages past its reused prefix; (page index, block) of the
        blocks it added."""
        n = min(len(tokens) // self.page_size, len(pages))
        added: list[tuple[int, Block]] = []
        if n <= reused:
            return added
        fresh = [None] * reused + [Block(b"", copies={L0: pages[i]}) for i in range(reused, n)]
        for i, (node, adopted) in enumerate(tree.insert(tokens[:n * self.page_size], fresh)):
            if not adopted:
                old = node.block
                if i < reused or old is None or not old.lost:
                    continue
                # a lost block (every copy gone) under live children: this page replaces it
                self.tiers.blocks.discard(old)
                node.block = fresh[i]
            b = node.block
            b.key, b.node, b.tree = node.key, node, tree
            self.policy.touch(b, now)
            self.pool.share([b.l0])                 # the cache's own reference
            self.tiers.blocks.add(b)
            self.stats["published_pages"] += 1
            added.append((i, b))
        return added

    # --------------------------------------------------------------------------- attention
    @property
    def wants_mass(self) -> bool:
        """Whether the placement policy uses attention evidence (``observe``)."""
        return self.prefix_reuse and getattr(self.policy, "wants_mass", False)

    def observe(self, request_id: str, page_mass) -> None:
        """Attention mass per page of a running request over one decoded block (page i of
        its canvas): its reused pages' share goes to the placement policy now, the rest is
        kept for the blocks those pages become when the request finishes."""
        if not self.wants_mass:
            return
        page_mass = np.asarray(page_mass, dtype=np.float64)
        _, nodes = self._locked.get(request_id, (None, []))
        k = min(len(nodes), len(page_mass))
        if k:
            self.policy.observe([nd.block for nd in nodes[:k]], page_mass[:k].tolist())
        rest = page_mass[len(nodes):]
        acc = self._fresh_mass.get(request_id)
        if acc is None or len(acc) < len(rest):
            grown = np.zeros(len(rest))
            if acc is not None:
                grown[:len(acc)] = acc
            acc = grown
        acc[:len(rest)] += rest
        self._fresh_mass[request_id] = acc

    # ------------------------------------------------------------------------------- tier ops
    def take_ops(self) -> list:
        """The tier ops the runner carries out before the next step (stores first)."""
        return self.tiers.take_ops()

    def ops_done(self, results: list) -> list[str]:
        """Results ``(op, ok, seconds)`` from the runner; publishes what succeeded, drops what
        failed. Returns nothing; failed loads are handled by ``load_failed``."""
        self.tiers.ops_done(results)
        self.reuse_count.verified(results)
        return []

    def load_failed(self, request_id: str) -> None:
        """A load of one of the request's reused pages failed verification: undo its allocation
        (it is admitted again and recomputes what it cannot reuse)."""
        pages = self._pages.pop(request_id, [])
        self.reuse_count.forget(request_id)
        tree, nodes = self._locked.pop(request_id, (None, []))
        if tree is not None:
            tree.unlock(nodes)
        # the cache's reference on pages whose load failed goes with them (b.l0 was cleared)
        cache_refs = [p for nd, p in zip(nodes, pages) if nd.block.l0 != p]
        self.pool.free(pages + cache_refs)
        for nd in nodes:
            b = nd.block
            if not b.copies and not b.busy:
                self.tiers.drop(b)

    def _in_use(self, page: int) -> bool:
        """Whether a request holds pool page ``page``."""
        return any(page in pages for pages in self._pages.values())
