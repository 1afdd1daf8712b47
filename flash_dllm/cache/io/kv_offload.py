"""The runner's offloader: moves KV pages between the GPU pool (L0) and the stack of tier stores
below it (L1 pinned host memory, then disk, then whatever is registered: ``cache/tier_store.py``),
as the tier manager's ops say (``cache/tiers.py``).

A page leaves the GPU page-first (``kernels/kv_pages``: all layers of a page contiguous, one pack
launch per group of pages), optionally as fp8 / int8 with one scale per (layer, k/v, head), and
lands in one host slot as one record (``cache/io/page_record.py``: payload, scales, key,
checksum).

The key is the cached block's prefix-chain key: a load compares it with the key it expects, so a
host slot still holding another block's (valid) record can never be served as this one.
The checksum is the 128-bit ``cache.checksum.device_checksum`` of payload + scales, computed on
the GPU at pack time (``kernels/checksum``) and
recomputed on the GPU when the record comes back up, so verification runs at memory bandwidth
(xxh3 on the host would cap page moves at hashing speed); a store may verify its records too (the
disk store's xxh3, ``cache/disk_store``). A record that fails any check is a miss: never
unpacked, never served. The records below host memory are the same bytes: a ``Spill`` writes a
host slot's record to a lower store, a ``Fetch`` reads one back into a host slot (the stores'
``write_async`` / ``read_async``; nothing here depends on which store it is).

NOTE (streams and publishing): on CUDA, packing runs on the current stream (so it reads a page
before any later step or load can overwrite it: the KV manager frees a demoted page at once), and
the device -> host copies run on a side stream behind an event; a store is reported done (and
only then published by the tier manager) once its event has completed. Loads are needed by the
step that follows, so they run on the current stream and are verified with one host sync.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from flash_dllm.cache.checksum import device_checksum_rows
from flash_dllm.cache.host_store import HostStore
from flash_dllm.cache.io.page_record import (  # noqa: F401 - RECORD_ALIGN: re-exported
    OFFLOAD_DTYPES, RECORD_ALIGN, RecordLayout)
from flash_dllm.cache.latency import LatencyHistogram
from flash_dllm.cache.tier_store import build_tiers
from flash_dllm.cache.tiers import L1, Fetch, Load, Spill, Store
from flash_dllm.kernels import kv_pages, kv_quant
from flash_dllm.transfer import h2d

MOVE_GROUP_PAGES = 16  # pages per pipelined group of a store or load (see ``_store``, ``load``)


@dataclass
class _Pending:
    ops: list
    event: object                # torch.cuda.Event (None on the CPU: done)
    keep: tuple                  # tensors the side stream still reads
    t0: float


@dataclass
class _Io:
    """A store call in flight: ``op``'s ``write_async`` / ``read_async`` on ``store``."""

    op: object
    store: object
    fut: Future
    t0: float


class KVOffloader:
    """Page moves for ``kv`` (the pool) through ``stores``, the tiers L1, L2, ... in order (L1
    host memory: a ``HostStore``); an int builds one host store of that many slots (tests,
    benchmarks). ``offload_dtype``: how pages travel (``OFFLOAD_DTYPES``); ``group_pages``:
    pages per pipelined copy group."""

    def __init__(self, kv: torch.Tensor, stores: int | list, offload_dtype: str = "bf16",
                 group_pages: int = MOVE_GROUP_PAGES, scales: torch.Tensor | None = None) -> None:
        if offload_dtype not in OFFLOAD_DTYPES:
            raise ValueError(f"kv_offload_dtype must be one of {sorted(OFFLOAD_DTYPES)}, got "
                             f"{offload_dtype!r}")
        self.kv = kv
        self.device = kv.device
        # fp8 pools (``kernels/kv_quant``): codes and the pool's scales travel as they are
        self.scales = scales
        if (scales is None) != (kv.dtype != kv_quant.FP8):
            raise ValueError("an fp8 KV pool comes with its scales (and only an fp8 pool does)")
        self.qdtype = OFFLOAD_DTYPES[offload_dtype] if scales is None else None
        self.layout = RecordLayout.for_pool(kv, self.qdtype or OFFLOAD_DTYPES[offload_dtype])
        if isinstance(stores, int):
            stores = [HostStore(stores, self.layout.nbytes)]
        self.stores = list(stores)
        if self.stores and not hasattr(self.stores[0], "view"):
            raise ValueError("the first tier (L1) stages every move: it must be host memory, a "
                             f"store with view(slot), got a {type(self.stores[0]).__name__}")
        for t, st in enumerate(self.stores, L1):
            if st.record_bytes < self.layout.nbytes:
                raise ValueError(f"tier l{t}'s records hold {st.record_bytes} B, a page record "
                                 f"needs {self.layout.nbytes} B")
            # NOTE: the tier manager hands out slot numbers (it knows which cached page each
            # holds); the stores' own allocators are taken whole, so every slot is writable here
            while st.alloc() is not None:
                pass
        self.host = self.stores[0] if self.stores else None      # L1: the staging tier
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
        self._writes: list[_Io] = []                 # spills and skip stores: host -> a store
        self._fetches: list[_Io] = []                # a store -> host
        self.stats = {"stores": 0, "loads": 0}
        self.latency = {"store": LatencyHistogram(), "load": LatencyHistogram()}  # s per page

    @classmethod
    def from_config(cls, kv: torch.Tensor, config, compat: bytes,
                    scales: torch.Tensor | None = None) -> KVOffloader:
        """The offloader of an ``EngineConfig``: the tiers it enables (``TIER_STORES``);
        ``scales``: an fp8 pool's."""
        if config.kv_offload_dtype not in OFFLOAD_DTYPES:
            raise ValueError(f"kv_offload_dtype must be one of {sorted(OFFLOAD_DTYPES)}, got "
                             f"{config.kv_offload_dtype!r}")
        layout = RecordLayout.for_pool(kv, OFFLOAD_DTYPES[config.kv_offload_dtype])
        return cls(kv, build_tiers(config, layout.nbytes, compat), config.kv_offload_dtype,
                   scales=scales)

    @property
    def tier_slots(self) -> tuple[int, ...]:
        """Slots per tier L1, L2, ... (the KV manager's ``tier_slots``)."""
        return tuple(st.num_slots for st in self.stores)

    def store(self, tier: int):
        """The store of ``tier`` (L1 and below)."""
        return self.stores[tier - L1]

    # ---------------------------------------------------------------------------------- run
    def run(self, ops: list) -> list:
        """Carry out a step's tier ops in order (stores, spills, fetches, loads); returns the
        results ``(op, ok, seconds)`` of every op that completed since the last call."""
        done = self.poll()
        stores = [op for op in ops if isinstance(op, Store) and op.dst == L1]
        if stores:
            self._store(stores)
        stored = {op.slot for op in stores}
        skips = [op for op in ops if isinstance(op, Store) and op.dst != L1]
        if skips:                      # L0 -> a temporary host buffer -> a lower store
            rec = self._pack([op.page for op in skips], [op.block.key for op in skips])
            host = torch.empty(rec.shape, dtype=torch.uint8, pin_memory=self.cuda)
            host.copy_(rec)            # synchronous: the store writes read it next
            for i, op in enumerate(skips):
                self._write(op, host[i])
        for op in ops:
            if isinstance(op, Spill):
                if op.slot in stored and self.cuda:
                    self.stream.synchronize()       # the host record must be there to write
                    stored = set()
                self._write(op, self.host.view(op.slot))
            elif isinstance(op, Fetch):
                # NOTE: reads run on the stores' own terms (the disk store's I/O threads), all
                # of a step's at once; a fetch no load of this step waits for (a prefetch for a
                # waiting request) completes in the background and is reported by a later poll
                st = self.store(op.src)
                self._fetches.append(_Io(op, st, st.read_async(
                    op.src_slot, op.block.key, self.host.view(op.slot)), time.perf_counter()))
        loads = [op for op in ops if isinstance(op, Load)]
        done += self._poll_fetches(wait_for={op.slot for op in loads})
        # NOTE: a load from a host slot whose fetch failed is never attempted (the slot holds
        # whatever it held before, which may be another block's valid record)
        fetched_bad = {op.slot for op, ok, _ in done if isinstance(op, Fetch) and not ok}
        run = [op for op in loads if op.slot not in fetched_bad]
        done += [(op, False, 0.0) for op in loads if op.slot in fetched_bad]
        if run:
            # NOTE: the tier manager never loads from a slot a store is still writing (such a
            # block is not published yet); should it ever, the load's copies first wait for
            # the store copies in flight
            writing = {op.slot for p in self._pending for op in p.ops}
            if self.cuda and any(op.slot in writing for op in run):
                self.load_stream.wait_stream(self.stream)
            ok = self.load([op.slot for op in run], [op.page for op in run],
                           [op.block.key for op in run])
            t = self._last_load / max(len(run), 1)
            done += [(op, good, t) for op, good in zip(run, ok)]
            done = self._blame_fetches(done)
        return done + (self.poll() if stores else [])

    def _blame_fetches(self, done: list) -> list:
        """A store that does not verify its records itself (``verifies`` False) leaves that to
        the device check of the load: a record it returned that fails there is its own bad
        copy, reported as a failed fetch (so it is dropped, not fetched and refused for ever)."""
        bad = {op.slot for op, ok, _ in done if isinstance(op, Load) and not ok}
        return [(op, False, s) if (isinstance(op, Fetch) and ok and op.slot in bad
                                   and not self.store(op.src).verifies) else (op, ok, s)
                for op, ok, s in done]

    def _write(self, op, payload: torch.Tensor) -> None:
        """``op``'s record (host bytes ``payload``) to its destination store."""
        st = self.store(op.dst)
        self._writes.append(_Io(op, st, st.write_async(op.dst_slot, op.block.key, payload),
                                time.perf_counter()))

    def _reap(self, entries: list, ok_of, wait_for: set | frozenset = frozenset()
              ) -> tuple[list, list]:
        """Split ``_Io`` entries into the finished ``(op, ok, seconds)`` and those still
        running, waiting first for the fetches into a host slot of ``wait_for``."""
        for st in self.stores if wait_for else ():
            futs = [io.fut for io in entries if io.store is st and io.op.slot in wait_for]
            if futs:
                st.poll(futs)                     # a failure is reported, not raised
        done, still = [], []
        for io in entries:
            if io.fut.done():
                done.append((io.op, ok_of(io.fut), time.perf_counter() - io.t0))
            else:
                still.append(io)
        return done, still

    def _poll_fetches(self, wait_for: set | frozenset = frozenset()) -> list:
        """Fetches that completed (waiting first for those into a host slot of ``wait_for``):
        ``(op, ok, seconds)``, ok when the record came back verified."""
        done, self._fetches = self._reap(
            self._fetches, lambda f: f.exception() is None and f.result() is not None, wait_for)
        return done

    def poll(self) -> list:
        """Stores whose copies completed, finished writes below host memory and fetches."""
        for st in self.stores:
            st.poll()                             # (I/O a store drives itself)
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
        written, self._writes = self._reap(self._writes, lambda f: f.exception() is None)
        return done + written

    def drain(self) -> list:
        """Wait for every store, write and fetch in flight (shutdown, tests)."""
        if self.cuda:
            self.stream.synchronize()
        for st in self.stores:
            futs = [io.fut for io in self._writes + self._fetches if io.store is st]
            if futs:
                st.poll(futs)
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
        if self.scales is not None:                   # fp8 pool: codes + the pages' scales
            scales = kv_quant.pack_pages(self.kv, self.scales, ids, lay.payload_view(rec))
        else:
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
        if self.scales is not None:
            kv_quant.unpack_pages(lay.payload_view(rec), scales, ids, self.kv, self.scales)
            return
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
