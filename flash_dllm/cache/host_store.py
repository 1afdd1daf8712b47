"""Host tier (L1) storage: fixed-size page records in one pinned host tensor (no torch.cuda here).

One uint8 tensor ``[num_slots, record_bytes]`` holds every record; a slot is one packed page
(page-first: all layers, K and V, possibly quantised data plus scales). One allocation, pinned once
at start-up, because pinning is slow (page-locking costs milliseconds per call) and pinned memory is
what lets a GPU <-> host copy run asynchronously at full PCIe/NVLink-C2C bandwidth; a pool of
separately pinned buffers would fragment and pay the cost per page.

The store only hands out slots and views; what goes where is the tier manager's decision, and the
record's checksum (``checksum.device_checksum``) is computed and checked by whoever moves it.
It is L1, the staging tier (``cache/tier_store.py``): the offloader copies pages between the GPU
and its ``view``s on its own streams. Its ``write_async`` / ``read_async`` (the ``TierStore``
calls, for host bytes) complete at once.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future

import torch

from flash_dllm.cache.checksum import byte_view


def _check_int(name: str, v, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")


class HostStore:
    """``num_slots`` records of ``record_bytes`` bytes in one (pinned) host tensor.

    ``pin=None`` pins exactly when CUDA is available; ``pin=True`` without CUDA is an error (a
    CPU-only torch build cannot page-lock memory).
    """

    # a read checks the key only: a page record carries its own checksum (verified on the GPU)
    verifies = False

    def __init__(self, num_slots: int, record_bytes: int, pin: bool | None = None) -> None:
        _check_int("num_slots", num_slots, 1)
        _check_int("record_bytes", record_bytes, 1)
        cuda = torch.cuda.is_available()
        if pin is None:
            pin = cuda
        elif pin and not cuda:
            raise ValueError("pin=True needs CUDA (this torch build or machine has none); "
                             "use pin=None or pin=False")
        self.num_slots = num_slots
        self.record_bytes = record_bytes
        self.pinned = bool(pin)
        self.buffer = torch.empty((num_slots, record_bytes), dtype=torch.uint8,
                                  pin_memory=self.pinned)     # [slots, record_bytes]
        # NOTE: LIFO free list (recently freed slots are cache-warm); `_used[s]` is the single truth
        # of whether slot s is handed out, so a double free is caught, not silently appended.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._used = [False] * num_slots
        # the key of the record ``write_async`` stored in a slot (None: nothing readable; a
        # record written through ``view`` carries its own key, checked by the offloader)
        self._key: list[bytes | None] = [None] * num_slots
        self._len = [0] * num_slots
        self._counters = {"reads": 0, "hits": 0, "misses": 0, "writes": 0}
        self._lock = threading.Lock()    # I/O completion callbacks may free from other threads

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole store (``num_slots * record_bytes``)."""
        return self.num_slots * self.record_bytes

    def alloc(self) -> int | None:
        """A free slot, or None when all are in use."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
            self._used[slot] = True
            return slot

    def free(self, slot: int) -> None:
        """Return ``slot``; raises ValueError on a slot that is not allocated (double free)."""
        self._check_slot(slot)
        with self._lock:
            if not self._used[slot]:
                raise ValueError(f"double free of host slot {slot}: it is not allocated")
            self._used[slot] = False
            self._key[slot] = None
            self._free.append(slot)

    def view(self, slot: int) -> torch.Tensor:
        """The bytes of allocated ``slot``: a uint8 [record_bytes] view into the store (no copy)."""
        self._check_slot(slot)
        if not self._used[slot]:
            raise ValueError(f"host slot {slot} is not allocated")
        return self.buffer[slot]

    def write_async(self, slot: int, key: bytes, payload) -> Future:
        """Copy ``payload`` (host bytes, at most ``record_bytes``) into allocated ``slot`` under
        ``key``; done on return."""
        mv = byte_view(payload)
        dst = self.view(slot)
        if len(mv) > self.record_bytes:
            raise ValueError(f"payload must be at most record_bytes={self.record_bytes} B, "
                             f"got {len(mv)} B")
        self._key[slot] = None
        byte_view(dst, writable=True)[:len(mv)] = mv
        self._key[slot], self._len[slot] = bytes(key), len(mv)
        self._counters["writes"] += 1
        return _done(None)

    def read_async(self, slot: int, key: bytes, out) -> Future:
        """The record ``write_async`` stored in ``slot`` under ``key``, copied into ``out``
        (host memory of at least the record's bytes): a view of it, or None (a miss); done on
        return."""
        src = self.view(slot)
        self._counters["reads"] += 1
        if self._key[slot] != key:
            self._counters["misses"] += 1
            return _done(None)
        n = self._len[slot]
        dst = byte_view(out, writable=True)
        if len(dst) < n:
            raise ValueError(f"out must hold the record's {n} B, got {len(dst)} B")
        dst[:n] = byte_view(src)[:n]
        self._counters["hits"] += 1
        return _done(dst[:n])

    def poll(self, wait=()) -> None:
        """Nothing to do: every call completes at once."""

    @property
    def stats(self) -> dict:
        return {**self._counters, "num_free": self.num_free}

    def close(self) -> None:
        """Nothing to release (the memory goes with the store)."""

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be an integer in [0, {self.num_slots}), got {slot!r}")

    def __repr__(self) -> str:
        return (f"HostStore(num_slots={self.num_slots}, record_bytes={self.record_bytes}, "
                f"pinned={self.pinned}, used={self.num_used})")


def _done(result) -> Future:
    fut: Future = Future()
    fut.set_result(result)
    return fut
