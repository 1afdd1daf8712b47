"""Disk-tier rates for ``flash-dllm bench memory``: page records written and read through
``DiskStore`` against a plain sequential write and read of the same file, in the same run (the
target is >= 70 % of the sequential rates)."""
from __future__ import annotations

import errno
import mmap
import os
import statistics
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
               in_flight: int = 8, io_threads: int = 4, direct: bool = True,
               reps: int = 5) -> dict:
    """Write then read ``nbytes`` of page records through a DiskStore at ``path`` (async, up to
    ``in_flight`` outstanding; cache dropped in between; every read verified), then a plain
    sequential write/read of the same file size; ``reps`` such pairs, alternating, so that both
    see the same drift of the disk (a cloud volume's rate moved by 20 % between single runs).
    Rates count payload bytes and are medians over the reps; ratios are the medians of each
    pair's store / sequential (the target is >= 0.7); ``verified`` is the fewest reads of a
    rep that returned the payload (a miss in any rep counts as not verified); the latency
    histograms are the last rep's. Removes ``path`` afterwards."""
    layout = DiskLayout(record_bytes, ALIGN + _round_up(HEADER_BYTES + record_bytes))
    n = max(1, nbytes // layout.slot_bytes)
    payload = os.urandom(record_bytes)
    want = xxh3_64(payload)        # NOTE: not `view == payload`: memoryview compares per item
    keys = [i.to_bytes(KEY_BYTES, "little") for i in range(n)]
    total = n * record_bytes
    runs, verified = [], n
    for _ in range(max(1, reps)):
        store = DiskStore(path, ALIGN + n * layout.slot_bytes, record_bytes, b"bench",
                          io_threads=io_threads, direct=direct)
        try:
            t_write, t_read, hits = _store_pass(store, keys, payload, want, in_flight)
            verified = min(verified, hits)
            stats, is_direct = store.stats, store.direct
        finally:
            store.close()
        seq = sequential_rate(path, n * layout.slot_bytes, direct=direct)
        runs.append({"write": total / t_write, "read": total / t_read,
                     "seq_write": seq["write_bytes_per_s"], "seq_read": seq["read_bytes_per_s"]})

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)
    write_ratios = [r["write"] / r["seq_write"] for r in runs]
    read_ratios = [r["read"] / r["seq_read"] for r in runs]
    return {"records": n, "record_bytes": record_bytes, "slot_bytes": layout.slot_bytes,
            "direct": is_direct, "in_flight": in_flight, "io_threads": io_threads,
            "reps": len(runs), "verified": verified, "write_bytes_per_s": med("write"),
            "read_bytes_per_s": med("read"), "seq_write_bytes_per_s": med("seq_write"),
            "seq_read_bytes_per_s": med("seq_read"),
            "write_ratio": statistics.median(write_ratios),
            "read_ratio": statistics.median(read_ratios),
            "write_ratios": write_ratios, "read_ratios": read_ratios,
            "read_latency_s": stats["read_latency_s"], "write_latency_s": stats["write_latency_s"]}


def _store_pass(store: DiskStore, keys: list[bytes], payload: bytes, want: int,
                in_flight: int) -> tuple[float, float, int]:
    """One write of every record then one read of each (verified): (write s, read s, hits)."""
    n = len(keys)
    record_bytes = len(payload)
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
    return t_write, time.perf_counter() - t0, hits
