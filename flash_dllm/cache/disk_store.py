"""Disk tier storage: page records in fixed-size slots of one preallocated file, verified on every
read (no torch.cuda here). A ``TierStore`` (``cache/tier_store.py``) whose reads and writes run
on its thread pool; the file format is ``cache/disk_format.py``'s, and so are stale records of
an earlier process and files that are not the store's. What other engines' disk caches got
wrong, and what makes each impossible here:

- **Another request's KV served from disk.** Every record carries the caller's 16-byte ``key``,
  the store's ``compat`` bytes and nonce, its slot and length under an xxh3 checksum. A read
  names the key it expects; any mismatch is a miss, never data.
- **A failed store visible to lookups / reads racing writes.** Publish-after-write: a slot becomes
  readable only after its whole record was written, and a slot with I/O in flight can be neither
  read (while written), written again, nor freed (see "Slot states" below).
- **I/O on a closed descriptor.** ``close()`` waits until no read or write is between its begin
  and its end (synchronous calls on other threads included), so a late ``pwrite`` can never land
  in whatever file reused the descriptor number.

I/O goes through page-aligned ``mmap`` staging buffers (one memcpy each way: a record's header
precedes its payload, so a read cannot land directly in the caller's buffer) and through
``_pwrite``/``_pread``, the fault-injection seam the tests override. ``O_DIRECT`` (when ``direct``
and the file system takes it) keeps page records out of the page cache, which would otherwise
double-buffer what the host tier already holds. Benchmarks: ``bench/disk.py``.
"""
from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from flash_dllm.cache.checksum import byte_view
from flash_dllm.cache.disk_format import (  # noqa: F401 - the format's names, re-exported
    ALIGN, FORMAT_VERSION, HEADER_BYTES, KEY_BYTES, MAGIC, MAX_COMPAT_BYTES, SUPER_MAGIC,
    DiskLayout, SlotStateError, StoreError, StoreIOError, check_record, create_file,
    encode_record)
from flash_dllm.cache.disk_format import open_file as _open_file  # noqa: F401 - bench/disk
from flash_dllm.cache.disk_format import round_up as _round_up
from flash_dllm.cache.latency import LATENCY_BUCKETS_S, LatencyHistogram  # noqa: F401

# Slot states. NOTE: the invariants every method keeps (under `self._lock`):
#   FREE    not handed out; in the free list exactly then.
#   EMPTY   allocated, holds nothing readable (new, or its last write failed).
#   WRITING a write is in flight: no read, no second write, no free.
#   VALID   the last write completed: readable with its key; `readers[s]` reads in flight block
#           write and free (valid -> reading is VALID with readers > 0).
# Only a completed write makes a slot VALID, so a failed or torn write is never visible.
FREE, EMPTY, WRITING, VALID = "free", "empty", "writing", "valid"
_COUNTERS = ("reads", "hits", "misses", "writes", "write_failures", "bytes_read",
             "bytes_written", "checksum_failures", "stale", "corrupt", "short_reads",
             "wrong_key", "compat_mismatch", "not_valid", "io_errors")


class DiskStore:
    """Fixed-size page records in one preallocated file at ``path`` (see the module docstring).

    ``compat``: 1..64 bytes identifying what the records mean (model, dtype, layout, page size,
    cache mode); ``io_threads``: workers of the async API; ``direct``: try O_DIRECT (``self.direct``
    says whether it is active).
    """

    verifies = True               # every read checks the record's checksum, key and compat

    def __init__(self, path: str | os.PathLike, capacity_bytes: int, record_bytes: int,
                 compat: bytes, io_threads: int = 2, direct: bool = True) -> None:
        self.layout = DiskLayout(record_bytes, capacity_bytes)
        if not isinstance(compat, (bytes, bytearray)) or not 1 <= len(compat) <= MAX_COMPAT_BYTES:
            raise ValueError(f"compat must be 1..{MAX_COMPAT_BYTES} bytes, got {compat!r:.80}")
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise ValueError(f"io_threads must be an integer >= 1, got {io_threads!r}")
        self.path = os.fspath(path)
        self.record_bytes = record_bytes
        self.num_slots = self.layout.num_slots
        self.compat = bytes(compat)
        self.nonce = os.urandom(16)
        self._fd, self.direct = create_file(self.path, direct, self.nonce, self.layout,
                                            self.compat)
        self._lock = threading.Lock()
        # NOTE: `_ops` counts reads/writes between their `_begin_*` and `_end_*` (sync or on the
        # pool); close() waits on `_idle` until it is 0, so no I/O ever runs on a closed (and
        # possibly reused) fd number.
        self._idle = threading.Condition(self._lock)
        self._ops = 0
        self._state = [FREE] * self.num_slots
        self._readers = [0] * self.num_slots
        self._key: list[bytes | None] = [None] * self.num_slots
        self._len = [0] * self.num_slots
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._read_lat, self._write_lat = LatencyHistogram(), LatencyHistogram()
        self._buffers: list[mmap.mmap] = []             # idle staging buffers (page aligned)
        self._pool_threads: set[int] = set()            # idents of the pool's workers
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="flash-dllm-disk",
                                        initializer=self._pool_thread_started)
        self._closed = False        # no new I/O may begin (set once, under the lock)
        self._shut = False          # the fd is closed (close() finished)

    def _pool_thread_started(self) -> None:
        self._pool_threads.add(threading.get_ident())

    # ------------------------------------------------------------------------------ fault seam
    def _pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        """Write ``buf`` at ``offset``; returns bytes written (may be short). Tests override."""
        return os.pwrite(fd, buf, offset)

    def _pread(self, fd: int, buf: memoryview, offset: int) -> int:
        """Read into ``buf`` from ``offset``; returns bytes read (0 at EOF). Tests override."""
        return os.preadv(fd, [buf], offset)

    # -------------------------------------------------------------------------- slot lifecycle
    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A free slot (EMPTY: holds nothing readable), or None when the store is full."""
        with self._lock:
            self._check_open()
            if not self._free:
                return None
            slot = self._free.pop()
            self._state[slot] = EMPTY
            return slot

    def free(self, slot: int) -> None:
        """Release ``slot``. Refused (SlotStateError) while a read or write of it is in flight:
        the caller waits for that future first, so I/O never races a reuse of the slot."""
        self._check_slot(slot)
        with self._lock:
            st = self._state[slot]
            if st == FREE:
                raise SlotStateError(f"double free of disk slot {slot}: it is not allocated")
            if st == WRITING or self._readers[slot]:
                raise SlotStateError(f"cannot free disk slot {slot}: I/O in flight ({st}, "
                                     f"{self._readers[slot]} reader(s))")
            self._state[slot], self._key[slot] = FREE, None
            self._free.append(slot)

    def state(self, slot: int) -> str:
        """``free`` / ``empty`` / ``writing`` / ``valid`` (for tests and debugging)."""
        self._check_slot(slot)
        return self._state[slot]

    # ---------------------------------------------------------------------------------- writes
    def write(self, slot: int, key: bytes, payload) -> None:
        """Store ``payload`` (<= record_bytes bytes: bytes-like, numpy, CPU tensor) under ``key``
        in allocated ``slot``, replacing what it held. Raises StoreIOError if the disk fails; the
        slot is then EMPTY (nothing readable) and can be written again or freed."""
        self._finish_write(slot, *self._begin_write(slot, key, payload))

    def write_async(self, slot: int, key: bytes, payload) -> Future:
        """``write`` on the I/O pool -> Future[None] (carrying StoreIOError on failure). The slot is
        unreadable from this call on until the future succeeds; ``payload`` must stay alive and
        unchanged until the future is done. State errors raise here, not in the future."""
        args = self._begin_write(slot, key, payload)
        return self._submit(self._finish_write, slot, *args, undo=lambda: self._end_write(
            slot, None, 0, args[-1], ok=False))

    def _begin_write(self, slot: int, key: bytes, payload):
        self._check_slot(slot)
        self._check_key(key)
        mv = byte_view(payload)
        if len(mv) > self.record_bytes:
            raise ValueError(f"payload must be at most record_bytes={self.record_bytes} B, "
                             f"got {len(mv)} B")
        with self._lock:
            self._check_open()
            st = self._state[slot]
            if st == FREE:
                raise SlotStateError(f"disk slot {slot} is not allocated")
            if st == WRITING or self._readers[slot]:
                raise SlotStateError(f"disk slot {slot} is busy ({st}, {self._readers[slot]} "
                                     f"reader(s))")
            self._state[slot], self._key[slot] = WRITING, None
            self._ops += 1
        return bytes(key), mv, time.perf_counter()

    def _finish_write(self, slot: int, key: bytes, payload: memoryview, t0: float) -> None:
        ok = False
        try:
            self._write_record(slot, key, payload)
            ok = True
        except OSError as e:
            with self._lock:
                self._counters["io_errors"] += 1
            raise StoreIOError(e.errno or errno.EIO, f"write of disk slot {slot} failed: "
                               f"{e.strerror or e}", self.path) from e
        finally:
            self._end_write(slot, key, len(payload), t0, ok)

    def _end_write(self, slot: int, key: bytes | None, n: int, t0: float, ok: bool) -> None:
        with self._lock:
            # NOTE: the single point where a slot becomes readable: after the complete record.
            self._state[slot] = VALID if ok else EMPTY
            self._key[slot], self._len[slot] = (key, n) if ok else (None, 0)
            c = self._counters
            c["writes" if ok else "write_failures"] += 1
            if ok:
                c["bytes_written"] += n
                self._write_lat.observe(time.perf_counter() - t0)
            self._op_done()

    def _write_record(self, slot: int, key: bytes, payload: memoryview) -> None:
        buf = self._take_buffer()
        try:
            io_len = encode_record(buf, self.nonce, self.compat, key, slot, payload)
            mv, off, done = memoryview(buf), self.layout.offset(slot), 0
            while done < io_len:
                k = self._pwrite(self._fd, mv[done:io_len], off + done)
                if k <= 0:
                    raise OSError(errno.EIO, f"short write: {done} of {io_len} B")
                done += k
        finally:
            self._buffers.append(buf)

    # ----------------------------------------------------------------------------------- reads
    def read(self, slot: int, key: bytes, out=None) -> memoryview | None:
        """The payload stored in ``slot`` under ``key``, or None (a miss: slot not VALID, another
        key, or a record that fails verification; never raises on corrupt data). ``out`` (a
        writable buffer / numpy array / CPU tensor of >= the payload's bytes, e.g. a pinned host
        slot) receives the payload and the result is a view of it; else a new buffer is returned."""
        begun = self._begin_read(slot, key, out)
        return None if begun is None else self._finish_read(slot, key, *begun)

    def read_async(self, slot: int, key: bytes, out=None) -> Future:
        """``read`` on the I/O pool -> Future[memoryview | None]. From this call until the future
        is done the slot cannot be written or freed; ``out`` must stay alive until then."""
        begun = self._begin_read(slot, key, out)
        if begun is None:
            fut: Future = Future()
            fut.set_result(None)
            return fut
        return self._submit(self._finish_read, slot, key, *begun,
                            undo=lambda: self._end_read(slot))

    def _begin_read(self, slot: int, key: bytes, out):
        self._check_slot(slot)
        self._check_key(key)
        out_mv = None if out is None else byte_view(out, writable=True)
        with self._lock:
            self._check_open()
            c = self._counters
            miss = ("not_valid" if self._state[slot] != VALID
                    else "wrong_key" if self._key[slot] != key else None)
            n = self._len[slot]
            if miss is None and out_mv is not None and len(out_mv) < n:
                # a caller error, not a read: raised before anything is counted
                raise ValueError(f"out must hold the record's {n} B, got {len(out_mv)} B")
            c["reads"] += 1
            if miss is not None:
                c[miss] += 1
                c["misses"] += 1
                return None
            self._readers[slot] += 1
            self._ops += 1
        return n, out_mv, time.perf_counter()

    def _finish_read(self, slot: int, key: bytes, n: int, out_mv, t0: float):
        try:
            result = self._read_record(slot, key, out_mv, n)
        finally:
            self._end_read(slot)
        with self._lock:
            c = self._counters
            c["hits" if result is not None else "misses"] += 1
            if result is not None:
                c["bytes_read"] += len(result)
                self._read_lat.observe(time.perf_counter() - t0)
        return result

    def _end_read(self, slot: int) -> None:
        with self._lock:
            self._readers[slot] -= 1
            self._op_done()

    def poll(self, wait=()) -> None:
        """Nothing to drive (the pool runs the I/O); returns once the futures of ``wait`` (of
        this store) are done, whatever their outcome."""
        for fut in wait:
            fut.exception()

    def _op_done(self) -> None:
        """An operation counted by ``_begin_*`` ended (called under ``_lock``)."""
        self._ops -= 1
        if self._ops == 0:
            self._idle.notify_all()

    def _read_record(self, slot: int, key: bytes, out_mv=None, n: int | None = None):
        """Read and verify the record in ``slot`` on disk, whatever the slot's state (the state
        checks are the callers'); -> payload view, or None with the reason counted."""
        io_len = self.layout.slot_bytes if n is None else _round_up(HEADER_BYTES + n)
        buf = self._take_buffer()
        try:
            mv = memoryview(buf)
            try:
                # NOTE: one call: a regular file reads short only at EOF (truncated under us),
                # and a retry at the unaligned remainder would fail under O_DIRECT anyway.
                got = self._pread(self._fd, mv[:io_len], self.layout.offset(slot))
            except OSError:
                return self._miss("io_errors")
            miss, rlen = check_record(buf, got, self.nonce, self.compat, key, slot,
                                      self.record_bytes, n)
            if miss is not None:
                return self._miss(miss)
            if out_mv is None:
                out_mv = memoryview(bytearray(rlen))
            elif len(out_mv) < rlen:
                return self._miss("corrupt")
            out_mv[:rlen] = mv[HEADER_BYTES:HEADER_BYTES + rlen]
            return out_mv[:rlen]
        finally:
            self._buffers.append(buf)

    def _miss(self, reason: str) -> None:
        with self._lock:
            self._counters[reason] += 1
        return None

    # ---------------------------------------------------------------------------------- helpers
    def _take_buffer(self) -> mmap.mmap:
        try:
            return self._buffers.pop()                         # list.pop/append are atomic
        except IndexError:
            return mmap.mmap(-1, self.layout.slot_bytes)       # page aligned, as O_DIRECT needs

    def _submit(self, fn, *args, undo) -> Future:
        try:
            return self._pool.submit(fn, *args)
        except RuntimeError:                                   # pool shut down: roll back state
            undo()
            raise StoreError(f"{self.path}: store is closed") from None

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be an integer in [0, {self.num_slots}), got {slot!r}")

    @staticmethod
    def _check_key(key: bytes) -> None:
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ValueError(f"key must be {KEY_BYTES} bytes, got {key!r:.60}")

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self.path}: store is closed")

    @property
    def stats(self) -> dict:
        """A snapshot: the counters (``_COUNTERS``), ``num_free``, and read/write latency
        histograms (``{"buckets": [(le, cumulative count)], "count", "sum", "p50", "p99"}``)."""
        with self._lock:
            s = dict(self._counters)
            s["num_free"] = len(self._free)
            s["read_latency_s"] = self._read_lat.snapshot()
            s["write_latency_s"] = self._write_lat.snapshot()
        return s

    def close(self) -> None:
        """Wait for in-flight I/O (synchronous calls on other threads and the async pool's), then
        close the file (its records die with the store). From the moment it is called, new reads,
        writes and allocs raise StoreError. Idempotent and thread-safe: a concurrent second
        close() waits for the first.
        Refused (StoreError) on one of the store's own I/O threads (e.g. in a future's done
        callback): it would wait for itself."""
        if threading.get_ident() in self._pool_threads:
            raise StoreError(f"{self.path}: close() called on one of the store's own I/O threads "
                             f"(e.g. from a future's done callback) would deadlock; close the "
                             f"store from another thread")
        with self._lock:
            if self._closed:                  # closing or closed: wait for the one closer
                self._idle.wait_for(lambda: self._shut)
                return
            self._closed = True               # no new I/O begins from here on
            self._idle.wait_for(lambda: self._ops == 0)
        try:
            self._pool.shutdown(wait=True)    # idle: every submitted op has ended
            self._pool_threads.clear()        # joined: their idents may be reused
            os.close(self._fd)                # also drops the flock
            for b in self._buffers:
                try:
                    b.close()
                except BufferError:  # a view is still alive (e.g. in a traceback): GC frees it
                    pass
            self._buffers.clear()
        finally:
            with self._lock:
                self._shut = True
                self._idle.notify_all()

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"DiskStore({self.path!r}, num_slots={self.num_slots}, slot_bytes="
                f"{self.layout.slot_bytes}, direct={self.direct}, free={self.num_free})")
