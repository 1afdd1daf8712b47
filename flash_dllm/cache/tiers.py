"""Tier bookkeeping of cached KV pages (no torch at import): where each copy lives, what to move,
what pays.

A cached **block** is one page of KV that a finished request left behind for prefix reuse (a node
of ``cache/prefix_tree.py``). Copies of it live in an ordered stack of tiers: **L0** is a page of
the GPU pool (the cache holds one pool reference on it); **L1, L2, ...** are slots of the
registered ``TierStore``s in order (``cache/tier_store.py``: today L1 pinned host memory, L2 a
disk file). ``block.copies[t]`` is its published copy in tier ``t`` (a page for L0, a slot
below), ``block.pending[t]`` a slot an op is writing.

This module only records; the tier manager (``cache/tier_manager.py``) decides and the runner's
offloader (``cache/io/kv_offload.py``) moves the bytes. Every move is an op handed to the runner
through the step plan, of four kinds, the same for any number of tiers:

- ``Store``  L0 -> L1 (or straight to a lower tier, a skip, when no host slot is free);
- ``Load``   L1 -> L0;
- ``Spill``  L1 -> a lower tier (write-through of a stored page);
- ``Fetch``  a lower tier -> L1 (before a ``Load``, or ahead of an admission).

NOTE (L1 is the staging tier): every move below L0 starts or ends in host memory. A store's
``read``/``write`` take host buffers, and L1's slots are host memory, so each move is one store
call into or out of an L1 slot: no temporary buffers and no chain of waits through the tiers in
between (an L3 hit is one read into host memory, not L3 -> L2 -> L1).

NOTE (publish-after-write): a copy becomes visible (``block.copies[t]`` set) only when the op
that writes it has completed and verified; until then it is ``pending`` and no lookup can use
it; a failed op never publishes and frees its slot. A block whose every copy is gone or corrupt
is ``lost``: lookups stop there (a miss that recomputes), never serve it.

Placement is a policy object (``PLACEMENT_POLICIES``): it only orders candidates for eviction
from a tier; it never moves bytes. ``lru`` orders by recency; ``ema`` and ``kag`` by the
attention the blocks' pages received (``observe``, fed by the KV manager once per decoded block)
through the KV access graph (``cache/access_graph.py``, torch, imported when one is chosen).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

L0, L1, L2 = 0, 1, 2
# the ledger always counts the host (l1) and disk (l2) tiers, configured or not, so that stats
# and metric series keep their shape; a store registered below them is l3, l4, ...
MIN_TIERS = 3


def tier_name(tier: int) -> str:
    """The metric label of ``tier``: ``l0``, ``l1``, ..."""
    return f"l{tier}"


@dataclass(eq=False)
class Block:
    """One cached page and its copies: ``copies[tier]`` a published copy (a page of L0, a slot
    below), ``pending[tier]`` a slot an op is writing; a tier absent holds none."""

    key: bytes
    copies: dict = field(default_factory=dict)
    pending: dict = field(default_factory=dict)
    loading: bool = False             # a Load into the L0 copy is in flight (this step)
    lost: bool = False                # no usable copy is left (corrupt or dropped)
    last_access: float = field(default_factory=time.monotonic)
    node: object = field(default=None, repr=False)   # its prefix-tree node
    tree: object = field(default=None, repr=False)   # and that node's tree

    @property
    def l0(self) -> int | None:
        """Its page of the GPU pool (None: none)."""
        return self.copies.get(L0)

    @l0.setter
    def l0(self, page: int | None) -> None:
        if page is None:
            self.copies.pop(L0, None)
        else:
            self.copies[L0] = page

    @property
    def tier(self) -> int | None:
        """The fastest tier holding a published copy (None: none)."""
        return min((t for t in self.copies if t != L0 or not self.loading), default=None)

    def below(self, tier: int) -> bool:
        """Whether a copy below ``tier`` is published."""
        return any(t > tier for t in self.copies)

    @property
    def busy(self) -> bool:
        return self.loading or bool(self.pending)


# NOTE: every op reads ``src_slot`` of tier ``src`` and writes ``dst_slot`` of tier ``dst``
# (a page when the tier is L0); the kinds keep their own field names (``page`` the L0 page,
# ``slot`` the host slot) and answer the generic ones as properties.
@dataclass(frozen=True)
class Store:
    """Copy L0 page ``page`` into slot ``slot`` of tier ``dst``: L1 (pack page-first, then
    device -> host), or a lower tier when no host slot is free (through a temporary host
    buffer)."""

    block: Block
    page: int
    slot: int
    dst: int = L1
    src = L0

    @property
    def src_slot(self) -> int:
        return self.page

    @property
    def dst_slot(self) -> int:
        return self.slot


@dataclass(frozen=True)
class Load:
    """Copy host slot ``slot`` into L0 page ``page`` (host -> device, verify, unpack)."""

    block: Block
    slot: int
    page: int
    src = L1
    dst = L0

    @property
    def src_slot(self) -> int:
        return self.slot

    @property
    def dst_slot(self) -> int:
        return self.page


@dataclass(frozen=True)
class Spill:
    """Write host slot ``slot`` into slot ``dst_slot`` of the lower tier ``dst``."""

    block: Block
    slot: int
    dst_slot: int
    dst: int = L2
    src = L1

    @property
    def src_slot(self) -> int:
        return self.slot


@dataclass(frozen=True)
class Fetch:
    """Read slot ``src_slot`` of the lower tier ``src`` into host slot ``slot`` (before a Load
    from it, or ahead of an admission)."""

    block: Block
    src_slot: int
    slot: int
    src: int = L2
    dst = L1

    @property
    def dst_slot(self) -> int:
        return self.slot


OP_ORDER = {Store: 0, Spill: 1, Fetch: 2, Load: 3}   # the runner's order: stores first


# ---------------------------------------------------------------------------------- placement
class LRUPolicy:
    """Evict the least recently used first."""

    name = "lru"
    wants_mass = False

    def observe(self, blocks: list[Block], masses: list[float]) -> None:
        """Attention evidence (unused by LRU)."""

    def forget(self, block: Block) -> None:
        """``block`` left the cache."""

    def touch(self, block: Block, now: float) -> None:
        block.last_access = now

    def order(self, candidates: list[Block]) -> list[Block]:
        """``candidates`` in eviction order (first out first)."""
        return sorted(candidates, key=lambda b: (b.last_access, b.key))   # ties: deterministic


class EMAPolicy(LRUPolicy):
    """Evict the block whose pages received the least attention first (a moving average of
    the attention mass its page received, per decoded block, from the requests that used it:
    ``observe``); blocks without evidence, and ties, go least recently used first."""

    name = "ema"
    wants_mass = True             # the engine feeds ``observe`` (cache="flash" steps)

    def __init__(self, top_k: int = 8, decay: float = 0.9) -> None:
        from flash_dllm.cache.access_graph import AccessGraph

        self.graph = AccessGraph(top_k=top_k, decay=decay)
        self._ids: dict[bytes, int] = {}
        self._free_ids: list[int] = []      # nodes of forgotten blocks, reused (graph stays small)

    def _id(self, block: Block) -> int:
        i = self._ids.get(block.key)
        if i is None:
            i = self._free_ids.pop() if self._free_ids else len(self._ids)
            self._ids[block.key] = i
        return i

    def observe(self, blocks: list[Block], masses: list[float]) -> None:
        """One decoded block's evidence: ``masses[i]`` is the attention mass ``blocks[i]``'s
        page received over it."""
        if blocks:
            self.graph.update([self._id(b) for b in blocks], masses)

    def forget(self, block: Block) -> None:
        i = self._ids.pop(block.key, None)
        if i is not None:
            self.graph.forget(i)
            self._free_ids.append(i)

    def scores(self) -> "object":
        return self.graph.mass

    def order(self, candidates: list[Block]) -> list[Block]:
        sc = self.scores().tolist()
        n = len(sc)

        def score(b: Block) -> float:
            i = self._ids.get(b.key)
            return sc[i] if i is not None and i < n else 0.0

        return sorted(candidates, key=lambda b: (score(b), b.last_access, b.key))


class KAGPolicy(EMAPolicy):
    """Evict the least central block first: PageRank over the KV access graph
    (``cache/access_graph.py``), whose edges link pages attended by the same block's queries.
    After each update it records how stable the ``STABILITY_TOP`` most central pages are
    (``stats``: the ``flash_dllm_kag_*`` metrics)."""

    name = "kag"
    STABILITY_TOP = 16

    def __init__(self, top_k: int = 8, decay: float = 0.9) -> None:
        super().__init__(top_k, decay)
        self.stats = {"updates": 0, "update_seconds": 0.0, "stability_ratio": 1.0}

    def observe(self, blocks: list[Block], masses: list[float]) -> None:
        if not blocks:
            return
        t0 = time.perf_counter()
        super().observe(blocks, masses)
        ratio = self.graph.stability(self.STABILITY_TOP)        # PageRank of the new graph
        self.stats["update_seconds"] += time.perf_counter() - t0
        self.stats["updates"] += 1
        self.stats["stability_ratio"] = ratio

    def scores(self) -> "object":
        return self.graph.pagerank()


PLACEMENT_POLICIES = {"lru": LRUPolicy, "ema": EMAPolicy, "kag": KAGPolicy}


def make_policy(name: str, top_k: int = 8):
    """The placement policy ``name``; ``top_k``: neighbours per page of the access graph."""
    if name not in PLACEMENT_POLICIES:
        raise ValueError(f"kv_placement must be one of {sorted(PLACEMENT_POLICIES)}, got {name!r}")
    cls = PLACEMENT_POLICIES[name]
    return cls(top_k=top_k) if issubclass(cls, EMAPolicy) else cls()


# ----------------------------------------------------------------------------------- cost model
@dataclass
class CostModel:
    """Is loading a cached prefix from a lower tier faster than recomputing it?

    ``load_seconds = bytes / rate[tier] + latency[tier]``, ``recompute_seconds = tokens /
    prefill_tokens_per_s``. The rates start from conservative defaults and follow measurements
    (an exponential moving average of every completed load and of the refresh steps' token rate),
    so the model is the device's own. A lower-tier hit that measured slower than the recompute it
    replaced is counted (``slower_than_recompute``)."""

    page_bytes: int
    page_size: int
    rate: list = field(default_factory=lambda: [float("inf"), 8e9, 1e9])   # bytes/s per tier
    latency: list = field(default_factory=lambda: [0.0, 50e-6, 200e-6])    # s per op
    prefill_tokens_per_s: float = 5e3
    alpha: float = 0.2
    slower_than_recompute: int = 0
    adaptive: bool = True        # False: fixed rates (tensor-parallel replicas must agree)
    tiers: int = MIN_TIERS       # L0 and the stores below it

    def __post_init__(self) -> None:
        # a store below the standard tiers starts from the lowest one's guesses (then measured)
        for v in (self.rate, self.latency):
            v += [v[-1]] * (self.tiers - len(v))

    def load_seconds(self, pages: int, tier: int) -> float:
        if tier == L0 or pages == 0:
            return 0.0
        return pages * self.page_bytes / self.rate[tier] + self.latency[tier]

    def recompute_seconds(self, pages: int) -> float:
        return pages * self.page_size / self.prefill_tokens_per_s

    def worth_loading(self, pages: int, tier: int) -> bool:
        return self.load_seconds(pages, tier) <= self.recompute_seconds(pages)

    def observe_load(self, pages: int, tier: int, seconds: float) -> None:
        if pages <= 0 or seconds <= 0 or tier == L0:
            return
        if seconds > self.recompute_seconds(pages):
            self.slower_than_recompute += 1
        if self.adaptive:
            measured = pages * self.page_bytes / seconds
            self.rate[tier] = (1 - self.alpha) * self.rate[tier] + self.alpha * measured

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0 and self.adaptive:
            self.prefill_tokens_per_s = ((1 - self.alpha) * self.prefill_tokens_per_s
                                         + self.alpha * tokens / seconds)
