"""Disk tier (L2) storage: page records in fixed-size slots of one preallocated file, verified on
every read (no torch.cuda here).

What other engines' disk caches got wrong, and what makes each impossible here:

- **Another request's KV served from disk.** Every record carries the caller's 16-byte ``key`` (a
  prefix-chain hash), the store's ``compat`` bytes (model, dtype, layout, page size, cache mode),
  its slot index and length, and an xxh3 checksum over all of them plus the payload. A read names
  the key it expects; any mismatch is a miss, never data.
- **A failed store visible to lookups / reads racing writes.** Publish-after-write: a slot becomes
  readable only after its whole record was written, and a slot with I/O in flight can be neither
  read (while written), written again, nor freed (see "Slot states" below).
- **Stale files from an earlier process.** Every record carries a random 16-byte nonce drawn when
  the store is opened (so it is at least per process). A store opened on an existing file starts
  with every slot free and rejects any record it did not write itself (``stats["stale"]``): a
  restart treats the whole file as empty. Stale files are detected, never used, and need no
  cleanup; nothing is fsync'ed, because nothing is meant to survive the process. An advisory
  ``flock`` keeps two live stores off one file (the kernel drops it when a process dies).
- **Someone else's file overwritten.** A store opens only an empty (or new) file or a store file
  (first 8 bytes ``SUPER_MAGIC``, which the very first write puts there); any other non-empty
  file at ``path`` is refused before a byte of it is written.
- **I/O on a closed descriptor.** ``close()`` waits until no read or write is between its begin
  and its end (synchronous calls on other threads included), so a late ``pwrite`` can never land
  in whatever file reused the descriptor number.

File layout (one file at ``path``): a 4 KiB superblock (format, nonce, compat, geometry; only for
people with a hex dump, never trusted) then ``num_slots`` slots of ``slot_bytes`` = 256-byte header
+ ``record_bytes`` payload, rounded up to 4 KiB so that ``O_DIRECT`` works. The file is
preallocated with ``posix_fallocate`` (ftruncate where the file system cannot), so a full disk
shows at start-up, not mid-write (except on copy-on-write or thin-provisioned file systems, where
a write can still fail with ENOSPC: it then fails that write, see below).

I/O goes through page-aligned ``mmap`` staging buffers (one memcpy each way: a record's header
precedes its payload, so a read cannot land directly in the caller's buffer) and through
``_pwrite``/``_pread``, the fault-injection seam the tests override. ``O_DIRECT`` (when ``direct``
and the file system accepts an aligned probe write) keeps page records out of the page cache, which
would otherwise double-buffer what the host tier already holds.

NOTE (size): one class over ~500 lines on purpose: the slot state machine, the I/O and the
verification of a record are what has to be read together to trust that nothing wrong is served.
The benchmark helpers live in ``bench/disk.py``.
"""
from __future__ import annotations

import bisect
import errno
import fcntl
import mmap
import os
import struct
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from flash_dllm.cache.checksum import byte_view, xxh3_64

ALIGN = 4096                      # O_DIRECT alignment (offsets, lengths, buffers) and slot rounding
HEADER_BYTES = 256
KEY_BYTES = 16
MAX_COMPAT_BYTES = 64
MAGIC = b"FDLLM-KV"
SUPER_MAGIC = b"FDLLM-SB"        # the file's first 8 bytes: how a store recognises its own file
FORMAT_VERSION = 1
# magic | version | compat_len | reserved | nonce | key | slot | payload_len | compat, then the
# checksum: xxh3 of the whole 256-byte header (checksum field zeroed) and the payload, so every
# header bit counts, padding included.
_HEADER = struct.Struct("<8sIHH16s16sQQ64s")
_CHECKSUM = struct.Struct("<Q")
_CHECKSUM_AT = _HEADER.size
_SUPER = struct.Struct("<8sI16sQQQH64s")
assert _CHECKSUM_AT + _CHECKSUM.size <= HEADER_BYTES

# Prometheus-style latency buckets (seconds): NVMe page reads are ~50 us - 5 ms.
LATENCY_BUCKETS_S = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
                     50e-3, 100e-3, 250e-3, 1.0, 2.5)

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


class StoreError(Exception):
    """A store operation failed."""


class StoreIOError(StoreError, OSError):
    """The disk failed (``errno`` kept: ENOSPC, EIO, EFBIG, ...); the record was not stored."""


class SlotStateError(StoreError, ValueError):
    """The slot is in the wrong state for the call (not allocated, busy, double free)."""


def _round_up(n: int, k: int = ALIGN) -> int:
    return -(-n // k) * k


@dataclass(frozen=True)
class DiskLayout:
    """Geometry of the store's file: slots of ``slot_bytes`` after a 4 KiB superblock."""
    record_bytes: int
    capacity_bytes: int

    def __post_init__(self) -> None:
        for name in ("record_bytes", "capacity_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DiskLayout.{name} must be an integer >= 1, got {v!r}")
        if self.num_slots < 1:
            raise ValueError(f"DiskLayout.capacity_bytes must be >= {ALIGN + self.slot_bytes} "
                             f"(superblock + one slot of {self.slot_bytes} B), "
                             f"got {self.capacity_bytes}")

    @property
    def slot_bytes(self) -> int:
        return _round_up(HEADER_BYTES + self.record_bytes)

    @property
    def num_slots(self) -> int:
        return max(0, (self.capacity_bytes - ALIGN) // self.slot_bytes)

    @property
    def file_bytes(self) -> int:
        return ALIGN + self.num_slots * self.slot_bytes

    def offset(self, slot: int) -> int:
        return ALIGN + slot * self.slot_bytes


class LatencyHistogram:
    """Counts per Prometheus bucket (``le`` edges) plus the most recent samples for quantiles."""

    def __init__(self, edges: tuple[float, ...] = LATENCY_BUCKETS_S, keep: int = 4096) -> None:
        self.edges = tuple(edges)
        self.counts = [0] * (len(self.edges) + 1)          # last bucket: +Inf
        self.count = 0
        self.sum = 0.0
        self.samples: deque[float] = deque(maxlen=keep)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.edges, seconds)] += 1
        self.count += 1
        self.sum += seconds
        self.samples.append(seconds)

    def quantile(self, q: float) -> float | None:
        if not self.samples:
            return None
        s = sorted(self.samples)
        return s[min(len(s) - 1, int(q * len(s)))]

    def snapshot(self) -> dict:
        cum, buckets = 0, []
        for le, c in zip(self.edges + (float("inf"),), self.counts):
            cum += c
            buckets.append((le, cum))
        return {"buckets": buckets, "count": self.count, "sum": self.sum,
                "p50": self.quantile(0.5), "p99": self.quantile(0.99)}


def _refuse_foreign(path: str) -> None:
    """Raise StoreError if ``path`` holds a non-empty file that is not a store file (its first 8
    bytes are not ``SUPER_MAGIC``): opening it would overwrite someone else's data. An empty file
    and a store file (even one a killed process left) are fine."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(SUPER_MAGIC))
    except FileNotFoundError:
        return
    if head and head != SUPER_MAGIC:
        raise StoreError(f"{path} is not a flash-dllm disk store file (it is not empty and does "
                         f"not start with the store's superblock magic {SUPER_MAGIC!r}); refusing "
                         f"to overwrite it: pick another path or delete the file")


def _open_file(path: str, direct: bool, lock: bool = False,
               first_block: mmap.mmap | None = None) -> tuple[int, bool]:
    """Open (create) ``path`` read-write; with O_DIRECT when ``direct`` and the file system takes
    it: open and an aligned probe write at offset 0 must both succeed. ``lock``: take an exclusive
    ``flock`` first (StoreError if another store holds it). A non-empty file that is not a store
    file is refused (StoreError) before anything is written. ``first_block``: the ALIGN bytes the
    probe writes at offset 0 (default zeros; the store passes its superblock, so its file starts
    with ``SUPER_MAGIC`` from the first write on). -> (fd, direct_active)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
    use_direct = direct and hasattr(os, "O_DIRECT")
    try:
        fd = os.open(path, flags | (os.O_DIRECT if use_direct else 0), 0o600)
    except OSError as e:
        if not use_direct or e.errno != errno.EINVAL:    # tmpfs refuses O_DIRECT at open
            raise
        fd, use_direct = os.open(path, flags, 0o600), False
    try:
        if lock:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StoreError(f"{path} is in use by another DiskStore") from None
        _refuse_foreign(path)                  # after the lock: no live store is writing it
        if use_direct:
            probe = first_block if first_block is not None else mmap.mmap(-1, ALIGN)
            try:
                os.pwrite(fd, probe, 0)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                use_direct = False
            finally:
                if probe is not first_block:
                    probe.close()
    except BaseException:
        os.close(fd)
        raise
    return fd, use_direct


class DiskStore:
    """Fixed-size page records in one preallocated file at ``path`` (see the module docstring).

    ``compat``: 1..64 bytes identifying what the records mean (model, dtype, layout, page size,
    cache mode); ``io_threads``: workers of the async API; ``direct``: try O_DIRECT (``self.direct``
    says whether it is active).
    """

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
        sb = self._superblock()
        parent = os.path.dirname(os.path.abspath(self.path))
        try:
            os.makedirs(parent, exist_ok=True)       # as a user expects of --kv-disk-path
        except OSError as e:
            raise StoreError(f"cannot create the disk store's folder {parent}: {e}") from None
        try:
            self._fd, self.direct = _open_file(self.path, direct, lock=True, first_block=sb)
            try:
                self._preallocate(sb)
            except BaseException:
                os.close(self._fd)
                raise
        finally:
            sb.close()
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
        self._zeros = bytes(ALIGN)      # header padding and the tail up to the next 4 KiB
        self._pool_threads: set[int] = set()            # idents of the pool's workers
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="flash-dllm-disk",
                                        initializer=self._pool_thread_started)
        self._closed = False        # no new I/O may begin (set once, under the lock)
        self._shut = False          # the fd is closed (close() finished)

    def _pool_thread_started(self) -> None:
        self._pool_threads.add(threading.get_ident())

    def _superblock(self) -> mmap.mmap:
        """The 4 KiB superblock (page aligned for O_DIRECT); starts with ``SUPER_MAGIC``."""
        sb = mmap.mmap(-1, ALIGN)
        _SUPER.pack_into(sb, 0, SUPER_MAGIC, FORMAT_VERSION, self.nonce, self.layout.slot_bytes,
                         self.num_slots, self.record_bytes, len(self.compat), self.compat)
        return sb

    def _preallocate(self, sb: mmap.mmap) -> None:
        size = self.layout.file_bytes
        if os.fstat(self._fd).st_size > size:
            os.ftruncate(self._fd, size)
        try:
            os.posix_fallocate(self._fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise StoreIOError(e.errno, f"cannot preallocate {size} B for capacity_bytes="
                                   f"{self.layout.capacity_bytes}: {e.strerror}", self.path) from e
            os.ftruncate(self._fd, size)
        os.pwrite(self._fd, sb, 0)

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
        n = len(payload)
        io_len = _round_up(HEADER_BYTES + n)
        buf = self._take_buffer()
        try:
            mv = memoryview(buf)
            _HEADER.pack_into(buf, 0, MAGIC, FORMAT_VERSION, len(self.compat), 0, self.nonce,
                              key, slot, n, self.compat)
            mv[_CHECKSUM_AT:HEADER_BYTES] = memoryview(self._zeros)[:HEADER_BYTES - _CHECKSUM_AT]
            mv[HEADER_BYTES:HEADER_BYTES + n] = payload
            mv[HEADER_BYTES + n:io_len] = memoryview(self._zeros)[:io_len - HEADER_BYTES - n]
            _CHECKSUM.pack_into(buf, _CHECKSUM_AT, xxh3_64(mv[:HEADER_BYTES + n]))
            off, done = self.layout.offset(slot), 0
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
            if got < HEADER_BYTES:
                return self._miss("short_reads")
            (magic, version, clen, _, nonce, rkey, rslot, rlen,
             rcompat) = _HEADER.unpack_from(buf, 0)
            if magic != MAGIC or version != FORMAT_VERSION:
                return self._miss("corrupt")
            if nonce != self.nonce:
                return self._miss("stale")                     # an earlier process's record
            if (rlen > self.record_bytes or clen > MAX_COMPAT_BYTES
                    or (n is not None and rlen != n)):
                return self._miss("checksum_failures")         # our record, corrupted lengths
            if got < HEADER_BYTES + rlen:
                return self._miss("short_reads")
            (stored,) = _CHECKSUM.unpack_from(buf, _CHECKSUM_AT)
            _CHECKSUM.pack_into(buf, _CHECKSUM_AT, 0)          # as it was hashed
            if stored != xxh3_64(mv[:HEADER_BYTES + rlen]):
                return self._miss("checksum_failures")
            if rcompat[:clen] != self.compat:
                return self._miss("compat_mismatch")
            if rkey != key:
                return self._miss("wrong_key")
            if rslot != slot:
                return self._miss("corrupt")                   # a misdirected write
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


# ------------------------------------------------------------------------------------ benchmark
