"""Disk-tier rates for ``flash-dllm bench memory``: page records written and read through
``DiskStore`` against a plain sequential write and read of the same file, in the same run (the
target is >= 70 % of the sequential rates)."""
from __future__ import annotations

import errno
import mmap
import os
import time
from collections import deque
from concurrent.futures import Future

from flash_dllm.cache.checksum import xxh3_64
from flash_dllm.cache.disk_store import (ALIGN, HEADER_BYTES, KEY_BYTES, DiskLayout, DiskStore,
                                         _open_file,
                                         _round_up)


def _drop_cache(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    """Write all of ``mv`` at ``offset``: a regular file may take fewer bytes than asked."""
    done = 0
    while done < len(mv):
        k = os.pwrite(fd, mv[done:], offset + done)
        if k <= 0:
            raise OSError(errno.EIO, f"short write: {done} of {len(mv)} B at offset {offset}")
        done += k


def _pread_all(fd: int, mv: memoryview, offset: int) -> None:
    """Fill ``mv`` from ``offset`` (a short read before the end of the file is retried)."""
    done = 0
    while done < len(mv):
        k = os.preadv(fd, [mv[done:]], offset + done)
        if k <= 0:
            raise OSError(errno.EIO, f"short read: {done} of {len(mv)} B at offset {offset}")
        done += k


def sequential_rate(path: str | os.PathLike, nbytes: int, direct: bool = True,
                    block_bytes: int = 4 << 20) -> dict:
    """Plain sequential write (+ fsync) then read (cache dropped) of ``nbytes`` at ``path``, with
    the store's open flags: the ceiling that ``bench_disk`` compares page-record I/O against.
    Creates ``path`` and removes it afterwards (a non-empty file there that is not a store file
    is refused, StoreError, as ``DiskStore`` refuses it)."""
    nbytes, block_bytes = _round_up(nbytes), _round_up(block_bytes)
    fd, is_direct = _open_file(os.fspath(path), direct)
    buf = mmap.mmap(-1, block_bytes)
    buf.write(os.urandom(block_bytes))
    mv = memoryview(buf)
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, block_bytes):
            _pwrite_all(fd, mv[:min(block_bytes, nbytes - off)], off)
        _drop_cache(fd)
        t_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        for off in range(0, nbytes, block_bytes):
            _pread_all(fd, mv[:min(block_bytes, nbytes - off)], off)
        t_read = time.perf_counter() - t0
    finally:
        mv.release()
        try:
            buf.close()
        except BufferError:          # a slice is still alive in a traceback: GC frees it
            pass
        os.close(fd)
        os.unlink(path)
    return {"bytes": nbytes, "direct": is_direct, "write_bytes_per_s": nbytes / t_write,
            "read_bytes_per_s": nbytes / t_read}


def bench_disk(path: str | os.PathLike, record_bytes: int, nbytes: int = 256 << 20,
               in_flight: int = 8, io_threads: int = 4, direct: bool = True) -> dict:
    """Write then read ``nbytes`` of page records through a DiskStore at ``path`` (async, up to
    ``in_flight`` outstanding; cache dropped in between; every read verified), then a plain
    sequential write/read of the same file size. Rates count payload bytes; ratios are store /
    sequential (the target is >= 0.7); ``verified`` counts the reads that returned the payload
    (a miss counts as not verified). Removes ``path`` afterwards."""
    layout = DiskLayout(record_bytes, ALIGN + _round_up(HEADER_BYTES + record_bytes))
    n = max(1, nbytes // layout.slot_bytes)
    store = DiskStore(path, ALIGN + n * layout.slot_bytes, record_bytes, b"bench",
                      io_threads=io_threads, direct=direct)
    payload = os.urandom(record_bytes)
    want = xxh3_64(payload)        # NOTE: not `view == payload`: memoryview compares per item
    keys = [i.to_bytes(KEY_BYTES, "little") for i in range(n)]
    try:
        slots = [store.alloc() for _ in range(n)]
        t0 = time.perf_counter()
        pending: deque[Future] = deque()
        for s, k in zip(slots, keys):
            if len(pending) >= in_flight:
                pending.popleft().result()
            pending.append(store.write_async(s, k, payload))
        while pending:
            pending.popleft().result()
        _drop_cache(store._fd)
        t_write = time.perf_counter() - t0
        outs = [bytearray(record_bytes) for _ in range(in_flight + 1)]

        def verified(got) -> bool:    # a miss (None) is a read that did not verify
            return got is not None and xxh3_64(got) == want

        hits, t0 = 0, time.perf_counter()
        for i, (s, k) in enumerate(zip(slots, keys)):
            if len(pending) >= in_flight:
                hits += verified(pending.popleft().result())
            pending.append(store.read_async(s, k, out=outs[i % len(outs)]))
        while pending:
            hits += verified(pending.popleft().result())
        t_read = time.perf_counter() - t0
        stats, is_direct = store.stats, store.direct
    finally:
        store.close()
    seq = sequential_rate(path, n * layout.slot_bytes, direct=direct)
    total = n * record_bytes
    w, r = total / t_write, total / t_read
    return {"records": n, "record_bytes": record_bytes, "slot_bytes": layout.slot_bytes,
            "direct": is_direct, "in_flight": in_flight, "io_threads": io_threads,
            "verified": hits, "write_bytes_per_s": w, "read_bytes_per_s": r,
            "seq_write_bytes_per_s": seq["write_bytes_per_s"],
            "seq_read_bytes_per_s": seq["read_bytes_per_s"],
            "write_ratio": w / seq["write_bytes_per_s"], "read_ratio": r / seq["read_bytes_per_s"],
            "read_latency_s": stats["read_latency_s"], "write_latency_s": stats["write_latency_s"]}
