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
  batch at the step it left (``disagg/receiver.py``: the incoming side's state machine).

Control messages (requests, snapshots, outputs, aborts) travel on a ``multiprocessing``
connection to the front end; KV bytes travel worker to worker on the transport (gloo or NCCL).

This module is the worker's loop, its commands, its steps and the outgoing side (exports and
their sends); the incoming side is ``disagg/receiver.py``.

NOTE (faults): every transfer has a deadline (``timeout_s``); past it the request fails alone (a
``Failed`` event) and the others go on. A buffer handed to the transport is freed only once the
handle is settled (gloo cannot withdraw a posted receive: a late segment would otherwise land in
the next request's staging slice). An abort frees the request's pages and staging at once, or as
soon as its transfer settled.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from flash_dllm.disagg import migrate
from flash_dllm.disagg.messages import (Abort, Add, Expect, Exported, Failed, Import, Out, Peers,
                                        Release, Stats, Stop)
from flash_dllm.disagg.receiver import Receiver
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


class Worker:
    """The worker loop over an engine, a transport and a control connection (``conn``: anything
    with ``send``/``recv``/``poll``). ``layer_groups`` > 1: pipelined sends
    (``disagg/pipeline.py``)."""

    def __init__(self, engine: Engine, transport: Transport, conn, *, timeout_s: float = 30.0,
                 staging_bytes: int = 64 << 20, wire_device: torch.device | None = None,
                 ipc: bool = False, layer_groups: int = 1) -> None:
        migrate.refuse_fp8_kv(engine.config)
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
        self.rx = Receiver(self)                          # incoming requests
        self.stopping = False
        self.prefill_steps = 0
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
                elif self.sends or self.rx.recvs or self.rx.stranded:
                    time.sleep(0.0005)       # transfers only: let them progress
                self._report_stats()

    def _busy(self) -> bool:
        return bool(self.engine.has_unfinished() or self.sends or self.rx.busy())

    def _idle(self) -> bool:
        return not (self.engine.has_unfinished() or self.sends or self.rx.pending)

    def emit(self, msg) -> None:
        """Send ``msg`` to the front end (gone: the loop ends at its next poll)."""
        try:
            self.conn.send(msg)
        except OSError:
            pass

    def _commands(self, timeout: float) -> None:
        while self.conn.poll(timeout):
            timeout = 0
            msg = self.conn.recv()
            if isinstance(msg, Add):
                self._add(msg)
            elif isinstance(msg, Import):
                self.rx.on_import(msg)
            elif isinstance(msg, Expect):
                self.rx.on_expect(msg)
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
            self.emit(Failed(msg.request_id, str(e), "request"))
            return
        if msg.dst is not None:
            if self.pipeline is not None and msg.groups > 1:
                self.pipeline.pending[msg.request_id] = (msg.dst, msg.tag)
            else:
                self.exports[msg.request_id] = (msg.dst, msg.tag)

    def _abort(self, rid: str) -> None:
        self.exports.pop(rid, None)
        if self.pipeline is not None:
            self.pipeline.forget(rid)
        if not self.engine.abort(rid):
            self.rx.abort(rid)                # (in transit to here, or unknown)

    # -------------------------------------------------------------------------------- steps
    def _step(self) -> None:
        e = self.engine
        reqs = {r.request_id: r for r in (*e.running, *e.scheduler.waiting)}
        outs = e.step()
        self.prefill_steps += any(r.num_forwards == 1 for r in e.running)
        for so in outs:
            req = reqs.get(so.request_id)
            if so.new_token_ids or so.finished:
                self.emit(Out(so.request_id, so.new_token_ids, so.num_tokens,
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
                    self.emit(Exported(snap, dst, tag, groups=len(self.pipeline.groups)))
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
            self.emit(Failed(rid, f"sending its KV to worker {dst} failed: {e}"))
            return
        self.track_send(h, buf, rid)
        self.emit(Exported(snap, dst, tag))

    def _export_ipc(self, rid: str, dst: int, tag: int) -> None:
        kv = self.engine.runner.kv
        shape = packed_shape(kv.shape, len(self.engine.kv_manager.pages(rid)))
        n = math.prod(shape) * kv.element_size()
        if n > self.alloc.capacity:
            self.engine.abort(rid)
            self.emit(Failed(rid, f"its KV segment ({n} bytes) is larger than worker "
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
        self.emit(Exported(snap, dst, tag, off))

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
                    self.emit(Failed(s.request_id, f"sending its KV failed: {e}"))
                continue
            if now > s.deadline and not s.failed:
                s.failed = True
                self.transport.cancel(s.handle)
                self.emit(Failed(s.request_id, f"sending its KV to worker {s.handle.peer} "
                                               f"timed out after {2 * self.timeout_s:.3g} s"))
            if s.failed and self.transport.settled(s.handle):
                continue
            keep.append(s)
        self.sends = keep
        self.rx.poll(now)

    # ------------------------------------------------------------------------------- stats
    def stats(self) -> Stats:
        e = self.engine
        running, waiting = e.counts()
        return Stats(self.rank, running, waiting, e.kv_manager.num_used, e.kv_manager.num_pages,
                     len(self.alloc.allocated()), len(self.sends), self.rx.pending,
                     e.stats["forwards"], e.stats["step_seconds"], self.prefill_steps)

    def _report_stats(self) -> None:
        s = self.stats()
        # on a change of what it holds, and every 16 forwards (the forward counters): an idle
        # worker sends nothing (nobody reads its connection while the router is idle)
        key = (s.running, s.waiting, s.pages_used, s.staging_used, s.sends, s.recvs,
               s.steps // 16)
        if key != self._last_stats:
            self._last_stats = key
            self.emit(s)
