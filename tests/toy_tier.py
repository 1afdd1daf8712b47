"""A toy KV tier: page records in a dict, with an injectable delay (in polls) and faults.

It implements ``TierStore`` (``flash_dllm/cache/tier_store.py``) and nothing else knows it: an
engine uses it through one registration line (``tests/test_toy_tier.py``). It checks keys but no
checksum: a record corrupted in it comes back as it is, and the page record's own checksum
(verified when the page reaches the GPU) must turn it into a miss.
"""
from __future__ import annotations

from concurrent.futures import Future

from flash_dllm.cache.checksum import byte_view


class DictStore:
    """``num_slots`` records of at most ``record_bytes`` bytes. ``delay``: polls before an op
    completes (0: at once); ``fail_writes``: writes fail; ``fail_reads``: reads miss."""

    verifies = False              # keys only: the page record's device checksum does the rest

    def __init__(self, num_slots: int, record_bytes: int, delay: int = 0) -> None:
        self.num_slots, self.record_bytes, self.delay = num_slots, record_bytes, delay
        self.fail_writes = self.fail_reads = False
        self.records: dict[int, tuple[bytes, bytearray]] = {}   # slot -> (key, payload)
        self._free = list(range(num_slots - 1, -1, -1))
        self._queue: list[list] = []                 # [polls left, future, completion]
        self.counts = {"writes": 0, "reads": 0, "hits": 0, "misses": 0, "write_failures": 0}
        self.closed = False

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def stats(self) -> dict:
        return {**self.counts, "num_free": self.num_free, "in_flight": len(self._queue)}

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"double free of toy slot {slot}")
        self.records.pop(slot, None)
        self._free.append(slot)

    def write_async(self, slot: int, key: bytes, payload) -> Future:
        data = bytearray(byte_view(payload))         # (copied now: the caller may reuse it)
        self.records.pop(slot, None)                 # unreadable until the write completes

        def complete(fut: Future) -> None:
            if self.fail_writes:
                self.counts["write_failures"] += 1
                fut.set_exception(OSError(5, f"toy write of slot {slot} failed"))
            else:
                self.records[slot] = (bytes(key), data)
                self.counts["writes"] += 1
                fut.set_result(None)
        return self._submit(complete)

    def read_async(self, slot: int, key: bytes, out) -> Future:
        def complete(fut: Future) -> None:
            self.counts["reads"] += 1
            rec = self.records.get(slot)
            if self.fail_reads or rec is None or rec[0] != key:
                self.counts["misses"] += 1
                fut.set_result(None)
                return
            dst = byte_view(out, writable=True)
            dst[:len(rec[1])] = rec[1]
            self.counts["hits"] += 1
            fut.set_result(dst[:len(rec[1])])
        return self._submit(complete)

    def poll(self, wait=()) -> None:
        """One tick: ops whose delay ran out complete; with ``wait``, every op up to the last of
        those completes now."""
        for entry in self._queue:
            entry[0] -= 1
        wait = list(wait)
        while self._queue and (self._queue[0][0] <= 0 or any(not f.done() for f in wait)):
            _, fut, complete = self._queue.pop(0)
            complete(fut)

    def close(self) -> None:
        self.closed = True

    def corrupt(self) -> int:
        """Flip one payload byte of every record; returns how many."""
        for _, data in self.records.values():
            data[len(data) // 3] ^= 0x40
        return len(self.records)

    def _submit(self, complete) -> Future:
        fut: Future = Future()
        if self.delay <= 0:
            complete(fut)
        else:
            self._queue.append([self.delay, fut, complete])
        return fut
