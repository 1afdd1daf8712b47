"""AsyncEngine: an ``Engine`` stepping in its own thread, with one async output stream per request.

Continuous batching happens at step granularity: requests join (``submit``) and leave (finish,
abort) *between* denoising steps, and every step is one packed forward over all running requests,
whatever their length, block, step or sampling knobs. Admission is by KV pages (``Engine._admit``):
a request whose canvas does not fit waits in the engine's queue; when that queue holds
``EngineConfig.max_waiting`` requests, ``submit`` refuses new ones with ``QueueFullError``.

NOTE: only the engine thread touches the ``Engine``. The event loop talks to it through a command
inbox of typed messages (``AddRequest``, ``AbortRequest``) applied between steps, and the engine
thread hands outputs back with ``loop.call_soon_threadsafe``. ``Engine.validate`` is the one call
made from the loop: it reads only immutable configuration. Outputs are host data built from the
step's ``StepOutput``s (no device access on publish) and carry token ids only: detokenising is the
consumer's job, on its own thread (the server does it incrementally on the event loop).
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from flash_dllm.config import SamplingParams
from flash_dllm.core.request import Request, RequestOutput, StepOutput
from flash_dllm.engine.engine import Engine
from flash_dllm.worker.compile_watch import KERNEL_COMPILES, runtime_counts


class QueueFullError(RuntimeError):
    """Too many requests are waiting for pages; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineUnavailableError(RuntimeError):
    """The engine is draining (shutting down) or its step thread died."""


class RequestFailedError(RuntimeError):
    """One request failed (e.g. its KV transfer between workers timed out); others go on."""


class StepObserver(Protocol):
    """Receives engine events (on the engine thread); the server's metrics implement it."""

    def on_step(self, seconds: float, batch_size: int) -> None: ...
    def on_tokens(self, n: int) -> None: ...
    def on_first_token(self, seconds: float) -> None: ...
    def on_finish(self, output: RequestOutput, seconds: float) -> None: ...


@dataclass
class _Stream:
    """Loop-side end of one request: outputs arrive in ``queue``; ``None`` in it ends the stream."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    finished: bool = False


@dataclass(frozen=True)
class AddRequest:
    """Inbox message: queue a validated request (its id is already reserved)."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    prompt: str | None
    stream: _Stream


@dataclass(frozen=True)
class AbortRequest:
    """Inbox message: abort a request (unknown or finished ids are ignored)."""

    request_id: str


@dataclass
class _Live:
    """Engine-thread view of one request."""

    req: Request
    stream: _Stream
    emitted: int = 0                 # committed-prefix length last published


class RequestStream:
    """Async iterator over one request's outputs: a new ``RequestOutput`` whenever its committed
    prefix grew, and a final one (``finished=True``). Closing it early aborts the request."""

    def __init__(self, owner: "AsyncEngine", stream: _Stream) -> None:
        self._owner = owner
        self._s = stream

    @property
    def request_id(self) -> str:
        return self._s.request_id

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._s.finished:
            raise StopAsyncIteration
        item = await self._s.queue.get()
        if isinstance(item, RequestFailedError):
            self._s.finished = True
            raise EngineUnavailableError(f"request failed: {item}") from item
        if isinstance(item, BaseException):
            self._s.finished = True
            raise EngineUnavailableError(f"engine step failed: {item!r}") from item
        if item.finished:
            self._s.finished = True
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self._s.finished:
            self._s.finished = True
            self._owner.abort(self._s.request_id)

    async def aclose(self) -> None:
        self.abort()


class AsyncEngine:
    def __init__(self, engine: Engine, observer: StepObserver | None = None,
                 warmup=None) -> None:
        """``warmup``: a callable ``warmup(engine) -> report`` (``worker/warmup.py``) the step
        thread runs before anything else; until it returns the engine is not ready (requests
        get ``EngineUnavailableError``, ``/ready`` answers 503)."""
        self.engine = engine
        self.observer = observer
        self._warmup = warmup
        self.warming = warmup is not None
        self.warmup_report = None
        self.at_ready: dict | None = None      # runtime_counts when the engine became ready
        self.ready_at: float | None = None if warmup is not None else time.perf_counter()
        self._cv = threading.Condition()
        self._inbox: deque[AddRequest | AbortRequest] = deque()
        self._live: dict[str, _Live] = {}            # engine thread only
        self._ids: set[str] = set()                  # ids submitted and not yet finished
        self._pending_adds = 0                       # adds in the inbox (guarded by _cv)
        self._engine_waiting = 0                     # snapshot after each step
        self._engine_running = 0
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
        close = getattr(self.engine, "close", None)
        if close is not None and (self._thread is None or not self._thread.is_alive()):
            await asyncio.to_thread(close)

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
        stream = _Stream(rid, asyncio.get_running_loop())
        with self._cv:
            if rid in self._ids:
                raise ValueError(f"request id {rid!r} is already in flight")
            limit = self.engine.config.max_waiting
            if self.num_waiting >= limit:
                raise QueueFullError(f"{limit} requests are already waiting for KV pages; "
                                     f"retry later")
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

    def abort(self, request_id: str) -> None:
        """Thread-safe; applied before the next step. Unknown or finished ids are ignored."""
        with self._cv:
            self._inbox.append(AbortRequest(request_id))
            self._cv.notify()

    # ---------------------------------------------------------------------------------- counters
    @property
    def num_running(self) -> int:
        return self._engine_running

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission: the engine's queue, plus inbox requests beyond the free
        running slots (those will start at the next step unless pages run out)."""
        free_slots = max(0, self.engine.config.max_num_seqs - self._engine_running)
        return self._engine_waiting + max(0, self._pending_adds - free_slots)

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
            self.at_ready = runtime_counts(self.engine)
            if self._warmup is not None:
                KERNEL_COMPILES.ready = True       # later compiles are stalls: log them
            while True:
                with self._cv:
                    while not (self._inbox or self.engine.has_unfinished() or self._stop):
                        self._cv.wait()
                    if self._stop and not self._inbox and not self.engine.has_unfinished():
                        return
                    cmds = list(self._inbox)
                    self._inbox.clear()
                for cmd in cmds:
                    if isinstance(cmd, AddRequest):
                        self._add_now(cmd)
                    else:
                        self._abort_now(cmd.request_id)
                adds = sum(1 for c in cmds if isinstance(c, AddRequest))
                with self._cv:   # moved from the inbox to the engine's queue: count them there
                    self._engine_waiting = self.engine.scheduler.num_waiting
                    self._pending_adds -= adds
                outs: list[StepOutput] = []
                if self.engine.has_unfinished():
                    t0 = time.perf_counter()
                    outs = self.engine.step()
                    dt = time.perf_counter() - t0
                    if self.observer is not None and outs:
                        self.observer.on_step(dt, len(outs))
                self._publish(outs)
        except BaseException as e:   # noqa: BLE001 - every waiting client must hear about it
            self.error = e
            streams = [live.stream for live in self._live.values()]
            self._live.clear()
            with self._cv:
                streams += [c.stream for c in self._inbox if isinstance(c, AddRequest)]
                self._inbox.clear()
                self._pending_adds = 0
                self._ids.clear()
            self._post_many([(stream, e) for stream in streams])
            raise

    def _add_now(self, cmd: AddRequest) -> None:
        try:
            req = self.engine.add_request(cmd.prompt_ids, cmd.params, request_id=cmd.request_id,
                                          prompt=cmd.prompt)
        except Exception as e:  # noqa: BLE001 - validated already; be safe
            self._post(cmd.stream, e)
            with self._cv:
                self._ids.discard(cmd.request_id)
            return
        self._live[cmd.request_id] = _Live(req, cmd.stream)

    def _abort_now(self, rid: str) -> None:
        live = self._live.pop(rid, None)
        if live is None:
            return
        self.engine.abort(rid)           # frees its pages now
        out = self.engine.output(live.req)
        self._done(live, out)
        self._post(live.stream, out)

    def _publish(self, outs: list[StepOutput]) -> None:
        """Post an output for every request of the step whose committed prefix grew or that
        finished (host data only: no device access)."""
        now = time.monotonic()
        # NOTE: counts first: a client that got its final output must already see it gone from
        # requests_running (the step has removed finished requests from the running list)
        self._engine_running = len(self.engine.running)
        self._engine_waiting = self.engine.scheduler.num_waiting
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
            self._post_many(posts)

    def _done(self, live: _Live, out: RequestOutput) -> None:
        with self._cv:
            self._ids.discard(live.stream.request_id)
        if self.observer is not None:
            self.observer.on_finish(out, time.monotonic() - live.stream.arrival)

    @staticmethod
    def _post(stream: _Stream, item) -> None:
        AsyncEngine._post_many([(stream, item)])

    @staticmethod
    def _post_many(posts: list[tuple[_Stream, object]]) -> None:
        """Hand items to their streams' event loops: ONE thread-safe call per loop per step, not
        one per request (each call writes to the loop's wake-up pipe)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in posts:
            by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:         # the client's event loop is gone
                pass


def _deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
