"""The disk tier's file format (no torch.cuda here): geometry, superblock, record encoding and
verification, and opening the file safely. ``cache/disk_store.py`` is the store around it.

File layout (one file at ``path``): a 4 KiB superblock (format, nonce, compat, geometry; only for
people with a hex dump, never trusted) then ``num_slots`` slots of ``slot_bytes`` = 256-byte header
+ ``record_bytes`` payload, rounded up to 4 KiB so that ``O_DIRECT`` works. The file is
preallocated with ``posix_fallocate`` (ftruncate where the file system cannot), so a full disk
shows at start-up, not mid-write (except on copy-on-write or thin-provisioned file systems, where
a write can still fail with ENOSPC: it then fails that write).

A record's header carries the caller's 16-byte ``key`` (a prefix-chain hash), the store's
``compat`` bytes (model, dtype, layout, page size, cache mode), the store's per-process ``nonce``,
its slot index and length; an xxh3 checksum covers the whole header and the payload. A record
that fails any check is a miss (``check_record`` names the reason), never data.

- **Stale files from an earlier process.** Every record carries a random 16-byte nonce drawn when
  the store is opened (so it is at least per process). A store opened on an existing file starts
  with every slot free and rejects any record it did not write itself (``stats["stale"]``): a
  restart treats the whole file as empty. Stale files are detected, never used, and need no
  cleanup; nothing is fsync'ed, because nothing is meant to survive the process. An advisory
  ``flock`` keeps two live stores off one file (the kernel drops it when a process dies).
- **Someone else's file overwritten.** A store opens only an empty (or new) file or a store file
  (first 8 bytes ``SUPER_MAGIC``, which the very first write puts there); any other non-empty
  file at ``path`` is refused before a byte of it is written.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
from dataclasses import dataclass

from flash_dllm.cache.checksum import xxh3_64

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
_ZEROS = bytes(ALIGN)            # header padding and the tail up to the next 4 KiB


class StoreError(Exception):
    """A store operation failed."""


class StoreIOError(StoreError, OSError):
    """The disk failed (``errno`` kept: ENOSPC, EIO, EFBIG, ...); the record was not stored."""


class SlotStateError(StoreError, ValueError):
    """The slot is in the wrong state for the call (not allocated, busy, double free)."""


def round_up(n: int, k: int = ALIGN) -> int:
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
        return round_up(HEADER_BYTES + self.record_bytes)

    @property
    def num_slots(self) -> int:
        return max(0, (self.capacity_bytes - ALIGN) // self.slot_bytes)

    @property
    def file_bytes(self) -> int:
        return ALIGN + self.num_slots * self.slot_bytes

    def offset(self, slot: int) -> int:
        return ALIGN + slot * self.slot_bytes


def refuse_foreign(path: str) -> None:
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


def open_file(path: str, direct: bool, lock: bool = False,
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
        refuse_foreign(path)                  # after the lock: no live store is writing it
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


def superblock(nonce: bytes, layout: DiskLayout, compat: bytes) -> mmap.mmap:
    """The 4 KiB superblock (page aligned for O_DIRECT); starts with ``SUPER_MAGIC``."""
    sb = mmap.mmap(-1, ALIGN)
    _SUPER.pack_into(sb, 0, SUPER_MAGIC, FORMAT_VERSION, nonce, layout.slot_bytes,
                     layout.num_slots, layout.record_bytes, len(compat), compat)
    return sb


def create_file(path: str, direct: bool, nonce: bytes, layout: DiskLayout,
                compat: bytes) -> tuple[int, bool]:
    """Open (create) the store file at ``path`` (its folder too) under an exclusive lock,
    preallocated for ``layout``, its superblock written. -> (fd, O_DIRECT active)."""
    sb = superblock(nonce, layout, compat)
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)       # as a user expects of --kv-disk-path
    except OSError as e:
        raise StoreError(f"cannot create the disk store's folder {parent}: {e}") from None
    try:
        fd, direct = open_file(path, direct, lock=True, first_block=sb)
        try:
            preallocate(fd, layout, sb, path)
        except BaseException:
            os.close(fd)
            raise
    finally:
        sb.close()
    return fd, direct


def preallocate(fd: int, layout: DiskLayout, sb: mmap.mmap, path: str) -> None:
    """Size the file to ``layout`` (allocated, where the file system can) and write ``sb``."""
    size = layout.file_bytes
    if os.fstat(fd).st_size > size:
        os.ftruncate(fd, size)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise StoreIOError(e.errno, f"cannot preallocate {size} B for capacity_bytes="
                               f"{layout.capacity_bytes}: {e.strerror}", path) from e
        os.ftruncate(fd, size)
    os.pwrite(fd, sb, 0)


def encode_record(buf, nonce: bytes, compat: bytes, key: bytes, slot: int, payload) -> int:
    """Lay out the record of ``payload`` under ``key`` for ``slot`` in ``buf`` (header, payload,
    zeros up to the next 4 KiB, checksum); returns the bytes to write."""
    n = len(payload)
    io_len = round_up(HEADER_BYTES + n)
    mv = memoryview(buf)
    _HEADER.pack_into(buf, 0, MAGIC, FORMAT_VERSION, len(compat), 0, nonce, key, slot, n, compat)
    mv[_CHECKSUM_AT:HEADER_BYTES] = memoryview(_ZEROS)[:HEADER_BYTES - _CHECKSUM_AT]
    mv[HEADER_BYTES:HEADER_BYTES + n] = payload
    mv[HEADER_BYTES + n:io_len] = memoryview(_ZEROS)[:io_len - HEADER_BYTES - n]
    _CHECKSUM.pack_into(buf, _CHECKSUM_AT, xxh3_64(mv[:HEADER_BYTES + n]))
    return io_len


def check_record(buf, got: int, nonce: bytes, compat: bytes, key: bytes, slot: int,
                 record_bytes: int, n: int | None = None) -> tuple[str | None, int]:
    """Verify the record read into ``buf`` (``got`` bytes): ``(None, payload bytes)`` when it is
    this store's record of ``key`` for ``slot`` (of ``n`` bytes when given), else ``(reason,
    0)`` with the store's counter of the miss. Clears the checksum field of ``buf``."""
    if got < HEADER_BYTES:
        return "short_reads", 0
    (magic, version, clen, _, rnonce, rkey, rslot, rlen, rcompat) = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC or version != FORMAT_VERSION:
        return "corrupt", 0
    if rnonce != nonce:
        return "stale", 0                                  # an earlier process's record
    if rlen > record_bytes or clen > MAX_COMPAT_BYTES or (n is not None and rlen != n):
        return "checksum_failures", 0                      # our record, corrupted lengths
    if got < HEADER_BYTES + rlen:
        return "short_reads", 0
    (stored,) = _CHECKSUM.unpack_from(buf, _CHECKSUM_AT)
    _CHECKSUM.pack_into(buf, _CHECKSUM_AT, 0)              # as it was hashed
    if stored != xxh3_64(memoryview(buf)[:HEADER_BYTES + rlen]):
        return "checksum_failures", 0
    if rcompat[:clen] != compat:
        return "compat_mismatch", 0
    if rkey != key:
        return "wrong_key", 0
    if rslot != slot:
        return "corrupt", 0                                # a misdirected write
    return None, rlen
