"""Running an app under uvicorn with a bounded drain on SIGTERM (``serve`` and the in-process
server of ``bench serve`` both use it)."""
from __future__ import annotations

import asyncio

import uvicorn

from flash_dllm.server.drain import GRACE


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
        thread and the process exits. A second signal exits at once."""

        drain_task: asyncio.Future | None = None
        drain_requested = False

        def handle_exit(self, sig, frame) -> None:
            if self.drain_requested:
                self.force_exit = True
                return super().handle_exit(sig, frame)
            # NOTE: a signal handler: only flags here; on_tick (every 0.1 s) starts the drain
            self.drain_requested = True
            aeng.begin_drain()

        async def on_tick(self, counter: int) -> bool:
            if self.drain_requested and self.drain_task is None:
                self.drain_task = asyncio.ensure_future(drain.run())
            if self.drain_task is not None and self.drain_task.done():
                # what the drain left (a response stuck on a slow client) gets GRACE seconds
                self.config.timeout_graceful_shutdown = GRACE
                self.should_exit = True
            return await super().on_tick(counter)

    cfg = uvicorn.Config(app, host=host, port=port, log_level=log_level)
    return DrainingServer(cfg)
