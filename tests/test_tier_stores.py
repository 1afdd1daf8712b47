"""Host (L1) and disk (L2) page-record stores: bytes in == bytes out, and every way a disk cache
goes wrong (truncation, bit rot, full disk, slow disk, a killed writer, wrong key or compat, races)
is a miss or a failed write, never wrong data. Real files in tmp_path; fakes only inject faults."""
from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import json
import os
import random
import select
import shutil
import signal
import tempfile
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flash_dllm.cache.disk_store import (ALIGN, FREE, HEADER_BYTES, SUPER_MAGIC, VALID, WRITING,
                                         DiskLayout, DiskStore, SlotStateError, StoreError,
                                         StoreIOError)
from flash_dllm.bench.disk import bench_disk, sequential_rate
from flash_dllm.cache.host_store import HostStore

RB = 5000                                   # not a multiple of 4096: slots round up to 8192
COMPAT = b"llada-8b|bf16|pages16|dual"


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload_for(k: bytes, n: int = RB) -> bytes:
    """Deterministic payload of a key: any successful read under k must return exactly this."""
    return np.random.default_rng(list(k)).bytes(n)


def capacity(slots: int, rb: int = RB) -> int:
    return ALIGN + slots * DiskLayout(rb, 1 << 40).slot_bytes


@pytest.fixture
def make_store(tmp_path):
    stores = []

    def make(slots: int = 8, cls=DiskStore, name: str = "kv.bin", rb: int = RB, **kw):
        s = cls(tmp_path / name, capacity(slots, rb), rb, kw.pop("compat", COMPAT), **kw)
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()


class FaultyStore(DiskStore):
    """Fault-injection seam: ``fail`` (an errno) fails every write, ``short`` makes writes
    write at most that many bytes, ``gate`` (an Event) holds I/O until set."""

    fail: int | None = None
    short: int | None = None
    gate: threading.Event | None = None
    read_gate: threading.Event | None = None

    def _pwrite(self, fd, buf, offset):
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.fail is not None:
            raise OSError(self.fail, os.strerror(self.fail))
        if self.short is not None:
            buf = buf[:self.short]
            if not len(buf):
                return 0
        return super()._pwrite(fd, buf, offset)

    def _pread(self, fd, buf, offset):
        if self.read_gate is not None:
            assert self.read_gate.wait(10)
        return super()._pread(fd, buf, offset)


def flip_bit(path, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))


# ------------------------------------------------------------------------------------ HostStore
def test_host_store_slots_and_views():
    hs = HostStore(3, 100)
    assert hs.nbytes == 300 and hs.num_free == 3 and hs.buffer.shape == (3, 100)
    assert hs.pinned == torch.cuda.is_available()
    slots = [hs.alloc() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and hs.alloc() is None
    hs.view(slots[1])[:] = 7
    assert int(hs.buffer[slots[1]].sum()) == 700 and hs.view(slots[1]).dtype == torch.uint8
    hs.free(slots[1])
    with pytest.raises(ValueError, match=f"double free of host slot {slots[1]}"):
        hs.free(slots[1])
    with pytest.raises(ValueError, match="not allocated"):
        hs.view(slots[1])
    with pytest.raises(ValueError, match=r"slot must be an integer in \[0, 3\)"):
        hs.free(3)
    assert hs.alloc() == slots[1] and hs.num_free == 0
    with pytest.raises(ValueError, match="record_bytes"):
        HostStore(2, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only build")
def test_host_store_never_pins_without_cuda():
    assert not HostStore(1, 8, pin=None).pinned
    with pytest.raises(ValueError, match="pin=True needs CUDA"):
        HostStore(1, 8, pin=True)


# ---------------------------------------------------------------------------- DiskStore basics
@pytest.mark.parametrize("direct", [True, False])
def test_round_trip_many_records(make_store, direct):
    store = make_store(slots=24, direct=direct)
    if not direct:
        assert store.direct is False
    rng = random.Random(0)
    written = {}
    for i in range(24):
        s = store.alloc()
        n = [0, 1, RB, rng.randrange(RB)][i % 4]
        store.write(s, key(i), payload_for(key(i), n))
        written[s] = (key(i), payload_for(key(i), n))
    assert store.alloc() is None and store.num_free == 0
    for s, (k, p) in written.items():
        assert bytes(store.read(s, k)) == p
    # reads straight into caller buffers: bytearray, numpy, (pinnable) CPU tensor
    s, (k, p) = next((s, v) for s, v in written.items() if len(v[1]) == RB)
    out_t = torch.zeros(RB + 3, dtype=torch.uint8)
    view = store.read(s, k, out=out_t)
    assert len(view) == RB and bytes(out_t[:RB].numpy()) == p
    out_np = np.zeros(RB, np.uint8)
    store.read(s, k, out=out_np)
    assert out_np.tobytes() == p
    with pytest.raises(ValueError, match="out must hold"):
        store.read(s, k, out=bytearray(RB - 1))
    # async API
    fw = [store.write_async(s, k, p) for s, (k, p) in written.items()]
    assert all(f.result(10) is None for f in fw)
    fr = {s: store.read_async(s, k) for s, (k, p) in written.items()}
    assert all(bytes(fr[s].result(10)) == written[s][1] for s in written)
    stats = store.stats
    assert stats["checksum_failures"] == stats["stale"] == stats["corrupt"] == 0
    assert stats["bytes_written"] == 2 * sum(len(p) for _, p in written.values())
    assert stats["read_latency_s"]["count"] == stats["hits"] > 0
    cum = [c for _, c in stats["write_latency_s"]["buckets"]]
    assert cum == sorted(cum) and cum[-1] == stats["writes"]


def test_payload_kinds_and_overwrite(make_store):
    store = make_store(slots=2)
    s = store.alloc()
    t = torch.randn(RB // 4)                               # a float tensor: its bytes are stored
    store.write(s, key(1), t)
    assert bytes(store.read(s, key(1))) == t.numpy().tobytes()
    store.write(s, key(2), np.arange(10, dtype=np.int64))
    assert store.read(s, key(1)) is None                   # one valid record per slot
    assert bytes(store.read(s, key(2))) == np.arange(10, dtype=np.int64).tobytes()
    with pytest.raises(ValueError, match="record_bytes=5000"):
        store.write(s, key(3), bytes(RB + 1))
    with pytest.raises(ValueError, match="key must be 16 bytes"):
        store.write(s, b"short", b"x")
    with pytest.raises(SlotStateError, match="not allocated"):
        store.write(1 - s, key(3), b"x")


def test_o_direct_refused_falls_back_to_buffered(tmp_path, monkeypatch):
    real, calls = os.pwrite, []

    def probe_refused(fd, buf, offset):                    # the first write is the probe
        if not calls:
            calls.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buf, offset)

    monkeypatch.setattr(os, "pwrite", probe_refused)
    store = DiskStore(tmp_path / "kv.bin", capacity(2), RB, COMPAT, direct=True)
    try:
        assert calls == [0] and store.direct is False
        assert not fcntl.fcntl(store._fd, fcntl.F_GETFL) & os.O_DIRECT
        s = store.alloc()
        store.write(s, key(1), payload_for(key(1)))
        assert bytes(store.read(s, key(1))) == payload_for(key(1))
    finally:
        store.close()


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="capacity_bytes must be >= 12288"):
        DiskStore(tmp_path / "a", 8192, RB, COMPAT)
    with pytest.raises(ValueError, match="record_bytes"):
        DiskStore(tmp_path / "a", 1 << 20, 0, COMPAT)
    with pytest.raises(ValueError, match="compat must be 1..64 bytes"):
        DiskStore(tmp_path / "a", 1 << 20, RB, b"x" * 65)
    with pytest.raises(ValueError, match="io_threads"):
        DiskStore(tmp_path / "a", 1 << 20, RB, COMPAT, io_threads=0)


def test_one_live_store_per_file(make_store, tmp_path):
    store = make_store()
    with pytest.raises(StoreError, match="in use by another DiskStore"):
        DiskStore(tmp_path / "kv.bin", capacity(8), RB, COMPAT)
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.alloc()
    with pytest.raises(StoreError, match="closed"):
        store.read(0, key(0))
    DiskStore(tmp_path / "kv.bin", capacity(8), RB, COMPAT).close()


@pytest.mark.parametrize("direct", [True, False])
def test_refuses_to_overwrite_a_file_that_is_not_a_store(tmp_path, direct):
    precious = tmp_path / "notes.txt"
    data = b"someone else's data\n" * 1000
    precious.write_bytes(data)
    with pytest.raises(StoreError, match=r"notes.txt is not a flash-dllm disk store file .*"
                                         r"pick another path or delete the file"):
        DiskStore(precious, capacity(2), RB, COMPAT, direct=direct)
    assert precious.read_bytes() == data                   # not a byte written or truncated
    tiny = tmp_path / "tiny"
    tiny.write_bytes(b"FDLLM")                             # shorter than the magic
    with pytest.raises(StoreError, match="not a flash-dllm disk store file"):
        DiskStore(tiny, capacity(2), RB, COMPAT, direct=direct)
    assert tiny.read_bytes() == b"FDLLM"
    with pytest.raises(StoreError, match="not a flash-dllm disk store file"):
        sequential_rate(precious, 1 << 16, direct=direct)  # the benchmark refuses it too
    assert precious.read_bytes() == data
    empty = tmp_path / "empty.bin"                         # an empty file is fine ...
    empty.touch()
    store = DiskStore(empty, capacity(2), RB, COMPAT, direct=direct)
    s = store.alloc()
    store.write(s, key(1), payload_for(key(1)))
    store.close()
    assert empty.read_bytes()[:8] == SUPER_MAGIC
    store = DiskStore(empty, capacity(3), RB, COMPAT, direct=direct)   # ... and so is a store's
    try:
        assert store.num_slots == 3 and store._read_record(s, key(1)) is None
        assert store.stats["stale"] == 1                   # the earlier record: never served
    finally:
        store.close()


def test_read_into_too_small_out_raises_and_counts_nothing(make_store):
    store = make_store(slots=2)
    s = store.alloc()
    store.write(s, key(1), payload_for(key(1)))
    with pytest.raises(ValueError, match=f"out must hold the record's {RB} B"):
        store.read(s, key(1), out=bytearray(RB - 1))
    with pytest.raises(ValueError, match="out must hold"):
        store.read_async(s, key(1), out=bytearray(10))
    stats = store.stats
    assert stats["reads"] == stats["hits"] == stats["misses"] == 0
    assert store.state(s) == VALID and store._readers[s] == 0
    out = bytearray(RB)
    assert bytes(store.read(s, key(1), out=out)) == payload_for(key(1)) == bytes(out)
    assert store.stats["reads"] == store.stats["hits"] == 1


def test_free_and_double_free(make_store):
    store = make_store(slots=2)
    s = store.alloc()
    store.free(s)
    with pytest.raises(ValueError, match=f"double free of disk slot {s}"):
        store.free(s)
    assert store.read(s, key(0)) is None and store.stats["not_valid"] == 1


# ------------------------------------------------------------------------------- corrupt files
def test_truncated_file_reads_are_misses(make_store, tmp_path):
    store = make_store(slots=6)
    slots = [store.alloc() for _ in range(6)]
    for s in slots:
        store.write(s, key(s), payload_for(key(s)))
    cut = store.layout.offset(3) + 1000                    # mid-header of slot 3
    os.truncate(tmp_path / "kv.bin", cut)
    for s in slots:
        got = store.read(s, key(s))
        assert (bytes(got) == payload_for(key(s))) if s < 3 else got is None
    assert store.stats["short_reads"] == 3
    os.truncate(tmp_path / "kv.bin", 0)
    assert all(store.read(s, key(s)) is None for s in slots)
    store.write(slots[5], key(9), payload_for(key(9)))     # writing again extends the file
    assert bytes(store.read(slots[5], key(9))) == payload_for(key(9))


@pytest.mark.parametrize("where,counter", [
    ("payload", "checksum_failures"), ("payload_end", "checksum_failures"),
    ("reserved", "checksum_failures"), ("key", "checksum_failures"),
    ("slot", "checksum_failures"), ("length", "checksum_failures"),
    ("compat", "checksum_failures"), ("checksum", "checksum_failures"),
    ("header_pad", "checksum_failures"), ("magic", "corrupt"), ("nonce", "stale")])
def test_bit_flip_on_disk_is_a_miss(make_store, tmp_path, where, counter):
    store = make_store(slots=2)
    s = store.alloc()
    store.write(s, key(5), payload_for(key(5)))
    pos = {"payload": HEADER_BYTES + 1234, "payload_end": HEADER_BYTES + RB - 1, "reserved": 14,
           "key": 40, "slot": 48, "length": 57, "compat": 70, "checksum": 131, "header_pad": 200,
           "magic": 3, "nonce": 20}[where]
    flip_bit(tmp_path / "kv.bin", store.layout.offset(s) + pos, bit=5)
    assert store.read(s, key(5)) is None
    assert store.stats[counter] == 1 and store.stats["hits"] == 0
    store.write(s, key(5), payload_for(key(5)))            # rewriting repairs it
    assert bytes(store.read(s, key(5))) == payload_for(key(5))


def test_wrong_key_and_wrong_compat_are_misses(make_store, tmp_path):
    store = make_store(slots=2)
    s = store.alloc()
    store.write(s, key(1), payload_for(key(1)))
    assert store.read(s, key(2)) is None and store.stats["wrong_key"] == 1
    # the on-disk checks, below the in-memory ones (white box): key, compat
    assert store._read_record(s, key(2)) is None and store.stats["wrong_key"] == 2
    store.compat = b"dream-7b|bf16|pages16|dual"
    assert store._read_record(s, key(1)) is None and store.stats["compat_mismatch"] == 1
    store.compat = COMPAT
    assert bytes(store._read_record(s, key(1))) == payload_for(key(1))
    store.close()
    other = make_store(slots=2, compat=b"dream-7b|bf16|pages16|dual")
    assert other._read_record(s, key(1)) is None and other.read(s, key(1)) is None


# ------------------------------------------------------------------------------- disk failures
def test_full_disk_write_fails_and_slot_stays_invalid(make_store):
    store = make_store(slots=2, cls=FaultyStore)
    s = store.alloc()
    store.write(s, key(1), payload_for(key(1)))
    store.fail = errno.ENOSPC
    with pytest.raises(StoreIOError) as ei:
        store.write(s, key(2), payload_for(key(2)))       # an overwrite that fails
    assert ei.value.errno == errno.ENOSPC and isinstance(ei.value, OSError)
    assert store.state(s) == "empty"
    assert store.read(s, key(1)) is None and store.read(s, key(2)) is None
    fut = store.write_async(s, key(3), payload_for(key(3)))
    with pytest.raises(StoreIOError, match="No space left"):
        fut.result(10)
    assert store.state(s) == "empty" and store.read(s, key(3)) is None
    assert store.stats["io_errors"] == 2 and store.stats["write_failures"] == 2
    store.free(s)                                          # freeable, then reusable
    store.fail = None
    s2 = store.alloc()
    store.write(s2, key(4), payload_for(key(4)))
    assert bytes(store.read(s2, key(4))) == payload_for(key(4))


def test_short_writes(make_store):
    store = make_store(slots=2, cls=FaultyStore, direct=False)
    s = store.alloc()
    store.short = 4096                                     # short but progressing: completes
    store.write(s, key(1), payload_for(key(1)))
    assert bytes(store.read(s, key(1))) == payload_for(key(1))
    store.short = 0                                        # no progress: fails, not published
    with pytest.raises(StoreIOError, match="short write"):
        store.write(s, key(2), payload_for(key(2)))
    assert store.state(s) == "empty" and store.read(s, key(2)) is None


def test_close_waits_for_a_synchronous_write_on_another_thread(make_store, tmp_path):
    """close() while a write runs on another thread: it waits, the fd stays the store's file
    until the write ended (a closed fd number could be reused by any open, and the late pwrite
    would land in that file), and no new I/O starts meanwhile."""
    inodes = []

    class Checked(FaultyStore):
        def _pwrite(self, fd, buf, offset):
            if self.gate is not None:
                assert self.gate.wait(10)
            inodes.append(os.fstat(fd).st_ino)              # EBADF if closed under us
            return DiskStore._pwrite(self, fd, buf, offset)

    store = make_store(slots=2, cls=Checked, direct=False)
    ino = os.stat(tmp_path / "kv.bin").st_ino
    fd = store._fd
    slot, other = store.alloc(), store.alloc()
    store.write(other, key(2), payload_for(key(2)))
    store.gate = threading.Event()
    errors = []

    def run(fn, *args):
        try:
            fn(*args)
        except Exception as e:                             # pragma: no cover - reported below
            errors.append(e)

    writer = threading.Thread(target=run, args=(store.write, slot, key(1), payload_for(key(1))))
    writer.start()
    deadline = time.monotonic() + 10
    while store.state(slot) != WRITING and time.monotonic() < deadline:
        time.sleep(0.005)
    closers = [threading.Thread(target=run, args=(store.close,)) for _ in range(2)]
    for c in closers:
        c.start()
    for c in closers:
        c.join(0.3)
    assert all(c.is_alive() for c in closers), "close() returned with a write in flight"
    assert os.fstat(fd).st_ino == ino                      # the fd is still the store's file
    with pytest.raises(StoreError, match="closed"):
        store.read(other, key(2))                          # no new I/O begins while closing
    store.gate.set()
    writer.join(10)
    for c in closers:
        c.join(10)
    assert not errors and not writer.is_alive() and not any(c.is_alive() for c in closers)
    assert inodes and set(inodes) == {ino} and store.state(slot) == VALID
    assert store.stats["writes"] == 2
    try:                                                   # closed (or reused by someone else)
        assert os.fstat(fd).st_ino != ino
    except OSError as e:
        assert e.errno == errno.EBADF


def test_concurrent_close_closes_the_fd_once(make_store, monkeypatch):
    store = make_store(slots=2, cls=FaultyStore, direct=False)
    fd, calls = store._fd, []
    real_close = os.close

    def counting_close(n):
        if n == fd:
            calls.append(n)
        return real_close(n)

    monkeypatch.setattr(os, "close", counting_close)
    slot = store.alloc()
    store.gate = threading.Event()
    fut = store.write_async(slot, key(1), payload_for(key(1)))    # async: held on the pool
    closers = [threading.Thread(target=store.close) for _ in range(3)]
    for c in closers:
        c.start()
    time.sleep(0.2)
    assert all(c.is_alive() for c in closers) and not calls
    store.gate.set()
    for c in closers:
        c.join(10)
    assert fut.result(10) is None and calls == [fd]
    store.close()                                           # and later calls are no-ops
    assert calls == [fd]


def test_close_on_the_stores_own_io_thread_is_refused(make_store):
    store = make_store(slots=2)
    with pytest.raises(StoreError, match="own I/O threads .* would deadlock"):
        store._pool.submit(store.close).result(10)
    s = store.alloc()                                       # still open and working
    store.write_async(s, key(1), payload_for(key(1))).result(10)
    assert bytes(store.read(s, key(1))) == payload_for(key(1))


def _in_child(fn, timeout: float = 20.0) -> dict:
    """Run ``fn() -> dict`` in a forked child (cheap: no re-import); returns its dict."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                           # pragma: no cover - child
        os.close(r)
        code = 1
        try:
            os.write(w, json.dumps(fn()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([r], [], [], left)[0]:
            os.kill(pid, signal.SIGKILL)                   # hung: fail below, do not hang
            break
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    return json.loads(b"".join(chunks))


def test_real_file_size_limit_fails_the_write(tmp_path):
    """A real kernel failure (RLIMIT_FSIZE: EFBIG, after a real short write) in a child."""
    import resource

    def child() -> dict:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        store = DiskStore(tmp_path / "kv.bin", capacity(3), RB, COMPAT)
        s0, s1 = store.alloc(), store.alloc()
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (store.layout.offset(max(s0, s1)) + 4096, hard))
        lo, hi = min(s0, s1), max(s0, s1)
        store.write(lo, key(1), payload_for(key(1)))       # below the limit
        try:
            store.write(hi, key(2), payload_for(key(2)))   # straddles it: short write, EFBIG
            err = None
        except StoreIOError as e:
            err = e.errno
        res = {"err": err, "state": store.state(hi), "miss": store.read(hi, key(2)) is None,
               "lo_ok": bytes(store.read(lo, key(1))) == payload_for(key(1))}
        store.free(hi)
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        s = store.alloc()
        store.write(s, key(3), payload_for(key(3)))
        res["after"] = bytes(store.read(s, key(3))) == payload_for(key(3))
        store.close()
        return res

    res = _in_child(child)
    assert res == {"err": errno.EFBIG, "state": "empty", "miss": True, "lo_ok": True,
                   "after": True}


def test_slow_disk_never_serves_a_record_in_flight(make_store):
    store = make_store(slots=2, cls=FaultyStore)
    s = store.alloc()
    store.write(s, key(1), payload_for(key(1)))
    store.gate = threading.Event()                         # the disk stalls
    fut = store.write_async(s, key(2), payload_for(key(2)))
    assert store.state(s) == "writing"
    assert store.read(s, key(2)) is None and store.read(s, key(1)) is None
    assert store.read_async(s, key(2)).result(10) is None
    with pytest.raises(SlotStateError, match="I/O in flight"):
        store.free(s)
    with pytest.raises(SlotStateError, match="busy"):
        store.write_async(s, key(3), b"x")
    store.gate.set()
    assert fut.result(10) is None
    assert bytes(store.read(s, key(2))) == payload_for(key(2))
    # a slow read blocks reuse of its slot until it completes, and returns whole data
    store.read_gate = threading.Event()
    reads = [store.read_async(s, key(2)) for _ in range(2)]
    with pytest.raises(SlotStateError, match="reader"):
        store.free(s)
    with pytest.raises(SlotStateError, match="busy"):
        store.write(s, key(4), b"y")
    store.read_gate.set()
    assert all(bytes(f.result(10)) == payload_for(key(2)) for f in reads)
    store.free(s)


def test_killed_writer_then_restart_sees_only_stale_records(tmp_path):
    path, n_slots = tmp_path / "kv.bin", 8
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                           # pragma: no cover - child
        os.close(r)
        try:
            store = DiskStore(path, capacity(n_slots), RB, COMPAT)
            slots = [store.alloc() for _ in range(n_slots)]
            i = 0
            while True:
                for s in slots:
                    store.write(s, key(i * n_slots + s), payload_for(key(s)))
                if i == 0:
                    os.write(w, b"r")
                i += 1
        finally:
            os._exit(1)
    os.close(w)
    assert select.select([r], [], [], 20)[0] and os.read(r, 1) == b"r"
    time.sleep(0.05)                                       # mid-way through some write
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(r)
    store = DiskStore(path, capacity(n_slots), RB, COMPAT)  # the flock died with the child
    try:
        assert store.num_free == n_slots
        assert all(store.read(s, key(s)) is None for s in range(n_slots))
        # below the slot states: every record on disk is rejected by its nonce (or torn)
        assert all(store._read_record(s, key(s)) is None for s in range(n_slots))
        assert store.stats["stale"] + store.stats["corrupt"] == n_slots
        assert store.stats["stale"] >= n_slots - 1 and store.stats["hits"] == 0
        slots = [store.alloc() for _ in range(n_slots)]    # and it works normally afterwards
        for s in slots:
            store.write(s, key(100 + s), payload_for(key(100 + s)))
        assert all(bytes(store.read(s, key(100 + s))) == payload_for(key(100 + s))
                   for s in slots)
    finally:
        store.close()


# --------------------------------------------------------------------------------- concurrency
def test_concurrent_writes_and_reads_return_exact_bytes(make_store):
    store = make_store(slots=12, io_threads=3, rb=3000)
    slots = [store.alloc() for _ in range(12)]
    last: dict[int, bytes] = {}
    bad, hits, futures = [], [0], []

    def check(k, got):
        if got is not None:
            hits[0] += 1
            if bytes(got) != payload_for(k, 3000):
                bad.append(k)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(120):
            s = rng.choice(slots)
            try:
                op = rng.random()
                if op < 0.35:
                    k = key(rng.randrange(16))
                    f = store.write_async(s, k, payload_for(k, 3000))
                    futures.append(f)
                    if rng.random() < 0.5:
                        f.result(10)
                    f.add_done_callback(lambda f, s=s, k=k: f.exception() or last.__setitem__(s, k))
                else:
                    k = last.get(s, key(0))
                    if op < 0.7:
                        check(k, store.read(s, k))
                    else:
                        check(k, store.read_async(s, k).result(10))
            except SlotStateError:
                pass                                       # busy: refused, never raced

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    concurrent.futures.wait(futures, timeout=30)
    assert all(store.state(s) != "writing" for s in slots)
    assert not bad and hits[0] > 0
    for s in slots:                                        # quiescent: each slot one record
        if store.state(s) == VALID:
            k = store._key[s]
            assert bytes(store.read(s, k)) == payload_for(k, 3000)
    stats = store.stats
    assert stats["checksum_failures"] == stats["corrupt"] == stats["stale"] == 0


# ----------------------------------------------------------------------------- state machine
SM_SLOTS, SM_RB = 4, 300


class DiskStoreMachine(RuleBasedStateMachine):
    """alloc / write (ok, failing, async) / read / free against a model: one valid record per
    slot, reads return the last successful write or a miss, no leaks, never over capacity."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="disk-sm-")
        self.store = FaultyStore(os.path.join(self.dir, "kv.bin"), capacity(SM_SLOTS, SM_RB),
                                 SM_RB, COMPAT, io_threads=1)
        self.model: dict[int, tuple[bytes, bytes] | None] = {}
        self.old_keys: dict[int, set[bytes]] = {}

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule()
    def alloc(self) -> None:
        s = self.store.alloc()
        if len(self.model) == SM_SLOTS:
            assert s is None
        else:
            assert s is not None and 0 <= s < SM_SLOTS and s not in self.model
            self.model[s] = None

    @precondition(lambda self: self.model)
    @rule(data=st.data(), k=st.binary(min_size=16, max_size=16),
          p=st.binary(max_size=SM_RB), mode=st.sampled_from(["ok", "fail", "async"]))
    def write(self, data, k, p, mode) -> None:
        s = data.draw(st.sampled_from(sorted(self.model)))
        if self.model[s] is not None:
            self.old_keys.setdefault(s, set()).add(self.model[s][0])
        if mode == "fail":
            self.store.fail = errno.EIO
            with pytest.raises(StoreIOError):
                self.store.write(s, k, p)
            self.store.fail = None
            self.model[s] = None
        elif mode == "async":
            f = self.store.write_async(s, k, p)
            got = self.store.read(s, k)                    # in flight or done: never old data
            assert got is None or bytes(got) == p
            f.result(10)
            self.model[s] = (k, p)
        else:
            self.store.write(s, k, p)
            self.model[s] = (k, p)
        self.old_keys.setdefault(s, set()).discard(k)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), other=st.binary(min_size=16, max_size=16))
    def read(self, data, other) -> None:
        s = data.draw(st.sampled_from(sorted(self.model)))
        rec = self.model[s]
        if rec is not None:
            assert bytes(self.store.read(s, rec[0])) == rec[1]
        if rec is None or other != rec[0]:
            assert self.store.read(s, other) is None
        for k in self.old_keys.get(s, ()):                 # superseded records are gone
            assert self.store.read(s, k) is None

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data) -> None:
        s = data.draw(st.sampled_from(sorted(self.model)))
        self.store.free(s)
        del self.model[s]
        self.old_keys.pop(s, None)
        with pytest.raises(SlotStateError, match="double free"):
            self.store.free(s)

    @precondition(lambda self: len(self.model) < SM_SLOTS)
    @rule(k=st.binary(min_size=16, max_size=16))
    def read_unallocated(self, k) -> None:
        s = next(i for i in range(SM_SLOTS) if i not in self.model)
        assert self.store.read(s, k) is None

    @invariant()
    def slots_match_model(self) -> None:
        assert self.store.num_free == SM_SLOTS - len(self.model)          # no leaks
        for s in range(SM_SLOTS):
            want = FREE if s not in self.model else ("empty" if self.model[s] is None else VALID)
            assert self.store.state(s) == want


TestDiskStoreMachine = DiskStoreMachine.TestCase
TestDiskStoreMachine.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)


# ------------------------------------------------------------------------------------ benchmark
def test_bench_disk_smoke(tmp_path):
    res = bench_disk(tmp_path / "bench.bin", record_bytes=64 << 10, nbytes=1 << 20, in_flight=4)
    assert res["verified"] == res["records"] > 0 and res["read_bytes_per_s"] > 0
    assert {"write_ratio", "read_ratio", "seq_read_bytes_per_s", "direct"} <= res.keys()
    assert res["reps"] == 5 and len(res["write_ratios"]) == len(res["read_ratios"]) == 5
    assert min(res["read_ratios"]) <= res["read_ratio"] <= max(res["read_ratios"])
    assert not (tmp_path / "bench.bin").exists()
    seq = sequential_rate(tmp_path / "seq.bin", 1 << 20, direct=False)
    assert seq["direct"] is False and seq["write_bytes_per_s"] > 0


def test_bench_disk_counts_a_miss_as_not_verified(tmp_path, monkeypatch):
    real = DiskStore._read_record

    def first_slot_corrupt(self, slot, key, out_mv=None, n=None):
        if slot == 0:
            return self._miss("checksum_failures")
        return real(self, slot, key, out_mv, n)

    monkeypatch.setattr(DiskStore, "_read_record", first_slot_corrupt)
    res = bench_disk(tmp_path / "bench.bin", record_bytes=64 << 10, nbytes=512 << 10,
                     in_flight=2, direct=False)
    assert res["records"] > 1 and res["verified"] == res["records"] - 1


def test_bench_disk_counts_a_miss_in_any_rep(tmp_path, monkeypatch):
    real, reads = DiskStore._read_record, []

    def one_bad_read_in_the_second_rep(self, slot, key, out_mv=None, n=None):
        reads.append(slot)
        if len(reads) == 10:                       # rep 2 of 8-record passes
            return self._miss("checksum_failures")
        return real(self, slot, key, out_mv, n)

    monkeypatch.setattr(DiskStore, "_read_record", one_bad_read_in_the_second_rep)
    res = bench_disk(tmp_path / "bench.bin", record_bytes=64 << 10, nbytes=8 * (68 << 10),
                     in_flight=2, direct=False, reps=3)
    assert res["records"] == 8 and len(reads) == 24 and res["verified"] == 7


def test_sequential_rate_completes_short_writes(tmp_path, monkeypatch):
    real, written = os.pwrite, []

    def short_pwrite(fd, buf, offset):                     # a file system taking 1000 B a call
        k = real(fd, memoryview(buf)[:1000], offset)
        written.append(k)
        return k

    monkeypatch.setattr(os, "pwrite", short_pwrite)
    seq = sequential_rate(tmp_path / "seq.bin", 1 << 16, direct=False, block_bytes=1 << 15)
    assert seq["bytes"] == 1 << 16 and sum(written) == 1 << 16
    monkeypatch.setattr(os, "pwrite", lambda fd, buf, offset: 0)     # no progress: an error
    with pytest.raises(OSError, match="short write"):
        sequential_rate(tmp_path / "seq2.bin", 1 << 16, direct=False)
