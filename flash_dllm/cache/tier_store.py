"""The ``TierStore`` seam: what a KV tier below the GPU pool implements, and the registry that
builds the stack of tiers from the engine's config (no torch.cuda here).

A store holds ``num_slots`` page records of at most ``record_bytes`` bytes each. The tier
manager (``cache/tier_manager.py``) decides which slot holds which cached page; the runner's
offloader (``cache/io/kv_offload.py``) moves the bytes through the store's calls:

- ``alloc() -> slot | None``, ``free(slot)``, ``num_free``: its slots (the offloader takes them
  all at start: the tier manager hands out slot numbers);
- ``write_async(slot, key, payload) -> Future[None]``: store ``payload`` (host bytes) under
  ``key``; the future fails (an exception) when the record was not stored;
- ``read_async(slot, key, out) -> Future[view | None]``: the record stored under ``key`` into
  ``out`` (host memory); None is a miss (never written, another key, or a record that fails
  the store's own verification);
- ``poll(wait=())``: progress for I/O the store drives itself (nothing to do for a store that
  completes inline or on its own threads); with ``wait`` (futures of this store), returns once
  those are done;
- ``stats`` (a dict snapshot of its counters) and ``close()``;
- ``verifies``: whether a read checks a record's integrity itself (the disk store's xxh3). One
  that does not leaves it to the page record's device checksum: a record it returned that fails
  there counts as its failed read, so its copy is dropped (never fetched and refused again).

NOTE (guarantees a store keeps): a slot is readable only after its write completed
(publish-after-write); a read never returns another key's record; a slot with I/O in flight is
never reused by the offloader (the tier manager frees a slot only after its op reported). Page
records also carry their own key and device checksum (``cache/io/kv_offload.py``), verified when
a page comes back to the GPU: whatever a store returns, a corrupt record is a miss, never served.

NOTE (the stack): the tiers are the registered stores that the config enables, in registration
order: L1, L2, ... L1 is the staging tier every move passes through (``cache/tiers.py``): it must
be host memory, a store with ``view(slot)`` (the host store). Adding a tier is one class that
implements this protocol and one line that registers a factory for it in ``TIER_STORES``.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

from flash_dllm.cache.disk_store import DiskStore
from flash_dllm.cache.host_store import HostStore


@runtime_checkable
class TierStore(Protocol):
    num_slots: int
    record_bytes: int
    verifies: bool

    @property
    def num_free(self) -> int: ...

    @property
    def stats(self) -> dict: ...

    def alloc(self) -> int | None: ...

    def free(self, slot: int) -> None: ...

    def write_async(self, slot: int, key: bytes, payload) -> Future: ...

    def read_async(self, slot: int, key: bytes, out) -> Future: ...

    def poll(self, wait=()) -> None: ...

    def close(self) -> None: ...


# A factory builds its store from the engine's config (``EngineConfig``), the bytes of one page
# record and the record compatibility bytes (model, dtype, layout, page size, offload dtype), or
# returns None when the config does not enable it.
TierFactory = Callable[[Any, int, bytes], "TierStore | None"]


def host_tier(config, record_bytes: int, compat: bytes) -> HostStore | None:
    """``kv_cpu_gb`` of pinned host memory (L1)."""
    if not config.kv_cpu_gb:
        return None
    slots = int(config.kv_cpu_gb * 2**30) // record_bytes
    if slots < 1:
        raise ValueError(f"kv_cpu_gb={config.kv_cpu_gb} holds no page record of "
                         f"{record_bytes} bytes")
    return HostStore(slots, record_bytes)


def disk_tier(config, record_bytes: int, compat: bytes) -> DiskStore | None:
    """A file of ``kv_disk_gb`` at ``kv_disk_path``."""
    if config.kv_disk_path is None:
        return None
    return DiskStore(config.kv_disk_path, int(config.kv_disk_gb * 2**30), record_bytes, compat)


# name -> factory, in stack order (the first enabled one is L1)
TIER_STORES: dict[str, TierFactory] = {
    "host": host_tier,
    "disk": disk_tier,
}


def build_tiers(config, record_bytes: int, compat: bytes) -> list:
    """The stores ``config`` enables, in ``TIER_STORES`` order (L1 first)."""
    stores: list = []
    try:
        for name, factory in TIER_STORES.items():
            store = factory(config, record_bytes, compat)
            if store is None:
                continue
            stores.append(store)
            if not isinstance(store, TierStore):
                raise TypeError(f"tier {name!r} built a {type(store).__name__}, which does not "
                                f"implement TierStore (cache/tier_store.py)")
            if len(stores) == 1 and not hasattr(store, "view"):
                raise ValueError(f"tier {name!r} would be L1, the staging tier, which must be "
                                 f"host memory (set kv_cpu_gb)")
    except BaseException:
        for store in stores:              # (a disk store holds a file lock)
            getattr(store, "close", lambda: None)()
        raise
    return stores
