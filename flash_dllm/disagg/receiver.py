"""The decode side of a disaggregated worker: requests whose KV comes in from a prefill worker.

``Import`` (a snapshot; CUDA IPC: where its segment lies in the sender's staging) and ``Expect``
(pipelined: the layer groups come before the snapshot) queue an incoming request. Between steps,
``Receiver.poll`` posts the queued receives in arrival order while pages, a staging slice and a
running slot are free, polls the posted ones, and imports the landed ones into the engine
(``disagg/migrate.py``); with CUDA IPC it reads the segment straight from the sender's staging.

NOTE: the two-sided path (a posted receive into a staging slice) and the CUDA IPC path (a read
from the peer's staging) share one state machine per incoming request (queued -> posted ->
landed, abort and deadline in each state). A buffer handed to the transport is freed only once
its handles settled (gloo cannot withdraw a posted receive: a late segment would otherwise land
in the next request's staging slice); an aborted request in transit is still received and
dropped, so its sender's send settles.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from flash_dllm.disagg import migrate
from flash_dllm.disagg.messages import Consumed, Expect, Failed, Import, Imported
from flash_dllm.distributed.transport import TransferError
from flash_dllm.kernels.kv_pages import packed_shape


@dataclass(eq=False)
class _Recv:
    """One incoming request: queued (waiting for room) -> posted -> landed -> imported."""

    rid: str
    src: int
    tag: int
    nbytes: int
    kv_shape: tuple
    arrived: float
    deadline: float
    snap: migrate.RequestSnapshot | None = None   # (pipelined: arrives after the receives)
    groups: list | None = None       # pipelined: the layer ranges, one receive each
    src_offset: int | None = None    # CUDA IPC: where it lies in the sender's staging
    pages: list | None = None
    offset: int | None = None
    handles: list = field(default_factory=list)
    aborted: bool = False


def _kind(e: migrate.MigrationError) -> str:
    return "checksum" if isinstance(e, migrate.CorruptSegment) else "request"


class Receiver:
    """The incoming requests of ``worker`` (a ``disagg.worker.Worker``: its engine, transport,
    staging buffer and allocator, peers' staging, deadline and control connection)."""

    def __init__(self, worker) -> None:
        self.w = worker
        self.queued: deque[_Recv] = deque()               # waiting for pages / staging
        self.recvs: dict[str, _Recv] = {}                 # posted
        self.landed: list[_Recv] = []                     # received, waiting for a slot
        self.stranded: list[_Recv] = []                   # cancelled, not yet settled
        self.checksum_failures = 0

    @property
    def pending(self) -> int:
        """Receives posted or waiting for room."""
        return len(self.recvs) + len(self.queued) + len(self.landed)

    def busy(self) -> bool:
        return bool(self.queued or self.recvs or self.landed or self.stranded)

    def _running(self) -> int:
        return self.w.engine.counts()[0]

    # -------------------------------------------------------------------------------- messages
    def _find(self, rid: str) -> _Recv | None:
        for r in (*self.queued, *self.recvs.values(), *self.landed):
            if r.rid == rid:
                return r
        return None

    def on_import(self, msg: Import) -> None:
        snap, now = msg.snap, time.monotonic()
        r = self._find(snap.request_id)
        if r is not None:                # pipelined: its receives were posted at the Announce
            if snap.kv_nbytes != r.nbytes or r.snap is not None:
                self._fail(r, "its snapshot does not match the announced segment")
                return
            # (``arrived`` restarts: ``Imported.seconds`` is what stays visible after the step)
            r.snap, r.deadline, r.arrived = snap, now + self.w.timeout_s, now
            return
        self.queued.append(_Recv(snap.request_id, msg.src, msg.tag, snap.kv_nbytes,
                                 tuple(snap.kv_shape), now, now + self.w.timeout_s, snap=snap,
                                 src_offset=msg.offset))

    def on_expect(self, msg: Expect) -> None:
        eng = self.w.engine
        kv = eng.runner.kv
        shape = tuple(packed_shape(kv.shape, eng.kv_manager.pages_for(msg.canvas_len)))
        now = time.monotonic()
        self.queued.append(_Recv(msg.request_id, msg.src, msg.tag,
                                 math.prod(shape) * kv.element_size(), shape, now,
                                 now + self.w.timeout_s,
                                 groups=migrate.layer_groups(kv.shape[0], msg.groups)))

    def abort(self, rid: str) -> None:
        r = self._find(rid)
        if r is not None:                # NOTE: still received (into staging only) and
            r.aborted = True             # dropped, so the sender's buffers settle
            if r.pages is not None:
                self.w.engine.kv_manager.free(rid, None)
                r.pages = None
        # (an unknown id: finished, failed, or never here; the front end sends an Import or
        # an Expect before the Abort of a request in transit, so nothing is remembered)

    def _drop(self, r: _Recv) -> None:
        """Give up on an incoming request: its pages now, its staging once the receive settled."""
        w = self.w
        if r.pages is not None:
            w.engine.kv_manager.free(r.rid, None)
            r.pages = None
        if r.handles:
            for h in r.handles:
                w.transport.cancel(h)
            self.stranded.append(r)
        elif r.offset is not None:
            w.alloc.free(r.offset)
            r.offset = None

    def _fail(self, r: _Recv, message: str) -> None:
        self._drop(r)
        if not r.aborted:
            self.w.emit(Failed(r.rid, message))

    # ------------------------------------------------------------------------------- transfers
    def poll(self, now: float) -> None:
        """Post what has room, poll what is posted, import what landed, free what settled."""
        w = self.w
        self._post(now)
        for rid, r in list(self.recvs.items()):
            try:
                done = all([w.transport.poll(h) for h in r.handles])
            except TransferError as e:
                del self.recvs[rid]
                self._fail(r, f"receiving its KV from worker {r.src} failed: {e}")
                continue
            if done:
                del self.recvs[rid]
                self.landed.append(r)
            elif now > r.deadline:
                del self.recvs[rid]
                self._fail(r, f"its KV from worker {r.src} did not arrive within "
                              f"{w.timeout_s:.3g} s")
        waiting = []
        for r in self.landed:
            if r.aborted or (r.snap is not None and migrate.can_import(w.engine)):
                self._land(r)
            elif r.snap is None and now > r.deadline:
                self._fail(r, f"its snapshot from worker {r.src} did not arrive within "
                              f"{w.timeout_s:.3g} s")
            else:        # a local request took the slot meanwhile, or the snapshot is on its way
                waiting.append(r)
        self.landed = waiting
        still = []
        for r in self.stranded:
            if all(w.transport.settled(h) for h in r.handles):
                w.alloc.free(r.offset)
            else:
                still.append(r)
        self.stranded = still

    def _post(self, now: float) -> None:
        """Post queued receives in arrival order while pages, a staging slice and a running slot
        are free (NCCL matches a pair's transfers in posting order: never reorder them)."""
        w = self.w
        while self.queued:
            r = self.queued[0]
            if now > r.deadline:
                self.queued.popleft()
                if not r.aborted:
                    self._fail(r, f"no room for its KV within {w.timeout_s:.3g} s "
                                  f"(pages or staging of worker {w.rank} stayed full)")
                self._consumed(r)
                continue
            if r.src_offset is not None:       # CUDA IPC: read it where it lies
                if not self._read_ipc(r):
                    return
                self.queued.popleft()
                continue
            n = r.nbytes
            try:
                if n > w.alloc.capacity:
                    raise migrate.MigrationError(
                        f"its KV segment ({n} bytes) is larger than worker {w.rank}'s staging "
                        f"buffer ({w.alloc.capacity} bytes): raise --pd-staging-gb")
                if not r.aborted and self._running() + len(self.recvs) + len(self.landed) \
                        >= w.engine.config.max_num_seqs:
                    return                     # a running slot for each posted receive
                if r.pages is None and not r.aborted:
                    r.pages = self._reserve(r)
                    if r.pages is None:
                        return
            except migrate.MigrationError as e:
                self.queued.popleft()
                self._fail(r, str(e))
                continue
            off = w.alloc.alloc(n)
            if off is None:
                return
            r.offset = off
            slot = w.staging[off:off + n]
            parts = [slot] if r.groups is None else migrate.group_views(
                slot, r.kv_shape, w.engine.runner.kv.dtype, r.groups)
            try:
                for g, part in enumerate(parts):
                    r.handles.append(w.transport.recv(r.src, part.view(-1).view(torch.uint8)
                                                      if part.dtype != torch.uint8 else part,
                                                      r.tag + g))
            except (TransferError, ValueError, RuntimeError) as e:
                self.queued.popleft()
                self._fail(r, f"receiving its KV failed: {e}")
                continue
            self.queued.popleft()
            self.recvs[r.rid] = r

    def _reserve(self, r: _Recv) -> list | None:
        eng = self.w.engine
        if r.snap is not None:
            return migrate.reserve(eng, r.snap)
        return migrate.reserve_pages(eng, r.rid, r.kv_shape[0] * eng.kv_manager.page_size)

    def _consumed(self, r: _Recv) -> None:
        if r.src_offset is not None:
            self.w.emit(Consumed(r.src, r.src_offset))

    def _read_ipc(self, r: _Recv) -> bool:
        """Import a request straight from the prefill worker's staging (False: no room yet)."""
        w, snap = self.w, r.snap
        if not r.aborted:
            if self._running() + len(self.landed) >= w.engine.config.max_num_seqs:
                return False
            try:
                r.pages = migrate.reserve(w.engine, snap)
            except migrate.MigrationError as e:
                w.emit(Failed(snap.request_id, str(e), _kind(e)))
                self._consumed(r)
                return True
            if r.pages is None:
                return False
            peer = w.peers.get(r.src)
            try:
                if peer is None:
                    raise migrate.MigrationError(f"worker {r.src}'s staging buffer is not "
                                                 "shared with this worker")
                seg = peer[r.src_offset:r.src_offset + r.nbytes]
                self._verify(snap, seg)
                migrate.import_request(w.engine, snap, seg, r.pages)
                torch.cuda.current_stream(w.engine.device).synchronize()   # read, then free
                w.emit(Imported(snap.request_id, time.monotonic() - r.arrived, r.nbytes))
            except migrate.MigrationError as e:
                w.engine.kv_manager.free(snap.request_id, None)
                w.emit(Failed(snap.request_id, str(e), _kind(e)))
        self._consumed(r)
        return True

    def _verify(self, snap, seg: torch.Tensor) -> None:
        """Raise ``MigrationError`` (the request fails, nothing is served) unless ``seg`` holds
        the bytes the sender checksummed."""
        if snap.kv_checksum is not None and migrate.segment_checksum(seg) != snap.kv_checksum:
            self.checksum_failures += 1
            raise migrate.CorruptSegment("its KV segment arrived corrupted (checksum mismatch); "
                                         "it was not served")

    def _land(self, r: _Recv) -> None:
        w, n = self.w, r.nbytes
        if r.aborted:                            # received only so the sender settles
            w.alloc.free(r.offset)
            return
        seg = w.staging[r.offset:r.offset + n]
        try:
            self._verify(r.snap, seg)
            migrate.import_request(w.engine, r.snap, seg, r.pages, groups=r.groups)
        except migrate.MigrationError as e:
            w.alloc.free(r.offset)
            w.engine.kv_manager.free(r.rid, None)
            w.emit(Failed(r.rid, str(e), _kind(e)))
            return
        if w.engine.device.type == "cuda":     # the unpack read the slice: then reuse it
            torch.cuda.current_stream(w.engine.device).synchronize()
        w.alloc.free(r.offset)
        w.emit(Imported(r.rid, time.monotonic() - r.arrived, n))
