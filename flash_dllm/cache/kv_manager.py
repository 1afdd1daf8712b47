"""The KV manager: which pages each request owns, prefix reuse across requests, and the tiers of
cached pages (no torch).

NOTE (ownership): the manager is the only writer of the page ledger (``PagePool``: free list and
reference counts), of the prefix tree and of the tier records (``cache/tiers.py``). The scheduler
asks it to reserve a request's pages at admission and to release them when the request finishes
(``publish``: its full pages become cached blocks) or is aborted; the runner only reads the page
ids of the step plan and carries out the tier ops the manager hands it (``take_ops``), reporting
back (``ops_done``). A request holds one pool reference on every page of its block table from
admission to release, so a running batch always fits (never an out-of-memory mid-flight); a
cached block in L0 holds one more, so a shared page outlives the requests that use it.

Prefix reuse (``prefix_reuse=True``): at admission the prompt's page-aligned prefix is matched in
the tree; reused pages are read-only for the request (its steps never recompute positions below
``reused_len``: the bidirectional model's K/V of a prompt depend on what follows it, so reused
K/V are approximate in the same way as Fast-dLLM's prefix cache). A reused page in L1 or L2 is
loaded (through ``Fetch`` / ``Load`` ops) only when the cost model says loading beats recomputing.

Placement evidence (``observe``): a request's attention mass per page, once per decoded block,
goes to the placement policy for the cached blocks it reuses now and for its own pages when they
become blocks at publish.

NOTE (size): a little over 400 lines on purpose: admission with reuse, eviction across three
tiers, tier-op completion and the placement evidence all read and write the same block set,
locks and ledger; split, each part would take that state as arguments.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from flash_dllm.cache.page_pool import PagePool
from flash_dllm.cache.tiers import (L0, L1, L2, TIER_NAMES, Block, CostModel, Fetch, Load, Spill,
                                    Store, StoreDisk, make_policy)


@dataclass
class Allocation:
    """A request's admission: its block table (reused pages first) and what it reuses."""

    pages: list[int]
    reused_len: int = 0                     # prompt tokens whose K/V are reused (frozen)
    hit_tiers: list[int] = field(default_factory=list)   # per reused page: the tier it came from
    loads: list[Load] = field(default_factory=list)      # reused pages that must be loaded first


def _stats() -> dict:
    return {"query_tokens": 0, "hit_tokens": [0, 0, 0], "bytes_moved": {}, "l0_evictions": 0,
            "checksum_failures": 0, "load_failures": 0, "dropped_blocks": 0,
            "published_pages": 0,
            # queue-ahead prefetch (``prefetch``), in pages: fetched; in host memory when their
            # request was admitted (on time); still reading from disk then (late: recomputed);
            # evicted from host memory, or their fetch failed, before any request used them
            "prefetch": {"issued": 0, "on_time": 0, "late": 0, "useless": 0}}


class KVCacheManager:
    # short requests (a canvas of at most this many pages) skip the prefix tree and the tiers:
    # nothing of theirs is worth a lookup or a cached page
    SHORT_PAGES = 2

    def __init__(self, num_pages: int, page_size: int, *, prefix_reuse: bool = False,
                 namespace: bytes = b"", l1_slots: int = 0, l2_slots: int = 0,
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
        self.policy = make_policy(placement, top_k=placement_top_k)
        self.cost = CostModel(page_bytes=max(page_bytes, 1), page_size=page_size)
        self._l1_free = list(range(l1_slots - 1, -1, -1))
        self._l2_free = list(range(l2_slots - 1, -1, -1))
        self.l1_slots, self.l2_slots = l1_slots, l2_slots
        self._blocks: set[Block] = set()            # every cached block with a live node
        # attention mass per page of a running request's own (not yet cached) pages, handed
        # to the placement policy with the blocks they become at publish (``observe``)
        self._fresh_mass: dict[str, np.ndarray] = {}
        self._l1_orphans: set[int] = set()          # host slots of failed stores still spilling
        self._ops: list = []                        # tier ops for the runner's next step
        self.page_bytes = page_bytes
        self.clock = clock
        self.stats = _stats()
        # blocks fetched ahead from disk for a waiting request: block -> True once in L1; and
        # the blocks fetched for each waiting request
        self._prefetched: dict[Block, bool] = {}
        self._prefetch_for: dict[str, list[Block]] = {}

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
        """Cached blocks per tier [L0, L1, L2] (published copies)."""
        n = [0, 0, 0]
        for b in self._blocks:
            for t, where in enumerate((b.l0, b.l1, b.l2)):
                if where is not None and not (t == L0 and b.loading):
                    n[t] += 1
        return n

    # ----------------------------------------------------------------------------- admission
    def tree(self, mode: str):
        """The prefix tree of cache mode ``mode`` (created at first use)."""
        t = self.trees.get(mode)
        if t is None:
            from flash_dllm.cache.prefix_tree import PrefixTree
            t = self.trees[mode] = PrefixTree(self.page_size, self.namespace + mode.encode())
        return t

    def allocate(self, request_id: str, n_tokens: int, prompt_ids: list[int] | None = None,
                 reuse: bool = True, mode: str = "dual") -> Allocation | None:
        """Reserve pages for a canvas of ``n_tokens`` tokens, reusing cached pages of
        ``prompt_ids``' prefix when ``reuse``; None when they do not fit now (never a partial
        allocation; cached blocks may have been evicted to make room, which is harmless)."""
        if request_id in self._pages:
            raise ValueError(f"request {request_id!r} already holds KV pages")
        n_total = self.pool.pages_for(n_tokens)
        reuse = (reuse and self.prefix_reuse and bool(prompt_ids)
                 and n_total > self.SHORT_PAGES)
        tree = self.tree(mode) if reuse else None
        nodes = self._match(tree, prompt_ids, admit=True) if reuse else []
        protect = {nd.block for nd in nodes}
        # a disk hit is fetched into a host slot first: reserve them now (the reuse stops at the
        # first disk hit that gets none)
        fetch: dict = {}
        for i, nd in enumerate(nodes):
            if nd.block.tier == L2:
                slot = self._l1_slot(protect)
                if slot is None:
                    nodes = nodes[:i]
                    break
                fetch[nd.block] = slot
        protect = {nd.block for nd in nodes}           # (a cut chain protects only what it uses)
        # every reused page not in L0 needs a fresh page to be loaded into
        fresh = n_total - len(nodes) + sum(1 for nd in nodes if nd.block.tier != L0)
        if self.pool.num_free < fresh:
            self._make_room(fresh - self.pool.num_free, protect)
        if self.pool.num_free < fresh:
            self._l1_free += fetch.values()
            return None
        new = self.pool.allocate(fresh * self.page_size) if fresh else []
        alloc = Allocation([], reused_len=len(nodes) * self.page_size)
        now = self.clock()
        for nd in nodes:
            b = nd.block
            tier = b.tier
            if self._prefetched.pop(b, False):
                self.stats["prefetch"]["on_time"] += 1
            alloc.hit_tiers.append(tier)
            if tier != L0:
                page = new.pop()
                if tier == L2:
                    slot = fetch[b]
                    b.pending_l1 = slot
                    self._ops.append(Fetch(b, b.l2, slot))
                    src = slot
                else:
                    src = b.l1
                b.l0, b.loading = page, True      # the cache's reference: this allocation
                load = Load(b, src, page)
                alloc.loads.append(load)
                self._ops.append(load)
            self.policy.touch(b, now)
            alloc.pages.append(b.l0)
        self.pool.share(alloc.pages)                # the request's reference on reused pages
        alloc.pages += new
        if tree is not None:
            tree.lock(nodes)
        self._locked[request_id] = (tree, nodes)
        self._pages[request_id] = alloc.pages
        if reuse:
            self.stats["query_tokens"] += len(prompt_ids)
        self.cancel_prefetch(request_id, admitted=True)
        for t in alloc.hit_tiers:
            self.stats["hit_tokens"][t] += self.page_size
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
            self._make_room(want - self.pool.num_free, set())
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
        admission (a prefetch still reading then counts as late). ``prefetching``: a disk copy
        is judged by the cost of loading it from host memory (the disk read happens while the
        request waits, off its critical path)."""
        limit = (len(prompt_ids) - 1) // self.page_size
        out = []
        for nd in tree.match(prompt_ids[:limit * self.page_size]):
            b = nd.block
            if b is None or b.lost or b.busy or b.tier is None:
                if admit and b is not None and self._prefetched.get(b) is False:
                    del self._prefetched[b]
                    self.stats["prefetch"]["late"] += 1       # still reading: recomputed
                break
            tier = L1 if prefetching and b.tier == L2 else b.tier
            if tier != L0 and not self.cost.worth_loading(1, tier):
                break
            out.append(nd)
        return out

    # ------------------------------------------------------------------------------ prefetch
    def prefetch(self, request_id: str, prompt_ids: list[int], mode: str,
                 max_pages: int = 64) -> int:
        """Queue-ahead prefetch for a request that waits for admission: read the disk copies of
        its reusable prefix into host memory now (``Fetch`` ops, run in the background), so
        that admission only has to load them from host memory. Only free host slots, or
        slots of host copies that also have a disk copy, are used; never L0 pages. Returns the
        pages fetched (at most ``max_pages``, fewer when host slots run out). What the
        request's admission does not use (or ``cancel_prefetch``) counts as useless.

        NOTE: when a background read completes depends on the disk, so what an admission
        reuses does too: not for replicated scheduling (tensor parallelism refuses the tiers)."""
        if not (self.prefix_reuse and self.l1_slots and self.l2_slots and prompt_ids
                and self.pool.pages_for(len(prompt_ids)) > self.SHORT_PAGES):
            return 0
        # NOTE: prefetched pages hold at most half the host slots: the admissions ahead of
        # them need host slots too (their own disk hits are staged there) and took them back
        # at once when prefetches could fill the tier (bench multiturn on the CPU, 30 host
        # slots: 150 pages prefetched, every one evicted before use)
        budget = min(max_pages, self.l1_slots // 2 - len(self._prefetched))
        nodes = self._match(self.tree(mode), prompt_ids, prefetching=True)
        # NOTE: never at the cost of another waiting request's prefetched pages (the blocks
        # this loop prefetches are among the nodes already)
        protect = {nd.block for nd in nodes} | set(self._prefetched)
        n = 0
        mine = self._prefetch_for.setdefault(request_id, [])
        for nd in nodes:
            b = nd.block
            if b.tier != L2:
                continue
            if n >= budget:
                break
            slot = self._l1_slot_spare(protect)
            if slot is None:
                break
            b.pending_l1 = slot
            self._ops.append(Fetch(b, b.l2, slot))
            self._prefetched[b] = False
            for rid, blocks in self._prefetch_for.items():    # one owner per prefetched block
                if rid != request_id and b in blocks:
                    blocks.remove(b)
            mine.append(b)
            n += 1
        self.stats["prefetch"]["issued"] += n
        return n

    def cancel_prefetch(self, request_id: str, admitted: bool = False) -> None:
        """The request was admitted (``admitted``) or left the queue: its prefetched pages that
        its admission did not use are late when still reading at admission, else useless
        (their host copies stay, as any cached copy)."""
        for b in self._prefetch_for.pop(request_id, []):
            ready = self._prefetched.pop(b, None)
            if ready is not None:
                self.stats["prefetch"]["late" if admitted and not ready else "useless"] += 1

    def _l1_slot_spare(self, protect: set) -> int | None:
        """A host slot for a prefetch: a free one, else one whose block keeps a disk copy
        (a prefetch never drops a block's only copy)."""
        if not self._l1_free:
            if not any(b.l1 is not None and b.l2 is not None and not b.busy
                       and b not in protect for b in self._blocks):
                return None
        return self._l1_slot(protect)

    # ------------------------------------------------------------------------------ eviction
    def _make_room(self, pages: int, protect: set) -> None:
        """Free ``pages`` L0 pages held only by the cache: demote unused cached blocks, the
        policy's choice first (to L1 when it has room, else dropped)."""
        cands = [b for b in self._blocks if b.l0 is not None and not b.busy
                 and b not in protect and b.node.ref == 0]
        victims = self.policy.order(cands)[:pages]
        # NOTE: the host (and disk) slots the demotions need are freed in one pass over the
        # cached blocks: one pass per demoted page made admitting a long prompt with full tiers
        # quadratic (8 users x 12K-token histories over a full host tier: 35 s of host time for
        # 32 requests, more than their GPU time)
        need = sum(1 for b in victims if b.l1 is None and b.l2 is None)
        keep = protect | set(victims)
        self._free_l1(need, keep)
        if self.l2_slots:
            self._free_l2(need, keep)
        for b in victims:
            self._demote_l0(b, protect)

    def _demote_l0(self, b: Block, protect: set) -> None:
        page, b.l0 = b.l0, None
        self.stats["l0_evictions"] += 1
        if b.l1 is None and b.l2 is None:
            slot = self._l1_slot(protect)
            if slot is not None:
                # NOTE: the runner runs stores before anything else of its next step, so the
                # pack reads the page before any step or load can write the freed page
                b.pending_l1 = slot
                self._ops.append(Store(b, page, slot))
                disk = self._l2_slot(protect | {b})
                if disk is not None:       # write-through: a copy on disk too, so the host slot
                    b.pending_l2 = disk    # can be reused at once later
                    self._ops.append(Spill(b, slot, disk))
            else:
                disk = self._l2_slot(protect | {b})
                if disk is not None:       # host slots all busy: straight to disk
                    b.pending_l2 = disk
                    self._ops.append(StoreDisk(b, page, disk))
                else:
                    self._drop(b)
        self.pool.free([page])

    def _l1_slot(self, protect: set) -> int | None:
        """A free host slot, evicting a cached block's L1 copy if needed (``_free_l1``)."""
        self._free_l1(1, protect)
        return self._l1_free.pop() if self._l1_free else None

    def _free_l1(self, n: int, protect: set) -> None:
        """Evict cached L1 copies until ``n`` host slots are free (or nothing evictable is
        left): copies with a disk copy first, else the policy's choice (dropped)."""
        short = n - len(self._l1_free)
        if short <= 0:
            return
        cands = [b for b in self._blocks if b.l1 is not None and not b.busy
                 and b not in protect]
        # a copy that is only here goes last, and before it one prefetched for a waiting
        # request (it is about to be used)
        for b in sorted(self.policy.order(cands),
                        key=lambda b: (b.l2 is None, b in self._prefetched))[:short]:
            self._l1_free.append(b.l1)
            b.l1 = None
            if self._prefetched.pop(b, None) is not None:
                self.stats["prefetch"]["useless"] += 1
            if b.l0 is None and b.l2 is None:
                self._drop(b)

    def _l2_slot(self, protect: set) -> int | None:
        """A free disk slot, evicting a disk copy if needed (``_free_l2``)."""
        self._free_l2(1, protect)
        return self._l2_free.pop() if self._l2_free else None

    def _free_l2(self, n: int, protect: set) -> None:
        """Evict the policy's choice of the disk copies not in use until ``n`` disk slots are
        free (or nothing evictable is left)."""
        short = n - len(self._l2_free)
        if short <= 0 or not self.l2_slots:
            return
        cands = [b for b in self._blocks if b.l2 is not None and not b.busy
                 and b not in protect]
        for b in self.policy.order(cands)[:short]:
            self._l2_free.append(b.l2)
            b.l2 = None
            if b.l0 is None and b.l1 is None:
                self._drop(b)

    def _drop(self, b: Block) -> None:
        """No copy of ``b`` is left: lookups stop there; its node goes once it is a leaf."""
        b.lost = True
        self.stats["dropped_blocks"] += 1
        self._prune(b)

    def _prune(self, b: Block) -> None:
        node, tree = b.node, b.tree
        while (node is not None and node.parent is not None and not node.children
               and node.ref == 0 and (node.block is None or node.block.lost)):
            parent = node.parent
            if node.block is not None:
                self._blocks.discard(node.block)
                self._prefetched.pop(node.block, None)
                self.policy.forget(node.block)
            tree.remove(node)
            node = parent

    # ------------------------------------------------------------------------------- release
    def free(self, request_id: str, publish: list[int] | None = None) -> bool:
        """Release a request's pages (idempotent: False when it holds none). ``publish``: the
        token ids whose full pages become cached blocks (a finished request's final canvas
        prefix); None (abort, or reuse off) drops them."""
        pages = self._pages.pop(request_id, None)
        if pages is None:
            return False
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
        fresh = [None] * reused + [Block(b"", l0=pages[i]) for i in range(reused, n)]
        for i, (node, adopted) in enumerate(tree.insert(tokens[:n * self.page_size], fresh)):
            if not adopted:
                old = node.block
                if i < reused or old is None or not old.lost:
                    continue
                # a lost block (every copy gone) under live children: this page replaces it
                self._blocks.discard(old)
                node.block = fresh[i]
            b = node.block
            b.key, b.node, b.tree = node.key, node, tree
            self.policy.touch(b, now)
            self.pool.share([b.l0])                 # the cache's own reference
            self._blocks.add(b)
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
        ops, self._ops = self._ops, []
        order = {Store: 0, StoreDisk: 0, Spill: 1, Fetch: 2, Load: 3}
        return sorted(ops, key=lambda op: order[type(op)])

    def ops_done(self, results: list) -> list[str]:
        """Results ``(op, ok, seconds)`` from the runner; publishes what succeeded, drops what
        failed. Returns nothing; failed loads are handled by ``load_failed``."""
        for op, ok, seconds in results:
            b = op.block
            moved = self.page_bytes
            if isinstance(op, Store):
                b.pending_l1 = None
                if ok:
                    b.l1 = op.slot
                    self._count_bytes(L1, "down", moved)
                else:
                    # a write-through spill may still read the slot: free it when it reports
                    if b.pending_l2 is not None:
                        self._l1_orphans.add(op.slot)
                    else:
                        self._l1_free.append(op.slot)
                    if b.l0 is None and b.l2 is None and b.pending_l2 is None:
                        self._drop(b)
            elif isinstance(op, (Spill, StoreDisk)):
                b.pending_l2 = None
                if isinstance(op, Spill) and op.slot in self._l1_orphans:
                    self._l1_orphans.discard(op.slot)     # its store failed: nothing to keep
                    self._l1_free.append(op.slot)
                    ok = False
                if ok and not b.lost:
                    b.l2 = op.disk_slot
                    self._count_bytes(L2, "down", moved)
                else:
                    self._l2_free.append(op.disk_slot)
                    if b.l0 is None and b.l1 is None and not b.busy and not b.lost:
                        self._drop(b)
            elif isinstance(op, Fetch):
                b.pending_l1 = None
                if b in self._prefetched:
                    if ok:
                        self._prefetched[b] = True
                    else:
                        del self._prefetched[b]
                        self.stats["prefetch"]["useless"] += 1
                if ok:
                    b.l1 = op.slot
                    self._count_bytes(L2, "up", moved)
                else:
                    self._l1_free.append(op.slot)
                    self._l2_free.append(op.disk_slot)
                    b.l2 = None
                    self.stats["checksum_failures"] += 1
                    # a prefetch has no load behind it: a block left without any copy is lost
                    # (so a recompute can cache its page again); an admission's load still
                    # runs (``loading``) and fails, and ``load_failed`` drops it
                    if b.l0 is None and b.l1 is None and not b.busy:
                        self._drop(b)
            elif isinstance(op, Load):
                b.loading = False
                if ok:
                    self._count_bytes(L1, "up", moved)
                    if seconds:
                        self.cost.observe_load(1, L1 if b.l2 is None else L2, seconds)
                else:                    # corrupt host copy: never served, never kept
                    self._prefetched.pop(b, None)
                    self.stats["checksum_failures"] += 1
                    self.stats["load_failures"] += 1
                    if b.l1 is not None:
                        self._l1_free.append(b.l1)
                        b.l1 = None
                    b.l0 = None      # the request's allocation is undone by load_failed
                    if not any(op.page in pages for pages in self._pages.values()):
                        self.pool.free([op.page])      # its request already left: the cache's
                        if b.l2 is None and not b.busy:    # reference goes here
                            self._drop(b)
        return []

    def load_failed(self, request_id: str) -> None:
        """A load of one of the request's reused pages failed verification: undo its allocation
        (it is admitted again and recomputes what it cannot reuse)."""
        pages = self._pages.pop(request_id, [])
        tree, nodes = self._locked.pop(request_id, (None, []))
        if tree is not None:
            tree.unlock(nodes)
        # the cache's reference on pages whose load failed goes with them (b.l0 was cleared)
        cache_refs = [p for nd, p in zip(nodes, pages) if nd.block.l0 != p]
        self.pool.free(pages + cache_refs)
        for nd in nodes:
            b = nd.block
            if b.l0 is None and b.l1 is None and b.l2 is None and not b.busy:
                self._drop(b)

    def _count_bytes(self, tier: int, direction: str, n: int) -> None:
        key = (TIER_NAMES[tier], direction)
        self.stats["bytes_moved"][key] = self.stats["bytes_moved"].get(key, 0) + n
