"""The SIGTERM drain of one app, bounded by ``--drain-timeout``.

From the signal on, the listening socket stays open: ``/ready`` and ``/health`` answer 503 and every
new API request gets 503 with ``Retry-After`` (the ``Guard`` refuses it before reading its body),
while the in-flight ones (HTTP responses under way and engine requests) run on. When they are all
done, or when ``timeout`` seconds have passed, the drain ends and uvicorn closes the socket and
exits. At the limit the drain *expires*: every handler still running ends its response properly,
a non-streamed one with a 503 OpenAI error body, a stream with an error event and ``data: [DONE]``,
a request whose body is still arriving with a 503; ``GRACE`` seconds are left for that.

NOTE: handlers learn of the expiry through ``cutoff()`` futures (one per response, on the loop that
runs it), never by polling, so a response costs nothing extra until the drain expires.
"""
from __future__ import annotations

import asyncio
import logging
import time

from flash_dllm.engine.async_engine import AsyncEngine

DEFAULT_DRAIN_TIMEOUT = 30.0
GRACE = 5.0            # after the limit: time for cut responses to be sent before uvicorn closes
POLL = 0.05
RETRY_AFTER = "5"      # seconds a refused client should wait (another replica, or our restart)

log = logging.getLogger("uvicorn.error")         # next to uvicorn's own lifecycle messages


class DrainExpired(Exception):
    """The drain limit passed while this response was still running."""


class Drain:
    """The drain state of one app: the in-flight API requests (counted by the ``Guard``), the limit,
    and the futures of the responses to cut when it passes."""

    def __init__(self, async_engine: AsyncEngine, timeout: float = DEFAULT_DRAIN_TIMEOUT) -> None:
        if not timeout >= 0:
            raise ValueError(f"drain timeout must be >= 0 seconds, got {timeout!r}")
        self.async_engine = async_engine
        self.timeout = float(timeout)
        self.active = 0                  # API requests in flight (Guard), refused ones excluded
        self.expired = False
        self.interrupted = False         # a second signal: cut everything now
        self._waiters: set[asyncio.Future] = set()

    @property
    def draining(self) -> bool:
        return self.async_engine.draining

    @property
    def busy(self) -> bool:
        return self.active > 0 or self.async_engine.num_unfinished > 0

    @property
    def code(self) -> str:
        """The error code of a response the drain cut."""
        return "interrupted" if self.interrupted else "drain_timeout"

    def message(self) -> str:
        if self.interrupted:
            return ("the server was interrupted (a second Ctrl-C / signal) and stopped at once; "
                    "retry the request")
        return (f"the server is shutting down and the request did not finish within the drain "
                f"limit of {self.timeout:g} s (--drain-timeout); retry it")

    def cutoff(self) -> asyncio.Future:
        """A future that resolves when the drain expires (at once if it has); cancel it when the
        response ends."""
        fut = asyncio.get_running_loop().create_future()
        if self.expired:
            fut.set_result(None)
        else:
            self._waiters.add(fut)
            fut.add_done_callback(self._waiters.discard)
        return fut

    async def run(self) -> bool:
        """Refuse new requests, wait for the in-flight ones up to ``timeout`` seconds, then cut the
        rest (``GRACE`` seconds for their last bytes). True if everything finished in time."""
        self.async_engine.begin_drain()
        eng = self.async_engine
        log.info("draining: %d request(s) in flight, %d in the engine; new requests get 503 "
                 "for up to %g s (a second signal stops at once)", self.active,
                 eng.num_unfinished, self.timeout)
        deadline = time.monotonic() + self.timeout
        while self.busy and eng.alive and time.monotonic() < deadline:
            await asyncio.sleep(POLL)
        if not self.busy:
            log.info("drained: every in-flight request finished")
            return True
        if not eng.alive:
            log.error("the engine stopped during the drain: %r", eng.error)
            return False
        log.warning("drain limit of %g s passed: ending %d request(s) with an error",
                    self.timeout, self.active)
        self.expire()
        end = time.monotonic() + GRACE
        while self.active and time.monotonic() < end:
            await asyncio.sleep(POLL)
        return False

    def interrupt(self) -> None:
        """A second signal: cut every response now (its client gets an error body, a stream an
        error event then [DONE]) and abort every engine request. Safe from a signal handler."""
        self.interrupted = True
        self.async_engine.begin_drain()
        self.async_engine.abort_all()
        self.expire()

    def expire(self) -> None:
        """Cut every running response now (and any that asks later)."""
        self.expired = True
        for fut in list(self._waiters):
            try:
                fut.get_loop().call_soon_threadsafe(_resolve, fut)
            except RuntimeError:             # its event loop is gone: nobody waits on it
                self._waiters.discard(fut)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
