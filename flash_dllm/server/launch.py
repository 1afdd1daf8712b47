"""Running an app under uvicorn with the engine's drain on SIGTERM (``serve`` and the in-process
server of ``bench serve`` both use it)."""
from __future__ import annotations

import uvicorn


def make_uvicorn_server(app, aeng, host: str, port: int, log_level: str = "info",
                        drain_timeout: float | None = None) -> uvicorn.Server:
    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT: /ready turns 503 and new requests get 503 at once; uvicorn stops
        accepting connections and waits for in-flight responses; the lifespan then stops the
        engine thread."""

        def handle_exit(self, sig, frame) -> None:
            aeng.begin_drain()
            super().handle_exit(sig, frame)

    cfg = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                         timeout_graceful_shutdown=drain_timeout)
    return DrainingServer(cfg)
