"""AsyncEngine: an engine stepping in its own thread, with one async output stream per request.

Continuous batching happens at step granularity: requests join (``submit``) and leave (finish,
abort) *between* denoising steps, and every step is one packed forward over all running requests,
whatever their length, block, step or sampling knobs. Admission is by KV pages (``Engine._admit``):
a request whose canvas does not fit waits in the engine's queue; ``submit`` refuses new ones with
``QueueFullError`` when it holds ``max_waiting`` or would keep them ``max_queue_wait`` seconds
(``engine/admission.py``). The engine is any ``EngineCore`` (``engine/core.py``), used through
that contract only; a request's event-loop side (``RequestStream``) is ``engine/streams.py``.

NOTE: only the engine thread touches the engine. The event loop talks to it through a command
inbox of typed messages (``AddRequest``, ``AbortRequest``) applied between steps, and the engine
thread hands outputs back with ``loop.call_soon_threadsafe``. ``validate`` is the one engine call
made from the loop: it reads only immutable data. Outputs are host data built from the step's
``StepOutput``s (no device access on publish) and carry token ids only: detokenising is the
consumer's job, on its own thread (the server does it incrementally on the event loop).

NOTE (stats): what other threads read of the engine's state is ``stats``, an immutable
``EngineStats`` the engine thread swaps in whole (``/metrics`` renders only it): after a step or
inbox commands, at most every ``STATS_INTERVAL_S`` while the engine is busy (a snapshot scans
the page ledger), and always at the first step after an idle one and when it goes idle, before
the outputs of that round are posted (a client that got its last output reads final values).
``num_running`` / ``num_waiting`` are counted after every step (admission control needs them).
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.core.request import Request, RequestOutput, StepOutput
from flash_dllm.core.stats import EngineStats, RuntimeStats
from flash_dllm.engine.admission import QueueWait
from flash_dllm.engine.core import EngineCore
# (the stream side's names are re-exported: the server imports them from here)
from flash_dllm.engine.streams import (EngineUnavailableError, QueueFullError,  # noqa: F401
                                       RequestFailedError, RequestStream, StepObserver, Stream,
                                       post, post_many)
from flash_dllm.worker.compile_watch import KERNEL_COMPILES

# while the engine is busy, a new stats snapshot at most this often (seconds)
STATS_INTERVAL_S = 0.5


@dataclass(frozen=True)
class AddRequest:
    """Inbox message: queue a validated request (its id is already reserved)."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    prompt: str | None
    stream: Stream


@dataclass(frozen=True)
class AbortRequest:
    """Inbox message: abort a request (unknown or finished ids are ignored); its output and
    the observer's count carry ``finish_reason``."""

    request_id: str
    finish_reason: str = "abort"


@dataclass
class _Live:
    """Engine-thread view of one request."""

    req: Request
    stream: Stream
    emitted: int = 0                 # committed-prefix length last published


class AsyncEngine:
    def __init__(self, engine: EngineCore, observer: StepObserver | None = None,
                 warmup=None) -> None:
        """``warmup``: a callable ``warmup(engine) -> report`` (``worker/warmup.py``) the step
        thread runs before anything else; until it returns the engine is not ready (requests
        get ``EngineUnavailableError``, ``/ready`` answers 503)."""
        self.engine = engine
        self.observer = observer
        self._warmup = warmup
        self.warming = warmup is not None
        self.warmup_report = None
        self.at_ready: RuntimeStats | None = None    # the snapshot's when the engine got ready
        self.ready_at: float | None = None if warmup is not None else time.perf_counter()
        self._cv = threading.Condition()
        self._inbox: deque[AddRequest | AbortRequest] = deque()
        self._live: dict[str, _Live] = {}            # engine thread only
        self._ids: set[str] = set()                  # ids submitted and not yet finished
        self._pending_adds = 0                       # adds in the inbox (guarded by _cv)
        self._engine_waiting = 0                     # engine.counts() after each step
        # requests added to the engine since its last step: in its waiting queue, but not yet
        # through an admission pass (guarded by _cv)
        self._fresh_adds = 0
        self._engine_running = 0
        self.queue_wait = QueueWait()     # a new request's wait (``max_queue_wait``; under _cv)
        # NOTE: built here before the engine thread starts; later only by the engine thread
        self.stats: EngineStats = engine.stats_snapshot()
        self._stats_at = time.monotonic()
        self._stats_stale = False                    # the engine changed since ``stats``
        self._stats_idle = True                      # ``stats`` is of an idle engine
        self._thread: threading.Thread | None = None
        self._stop = False
        self.draining = False
        self.error: BaseException | None = None

    # ------------------------------------------------------------------------------- lifecycle
    def set_warmup(self, warmup) -> None:
        """Run ``warmup(engine)`` on the step thread before anything else (see ``__init__``);
        call before ``start``."""
        if self._thread is not None:
            raise RuntimeError("set_warmup after the engine started")
        self._warmup = warmup
        self.warming = warmup is not None
        self.ready_at = None if warmup is not None else time.perf_counter()

    def start(self) -> None:
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="flash-dllm-engine",
                                                daemon=True)
                self._thread.start()

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration (immutable)."""
        return self.engine.config

    @property
    def max_model_len(self) -> int:
        """The model's maximum canvas length (prompt + max_tokens)."""
        return self.engine.cfg.max_position

    @property
    def alive(self) -> bool:
        return self.error is None and (self._thread is None or self._thread.is_alive())

    @property
    def ready(self) -> bool:
        return self.alive and not self.draining and not self.warming

    def begin_drain(self) -> None:
        """Refuse new requests from now on; in-flight ones run to completion."""
        self.draining = True

    async def drain(self, timeout: float | None = None) -> bool:
        """Refuse new requests and wait until in-flight ones finished; False on timeout."""
        self.begin_drain()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.num_unfinished and self.alive:
            if deadline is not None and time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def shutdown(self, timeout: float | None = None) -> None:
        """Drain, stop the step thread, then close the engine (a tensor-parallel engine stops
        its other ranks)."""
        await self.drain(timeout)
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)
        if self._thread is None or not self._thread.is_alive():
            await asyncio.to_thread(self.engine.close)

    # --------------------------------------------------------------------------------- requests
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               prompt: str | None = None) -> RequestStream:
        """Validate and queue a request; raises ``ValueError`` (bad request), ``QueueFullError``
        or ``EngineUnavailableError`` before anything is queued. Call from the event loop."""
        if not self.ready:
            if self.warming:
                self.start()                # (a server without lifespan: warm up now)
            raise EngineUnavailableError(
                "the engine is shutting down" if self.draining
                else "the engine is warming up (compiling kernels, capturing CUDA graphs); "
                     "retry when /ready answers 200" if self.warming and self.alive
                else f"the engine failed: {self.error!r}")
        self.engine.validate(prompt_ids, params)
        rid = request_id if request_id is not None else uuid.uuid4().hex
        stream = Stream(rid, asyncio.get_running_loop())
        with self._cv:
            if rid in self._ids:
                raise ValueError(f"request id {rid!r} is already in flight")
            cfg, waiting = self.engine.config, self.num_waiting
            if waiting >= cfg.max_waiting:
                raise QueueFullError(f"{cfg.max_waiting} requests are already waiting for KV "
                                     f"pages; retry later")
            self.queue_wait.check(cfg.max_queue_wait, waiting,
                                  self._pending_adds + self._engine_running < cfg.max_num_seqs)
            self._ids.add(rid)
            self._pending_adds += 1
            self._inbox.append(AddRequest(list(prompt_ids), params, rid, prompt, stream))
            self._cv.notify()
        self.start()
        return RequestStream(self, stream)

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None,
                       prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request; cancelling or closing the consumer aborts it."""
        stream = self.submit(prompt_ids, params, request_id, prompt)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str, finish_reason: str = "abort") -> None:
        """Thread-safe; applied before the next step. Unknown or finished ids are ignored.
        ``finish_reason``: what the end counts as (``"stop"``: a consumer found a stop string
        in the committed text and needs no more of it; the engine's request is aborted all the
        same, freeing its pages)."""
        with self._cv:
            self._inbox.append(AbortRequest(request_id, finish_reason))
            self._cv.notify()

    def abort_all(self) -> None:
        """Abort every request in flight (thread-safe; applied before the next step)."""
        with self._cv:
            self._inbox.extend(AbortRequest(rid) for rid in list(self._ids))
            self._cv.notify()

    # ---------------------------------------------------------------------------------- counters
    @property
    def num_running(self) -> int:
        return self._engine_running

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission: those the engine's last admission pass left waiting,
        plus the requests not yet through one (in the inbox, or added since the last step)
        beyond the free running slots (those will start at the next step unless pages run out).

        NOTE: a request added to the engine sits in its waiting queue until the next step admits
        it; counting it as waiting refused the next request with 429 while a slot was free
        (issue 42: --max-waiting 1 let none wait)."""
        free_slots = max(0, self.engine.config.max_num_seqs - self._engine_running)
        fresh = min(self._fresh_adds, self._engine_waiting)
        return (self._engine_waiting - fresh
                + max(0, fresh + self._pending_adds - free_slots))

    @property
    def num_unfinished(self) -> int:
        return len(self._ids)

    # ------------------------------------------------------------------------- the engine thread
    def _run(self) -> None:
        try:
            if self._warmup is not None and self.warming:
                self.warmup_report = self._warmup(self.engine)   # a failure: not alive
                self.ready_at = time.perf_counter()
                self.warming = False
            self._stats_stale = True               # (the warm-up stepped, then reset counters)
            self._refresh_stats()
            self.at_ready = self.stats.runtime
            if self._warmup is not None:
                KERNEL_COMPILES.ready = True       # later compiles are stalls: log them
            while True:
                with self._cv:
                    # (an engine with ``idle_poll_s`` is asked again while idle: the router
                    # notices a lost worker process with nothing in flight)
                    while not (self._inbox or self.engine.has_unfinished() or self._stop):
                        self._cv.wait(self.engine.idle_poll_s)
                    if self._stop and not self._inbox and not self.engine.has_unfinished():
                        return
                    cmds = list(self._inbox)
                    self._inbox.clear()
                aborted: list[tuple[_Live, RequestOutput]] = []
                added = 0
                for cmd in cmds:
                    if isinstance(cmd, AddRequest):
                        added += self._add_now(cmd)
                    else:
                        self._abort_now(cmd.request_id, aborted, cmd.finish_reason)
                adds = sum(1 for c in cmds if isinstance(c, AddRequest))
                running, waiting = self.engine.counts()
                with self._cv:   # moved from the inbox to the engine's queue: count them there
                    self._engine_running, self._engine_waiting = running, waiting
                    self._pending_adds -= adds
                    self._fresh_adds += added
                self._stats_stale = self._stats_stale or bool(cmds)
                if aborted:      # NOTE: the snapshot first (if idle now), then their outputs
                    self._refresh_stats()
                    self._finish_aborted(aborted)
                outs: list[StepOutput] = []
                if self.engine.has_unfinished():
                    t0, ran = time.perf_counter(), self.engine.steps_run
                    outs = self.engine.step()
                    self._stats_stale = True
                    dt = time.perf_counter() - t0
                    if self.observer is not None and outs:
                        n = max(1, self.engine.steps_run - ran)   # (multi-step: n forwards)
                        for _ in range(n):
                            self.observer.on_step(dt / n, len(outs))
                self._publish(outs)
        except BaseException as e:   # noqa: BLE001 - every waiting client must hear about it
            self.error = e
            streams = [live.stream for live in self._live.values()]
            self._live.clear()
            with self._cv:
                streams += [c.stream for c in self._inbox if isinstance(c, AddRequest)]
                self._inbox.clear()
                self._pending_adds = self._fresh_adds = 0
                self._ids.clear()
            post_many([(stream, e) for stream in streams])
            raise

    def _add_now(self, cmd: AddRequest) -> bool:
        """Add ``cmd``'s request to the engine; False (its stream told) if that failed."""
        try:
            req = self.engine.add_request(cmd.prompt_ids, cmd.params, request_id=cmd.request_id,
                                          prompt=cmd.prompt)
        except Exception as e:  # noqa: BLE001 - validated already; be safe
            post(cmd.stream, e)
            with self._cv:
                self._ids.discard(cmd.request_id)
            return False
        self._live[cmd.request_id] = _Live(req, cmd.stream)
        return True

    def _abort_now(self, rid: str, aborted: list[tuple[_Live, RequestOutput]],
                   finish_reason: str = "abort") -> None:
        """Abort ``rid`` in the engine (its pages are freed now); its output, ending with
        ``finish_reason``, goes to ``aborted`` for ``_finish_aborted``."""
        live = self._live.pop(rid, None)
        if live is None:
            return
        self.engine.abort(rid)
        out = self.engine.output(live.req)
        if finish_reason != out.finish_reason:
            out = dataclasses.replace(out, finish_reason=finish_reason)
        aborted.append((live, out))

    def _finish_aborted(self, aborted: list[tuple[_Live, RequestOutput]]) -> None:
        for live, out in aborted:
            self._done(live, out)
        post_many([(live.stream, out) for live, out in aborted])

    def _refresh_stats(self) -> None:
        """Swap in a new ``stats`` snapshot if the engine changed since the last one and it is
        idle now, or was idle at the last one, or ``STATS_INTERVAL_S`` passed (see the module's
        NOTE)."""
        if not self._stats_stale:
            return
        now, idle = time.monotonic(), not self.engine.has_unfinished()
        if idle or self._stats_idle or now - self._stats_at >= STATS_INTERVAL_S:
            self.stats = self.engine.stats_snapshot()
            self._stats_at, self._stats_stale, self._stats_idle = now, False, idle

    def _publish(self, outs: list[StepOutput]) -> None:
        """Post an output for every request of the step whose committed prefix grew or that
        finished (host data only: no device access)."""
        now = time.monotonic()
        # NOTE: counts and stats first: a client that got its final output must already see it
        # gone from requests_running (the step has removed finished requests from the running
        # list), and its pages freed in the snapshot once the engine is idle
        running, waiting = self.engine.counts()
        with self._cv:                 # the step's admission pass saw every request added
            self._engine_running, self._engine_waiting = running, waiting
            self._fresh_adds = 0
        self._refresh_stats()
        posts, tokens = [], 0
        try:
            for so in outs:
                live = self._live.get(so.request_id)
                if live is None or (not so.new_token_ids and not so.finished):
                    continue
                tokens += len(so.new_token_ids)
                if self.observer is not None and live.emitted == 0 and so.num_tokens:
                    self.observer.on_first_token(now - live.stream.arrival)
                live.emitted = so.num_tokens
                out = self.engine.output(live.req)
                if so.finished:          # NOTE: book-keeping first, so a client that got its
                    del self._live[so.request_id]   # final output already sees it counted
                    self._done(live, out)
                posts.append((live.stream,
                              out if out.error is None else RequestFailedError(out.error)))
            if self.observer is not None and tokens:
                self.observer.on_tokens(tokens)
        finally:
            # (a failure above must not lose what was built: a finished request has already
            # left ``_live``, so the error handler would not reach its stream)
            post_many(posts)

    def _done(self, live: _Live, out: RequestOutput) -> None:
        with self._cv:
            self._ids.discard(live.stream.request_id)
            self.queue_wait.finished(backlog=self.num_waiting > 0)
        if self.observer is not None:
            self.observer.on_finish(out, time.monotonic() - live.stream.arrival)
