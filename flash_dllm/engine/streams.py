"""The event-loop side of the async engine's requests: their output streams, the errors a stream
raises, the observer of engine events, and the hand-over of outputs from the engine thread.

Outputs cross threads in ``post_many``: ONE ``loop.call_soon_threadsafe`` per event loop per
step, never one per request.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Protocol

from flash_dllm.core.request import RequestOutput


class QueueFullError(RuntimeError):
    """Too many requests are waiting for pages; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineUnavailableError(RuntimeError):
    """The engine is draining (shutting down) or its step thread died."""


class RequestFailedError(RuntimeError):
    """One request failed (e.g. its KV transfer between workers timed out); others go on."""


class RequestFailed(EngineUnavailableError):
    """What a request's stream raises when that request alone failed (``RequestFailedError``:
    a failed step, a KV transfer timeout) while the engine goes on: the server answers 500, not
    503. A subclass, so that callers treating every failure alike still catch it."""


class StepObserver(Protocol):
    """Receives engine events (on the engine thread); the server's metrics implement it."""

    def on_step(self, seconds: float, batch_size: int) -> None: ...
    def on_tokens(self, n: int) -> None: ...
    def on_first_token(self, seconds: float) -> None: ...
    def on_finish(self, output: RequestOutput, seconds: float) -> None: ...


@dataclass
class Stream:
    """Loop-side end of one request: outputs arrive in ``queue``; ``None`` in it ends the stream."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    finished: bool = False


class RequestStream:
    """Async iterator over one request's outputs: a new ``RequestOutput`` whenever its committed
    prefix grew, and a final one (``finished=True``). Closing it early aborts the request."""

    def __init__(self, owner, stream: Stream) -> None:
        """``owner``: what aborts the request (``AsyncEngine.abort``)."""
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
            raise RequestFailed(f"request failed: {item}") from item
        if isinstance(item, BaseException):
            self._s.finished = True
            raise EngineUnavailableError(f"engine step failed: {item!r}") from item
        if item.finished:
            self._s.finished = True
        return item

    def abort(self, finish_reason: str = "abort") -> None:
        """Abort the request unless it already finished (idempotent). ``finish_reason``: what
        the request's end is counted as (``"stop"``: the server found a stop string)."""
        if not self._s.finished:
            self._s.finished = True
            self._owner.abort(self._s.request_id, finish_reason)

    async def aclose(self) -> None:
        self.abort()


def post(stream: Stream, item) -> None:
    post_many([(stream, item)])


def post_many(posts: list[tuple[Stream, object]]) -> None:
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
