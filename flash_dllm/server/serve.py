"""``flash-dllm serve``: load a checkpoint, build the app, run it under uvicorn (SIGTERM drains)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from flash_dllm.config import EngineConfig


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("engine (mirrors EngineConfig)")
    g.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    g.add_argument("--kv-cache-gb", type=float, default=d.kv_cache_gb,
                   help="KV page pool size in GiB (admission control)")
    g.add_argument("--num-kv-pages", type=int, default=None, help="explicit pool size in pages")
    g.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help="queued requests before new ones get 429")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA: size the KV pool to this fraction of GPU memory minus the weights "
                        "(overrides --kv-cache-gb)")


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(max_num_seqs=a.max_num_seqs, page_size=a.page_size,
                        kv_cache_gb=a.kv_cache_gb, num_kv_pages=a.num_kv_pages,
                        max_waiting=a.max_waiting, kv_layout=a.kv_layout,
                        cuda_graphs=not a.no_cuda_graphs,
                        fused_step=a.fused_step,
                        gpu_memory_utilization=a.gpu_memory_utilization)


def load_async_engine(model: str | os.PathLike | None, device: str = "cpu", dtype: str = "float32",
                      config: EngineConfig | None = None):
    """(AsyncEngine, Tokenizer, folder) for a checkpoint folder (default: the demo model)."""
    from flash_dllm.engine.async_engine import AsyncEngine
    from flash_dllm.engine.engine import Engine
    from flash_dllm.engine.llm import default_model_path, resolve_device
    from flash_dllm.models.loader import load_model
    from flash_dllm.models.tokenizer import Tokenizer

    folder = Path(model) if model is not None else default_model_path()
    net, cfg = load_model(folder, device=resolve_device(device), dtype=dtype)
    tok = Tokenizer(folder)
    cfg = tok.resolve_ids(cfg)
    engine = Engine(net, cfg, config or EngineConfig(), decode_text=tok.decode)
    return AsyncEngine(engine), tok, folder


def build_server_app(a: argparse.Namespace):
    from flash_dllm.server.app import build_app

    aeng, tok, folder = load_async_engine(a.model, a.device, a.dtype, engine_config_from_args(a))
    name = a.served_model_name or folder.name
    app = build_app(aeng, tok, name, api_key=a.api_key, max_body_bytes=a.max_body_bytes)
    return app, aeng, name


def make_uvicorn_server(app, aeng, host: str, port: int, log_level: str = "info",
                        drain_timeout: float | None = None):
    import uvicorn

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


def require_server_extras() -> None:
    try:
        import fastapi, httpx, prometheus_client, uvicorn  # noqa: F401,E401
    except ImportError as e:
        raise SystemExit(f"error: {e.name} is missing; install the server extras: "
                         f"pip install -e '.[server]'") from None


def cmd_serve(a: argparse.Namespace) -> int:
    require_server_extras()
    app, aeng, name = build_server_app(a)
    if a.host not in ("127.0.0.1", "localhost", "::1") and a.api_key is None:
        print(f"warning: serving on {a.host} without --api-key", file=sys.stderr)
    pool = aeng.engine.pool
    print(f"flash-dllm: serving '{name}' on http://{a.host}:{a.port} "
          f"({pool.num_pages} KV pages of {pool.page_size} tokens, "
          f"max_num_seqs={aeng.engine.config.max_num_seqs})", file=sys.stderr, flush=True)
    make_uvicorn_server(app, aeng, a.host, a.port, a.log_level, a.drain_timeout).run()
    return 0


def add_serve_parser(sub) -> None:
    from flash_dllm.cli import add_model_flags

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get("FLASH_DLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* and /generate "
                        "(default: $FLASH_DLLM_API_KEY, else none)")
    s.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the checkpoint folder's name)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="larger request bodies get 413")
    s.add_argument("--drain-timeout", type=float, default=None,
                   help="seconds to let in-flight requests finish after SIGTERM (default: no limit)")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    add_model_flags(s)
    add_engine_flags(s)
    s.set_defaults(func=cmd_serve)
