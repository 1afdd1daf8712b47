"""Running an app under uvicorn with a bounded drain on SIGTERM (``serve`` and the in-process
server of ``bench serve`` both use it)."""
from __future__ import annotations

import asyncio
import time

import uvicorn

from flash_dllm.server.drain import GRACE

INTERRUPT_GRACE = 1.0    # after a second signal: seconds for the cut responses' last bytes


def make_uvicorn_server(app, aeng, host: str, port: int, log_level: str = "info",
                        drain_timeout: float | None = None) -> uvicorn.Server:
    """``drain_timeout`` (seconds) replaces the app's own (``build_app(drain_timeout=...)``)."""
    drain = app.state.context.drain
    if drain_timeout is not None:
        drain.timeout = float(drain_timeout)

    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT: ``/ready`` and new requests answer 503 at once while the socket
        stays open; when the in-flight requests are done or the drain limit passed
        (``flash_dllm.server.drain``), uvicorn closes the socket, the lifespan stops the engine
        thread and the process exits. A second signal exits at once, cleanly: every response
        is cut (an error body; a stream's error event then [DONE]), every engine request
        aborted, and the engine thread stopped before the process exits (uvicorn's force_exit
        skipped that: the interpreter then died under the running thread, SIGABRT)."""

        drain_task: asyncio.Future | None = None
        drain_requested = False
        interrupted_at: float | None = None

        def handle_exit(self, sig, frame) -> None:
            if self.drain_requested:
                if self.interrupted_at is None:
                    # NOTE: a signal handler: the drain only sets flags and posts callbacks
                    self.interrupted_at = time.monotonic()
                    drain.interrupt()
                return
            # NOTE: a signal handler: only flags here; on_tick (every 0.1 s) starts the drain
            self.drain_requested = True
            aeng.begin_drain()

        async def on_tick(self, counter: int) -> bool:
            if self.interrupted_at is not None:
                # the cut responses get INTERRUPT_GRACE seconds for their last bytes
                self.config.timeout_graceful_shutdown = INTERRUPT_GRACE
                self.should_exit = True
                return await super().on_tick(counter)
            if self.drain_requested and self.drain_task is None:
                self.drain_task = asyncio.ensure_future(drain.run())
            if self.drain_task is not None and self.drain_task.done():
                # what the drain left (a response stuck on a slow client) gets GRACE seconds
                self.config.timeout_graceful_shutdown = GRACE
                self.should_exit = True
            return await super().on_tick(counter)

    cfg = uvicorn.Config(app, host=host, port=port, log_level=log_level)
    return DrainingServer(cfg)
