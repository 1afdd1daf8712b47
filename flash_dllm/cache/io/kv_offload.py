"""The runner's offloader: moves KV pages between the GPU pool (L0), pinned host slots (L1) and
disk (L2), as the KV manager's tier ops say (``cache/tiers.py``).

A page leaves the GPU page-first (``kernels/kv_pages``: all layers of a page contiguous, one pack
launch per group of pages), optionally as fp8 / int8 with one scale per (layer, k/v, head), and
lands in one host slot as one record::

    [ payload (packed page) | scales (quantised only) | key (16 B) | checksum (16 B) | pad ]

padded to a multiple of ``RECORD_ALIGN`` bytes, so that every record of a batch (a row of one
device tensor) starts 16-byte aligned: the pack kernel writes the payload straight into the
records, and the checksum and unpack kernels read them in place with vector loads (with odd row
strides the checksum ran 4x slower and a staging copy of the payload cost as much again).

The key is the cached block's prefix-chain key: a load compares it with the key it expects, so a
host slot still holding another block's (valid) record can never be served as this one.
The checksum is the 128-bit ``cache.checksum.device_checksum`` of payload + scales, computed on
the GPU at pack time (``kernels/checksum``) and
recomputed on the GPU when the record comes back up, so verification runs at memory bandwidth
(xxh3 on the host would cap page moves at hashing speed); disk records additionally carry xxh3
(``cache/disk_store``). A record that fails either check is a miss: never unpacked, never served.

NOTE (streams and publishing): on CUDA, packing runs on the current stream (so it reads a page
before any later step or load can overwrite it: the KV manager frees a demoted page at once), and
the device -> host copies run on a side stream behind an event; a store is reported done (and
only then published by the KV manager) once its event has completed. Loads are needed by the
step that follows, so they run on the current stream and are verified with one host sync.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from flash_dllm.cache.checksum import device_checksum_rows
from flash_dllm.cache.disk_store import DiskStore, LatencyHistogram
from flash_dllm.cache.host_store import HostStore
from flash_dllm.cache.tiers import Fetch, Load, Spill, Store, StoreDisk
from flash_dllm.kernels import kv_pages
from flash_dllm.transfer import h2d

OFFLOAD_DTYPES = {"bf16": None, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
RECORD_ALIGN = 256   # record size multiple: see the module docstring
MOVE_GROUP_PAGES = 16  # pages per pipelined group of a store or load (see ``_store``, ``load``)


@dataclass
class RecordLayout:
    """Byte layout of one page record (see the module docstring)."""

    shape: tuple                 # one packed page: [1, layers, 2, page_size, kv_heads, head_dim]
    dtype: torch.dtype           # payload dtype (the pool's, or fp8 / int8)
    payload: int
    scales: int                  # bytes of [1, layers, 2, kv_heads] fp32, 0 when not quantised

    @property
    def key_at(self) -> int:
        return self.payload + self.scales

    @property
    def sums_at(self) -> int:
        return self.payload + self.scales + 16

    @property
    def nbytes(self) -> int:
        return -(-(self.payload + self.scales + 32) // RECORD_ALIGN) * RECORD_ALIGN

    def payload_view(self, rec: torch.Tensor) -> torch.Tensor:
        """The packed pages of records ``rec [n, nbytes]`` uint8, as the pack / unpack kernels'
        ``[n, layers, 2, page_size, kv_heads, head_dim]`` buffer: a view (rows strided)."""
        n = rec.shape[0]
        return rec[:, :self.payload].view(self.dtype).view(n, *self.shape[1:])

    def scales_view(self, rec: torch.Tensor) -> torch.Tensor:
        """The scales of records ``rec`` as ``[n, layers, 2, kv_heads]`` fp32 (a copy: the
        kernels take contiguous scales)."""
        n = rec.shape[0]
        return rec[:, self.payload:self.key_at].contiguous().view(torch.float32).view(
            n, self.shape[1], 2, self.shape[4])

    @classmethod
    def for_pool(cls, kv: torch.Tensor, offload_dtype: torch.dtype | None) -> RecordLayout:
        L, _, _, S, H, D = kv.shape
        dtype = offload_dtype or kv.dtype
        payload = L * 2 * S * H * D * torch.empty((), dtype=dtype).element_size()
        scales = L * 2 * H * 4 if offload_dtype is not None else 0
        return cls((1, L, 2, S, H, D), dtype, payload, scales)


@dataclass
class _Pending:
    ops: list
    event: object                # torch.cuda.Event (None on the CPU: done)
    keep: tuple                  # tensors the side stream still reads
    t0: float


class KVOffloader:
    def __init__(self, kv: torch.Tensor, l1_slots: int, offload_dtype: str = "bf16",
                 disk_path: str | None = None, disk_bytes: int = 0, compat: bytes = b"",
                 group_pages: int = MOVE_GROUP_PAGES) -> None:
        if offload_dtype not in OFFLOAD_DTYPES:
            raise ValueError(f"kv_offload_dtype must be one of {sorted(OFFLOAD_DTYPES)}, got "
                             f"{offload_dtype!r}")
        self.kv = kv
        self.device = kv.device
        self.qdtype = OFFLOAD_DTYPES[offload_dtype]
        self.layout = RecordLayout.for_pool(kv, self.qdtype)
        self.host = HostStore(max(l1_slots, 1), self.layout.nbytes)
        self.disk = (DiskStore(disk_path, disk_bytes, self.layout.nbytes, compat)
                     if disk_path is not None else None)
        # NOTE: the KV manager hands out slot numbers (it knows which cached page each holds);
        # the stores' own allocators are taken whole, so every slot is writable here
        while self.host.alloc() is not None:
            pass
        while self.disk is not None and self.disk.alloc() is not None:
            pass
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None       # stores
        self.load_stream = torch.cuda.Stream(self.device) if self.cuda else None  # loads
        if isinstance(group_pages, bool) or not isinstance(group_pages, int) or group_pages < 1:
            raise ValueError(f"group_pages must be an integer >= 1, got {group_pages!r}")
        self.group_pages = group_pages
        # counts the failed records a load unpacked to page -1 (the counter turns masking on in
        # the reference path; nothing reads it)
        self._bad = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._pending: list[_Pending] = []
        self._spills: list = []                      # (op, future, t0)
        self._fetches: list = []                     # (op, future, t0): disk -> host reads
        self.stats = {"stores": 0, "loads": 0}
        self.latency = {"store": LatencyHistogram(), "load": LatencyHistogram()}  # s per page

    @property
    def l2_slots(self) -> int:
        return 0 if self.disk is None else self.disk.layout.num_slots

    # ---------------------------------------------------------------------------------- run
    def run(self, ops: list) -> list:
        """Carry out a step's tier ops in order (stores, spills, fetches, loads); returns the
        results ``(op, ok, seconds)`` of every op that completed since the last call."""
        done = self.poll()
        stores = [op for op in ops if isinstance(op, Store)]
        if stores:
            self._store(stores)
        stored = {op.slot for op in stores}
        direct = [op for op in ops if isinstance(op, StoreDisk)]
        if direct:                     # L0 -> a temporary host buffer -> disk
            rec = self._pack([op.page for op in direct], [op.block.key for op in direct])
            host = torch.empty(rec.shape, dtype=torch.uint8, pin_memory=self.cuda)
            host.copy_(rec)            # synchronous: the disk writes read it next
            for i, op in enumerate(direct):
                self._spills.append((op, self.disk.write_async(op.disk_slot, op.block.key,
                                                               host[i]), time.perf_counter()))
        for op in ops:
            if isinstance(op, Spill):
                if op.slot in stored and self.cuda:
                    self.stream.synchronize()       # the host record must be there to write
                    stored = set()
                payload = self.host.view(op.slot)
                self._spills.append((op, self.disk.write_async(op.disk_slot, op.block.key,
                                                               payload), time.perf_counter()))
            elif isinstance(op, Fetch):
                # NOTE: reads run on the disk store's I/O threads, all of a step's at once; a
                # fetch no load of this step waits for (a prefetch for a waiting request)
                # completes in the background and is reported by a later ``poll``
                self._fetches.append((op, self.disk.read_async(
                    op.disk_slot, op.block.key, out=self.host.view(op.slot)),
                    time.perf_counter()))
        loads = [op for op in ops if isinstance(op, Load)]
        done += self._poll_fetches(wait_for={op.slot for op in loads})
        # NOTE: a load from a host slot whose fetch failed is never attempted (the slot holds
        # whatever it held before, which may be another block's valid record)
        fetched_bad = {op.slot for op, ok, _ in done if isinstance(op, Fetch) and not ok}
        run = [op for op in loads if op.slot not in fetched_bad]
        done += [(op, False, 0.0) for op in loads if op.slot in fetched_bad]
        if run:
            # NOTE: the KV manager never loads from a slot a store is still writing (such a
            # block is not published yet); should it ever, the load's copies first wait for
            # the store copies in flight
            writing = {op.slot for p in self._pending for op in p.ops}
            if self.cuda and any(op.slot in writing for op in run):
                self.load_stream.wait_stream(self.stream)
            ok = self.load([op.slot for op in run], [op.page for op in run],
                           [op.block.key for op in run])
            t = self._last_load / max(len(run), 1)
            done += [(op, good, t) for op, good in zip(run, ok)]
        return done + (self.poll() if stores else [])

    @staticmethod
    def _reap(entries: list, ok_of, wait_for: set | frozenset = frozenset()) -> tuple[list, list]:
        """Split ``(op, future, t0)`` entries into the finished ``(op, ok, seconds)`` and those
        still running, waiting first for the ops into a host slot of ``wait_for``."""
        done, still = [], []
        for op, fut, t0 in entries:
            if wait_for and op.slot in wait_for:   # NOTE: a StoreDisk op has no host slot
                fut.exception()                   # waits; a failure is reported, not raised
            if fut.done():
                done.append((op, ok_of(fut), time.perf_counter() - t0))
            else:
                still.append((op, fut, t0))
        return done, still

    def _poll_fetches(self, wait_for: set | frozenset = frozenset()) -> list:
        """Fetches that completed (waiting first for those into a host slot of ``wait_for``):
        ``(op, ok, seconds)``, ok when the record came back verified."""
        done, self._fetches = self._reap(
            self._fetches, lambda f: f.exception() is None and f.result() is not None, wait_for)
        return done

    def poll(self) -> list:
        """Stores whose copies completed, finished spills and finished fetches."""
        done = self._poll_fetches()
        still = []
        for p in self._pending:
            if p.event is None or p.event.query():
                dt = (time.perf_counter() - p.t0) / max(len(p.ops), 1)
                for _ in p.ops:
                    self.latency["store"].observe(dt)
                done += [(op, True, dt) for op in p.ops]
            else:
                still.append(p)
        self._pending = still
        spilled, self._spills = self._reap(self._spills, lambda f: f.exception() is None)
        return done + spilled

    def drain(self) -> list:
        """Wait for every store and spill in flight (shutdown, tests)."""
        if self.cuda:
            self.stream.synchronize()
        for _, fut, _ in self._spills + self._fetches:
            fut.exception()
        return self.poll()

    # -------------------------------------------------------------------------------- stores
    def _pack(self, pages: list[int], keys: list[bytes]) -> torch.Tensor:
        """[n, record bytes] uint8 on the device: packed pages, scales, keys and checksums."""
        return self._pack_rows(self._ids(pages), self._keys(keys))

    def _pack_rows(self, ids: torch.Tensor, key_rows: torch.Tensor) -> torch.Tensor:
        """``_pack`` of device page ids [n] and key rows [n, 16]."""
        n = ids.shape[0]
        lay = self.layout
        rec = torch.empty(n, lay.nbytes, dtype=torch.uint8, device=self.device)
        _, scales = kv_pages.pack_pages(self.kv, ids, out=lay.payload_view(rec),
                                        out_dtype=self.qdtype)
        if scales is not None:
            rec[:, lay.payload:lay.key_at] = scales.reshape(n, -1).view(torch.uint8)
        rec[:, lay.key_at:lay.sums_at] = key_rows
        sums = device_checksum_rows(rec[:, :lay.key_at])        # [n, 2] int64: payload + scales
        rec[:, lay.sums_at:lay.sums_at + 16] = sums.view(torch.uint8).reshape(n, 16)
        rec[:, lay.sums_at + 16:].zero_()     # the pad: never another request's stale bytes
        return rec

    # NOTE: keys and ids cross through pinned memory (``transfer.h2d``): a copy from pageable
    # memory first waits for the stream's earlier work, so a store issued between steps would
    # wait for the step in flight
    def _keys(self, keys: list[bytes]) -> torch.Tensor:
        """[n, 16] uint8 on the device (one host->device copy)."""
        raw = b"".join(k.ljust(16, b"\0")[:16] for k in keys)
        return h2d(torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(-1, 16), torch.uint8,
                   self.device)

    def _ids(self, pages: list[int]) -> torch.Tensor:
        return h2d(pages, torch.int64, self.device)

    def _store(self, ops: list) -> None:
        t0 = time.perf_counter()
        if not self.cuda:
            rec = self._pack([op.page for op in ops], [op.block.key for op in ops])
            for i, op in enumerate(ops):
                self.host.view(op.slot).copy_(rec[i])
            self._pending.append(_Pending(ops, None, (), t0))
            self.stats["stores"] += len(ops)
            return
        # NOTE: groups of ``group_pages``: the copies of one group run under the pack and
        # checksum of the next. The side stream waits for each group's pack; each ``rec`` stays
        # referenced until the copies completed (the caching allocator may not hand its memory
        # to anyone else before)
        cur = torch.cuda.current_stream(self.device)
        keep = []
        ids = self._ids([op.page for op in ops])                 # one copy each for all groups
        key_rows = self._keys([op.block.key for op in ops])
        for g0 in range(0, len(ops), self.group_pages):
            part = ops[g0:g0 + self.group_pages]
            rec = self._pack_rows(ids[g0:g0 + len(part)], key_rows[g0:g0 + len(part)])
            self.stream.wait_stream(cur)
            with torch.cuda.stream(self.stream):
                for i, op in enumerate(part):
                    self.host.view(op.slot).copy_(rec[i], non_blocking=True)
            rec.record_stream(self.stream)
            keep.append(rec)
        ev = torch.cuda.Event()
        ev.record(self.stream)
        self._pending.append(_Pending(ops, ev, tuple(keep), t0))
        self.stats["stores"] += len(ops)

    # --------------------------------------------------------------------------------- loads
    def load(self, src_slots: list[int], pages: list[int], keys: list[bytes]) -> list[bool]:
        """Host records ``src_slots`` -> L0 ``pages``: copy up, verify on the device (checksums,
        and the key each record must carry), unpack the records that passed. One host sync;
        returns ok per record.

        NOTE (pipelined, nothing bad unpacked): the records come up in groups of
        ``group_pages`` on the load stream; each group is verified and unpacked on the current
        stream as soon as its copies are done, under the next group's copies. A record that
        failed a check is unpacked to page id -1, which the unpack kernel masks (never written,
        see ``kernels/kv_pages``), so no host sync is needed before unpacking."""
        t0 = time.perf_counter()
        n = len(pages)
        lay = self.layout
        key_rows = self._keys(keys)
        ids = self._ids(pages)
        rec = torch.empty(n, lay.nbytes, dtype=torch.uint8, device=self.device)
        cur = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda:
            self.load_stream.wait_stream(cur)           # rec, ids and keys are cur's
        oks = []
        for g0 in range(0, n, self.group_pages):
            g1 = min(n, g0 + self.group_pages)
            if self.cuda:
                with torch.cuda.stream(self.load_stream):
                    for i in range(g0, g1):
                        rec[i].copy_(self.host.view(src_slots[i]), non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(self.load_stream)
                cur.wait_event(ev)
            else:
                for i in range(g0, g1):
                    rec[i].copy_(self.host.view(src_slots[i]))
            part = rec[g0:g1]
            ok = self._verify(part) & (part[:, lay.key_at:lay.sums_at] == key_rows[g0:g1]).all(1)
            self._unpack(part, torch.where(ok, ids[g0:g1], -1), self._bad)
            oks.append(ok)
        if self.cuda:
            rec.record_stream(self.load_stream)
        ok_host = torch.cat(oks).tolist() if oks else []     # the one sync
        self._last_load = time.perf_counter() - t0
        for _ in range(n):
            self.latency["load"].observe(self._last_load / n)
        self.stats["loads"] += n
        return [bool(g) for g in ok_host]

    def _verify(self, rec: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        n = rec.shape[0]
        want = rec[:, lay.sums_at:lay.sums_at + 16].contiguous().view(torch.int64)   # [n, 2]
        got = device_checksum_rows(rec[:, :lay.key_at])                            # [n, 2]
        return (got == want).all(dim=1).reshape(n)

    def _unpack(self, rec: torch.Tensor, ids: torch.Tensor, bad: torch.Tensor | None = None
                ) -> None:
        """Records ``rec`` into pool pages ``ids`` (device int64; an id outside the pool, e.g.
        -1, is written nowhere and counted into ``bad``)."""
        lay = self.layout
        scales = lay.scales_view(rec) if lay.scales else None
        kv_pages.unpack_pages(lay.payload_view(rec), ids, self.kv, scales, bad=bad)

    # ------------------------------------------------------------------------------- stress
    def roundtrip(self, pages: list[int]) -> bool:
        """Every page of ``pages`` down to host memory and back (pack, copy, copy, verify,
        unpack): the tiers' data path with nothing kept (``EngineConfig.kv_tier_stress``)."""
        if not pages:
            return True
        rec = self._pack(pages, [b""] * len(pages))
        host = torch.empty(rec.shape, dtype=torch.uint8, pin_memory=self.cuda)
        host.copy_(rec)
        back = host.to(self.device)
        ok = bool(self._verify(back).all())
        if ok:
            self._unpack(back, self._ids(pages))
        return ok
