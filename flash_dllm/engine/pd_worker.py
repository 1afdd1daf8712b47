"""A prefill/decode worker: one process, one ``Engine``, one device, driven by the front end.

Every worker holds a whole engine, so a role is only what the front end sends it (and a role
switch needs no reload):

- **prefill**: ``Add`` requests run their first forward (the whole prompt and masked canvas), then
  leave the engine (``engine/migrate.py``): the KV is packed into ONE contiguous page-first
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
"""
from __future__ import annotations

import os
import pickle
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

import torch

from flash_dllm.distributed.segment_allocator import SegmentAllocator
from flash_dllm.distributed.transport import TransferError, Transport
from flash_dllm.engine import migrate
from flash_dllm.engine.engine import Engine

STAGING_ALIGN = 4096


class Channel:
    """A control connection that pickles with the plain pickler: ``Connection.send`` uses
    multiprocessing's, for which torch registers tensor reductions through shared-memory file
    descriptors (a handshake of its own that the peer's authkey would have to match)."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def send(self, obj) -> None:
        self.conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self):
        return pickle.loads(self.conn.recv_bytes())

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def close(self) -> None:
        self.conn.close()


# --------------------------------------------------------------------------- messages (picklable)
@dataclass(frozen=True)
class Add:
    """Front end -> prefill worker: run this request's first step, then move it to ``dst``
    (``None``: keep it here to the end)."""

    request_id: str
    prompt_ids: list
    params: object
    prompt: str | None
    dst: int | None
    tag: int


@dataclass(frozen=True)
class Import:
    """Front end -> decode worker: ``snap``'s segment comes from worker ``src`` with ``tag``."""

    snap: migrate.RequestSnapshot
    src: int
    tag: int


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Out:
    """Worker -> front end: a request's committed prefix grew, or it finished."""

    request_id: str
    new_ids: list
    num_tokens: int
    num_forwards: int
    finished: bool
    finish_reason: str | None


@dataclass(frozen=True)
class Exported:
    """Prefill worker -> front end: the request left; forward ``snap`` to ``dst``."""

    snap: migrate.RequestSnapshot
    dst: int
    tag: int


@dataclass(frozen=True)
class Imported:
    """Decode worker -> front end: the request's segment landed; it runs here now."""

    request_id: str
    seconds: float             # from the Import message to the unpacked pages
    nbytes: int


@dataclass(frozen=True)
class Failed:
    """Worker -> front end: this request failed (a transfer error or timeout); others go on."""

    request_id: str
    message: str


@dataclass(frozen=True)
class Stats:
    rank: int
    running: int
    waiting: int
    pages_used: int
    pages_total: int
    staging_used: int          # staging segments held (receives in flight + stranded)
    sends: int                 # sends in flight
    recvs: int                 # receives posted or queued
    steps: int
    step_seconds: float
    prefill_steps: int


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
    msg: Import
    arrived: float
    deadline: float
    pages: list | None = None
    offset: int | None = None
    handle: object = None
    aborted: bool = False


class Worker:
    """The worker loop over an engine, a transport and a control connection (``conn``: anything
    with ``send``/``recv``/``poll``)."""

    def __init__(self, engine: Engine, transport: Transport, conn, *, timeout_s: float = 30.0,
                 staging_bytes: int = 64 << 20, wire_device: torch.device | None = None) -> None:
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
        self.exports: dict[str, tuple[int, int]] = {}     # request id -> (dst, tag)
        self.sends: list[_Send] = []
        self.queued: deque[_Recv] = deque()               # waiting for pages / staging
        self.recvs: dict[str, _Recv] = {}                 # posted
        self.landed: list[_Recv] = []                     # received, waiting for a slot
        self.stranded: list[_Recv] = []                   # cancelled, not yet settled
        self.stopping = False
        self.prefill_steps = 0
        self._last_stats = None

    # ------------------------------------------------------------------------------- loop
    def run(self) -> None:
        with torch.inference_mode():
            while not (self.stopping and self._idle()):
                busy = self.engine.has_unfinished() or self.sends or self.queued or self.recvs \
                    or self.stranded or self.landed
                try:
                    self._commands(timeout=0 if busy else 0.05)
                except (EOFError, OSError):     # the front end is gone: nobody to answer
                    return
                self._transfers()
                if self.engine.has_unfinished():
                    self._step()
                elif self.sends or self.recvs or self.stranded:
                    time.sleep(0.0005)       # transfers only: let them progress
                self._report_stats()

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
                now = time.monotonic()
                self.queued.append(_Recv(msg, now, now + self.timeout_s))
            elif isinstance(msg, Abort):
                self._abort(msg.request_id)
            elif isinstance(msg, Stop):
                self.stopping = True
            else:
                raise TypeError(f"worker {self.rank}: unknown control message {msg!r}")

    def _add(self, msg: Add) -> None:
        try:
            self.engine.add_request(msg.prompt_ids, msg.params, request_id=msg.request_id,
                                    prompt=msg.prompt)
        except ValueError as e:
            self._emit(Failed(msg.request_id, str(e)))
            return
        if msg.dst is not None:
            self.exports[msg.request_id] = (msg.dst, msg.tag)

    def _abort(self, rid: str) -> None:
        self.exports.pop(rid, None)
        if self.engine.abort(rid):
            return
        for r in self.queued:
            if r.msg.snap.request_id == rid:   # NOTE: still received (into staging only) and
                r.aborted = True               # dropped, so the sender's buffer settles
                if r.pages is not None:
                    self.engine.kv_manager.free(rid, None)
                    r.pages = None
                return
        r = self.recvs.get(rid) or next((x for x in self.landed
                                         if x.msg.snap.request_id == rid), None)
        if r is not None:
            r.aborted = True
            if r.pages is not None:
                self.engine.kv_manager.free(rid, None)
                r.pages = None
        # (an unknown id: finished, failed, or never here; the front end sends an Import
        # before the Abort of a request in transit, so nothing is remembered)

    def _drop(self, r: _Recv) -> None:
        """Give up on an incoming request: its pages now, its staging once the receive settled."""
        if r.pages is not None:
            self.engine.kv_manager.free(r.msg.snap.request_id, None)
            r.pages = None
        if r.handle is not None:
            self.transport.cancel(r.handle)
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
        for rid in [r for r in self.exports
                    if (req := self.engine.scheduler.find(r)) is not None
                    and req in self.engine.running and req.num_forwards >= 1]:
            self._export(rid)

    def _export(self, rid: str) -> None:
        dst, tag = self.exports.pop(rid)
        snap, seg = migrate.export_request(self.engine, rid)
        buf = seg if seg.device == self.wire else seg.to(self.wire)
        if buf.device.type == "cuda":
            torch.cuda.current_stream(buf.device).synchronize()   # the pack, before NCCL reads
        try:
            h = self.transport.send(dst, buf, tag)
        except (TransferError, ValueError, RuntimeError) as e:
            self._emit(Failed(rid, f"sending its KV to worker {dst} failed: {e}"))
            return
        # NOTE: 2x the timeout: the receiver gives up first (it knows when it posted)
        self.sends.append(_Send(h, buf, time.monotonic() + 2 * self.timeout_s, rid))
        self._emit(Exported(snap, dst, tag))

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
                done = self.transport.poll(r.handle)
            except TransferError as e:
                del self.recvs[rid]
                self._fail_recv(r, f"receiving its KV from worker {r.msg.src} failed: {e}")
                continue
            if done:
                del self.recvs[rid]
                self.landed.append(r)
            elif now > r.deadline:
                del self.recvs[rid]
                self._fail_recv(r, f"its KV from worker {r.msg.src} did not arrive within "
                                   f"{self.timeout_s:.3g} s")
        waiting = []
        for r in self.landed:
            if r.aborted or migrate.can_import(self.engine):
                self._land(r)
            else:                  # a local request took the slot meanwhile: try next tick
                waiting.append(r)
        self.landed = waiting
        still = []
        for r in self.stranded:
            if self.transport.settled(r.handle):
                self.alloc.free(r.offset)
            else:
                still.append(r)
        self.stranded = still

    def _fail_recv(self, r: _Recv, message: str) -> None:
        self._drop(r)
        if not r.aborted:
            self._emit(Failed(r.msg.snap.request_id, message))

    def _post_receives(self, now: float) -> None:
        """Post queued receives in arrival order while pages, a staging slice and a running slot
        are free (NCCL matches a pair's transfers in posting order: never reorder them)."""
        while self.queued:
            r = self.queued[0]
            snap = r.msg.snap
            if now > r.deadline and not r.aborted:
                self.queued.popleft()
                self._fail_recv(r, f"no room for its KV within {self.timeout_s:.3g} s "
                                   f"(pages or staging of worker {self.rank} stayed full)")
                continue
            n = snap.kv_nbytes
            if now > r.deadline and r.aborted:
                self.queued.popleft()
                continue
            try:
                if n > self.alloc.capacity:
                    raise migrate.MigrationError(
                        f"its KV segment ({n} bytes) is larger than worker {self.rank}'s staging "
                        f"buffer ({self.alloc.capacity} bytes): raise --pd-staging-gb")
                if not r.aborted and len(self.engine.scheduler.running) + len(self.recvs) \
                        + len(self.landed) >= self.engine.config.max_num_seqs:
                    return                     # a running slot for each posted receive
                if r.pages is None and not r.aborted:
                    r.pages = migrate.reserve(self.engine, snap)
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
            try:
                r.handle = self.transport.recv(r.msg.src, self.staging[off:off + n], r.msg.tag)
            except (TransferError, ValueError, RuntimeError) as e:
                self.queued.popleft()
                self._fail_recv(r, f"receiving its KV failed: {e}")
                continue
            self.queued.popleft()
            self.recvs[snap.request_id] = r

    def _land(self, r: _Recv) -> None:
        snap = r.msg.snap
        n = snap.kv_nbytes
        if r.aborted:                            # received only so the sender settles
            self.alloc.free(r.offset)
            return
        seg = self.staging[r.offset:r.offset + n]
        try:
            migrate.import_request(self.engine, snap, seg, r.pages)
        except migrate.MigrationError as e:
            self.alloc.free(r.offset)
            self._emit(Failed(snap.request_id, str(e)))
            return
        if self.engine.device.type == "cuda":     # the unpack read the slice: then reuse it
            torch.cuda.current_stream(self.engine.device).synchronize()
        self.alloc.free(r.offset)
        self._emit(Imported(snap.request_id, time.monotonic() - r.arrived, n))

    # ------------------------------------------------------------------------------- stats
    def stats(self) -> Stats:
        e = self.engine
        return Stats(self.rank, len(e.running), e.scheduler.num_waiting, e.kv_manager.num_used,
                     e.pool.num_pages, len(self.alloc.allocated()), len(self.sends),
                     len(self.recvs) + len(self.queued) + len(self.landed), e.stats["forwards"],
                     e.stats["step_seconds"], self.prefill_steps)

    def _report_stats(self) -> None:
        s = self.stats()
        key = (s.running, s.waiting, s.pages_used, s.staging_used, s.sends, s.recvs)
        if key != self._last_stats or s.steps % 16 == 0:
            self._last_stats = key
            self._emit(s)


# ------------------------------------------------------------------------------- the process
@dataclass
class WorkerSpec:
    """What a spawned worker needs (pickled to it by the front end)."""

    rank: int
    world: int
    init_method: str
    address: tuple
    authkey: bytes
    args: object                      # EngineArgs
    config_override: dict = field(default_factory=dict)
    device: str = "cpu"
    backend: str = "gloo"
    timeout_s: float = 30.0
    staging_bytes: int = 64 << 20
    warmup: str = "none"
    model_shape: str | None = None


def worker_main(spec: WorkerSpec) -> None:
    """A spawned worker process (``distributed/launch.spawn``): join the KV transport's group,
    load the engine, say hello, serve the front end until it says stop."""
    from datetime import timedelta
    from multiprocessing.connection import Client

    import torch.distributed as dist

    from flash_dllm.distributed.torch_transport import TorchDistTransport

    dev = torch.device(spec.device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        share = max(1, (os.cpu_count() or 1) // max(1, spec.world))
        torch.set_num_threads(min(torch.get_num_threads(), share))
    conn = Channel(Client(spec.address, authkey=spec.authkey))
    try:
        dist.init_process_group(spec.backend, init_method=spec.init_method, rank=spec.rank,
                                world_size=spec.world,
                                timeout=timedelta(seconds=max(300, 4 * spec.timeout_s)))
        transport = TorchDistTransport(device=dev if spec.backend == "nccl" else "cpu")
        engine = _load(spec, dev)
        wire = dev if spec.backend == "nccl" else torch.device("cpu")
        worker = Worker(engine, transport, conn, timeout_s=spec.timeout_s,
                        staging_bytes=spec.staging_bytes, wire_device=wire)
        _warm_up(engine, spec.warmup)
        conn.send(("ready", spec.rank, os.getpid(), engine.pool.num_pages, engine.pool.page_size,
                   engine.config.max_num_seqs))
        worker.run()
    except BaseException:     # noqa: BLE001 - the front end must hear why
        try:
            conn.send(("error", spec.rank, traceback.format_exc()))
        except OSError:
            pass
        raise
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _load(spec: WorkerSpec, dev: torch.device) -> Engine:
    import dataclasses

    from flash_dllm.entrypoints.loader import load_engine, load_random_engine

    args = dataclasses.replace(spec.args, device=str(dev), tensor_parallel_size=1)
    if spec.model_shape:
        return load_random_engine(spec.model_shape, args, **spec.config_override).engine
    return load_engine(args, **spec.config_override).engine


def _warm_up(engine: Engine, level: str) -> None:
    if level == "none":
        return
    from flash_dllm.engine.warmup import warm_up

    filler = [t for t in range(5, 200) if t != engine.cfg.mask_token_id
              and t not in engine.cfg.eos_token_ids and t < engine.cfg.vocab_size]
    warm_up(engine, level, filler, lambda line: None)

