"""Prefill/decode disaggregation: the front end (router) over prefill and decode worker processes.

``PDEngine`` is an ``EngineCore`` (``engine/core.py``): the ``AsyncEngine`` drives it as it drives
an ``Engine``, so the OpenAI server, streaming, metrics and bad-input handling are unchanged,
but it runs no model itself:

1. ``add_request`` places the request on the least loaded live prefill worker and picks its
   decode worker (the least loaded live one) and a transfer tag;
2. the prefill worker runs the request's first forward, sends its KV segment straight to the
   decode worker (``disagg/worker.py``) and its snapshot here; ``step`` forwards the snapshot
   to the decode worker, which receives, unpacks and decodes the request to the end;
3. ``step`` turns the workers' output events into ``StepOutput``s of host mirrors of the
   requests (``Request`` objects that only hold the committed answer), so ``output`` works as the
   engine's does (``engine.core.request_output``);
4. ``stats_snapshot`` is built from the workers' ``Stats`` reports and the router's counters;
   ``validate`` checks a request against the smallest live worker pool (``limits``, swapped
   whole when a worker says hello or is lost).

Faults fail one request, never the server: a transfer that times out or fails (``Failed``), a
worker that dies (its requests fail at once; no new request goes to it; requests already sent to
it by a prefill worker fail when their transfer does), an abort (the workers free the request's
pages and staging). ``RoleController`` (``disagg/roles.py``) may move workers between the
prefill and decode roles under load.

NOTE (size): one file over ~400 lines because the request life cycle (placement, the phases
prefill -> transit -> decode, and its end by output, abort, failure or a lost worker) is one
state machine, and the ``EngineCore`` API the async engine drives is a thin layer over it.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Listener, wait

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.core.request import Request, RequestOutput, StepOutput
from flash_dllm.core.stats import DisaggStats, EngineStats, WorkerStats
from flash_dllm.decoding.policies import DECODE_POLICIES
from flash_dllm.disagg import messages as W
from flash_dllm.disagg.liveness import exit_text, log_lost, reap
from flash_dllm.disagg.migrate import refuse_fp8_kv
from flash_dllm.disagg.roles import WorkerLoad
from flash_dllm.distributed.transport import USER_TAG_LIMIT
from flash_dllm.engine.core import RequestLimits, check_request, request_output, resolve_params
from flash_dllm.engine.stats import runtime_stats

PREFILL, DECODE = "prefill", "decode"
TAG_STRIDE = 16          # a request's transfers use tags tag .. tag + 15 (one per layer group)


class WorkerLost(RuntimeError):
    """A worker process exited or broke its control connection."""


@dataclass(eq=False)
class WorkerHandle:
    """The front end's view of one worker process."""

    rank: int
    role: str
    proc: object                      # subprocess.Popen
    conn: object = None
    alive: bool = True
    ready: bool = False
    pid: int | None = None
    num_pages: int = 0
    page_size: int = 0
    max_num_seqs: int = 0
    stats: W.Stats | None = None
    prefilling: int = 0               # requests placed here for their first step
    decoding: int = 0                 # requests moving or moved here
    draining_to: str | None = None    # a role switch waiting for its old work to finish
    ipc_handle: tuple | None = None   # ("ipc", handle) | ("nixl", metadata): how peers reach it
    exit_code: int | None = None      # its process's return code, once reaped
    lost: str | None = None           # why it was lost (one line)


@dataclass(eq=False)
class _Track:
    req: Request
    prefill: int
    decode: int
    tag: int
    phase: str = "prefill"            # prefill -> transit -> decode
    sent_at: float = 0.0
    offset: int | None = None         # CUDA IPC: its segment in the prefill worker's staging
    announced: bool = False           # pipelined: the decode worker expects its layer groups


class PDEngine:
    """The front end of ``P`` prefill and ``D`` decode workers (see the module docstring).
    Start one with ``entrypoints.pd_launch.launch``; call ``wait_ready`` before use (the server
    does it as its warm-up, so ``/ready`` answers 503 until every worker has loaded).

    NOTE (lost workers): ``has_unfinished`` (asked every ``idle_poll_s``, idle or not) notices
    a worker process that exited; the next ``step`` reaps and logs it (``disagg/liveness.py``)
    and fails its requests; the snapshot shows it to ``/health`` and ``/ready``."""

    idle_poll_s = 0.2

    def __init__(self, cfg, config: EngineConfig, workers: list[WorkerHandle], listener: Listener,
                 timeout_s: float, controller=None, layer_groups: int = 1) -> None:
        refuse_fp8_kv(config)
        self.cfg = cfg
        self.base_config = config
        self.workers = workers
        self.listener = listener
        self.timeout_s = timeout_s
        self.controller = controller
        self.layer_groups = layer_groups      # > 1: prefill workers send KV during the forward
        n_dec = max(1, sum(w.role == DECODE for w in workers))
        # the async engine's accounting: every decode worker's running slots
        self.config = dataclasses.replace(config, max_num_seqs=config.max_num_seqs * n_dec)
        self._late: list[StepOutput] = []      # failures found outside the event loop
        self.tracks: dict[str, _Track] = {}
        self._tags = itertools.count(1)
        self._ids = itertools.count()
        self.closed = False
        self.error: str | None = None
        self.stats = {"forwards": 0, "tokens_committed": 0, "step_seconds": 0.0,
                      "last_batch_size": 0}
        self.pd = {"transfers": 0, "transfer_bytes": 0, "transfer_seconds": 0.0,
                   "transfer_failures": 0, "checksum_failures": 0, "failed_requests": 0,
                   "worker_deaths": 0,
                   "role_switches": 0}
        self.steps_run = 0
        self.limits = self._limits()

    def start_accepting(self) -> None:
        """Accept the workers' control connections in the background (``wait_ready`` reads
        their hellos)."""
        threading.Thread(target=self._accept, daemon=True, name="flash-dllm-pd-accept").start()

    def _accept(self) -> None:
        """Accept each worker's control connection (its first message names its rank)."""
        pending = []
        for _ in self.workers:
            try:
                conn = self.listener.accept()
            except OSError:
                return
            pending.append(conn)
        self._accepted = pending

    def wait_ready(self, timeout_s: float = 600.0, engine=None):
        """Block until every worker loaded its model (or raise naming the one that failed)."""
        deadline = time.monotonic() + timeout_s
        while not all(w.ready for w in self.workers):
            self._check_procs(starting=True)
            conns = getattr(self, "_accepted", None)
            if conns is not None:
                for c in wait(conns, timeout=0.05):
                    self._hello(c)
                    conns.remove(c)
            else:
                time.sleep(0.05)
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"the disaggregated workers were not ready within "
                                   f"{timeout_s:.0f} s")
        handles = {w.rank: w.ipc_handle for w in self.workers if w.ipc_handle is not None}
        if handles:                    # CUDA IPC handles or NIXL metadata: every worker meets
            #                            every other before the first request
            for w in self.workers:
                self._send(w, W.Peers(handles))
        return None

    def _hello(self, conn) -> None:
        try:
            msg = W.Channel(conn).recv()
        except (EOFError, OSError):
            return
        if msg[0] == "error":
            self.close()
            raise RuntimeError(f"disaggregated worker {msg[1]} failed to start:\n{msg[2]}")
        _, rank, pid, num_pages, page_size, max_num_seqs, handle = msg
        w = self.workers[rank]
        w.ipc_handle = handle
        w.conn, w.pid, w.ready = W.Channel(conn), pid, True
        w.num_pages, w.page_size, w.max_num_seqs = num_pages, page_size, max_num_seqs
        self.limits = self._limits()

    def _limits(self) -> RequestLimits:
        """What ``validate`` checks: one request lives in ONE worker's pool, so the smallest
        live pool bounds it (0 pages before any worker said hello: not checked)."""
        pools = [w.num_pages for w in self.workers if w.alive and w.ready]
        return RequestLimits(self.cfg.max_position, self.cfg.vocab_size,
                             self.base_config.page_size, min(pools) if pools else 0,
                             self.cfg.attention.block_size)

    # ------------------------------------------------------------------------------- EngineCore
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the problem if the request can never run on the smallest
        live worker (reads only ``limits``, swapped whole: any thread may call it)."""
        check_request(prompt_ids, resolve_params(params, self.cfg), self.limits, _no_overflow)

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, prompt: str | None = None) -> Request:
        params = resolve_params(params, self.cfg)
        self.validate(prompt_ids, params)
        rid = request_id if request_id is not None else f"pd-{next(self._ids)}"
        req = Request(rid, prompt_ids, params, self.cfg.mask_token_id, self.cfg.eos_token_ids,
                      prompt, grid=self.cfg.attention.block_size,
                      edits=DECODE_POLICIES[params.decode].edits)
        pre = self._pick(PREFILL)
        dec = self._pick(DECODE)
        if pre is None or dec is None:
            raise RuntimeError(f"no live {'prefill' if pre is None else 'decode'} worker: "
                               "the disaggregated engine cannot take requests")
        tag = next(self._tags) * TAG_STRIDE % (USER_TAG_LIMIT - TAG_STRIDE)  # tag + group
        self.tracks[rid] = _Track(req, pre.rank, dec.rank, tag)
        pre.prefilling += 1
        dec.decoding += 1
        self._send(pre, W.Add(rid, list(prompt_ids), params, prompt, dec.rank, tag,
                              self.layer_groups))
        return req

    def abort(self, request_id: str) -> bool:
        t = self.tracks.pop(request_id, None)
        if t is None:
            return False
        t.req.abort()
        self._untrack(t)
        if t.announced and t.phase == "prefill":   # its sends are posted: the decode worker
            self._send(self.workers[t.decode], W.Abort(request_id))   # receives and drops them
        # NOTE: one worker holds it. Still on the prefill worker: its export may already be on
        # its way here; then ``_handle`` forwards it to the decode worker with an Abort behind
        # it, so the decode worker drains the segment and the prefill worker's send settles.
        self._send(self.workers[t.prefill if t.phase == "prefill" else t.decode],
                   W.Abort(request_id))
        return True

    def has_unfinished(self) -> bool:
        """Requests in flight, or a worker still settling transfers or freeing pages: the async
        engine keeps stepping (reading the workers' events) until they report idle, so the
        metrics end at zero."""
        return bool(self.tracks) or any(
            w.alive and w.stats is not None and (w.stats.pages_used or w.stats.staging_used
                                                 or w.stats.sends or w.stats.recvs)
            for w in self.workers) or any(
            # a worker process that exited: ``step`` reaps it and says so
            w.exit_code is None and w.proc is not None and w.proc.poll() is not None
            for w in self.workers)

    def output(self, req: Request) -> RequestOutput:
        return request_output(req)

    def counts(self) -> tuple[int, int]:
        """(requests in flight, requests the workers queue: for pages, or for their KV)."""
        return len(self.tracks), sum(w.stats.waiting + w.stats.recvs for w in self.workers
                                     if w.alive and w.stats is not None)

    def stats_snapshot(self) -> EngineStats:
        """Pages of every live worker (their latest reports), the router's counters and each
        worker's state."""
        live = [w for w in self.workers if w.alive]
        running, waiting = self.counts()
        st = self.stats
        return EngineStats(
            running=running, waiting=waiting,
            pages_used=sum(w.stats.pages_used for w in live if w.stats is not None),
            pages_total=sum(w.num_pages for w in live), page_size=self.base_config.page_size,
            forwards=st["forwards"], tokens_committed=st["tokens_committed"],
            step_seconds=st["step_seconds"], last_batch_size=st["last_batch_size"],
            disagg=DisaggStats(**self.pd, workers=tuple(_worker_stats(w) for w in self.workers)),
            runtime=runtime_stats(None))

    def step(self) -> list[StepOutput]:
        """Outputs that arrived from the workers (waits up to 20 ms for one)."""
        t0 = time.perf_counter()
        self._check_procs()
        conns = {w.conn.conn: w for w in self.workers if w.alive and w.conn is not None}
        outs: list[StepOutput] = []
        for c in wait(list(conns), timeout=0.02) if conns else []:
            w = conns[c]
            try:
                while w.alive and w.conn.poll():
                    self._handle(w, w.conn.recv(), outs)
            except (EOFError, OSError):
                self._lost(w, "its control connection closed")
        if self.controller is not None:
            self._switch_roles()
        outs += self._late
        self._late = []
        self.stats["tokens_committed"] += sum(len(o.new_token_ids) for o in outs)
        self.stats["step_seconds"] += time.perf_counter() - t0
        return outs

    def close(self) -> None:
        """Stop the workers (they finish nothing more) and wait for them (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for w in self.workers:
            if w.alive and w.conn is not None:
                try:
                    w.conn.send(W.Stop())
                except OSError:
                    pass
        for w in self.workers:
            try:
                w.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001
                w.proc.kill()
                w.proc.wait(timeout=5)
        try:
            self.listener.close()
        except OSError:
            pass

    # ------------------------------------------------------------------------------- internals
    def _pick(self, role: str) -> WorkerHandle | None:
        cands = [w for w in self.workers if w.alive and w.ready and w.role == role
                 and w.draining_to is None]
        if not cands:
            return None
        load = (lambda w: w.prefilling) if role == PREFILL else (lambda w: w.decoding)
        return min(cands, key=lambda w: (load(w), w.rank))

    def _send(self, w: WorkerHandle, msg) -> None:
        if not w.alive or w.conn is None:
            return
        try:
            w.conn.send(msg)
        except OSError:
            self._lost(w, "its control connection closed")

    def _untrack(self, t: _Track) -> None:
        if t.phase == "prefill":
            self.workers[t.prefill].prefilling -= 1
        self.workers[t.decode].decoding -= 1

    def _handle(self, w: WorkerHandle, msg, outs: list[StepOutput]) -> None:
        if isinstance(msg, W.Stats):
            w.stats = msg
            return
        if isinstance(msg, tuple) and msg and msg[0] == "error":
            self._lost(w, f"it raised:\n{msg[2]}")
            return
        if isinstance(msg, W.Consumed):
            self._send(self.workers[msg.src], W.Release(msg.offset))
            return
        rid = getattr(msg, "request_id", None) or msg.snap.request_id
        t = self.tracks.get(rid)
        if t is None:                 # aborted or failed already
            if isinstance(msg, W.Announce) and self.workers[msg.dst].alive:
                # its sends will be posted: the decode worker receives and drops them
                self._send(self.workers[msg.dst], W.Expect(rid, w.rank, msg.tag,
                                                           msg.canvas_len, msg.groups))
                self._send(self.workers[msg.dst], W.Abort(rid))
            if isinstance(msg, W.Exported) and msg.groups == 1:   # (pipelined: its layer
                if self.workers[msg.dst].alive:                   # groups drained already)
                    # its segment is on the way: the decode worker receives and drops it
                    self._send(self.workers[msg.dst], W.Import(msg.snap, w.rank, msg.tag,
                                                               msg.offset))
                    self._send(self.workers[msg.dst], W.Abort(rid))
                elif msg.offset is not None:
                    self._send(w, W.Release(msg.offset))
            return
        if isinstance(msg, W.Out):
            if msg.finished and t.announced and t.phase == "prefill":
                # finished in its first step, its layer groups already sent: drop them there
                self._send(self.workers[t.decode], W.Abort(rid))
            outs.append(self._out(t, msg))
        elif isinstance(msg, W.Announce):
            t.announced = True
            dec = self.workers[t.decode]
            if dec.alive:
                self._send(dec, W.Expect(rid, t.prefill, msg.tag, msg.canvas_len, msg.groups))
        elif isinstance(msg, W.Exported):
            dec = self.workers[t.decode]
            if t.phase == "prefill":
                self.workers[t.prefill].prefilling -= 1
            t.phase, t.sent_at, t.offset = "transit", time.monotonic(), msg.offset
            if not dec.alive:
                self._fail(t, f"its decode worker {dec.rank} is gone", outs)
                if msg.offset is not None:
                    self._send(w, W.Release(msg.offset))
                return
            self._send(dec, W.Import(msg.snap, t.prefill, t.tag, msg.offset))
        elif isinstance(msg, W.Imported):
            t.phase = "decode"
            self.pd["transfers"] += 1
            self.pd["transfer_bytes"] += msg.nbytes
            self.pd["transfer_seconds"] += msg.seconds
        elif isinstance(msg, W.Failed):
            self.pd["transfer_failures"] += msg.kind != "request"
            self.pd["checksum_failures"] += msg.kind == "checksum"
            self._fail(t, msg.message, outs)
            for rank in {t.prefill, t.decode} - {w.rank}:
                self._send(self.workers[rank], W.Abort(rid))

    def _out(self, t: _Track, msg: W.Out) -> StepOutput:
        req = t.req
        n, k = msg.num_tokens, len(msg.new_ids)
        if k:
            req.tokens[req.prompt_len + n - k:req.prompt_len + n] = msg.new_ids
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
        req.num_tokens = n
        req.num_forwards = max(req.num_forwards, msg.num_forwards)
        if msg.finished:
            req.finished, req.finish_reason = True, msg.finish_reason
            req.finish_time = time.monotonic()
            self.tracks.pop(req.request_id, None)
            self._untrack(t)
        return StepOutput(req.request_id, list(msg.new_ids), n, k, msg.finished,
                          msg.finish_reason)

    def _fail(self, t: _Track, message: str, outs: list[StepOutput]) -> None:
        req = t.req
        if self.tracks.pop(req.request_id, None) is None:
            return
        self._untrack(t)
        req.finished, req.finish_reason = True, "error"
        req.error = f"request {req.request_id}: {message}"
        req.finish_time = time.monotonic()
        self.pd["failed_requests"] += 1
        outs.append(StepOutput(req.request_id, [], req.num_tokens, 0, True, "error"))

    def _check_procs(self, starting: bool = False) -> None:
        """Reap every worker process that exited (``poll`` waits for it); one still counted
        alive is lost."""
        for w in self.workers:
            if w.exit_code is not None or w.proc is None or w.proc.poll() is None:
                continue
            w.exit_code = w.proc.returncode
            if starting:
                self.close()
                raise RuntimeError(f"disaggregated worker {w.rank} {exit_text(w.exit_code)} "
                                   "while starting (its traceback, if any, is above)")
            self._lost(w, f"its process {exit_text(w.exit_code)}")

    def _lost(self, w: WorkerHandle, why: str) -> None:
        """A dead worker: reaped and logged; its requests fail now; nothing is sent to it
        again."""
        if not w.alive:
            return
        w.alive = False
        if w.exit_code is None and w.proc is not None:
            w.exit_code = reap(w.proc)
        w.lost = why.splitlines()[0]
        self.limits = self._limits()
        self.pd["worker_deaths"] += 1
        self.error = f"worker {w.rank} ({w.role}) lost: {why}"
        log_lost(w.rank, w.role, w.pid, w.lost, w.exit_code,
                 sum(x.alive and x.role == w.role for x in self.workers))
        outs = self._late
        for t in list(self.tracks.values()):
            if t.phase == "transit" and t.decode == w.rank and t.offset is not None:
                self._send(self.workers[t.prefill], W.Release(t.offset))   # never to be read
            if (t.phase == "prefill" and t.prefill == w.rank) or t.decode == w.rank:
                self._fail(t, f"{w.role} worker {w.rank} was lost ({why.splitlines()[0]})", outs)

    # ---------------------------------------------------------------------------- role switches
    def _switch_roles(self) -> None:
        now = time.monotonic()
        for w in self.workers:                    # finish switches whose old work drained
            if w.draining_to is not None and w.alive:
                old = w.prefilling if w.role == PREFILL else w.decoding
                if old == 0:
                    w.role, w.draining_to = w.draining_to, None
                    self.pd["role_switches"] += 1
        live = [w for w in self.workers if w.alive and w.ready]
        view = [WorkerLoad(w.rank, w.role, w.prefilling, w.decoding, w.max_num_seqs,
                           draining=w.draining_to is not None) for w in live]
        for rank, to in self.controller.decide(now, view):
            w = self.workers[rank]
            if w.role != to and w.draining_to is None:
                w.draining_to = to

    def pd_snapshot(self) -> dict:
        """Counters and per-worker state as a dict (benchmarks, tests; ``/metrics`` renders
        ``stats_snapshot``, published by the async engine)."""
        return {**self.pd, "workers": [
            {"rank": w.rank, "role": w.role, "alive": w.alive, "prefilling": w.prefilling,
             "decoding": w.decoding,
             **({} if w.stats is None else dataclasses.asdict(w.stats))}
            for w in self.workers]}


def _no_overflow(total: int, params: SamplingParams) -> str:
    """Why a request larger than a worker's pool cannot run: no overflow streaming here."""
    return "requests larger than the pool are not supported with --disaggregate"


def _worker_stats(w: WorkerHandle) -> WorkerStats:
    report = {} if w.stats is None else dataclasses.asdict(w.stats)
    report.pop("rank", None)
    return WorkerStats(rank=w.rank, role=w.role, alive=w.alive, prefilling=w.prefilling,
                       decoding=w.decoding, reported=w.stats is not None,
                       exit_code=w.exit_code, lost=w.lost, **report)
