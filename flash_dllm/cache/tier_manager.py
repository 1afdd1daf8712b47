"""The tier manager: which copies of the cached blocks live in which tier, which leave first, and
the ops that move them (no torch).

The stack is L0 (the GPU pool) over the registered stores in order (``cache/tier_store.py``:
L1 pinned host memory, the staging tier; L2 disk; L3.. whatever is registered below): tier ``t``
has ``slots[t]`` slots, handed out from ``free[t]``. The same rules hold for any number of tiers:

- a page evicted from L0 without a copy below is stored in L1 and written through to every lower
  tier that has a slot (a ``Store`` and a ``Spill`` each, in the same step), so its host slot can
  be reused at once later; when no host slot is free it goes straight to the first lower tier
  with one (a skip ``Store``); else it is dropped;
- a tier short of slots evicts the placement policy's choice of its copies not in use, those with
  a copy further down first (in L1, one prefetched for a waiting request just before the rest);
  a block left without any copy is lost;
- a hit below L1 is fetched into a host slot (``Fetch``), then loaded (``Load``).

NOTE (ownership): the KV manager (``cache/kv_manager.py``) owns the requests and the prefix
lookup; it publishes blocks into ``blocks`` and asks for room (``make_room``), host slots
(``slot``) and moves (``fetch``, ``load``). Everything else about the tiers is decided here; the
runner's offloader carries out the ops (``take_ops``) and reports back (``ops_done``).
"""
from __future__ import annotations

from collections.abc import Callable

from flash_dllm.cache.tiers import (L0, L1, L2, MIN_TIERS, OP_ORDER, Block, Fetch, Load, Spill,
                                    Store, tier_name)


class TierManager:
    """The tiers of ``pool``'s cached blocks: ``tier_slots`` slots per store tier (L1, L2, ..;
    padded to the standard tiers with empty ones), ``policy`` orders evictions, ``cost`` learns
    load rates, ``stats`` is the KV manager's counters dict; ``in_use(page)`` says whether a
    request holds pool page ``page``."""

    def __init__(self, pool, tier_slots, policy, cost, stats: dict, page_bytes: int,
                 in_use: Callable[[int], bool]) -> None:
        stores = list(tier_slots) + [0] * (MIN_TIERS - 1 - len(tier_slots))
        for t, n in enumerate(stores, 1):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"tier_slots[{t - 1}] (slots of tier l{t}) must be an integer "
                                 f">= 0, got {n!r}")
        self.pool = pool
        self.slots = (pool.num_pages, *stores)          # per tier; L0: the pool's pages
        self.free = {t: list(range(n - 1, -1, -1)) for t, n in enumerate(stores, 1)}
        self.blocks: set[Block] = set()                 # every cached block with a live node
        self.policy, self.cost, self.stats = policy, cost, stats
        self.page_bytes = page_bytes
        self._in_use = in_use
        self.ops: list = []                             # tier ops for the runner's next step
        # host slots of failed stores -> the write-through spills still reading them
        self.orphans: dict[int, int] = {}
        # blocks fetched ahead from disk for a waiting request: block -> True once in L1; and
        # the blocks fetched for each waiting request
        self.prefetched: dict[Block, bool] = {}
        self.prefetch_for: dict[str, list[Block]] = {}

    @property
    def num_tiers(self) -> int:
        return len(self.slots)

    @property
    def tier_names(self) -> tuple[str, ...]:
        """``("l0", "l1", ...)``: the metric labels, one per tier."""
        return tuple(tier_name(t) for t in range(self.num_tiers))

    def cached_pages(self) -> list[int]:
        """Cached blocks per tier [L0, L1, ..] (published copies)."""
        n = [0] * self.num_tiers
        for b in self.blocks:
            for t in b.copies:
                if t != L0 or not b.loading:
                    n[t] += 1
        return n

    # ------------------------------------------------------------------------------ eviction
    def make_room(self, pages: int, protect: set) -> None:
        """Free ``pages`` L0 pages held only by the cache: demote unused cached blocks, the
        policy's choice first (to lower tiers when they have room, else dropped)."""
        cands = [b for b in self.blocks if b.l0 is not None and not b.busy
                 and b not in protect and b.node.ref == 0]
        victims = self.policy.order(cands)[:pages]
        # NOTE: the slots the demotions need are freed in one pass over the cached blocks per
        # tier: one pass per demoted page made admitting a long prompt with full tiers
        # quadratic (8 users x 12K-token histories over a full host tier: 35 s of host time for
        # 32 requests, more than their GPU time)
        need = sum(1 for b in victims if not b.below(L0))
        keep = protect | set(victims)
        for t in range(L1, self.num_tiers):
            self._evict(t, need, keep)
        for b in victims:
            self._demote(b, protect)

    def _demote(self, b: Block, protect: set) -> None:
        page, b.l0 = b.l0, None
        self.stats["l0_evictions"] += 1
        if not b.below(L0):
            slot = self.slot(L1, protect)
            if slot is not None:
                # NOTE: the runner runs stores before anything else of its next step, so the
                # pack reads the page before any step or load can write the freed page
                b.pending[L1] = slot
                self.ops.append(Store(b, page, slot))
                for t in range(L2, self.num_tiers):   # write-through: a copy further down too,
                    dst = self.slot(t, protect | {b})  # so the host slot can be reused later
                    if dst is not None:
                        b.pending[t] = dst
                        self.ops.append(Spill(b, slot, dst, t))
            else:
                for t in range(L2, self.num_tiers):   # host slots all busy: straight down
                    dst = self.slot(t, protect | {b})
                    if dst is not None:
                        b.pending[t] = dst
                        self.ops.append(Store(b, page, dst, t))
                        break
                else:
                    self.drop(b)
        self.pool.free([page])

    def slot(self, tier: int, protect: set) -> int | None:
        """A free slot of store tier ``tier``, evicting a copy there if needed (``_evict``)."""
        self._evict(tier, 1, protect)
        free = self.free[tier]
        return free.pop() if free else None

    def release(self, tier: int, slots) -> None:
        """Give back slots of ``tier`` taken by ``slot`` and not used."""
        self.free[tier] += slots

    def _evict(self, tier: int, n: int, protect: set) -> None:
        """Evict copies in ``tier`` not in use until ``n`` of its slots are free (or nothing
        evictable is left): copies with a copy further down first, else the policy's choice."""
        short = n - len(self.free[tier])
        if short <= 0 or not self.slots[tier]:
            return
        cands = [b for b in self.blocks if tier in b.copies and not b.busy and b not in protect]
        if tier == L1:
            # a copy that is only here goes last, and before it one prefetched for a waiting
            # request (it is about to be used)
            def last(b: Block) -> tuple:
                return (not b.below(tier), b in self.prefetched)
        else:
            def last(b: Block) -> tuple:
                return (not b.below(tier),)
        for b in sorted(self.policy.order(cands), key=last)[:short]:
            self.free[tier].append(b.copies.pop(tier))
            if tier == L1 and self.prefetched.pop(b, None) is not None:
                self.stats["prefetch"]["useless"] += 1
            if not b.copies:
                self.drop(b)

    def drop(self, b: Block) -> None:
        """No copy of ``b`` is left: lookups stop there; its node goes once it is a leaf."""
        b.lost = True
        self.stats["dropped_blocks"] += 1
        node, tree = b.node, b.tree
        while (node is not None and node.parent is not None and not node.children
               and node.ref == 0 and (node.block is None or node.block.lost)):
            parent = node.parent
            if node.block is not None:
                self.blocks.discard(node.block)
                self.prefetched.pop(node.block, None)
                self.policy.forget(node.block)
            tree.remove(node)
            node = parent

    # -------------------------------------------------------------------------------- moves
    def fetch(self, b: Block, slot: int) -> None:
        """Read ``b``'s copy of its fastest tier (below L1) into host slot ``slot``."""
        t = b.tier
        b.pending[L1] = slot
        self.ops.append(Fetch(b, b.copies[t], slot, t))

    def load(self, b: Block, slot: int, page: int) -> Load:
        """Load host slot ``slot`` into L0 page ``page`` for ``b`` (the cache's L0 copy once
        verified)."""
        b.l0, b.loading = page, True
        op = Load(b, slot, page)
        self.ops.append(op)
        return op

    # ------------------------------------------------------------------------------ prefetch
    def prefetch(self, request_id: str, nodes: list, max_pages: int) -> int:
        """Fetch the copies below L1 of ``nodes``' blocks (a waiting request's reusable prefix)
        into host slots: free ones, or those of host copies that keep a copy further down;
        never L0 pages. Returns the pages fetched (at most ``max_pages``)."""
        # NOTE: prefetched pages hold at most half the host slots: the admissions ahead of
        # them need host slots too (their own disk hits are staged there) and took them back
        # at once when prefetches could fill the tier (bench multiturn on the CPU, 30 host
        # slots: 150 pages prefetched, every one evicted before use)
        budget = min(max_pages, self.slots[L1] // 2 - len(self.prefetched))
        # NOTE: never at the cost of another waiting request's prefetched pages (the blocks
        # this loop prefetches are among the nodes already)
        protect = {nd.block for nd in nodes} | set(self.prefetched)
        n = 0
        mine = self.prefetch_for.setdefault(request_id, [])
        for nd in nodes:
            b = nd.block
            if b.tier <= L1:
                continue
            if n >= budget:
                break
            slot = self._spare_host_slot(protect)
            if slot is None:
                break
            self.fetch(b, slot)
            self.prefetched[b] = False
            for rid, blocks in self.prefetch_for.items():    # one owner per prefetched block
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
        for b in self.prefetch_for.pop(request_id, []):
            ready = self.prefetched.pop(b, None)
            if ready is not None:
                self.stats["prefetch"]["late" if admitted and not ready else "useless"] += 1

    def _spare_host_slot(self, protect: set) -> int | None:
        """A host slot for a prefetch: a free one, else one whose block keeps a copy further
        down (a prefetch never drops a block's only copy)."""
        if not self.free[L1] and not any(L1 in b.copies and b.below(L1) and not b.busy
                                         and b not in protect for b in self.blocks):
            return None
        return self.slot(L1, protect)

    # ------------------------------------------------------------------------------ results
    def take_ops(self) -> list:
        """The tier ops the runner carries out before the next step (stores first)."""
        ops, self.ops = self.ops, []
        return sorted(ops, key=lambda op: OP_ORDER[type(op)])

    def ops_done(self, results: list) -> None:
        """Results ``(op, ok, seconds)`` from the runner: publishes what succeeded, frees what
        failed (failed loads: the KV manager's ``load_failed`` undoes their allocations)."""
        for op, ok, seconds in results:
            if isinstance(op, Load):
                self._loaded(op, ok, seconds)
            elif isinstance(op, Fetch):
                self._fetched(op, ok)
            else:
                self._written(op, ok)

    def _written(self, op: Store | Spill, ok: bool) -> None:
        b, t = op.block, op.dst
        b.pending.pop(t, None)
        if isinstance(op, Spill) and op.slot in self.orphans:
            self._unorphan(op.slot)          # its store failed: nothing to keep
            ok = False
        if ok and not b.lost:
            b.copies[t] = op.dst_slot
            self._count(t, "down")
            return
        spills = sum(1 for k in b.pending if k > L1)
        if isinstance(op, Store) and t == L1 and spills:
            self.orphans[op.slot] = spills   # write-through spills still read it: freed when
        else:                                # the last one reports
            self.free[t].append(op.dst_slot)
        if not b.copies and not b.busy and not b.lost:
            self.drop(b)

    def _unorphan(self, slot: int) -> None:
        left = self.orphans.pop(slot) - 1
        if left:
            self.orphans[slot] = left
        else:
            self.free[L1].append(slot)

    def _fetched(self, op: Fetch, ok: bool) -> None:
        b = op.block
        b.pending.pop(L1, None)
        if b in self.prefetched:
            if ok:
                self.prefetched[b] = True
            else:
                del self.prefetched[b]
                self.stats["prefetch"]["useless"] += 1
        if ok:
            b.copies[L1] = op.slot
            self._count(op.src, "up")
            return
        self.free[L1].append(op.slot)
        self.free[op.src].append(op.src_slot)
        b.copies.pop(op.src, None)
        self.stats["checksum_failures"] += 1
        # a prefetch has no load behind it: a block left without any copy is lost (so a
        # recompute can cache its page again); an admission's load still runs (``loading``)
        # and fails, and ``load_failed`` drops it
        if not b.copies and not b.busy:
            self.drop(b)

    def _loaded(self, op: Load, ok: bool, seconds: float) -> None:
        b = op.block
        b.loading = False
        if ok:
            self._count(L1, "up")
            if seconds:
                # NOTE: the load's time counts for the deepest tier holding a copy (L1 when
                # none below), as it did when L2 was the only tier below host memory
                self.cost.observe_load(1, max((t for t in b.copies if t > L0), default=L1),
                                       seconds)
            return
        # a corrupt host copy: never served, never kept
        self.prefetched.pop(b, None)
        # NOTE: one checksum failure per failed page. A load whose fetch failed was never
        # attempted (the offloader refuses to read a slot whose fetch failed, and a store that
        # does not verify has its fetch blamed for the load's failed check): ``_fetched``
        # counted that page already, and left it no host copy at this slot
        if b.copies.get(L1) == op.slot:
            self.stats["checksum_failures"] += 1
        self.stats["load_failures"] += 1
        if L1 in b.copies:
            self.free[L1].append(b.copies.pop(L1))
        b.l0 = None          # the request's allocation is undone by load_failed
        if not self._in_use(op.page):
            self.pool.free([op.page])      # its request already left: the cache's reference
            if not b.copies and not b.busy:    # goes here
                self.drop(b)

    def _count(self, tier: int, direction: str) -> None:
        key = (tier_name(tier), direction)
        moved = self.stats["bytes_moved"]
        moved[key] = moved.get(key, 0) + self.page_bytes
