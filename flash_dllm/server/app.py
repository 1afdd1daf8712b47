"""``build_app``: the FastAPI app of one model (lifespan, request guard, error handlers, router).

``build_app`` takes a ready ``AsyncEngine`` and tokenizer, so tests drive the app in-process
(httpx ``ASGITransport`` / ``TestClient``) and ``flash-dllm serve`` wraps it in uvicorn. The
endpoints are in ``flash_dllm.server.router``; what they share is the ``ServerContext`` stored on
``app.state.context``.

Every error is a 4xx/5xx with OpenAI's ``{"error": {"message", "type", "param", "code"}}`` body:
bad JSON, wrong types and unknown fields are 400 (not FastAPI's 422), a bad API key is 401, an
oversized body 413, an unknown model 404, a full queue 429 and a draining engine 503 (both with
``Retry-After``). The OpenAI parameters the engine does not use follow the policy of
``flash_dllm.server.protocol`` (``strict_params``: all are 400); the SIGTERM drain is
``flash_dllm.server.drain``'s.
"""
from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from flash_dllm.defaults import SamplingDefaults
from flash_dllm.engine.async_engine import AsyncEngine
from flash_dllm.server.context import ServerContext
from flash_dllm.server.drain import DEFAULT_DRAIN_TIMEOUT, GRACE, Drain
from flash_dllm.server.errors import (DEFAULT_MAX_BODY_BYTES, APIError, ErrorResponse,
                                      validation_message)
from flash_dllm.server.guard import Guard
from flash_dllm.server.metrics import ServerMetrics
from flash_dllm.server.protocol import error_body
from flash_dllm.server.router import router


def build_app(async_engine: AsyncEngine, tokenizer, served_model_name: str,
              api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              strict_params: bool = False,
              drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
              sampling_defaults: SamplingDefaults | None = None) -> FastAPI:
    """The server for one model. ``tokenizer`` needs ``encode``, ``decode`` and
    ``apply_chat_template`` (``flash_dllm.models.tokenizer.Tokenizer``). ``strict_params``: every
    OpenAI parameter the engine does not use is a 400 (none ignored); ``drain_timeout``: seconds
    in-flight requests get after SIGTERM (``flash_dllm.server.launch``);
    ``sampling_defaults``: what requests get for the knobs they leave out, below their own
    fields (``flash_dllm.defaults``; None: the recommended defaults only)."""
    metrics = ServerMetrics(async_engine)
    async_engine.observer = metrics
    drain = Drain(async_engine, drain_timeout)
    ctx = ServerContext(async_engine, tokenizer, served_model_name, metrics,
                        max_model_len=async_engine.max_model_len, drain=drain,
                        strict_params=strict_params,
                        sampling_defaults=sampling_defaults or SamplingDefaults())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        # SIGTERM: the drain ran first; what it cut ends within the grace period (a second
        # signal aborted every request: nothing to wait for)
        await async_engine.shutdown(timeout=0 if drain.interrupted else GRACE)

    app = FastAPI(title="flash-dllm", version="0.1.0", lifespan=lifespan)
    app.state.context = ctx
    # NOTE: the guard answers 401/413/503 itself, before routing, so it counts those errors
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes,
                       on_error=ctx.count_error, drain=drain)
    _add_error_handlers(app, ctx)
    app.include_router(router)
    return app


def _add_error_handlers(app: FastAPI, ctx: ServerContext) -> None:
    """Every error as OpenAI's JSON body, counted in ``flash_dllm_http_errors_total{status}``."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        ctx.count_error(e.status)
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        ctx.count_error(400)
        msg, param = validation_message(list(e.errors()),
                                        getattr(request.state, "body_content_type", None))
        return ErrorResponse(error_body(msg, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        ctx.count_error(e.status_code)
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return ErrorResponse(error_body(str(e.detail), code=code), status_code=e.status_code,
                             headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        ctx.count_error(500)
        return ErrorResponse(error_body(f"internal error: {e!r}", "server_error"), status_code=500)
