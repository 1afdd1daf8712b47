"""A prefill/decode worker: one process, one ``Engine``, one device, driven by the front end.

Every worker holds a whole engine, so a role is only what the front end sends it (and a role
switch needs no reload):

- **prefill**: ``Add`` requests run their first forward (the whole prompt and masked canvas), then
  leave the engine (``disagg/migrate.py``): the KV is packed into ONE contiguous page-first
  segment and sent to the decode worker the front end chose, with one ``send`` on the KV
  transport (``distributed/transport.py``), and the request's snapshot goes to the front end,
  which forwards it to that worker. A request that finishes in its first step never moves.
- **decode**: ``Import`` messages name an incoming segment; the worker reserves the request's
  pages and a staging slice (``SegmentAllocator``), posts the receive, and between steps polls
  it; once the bytes landed it unpacks them into its pages and the request joins the running
  batch at the step it left.

Control messages (requests, snapshots, outputs, aborts) travel on a ``multiprocessing``
connection to the front end; KV bytes travel worker to worker on the transport (gloo or NCCL).

NOTE (faults): every transfer has a deadline (``timeout_s``); past it the request fails alone (a
``Failed`` event) and the others go on. A buffer handed to the transport is freed only once the
handle is settled (gloo cannot withdraw a posted receive: a late segment would otherwise land in
the next request's staging slice). An abort frees the request's pages and staging at once, or as
soon as its transfer settled.

NOTE (size): one file over ~400 lines because the two-sided path (a posted receive into a staging
slice) and the CUDA IPC path (a read from the peer's staging) share one state machine per incoming
request (queued -> posted -> landed, abort and deadline in each state); split, each half would
have to re-derive the other's invariants.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from flash_dllm.disagg import migrate
from flash_dllm.disagg.messages import (Abort, Add, Consumed, Expect, Exported, Failed, Import,
                                        Imported, Out, Peers, Release, Stats, Stop)
from flash_dllm.distributed.segment_allocator import SegmentAllocator
from flash_dllm.distributed.transport import TransferError, Transport
from flash_dllm.engine.engine import Engine
from flash_dllm.kernels.kv_pages import packed_shape

STAGING_ALIGN = 4096


# ------------------------------------------------------------------------------------- the worker
@dataclass(eq=False)
class _Send:
    handle: object
    buf: torch.Tensor
    deadline: float
    request_id: str
    failed: bool = False


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


class Worker:
    """The worker loop over an engine, a transport and a control connection (``conn``: anything
    with ``send``/``recv``/``poll``). ``layer_groups`` > 1: pipelined sends
    (``disagg/pipeline.py``)."""

    def __init__(self, engine: Engine, transport: Transport, conn, *, timeout_s: float = 30.0,
                 staging_bytes: int = 64 << 20, wire_device: torch.device | None = None,
                 ipc: bool = False, layer_groups: int = 1) -> None:
        self.engine = engine
        self.transport = transport
        self.conn = conn
        self.rank = transport.rank
        self.timeout_s = timeout_s
        # segments travel from/to this device: the engine's, or the host when the transport is
        # gloo and the engine on a GPU (one device<->host copy each way)
        self.wire = wire_device or engine.device
        cap = max(STAGING_ALIGN, staging_bytes - staging_bytes % STAGING_ALIGN)
        self.staging = torch.empty(cap, dtype=torch.uint8, device=self.wire,
                                   pin_memory=self.wire.type == "cpu"
                                   and engine.device.type == "cuda")
        self.alloc = SegmentAllocator(cap, STAGING_ALIGN)
        # NOTE (CUDA IPC, workers sharing a GPU): the staging buffer holds OUTGOING segments;
        # the decode worker unpacks straight from the prefill worker's buffer (one-sided read,
        # no copy in between) and the front end relays its ``Consumed`` as a ``Release``
        self.ipc = ipc
        self.peers: dict[int, torch.Tensor] = {}
        self.exports: dict[str, tuple[int, int]] = {}     # request id -> (dst, tag)
        self.pipeline = None
        if layer_groups > 1 and not ipc:
            from flash_dllm.disagg.pipeline import LayerSender
            self.pipeline = LayerSender(self, layer_groups)
            engine.runner.layer_hook = self.pipeline
        self.sends: list[_Send] = []
        self.queued: deque[_Recv] = deque()               # waiting for pages / staging
        self.recvs: dict[str, _Recv] = {}                 # posted
        self.landed: list[_Recv] = []                     # received, waiting for a slot
        self.stranded: list[_Recv] = []                   # cancelled, not yet settled
        self.stopping = False
        self.prefill_steps = 0
        self.checksum_failures = 0
        self._last_stats = None

    # ------------------------------------------------------------------------------- loop
    def run(self) -> None:
        with torch.inference_mode():
            while not (self.stopping and self._idle()):
                try:
                    self._commands(timeout=0 if self._busy() else 0.05)
                except (EOFError, OSError):     # the front end is gone: nobody to answer
                    return
                self._transfers()
                if self.engine.has_unfinished():
                    self._step()
                elif self.sends or self.recvs or self.stranded:
                    time.sleep(0.0005)       # transfers only: let them progress
                self._report_stats()

    def _busy(self) -> bool:
        return bool(self.engine.has_unfinished() or self.sends or self.queued or self.recvs
                    or self.stranded or self.landed)

    def _idle(self) -> bool:
        return not (self.engine.has_unfinished() or self.sends or self.recvs or self.queued
                    or self.landed)

    def _emit(self, msg) -> None:
        try:
            self.conn.send(msg)
        except OSError:                 # the front end is gone; the loop ends at its next poll
            pass

    def _commands(self, timeout: float) -> None:
        while self.conn.poll(timeout):
            timeout = 0
            msg = self.conn.recv()
            if isinstance(msg, Add):
                self._add(msg)
            elif isinstance(msg, Import):
                self._import(msg)
            elif isinstance(msg, Expect):
                self._expect(msg)
            elif isinstance(msg, Abort):
                self._abort(msg.request_id)
            elif isinstance(msg, Release):
                self.alloc.free(msg.offset)
            elif isinstance(msg, Peers):
                self._meet(msg.handles)
            elif isinstance(msg, Stop):
                self.stopping = True
            else:
                raise TypeError(f"worker {self.rank}: unknown control message {msg!r}")

    def _meet(self, shares: dict) -> None:
        """The other workers' ``(kind, payload)``: a CUDA IPC handle of their staging buffer,
        or their NIXL agent's metadata."""
        for r, (kind, payload) in shares.items():
            if r == self.rank:
                continue
            if kind == "ipc":
                from torch.multiprocessing.reductions import rebuild_cuda_tensor
                self.peers[r] = rebuild_cuda_tensor(*payload)
            elif kind == "nixl":
                self.transport.add_peer(r, payload)
            else:
                raise TypeError(f"worker {self.rank}: unknown peer share {kind!r}")

    def _add(self, msg: Add) -> None:
        try:
            self.engine.add_request(msg.prompt_ids, msg.params, request_id=msg.request_id,
                                    prompt=msg.prompt)
        except ValueError as e:
            self._emit(Failed(msg.request_id, str(e), "request"))
            return
        if msg.dst is not None:
            if self.pipeline is not None and msg.groups > 1:
                self.pipeline.pending[msg.request_id] = (msg.dst, msg.tag)
            else:
                self.exports[msg.request_id] = (msg.dst, msg.tag)

    def _find(self, rid: str) -> _Recv | None:
        for r in (*self.queued, *self.recvs.values(), *self.landed):
            if r.rid == rid:
                return r
        return None

    def _import(self, msg: Import) -> None:
        snap, now = msg.snap, time.monotonic()
        r = self._find(snap.request_id)
        if r is not None:                # pipelined: its receives were posted at the Announce
            if snap.kv_nbytes != r.nbytes or r.snap is not None:
                self._fail_recv(r, "its snapshot does not match the announced segment")
                return
            # (``arrived`` restarts: ``Imported.seconds`` is what stays visible after the step)
            r.snap, r.deadline, r.arrived = snap, now + self.timeout_s, now
            return
        self.queued.append(_Recv(snap.request_id, msg.src, msg.tag, snap.kv_nbytes,
                                 tuple(snap.kv_shape), now, now + self.timeout_s, snap=snap,
                                 src_offset=msg.offset))

    def _expect(self, msg: Expect) -> None:
        kv = self.engine.runner.kv
        shape = tuple(packed_shape(kv.shape, self.engine.kv_manager.pages_for(msg.canvas_len)))
        now = time.monotonic()
        self.queued.append(_Recv(msg.request_id, msg.src, msg.tag,
                                 math.prod(shape) * kv.element_size(), shape, now,
                                 now + self.timeout_s,
                                 groups=migrate.layer_groups(kv.shape[0], msg.groups)))

    def _abort(self, rid: str) -> None:
        self.exports.pop(rid, None)
        if self.pipeline is not None:
            self.pipeline.forget(rid)
        if self.engine.abort(rid):
            return
        r = self._find(rid)
        if r is not None:                # NOTE: still received (into staging only) and
            r.aborted = True             # dropped, so the sender's buffers settle
            if r.pages is not None:
                self.engine.kv_manager.free(rid, None)
                r.pages = None
        # (an unknown id: finished, failed, or never here; the front end sends an Import or
        # an Expect before the Abort of a request in transit, so nothing is remembered)

    def _drop(self, r: _Recv) -> None:
        """Give up on an incoming request: its pages now, its staging once the receive settled."""
        if r.pages is not None:
            self.engine.kv_manager.free(r.rid, None)
            r.pages = None
        if r.handles:
            for h in r.handles:
                self.transport.cancel(h)
            self.stranded.append(r)
        elif r.offset is not None:
            self.alloc.free(r.offset)
            r.offset = None

    # -------------------------------------------------------------------------------- steps
    def _step(self) -> None:
        e = self.engine
        reqs = {r.request_id: r for r in (*e.running, *e.scheduler.waiting)}
        outs = e.step()
        self.prefill_steps += any(r.num_forwards == 1 for r in e.running)
        for so in outs:
            req = reqs.get(so.request_id)
            if so.new_token_ids or so.finished:
                self._emit(Out(so.request_id, so.new_token_ids, so.num_tokens,
                               req.num_forwards if req is not None else 0, so.finished,
                               so.finish_reason))
            if so.finished:
                self.exports.pop(so.request_id, None)
                if self.pipeline is not None:
                    self.pipeline.forget(so.request_id)
        if self.pipeline is not None:            # its KV went during the forward: the rest
            for rid, (dst, tag, checksum) in list(self.pipeline.sent.items()):
                del self.pipeline.sent[rid]
                if self.engine.scheduler.find(rid) is not None:
                    snap = migrate.snapshot(self.engine, rid)
                    snap.kv_checksum = checksum
                    migrate.detach(self.engine, rid)
                    self._emit(Exported(snap, dst, tag, groups=len(self.pipeline.groups)))
        for rid in [r for r in self.exports
                    if (req := self.engine.scheduler.find(r)) is not None
                    and req in self.engine.running and req.num_forwards >= 1]:
            self._export(rid)

    def track_send(self, handle, buf: torch.Tensor, rid: str) -> None:
        # NOTE: 2x the timeout: the receiver gives up first (it knows when it posted)
        self.sends.append(_Send(handle, buf, time.monotonic() + 2 * self.timeout_s, rid))

    def _export(self, rid: str) -> None:
        dst, tag = self.exports.pop(rid)
        if self.ipc:
            self._export_ipc(rid, dst, tag)
            return
        snap, seg = migrate.export_request(self.engine, rid)
        buf = seg if seg.device == self.wire else seg.to(self.wire)
        snap.kv_checksum = migrate.segment_checksum(buf)     # (on a GPU: syncs after the pack)
        try:
            h = self.transport.send(dst, buf, tag)
        except (TransferError, ValueError, RuntimeError) as e:
            self._emit(Failed(rid, f"sending its KV to worker {dst} failed: {e}"))
            return
        self.track_send(h, buf, rid)
        self._emit(Exported(snap, dst, tag))

    def _export_ipc(self, rid: str, dst: int, tag: int) -> None:
        kv = self.engine.runner.kv
        shape = packed_shape(kv.shape, len(self.engine.kv_manager.pages(rid)))
        n = math.prod(shape) * kv.element_size()
        if n > self.alloc.capacity:
            self.engine.abort(rid)
            self._emit(Failed(rid, f"its KV segment ({n} bytes) is larger than worker "
                                   f"{self.rank}'s staging buffer ({self.alloc.capacity} bytes): "
                                   "raise --pd-staging-gb", "request"))
            return
        off = self.alloc.alloc(n)
        if off is None:                # staging full: it decodes here one more step, then retry
            self.exports[rid] = (dst, tag)
            return
        out = self.staging[off:off + n].view(kv.dtype).view(shape)
        snap, _ = migrate.export_request(self.engine, rid, out=out)
        snap.kv_checksum = migrate.segment_checksum(out)   # (syncs: packed before it is read)
        self._emit(Exported(snap, dst, tag, off))

    # ---------------------------------------------------------------------------- transfers
    def _transfers(self) -> None:
        now = time.monotonic()
        keep = []
        for s in self.sends:
            try:
                if self.transport.poll(s.handle):
                    continue                             # done: the buffer is free
            except TransferError as e:
                if not s.failed:
                    self._emit(Failed(s.request_id, f"sending its KV failed: {e}"))
                continue
            if now > s.deadline and not s.failed:
                s.failed = True
                self.transport.cancel(s.handle)
                self._emit(Failed(s.request_id, f"sending its KV to worker {s.handle.peer} "
                                                f"timed out after {2 * self.timeout_s:.3g} s"))
            if s.failed and self.transport.settled(s.handle):
                continue
            keep.append(s)
        self.sends = keep
        self._post_receives(now)
        for rid, r in list(self.recvs.items()):
            try:
                done = all([self.transport.poll(h) for h in r.handles])
            except TransferError as e:
                del self.recvs[rid]
                self._fail_recv(r, f"receiving its KV from worker {r.src} failed: {e}")
                continue
            if done:
                del self.recvs[rid]
                self.landed.append(r)
            elif now > r.deadline:
                del self.recvs[rid]
                self._fail_recv(r, f"its KV from worker {r.src} did not arrive within "
                                   f"{self.timeout_s:.3g} s")
        waiting = []
        for r in self.landed:
            if r.aborted or (r.snap is not None and migrate.can_import(self.engine)):
                self._land(r)
            elif r.snap is None and now > r.deadline:
                self._fail_recv(r, f"its snapshot from worker {r.src} did not arrive within "
                                   f"{self.timeout_s:.3g} s")
            else:        # a local request took the slot meanwhile, or the snapshot is on its way
                waiting.append(r)
        self.landed = waiting
        still = []
        for r in self.stranded:
            if all(self.transport.settled(h) for h in r.handles):
                self.alloc.free(r.offset)
            else:
                still.append(r)
        self.stranded = still

    def _fail_recv(self, r: _Recv, message: str) -> None:
        self._drop(r)
        if not r.aborted:
            self._emit(Failed(r.rid, message))

    def _post_receives(self, now: float) -> None:
        """Post queued receives in arrival order while pages, a staging slice and a running slot
        are free (NCCL matches a pair's transfers in posting order: never reorder them)."""
        while self.queued:
            r = self.queued[0]
            if now > r.deadline:
                self.queued.popleft()
                if not r.aborted:
                    self._fail_recv(r, f"no room for its KV within {self.timeout_s:.3g} s "
                                       f"(pages or staging of worker {self.rank} stayed full)")
                self._consumed(r)
                continue
            if r.src_offset is not None:       # CUDA IPC: read it where it lies
                if not self._read_ipc(r):
                    return
                self.queued.popleft()
                continue
            n = r.nbytes
            try:
                if n > self.alloc.capacity:
                    raise migrate.MigrationError(
                        f"its KV segment ({n} bytes) is larger than worker {self.rank}'s staging "
                        f"buffer ({self.alloc.capacity} bytes): raise --pd-staging-gb")
                if not r.aborted and len(self.engine.scheduler.running) + len(self.recvs) \
                        + len(self.landed) >= self.engine.config.max_num_seqs:
                    return                     # a running slot for each posted receive
                if r.pages is None and not r.aborted:
                    r.pages = self._reserve(r)
                    if r.pages is None:
                        return
            except migrate.MigrationError as e:
                self.queued.popleft()
                self._fail_recv(r, str(e))
                continue
            off = self.alloc.alloc(n)
            if off is None:
                return
            r.offset = off
            slot = self.staging[off:off + n]
            parts = [slot] if r.groups is None else migrate.group_views(
                slot, r.kv_shape, self.engine.runner.kv.dtype, r.groups)
            try:
                for g, part in enumerate(parts):
                    r.handles.append(self.transport.recv(r.src, part.view(-1).view(torch.uint8)
                                                         if part.dtype != torch.uint8 else part,
                                                         r.tag + g))
            except (TransferError, ValueError, RuntimeError) as e:
                self.queued.popleft()
                self._fail_recv(r, f"receiving its KV failed: {e}")
                continue
            self.queued.popleft()
            self.recvs[r.rid] = r

    def _reserve(self, r: _Recv) -> list | None:
        if r.snap is not None:
            return migrate.reserve(self.engine, r.snap)
        return migrate.reserve_pages(self.engine, r.rid, r.kv_shape[0] * self.engine.kv_manager
                                     .page_size)

    def _consumed(self, r: _Recv) -> None:
        if r.src_offset is not None:
            self._emit(Consumed(r.src, r.src_offset))

    def _read_ipc(self, r: _Recv) -> bool:
        """Import a request straight from the prefill worker's staging (False: no room yet)."""
        snap = r.snap
        if not r.aborted:
            if len(self.engine.scheduler.running) + len(self.landed) \
                    >= self.engine.config.max_num_seqs:
                return False
            try:
                r.pages = migrate.reserve(self.engine, snap)
            except migrate.MigrationError as e:
                self._emit(Failed(snap.request_id, str(e), _kind(e)))
                self._consumed(r)
                return True
            if r.pages is None:
                return False
            peer = self.peers.get(r.src)
            try:
                if peer is None:
                    raise migrate.MigrationError(f"worker {r.src}'s staging buffer is not "
                                                 "shared with this worker")
                seg = peer[r.src_offset:r.src_offset + r.nbytes]
                self._verify(snap, seg)
                migrate.import_request(self.engine, snap, seg, r.pages)
                torch.cuda.current_stream(self.engine.device).synchronize()   # read, then free
                self._emit(Imported(snap.request_id, time.monotonic() - r.arrived, r.nbytes))
            except migrate.MigrationError as e:
                self.engine.kv_manager.free(snap.request_id, None)
                self._emit(Failed(snap.request_id, str(e), _kind(e)))
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
        n = r.nbytes
        if r.aborted:                            # received only so the sender settles
            self.alloc.free(r.offset)
            return
        seg = self.staging[r.offset:r.offset + n]
        try:
            self._verify(r.snap, seg)
            migrate.import_request(self.engine, r.snap, seg, r.pages, groups=r.groups)
        except migrate.MigrationError as e:
            self.alloc.free(r.offset)
            self.engine.kv_manager.free(r.rid, None)
            self._emit(Failed(r.rid, str(e), _kind(e)))
            return
        if self.engine.device.type == "cuda":     # the unpack read the slice: then reuse it
            torch.cuda.current_stream(self.engine.device).synchronize()
        self.alloc.free(r.offset)
        self._emit(Imported(r.rid, time.monotonic() - r.arrived, n))

    # ------------------------------------------------------------------------------- stats
    def stats(self) -> Stats:
        e = self.engine
        return Stats(self.rank, len(e.running), e.scheduler.num_waiting, e.kv_manager.num_used,
                     e.pool.num_pages, len(self.alloc.allocated()), len(self.sends),
                     len(self.recvs) + len(self.queued) + len(self.landed), e.stats["forwards"],
                     e.stats["step_seconds"], self.prefill_steps)

    def _report_stats(self) -> None:
        s = self.stats()
        # on a change of what it holds, and every 16 forwards (the forward counters): an idle
        # worker sends nothing (nobody reads its connection while the router is idle)
        key = (s.running, s.waiting, s.pages_used, s.staging_used, s.sends, s.recvs,
               s.steps // 16)
        if key != self._last_stats:
            self._last_stats = key
            self._emit(s)
