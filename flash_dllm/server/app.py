"""The FastAPI app: OpenAI completions + chat, ``/generate``, health, readiness and metrics.

``build_app`` takes a ready ``AsyncEngine`` and tokenizer, so tests drive the app in-process
(httpx ``ASGITransport`` / ``TestClient``) and ``flash-dllm serve`` wraps it in uvicorn.

Every error is a 4xx/5xx with OpenAI's ``{"error": {"message", "type", "param", "code"}}`` body:
bad JSON, wrong types and unknown fields are 400 (not FastAPI's 422), a bad API key is 401, an
oversized body 413, an unknown model 404, a full queue 429 and a draining engine 503 (both with
``Retry-After``).

OpenAI ``n`` runs n engine requests for the same prompt (choice i seeded ``seed + i``); ``stop``
strings cut each choice's text right before the first occurrence and abort its engine request as
soon as its decoded committed prefix holds one (``flash_dllm.server.stops``).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flash_dllm.config import SamplingParams
from flash_dllm.engine.async_engine import (AsyncEngine, EngineUnavailableError, QueueFullError,
                                            RequestStream)
from flash_dllm.engine.request import RequestOutput
from flash_dllm.server.detokenize import IncrementalDetokenizer
from flash_dllm.server.errors import (DEFAULT_MAX_BODY_BYTES, APIError, Guard, param_of,
                                      validation_message)
from flash_dllm.server.metrics import ServerMetrics
from flash_dllm.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                        ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
                                        ChatMessageOut, CompletionChoice, CompletionChunk,
                                        CompletionRequest, CompletionResponse, DLLMKnobs,
                                        GenerateRequest, GenerateResponse, Usage, error_body)
from flash_dllm.server.stops import StopBuffer, tokens_covering


# ----------------------------------------------------------------------------------- the app
def build_app(async_engine: AsyncEngine, tokenizer, served_model_name: str,
              api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The server for one model. ``tokenizer`` needs ``encode``, ``decode`` and
    ``apply_chat_template`` (``flash_dllm.models.tokenizer.Tokenizer``)."""
    metrics = ServerMetrics(async_engine)
    async_engine.observer = metrics
    max_len = async_engine.engine.cfg.max_position
    created = int(time.time())

    def count_error(status: int) -> None:
        metrics.http_errors.labels(status=str(status)).inc()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        await async_engine.shutdown()     # SIGTERM: uvicorn drained the connections first

    app = FastAPI(title="flash-dllm", version="0.1.0", lifespan=lifespan)
    app.state.engine = async_engine
    app.state.metrics = metrics
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, on_error=count_error)

    # ------------------------------------------------------------------------ error handlers
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        count_error(e.status)
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError):
        count_error(400)
        msg, param = validation_message(list(e.errors()))
        return JSONResponse(error_body(msg, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        count_error(e.status_code)
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(error_body(str(e.detail), code=code), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        count_error(500)
        return JSONResponse(error_body(f"internal error: {e!r}", "server_error"), status_code=500)

    # ------------------------------------------------------------------------------ helpers
    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{served_model_name}'", param="model", code="model_not_found")

    def encode_prompt(prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, f"only one prompt per request is supported, got {len(prompt)}",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return tokenizer.encode(prompt), prompt
        return list(prompt), None

    def make_params(knobs: DLLMKnobs, max_tokens: int | None) -> SamplingParams:
        try:
            return knobs.sampling_params(max_tokens)
        except ValueError as e:
            raise APIError(400, str(e), param=param_of(str(e))) from None

    def submit(prompt_ids: list[int], params: SamplingParams, prefix: str,
               prompt: str | None, rid: str | None = None) -> RequestStream:
        rid = rid or f"{prefix}-{uuid.uuid4().hex}"
        try:
            return async_engine.submit(prompt_ids, params, request_id=rid, prompt=prompt)
        except QueueFullError as e:
            raise APIError(429, str(e), "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except EngineUnavailableError as e:
            raise APIError(503, str(e), "server_error", code="unavailable",
                           headers={"Retry-After": "5"}) from None
        except ValueError as e:
            msg = str(e)
            if "maximum length" in msg or "KV pages" in msg:
                param = "prompt" if len(prompt_ids) >= max_len else "max_tokens"
                raise APIError(400, msg, param=param, code="context_length_exceeded") from None
            raise APIError(400, msg, param="prompt") from None

    async def final_output(stream: RequestStream, request: Request) -> RequestOutput:
        """The finished output of one engine request (``/generate``): ``run_choices`` on a single
        choice with no stop strings, so a disconnect or an engine failure is handled alike."""
        ch = _Choice(0, stream, IncrementalDetokenizer(tokenizer.decode), StopBuffer(()),
                     tokenizer.decode, 0, lazy=True)
        await run_choices([ch], request)
        return ch.last

    def usage(out: RequestOutput) -> Usage:
        n_p, n_c = len(out.prompt_token_ids), len(out.token_ids)
        return Usage(prompt_tokens=n_p, completion_tokens=n_c, total_tokens=n_p + n_c,
                     num_forwards=out.num_forwards)

    # ------------------------------------------------- OpenAI endpoints: n choices, stop strings
    def submit_choices(prompt_ids: list[int], body, max_tokens: int | None, prefix: str,
                       prompt: str | None) -> tuple[str, list[_Choice]]:
        """(response id, choices): one engine request per choice. With a ``seed``, choice i
        samples with ``seed + i`` (reproducible, and the choices differ); without one, each
        request draws its own seed. If submitting choice k fails, the ones already submitted are
        aborted and the error is raised."""
        stops, lazy = body.stop_strings(), not body.stream
        params = [make_params(body if body.seed is None or i == 0 else
                              body.model_copy(update={"seed": body.seed + i}), max_tokens)
                  for i in range(body.n)]
        rid = f"{prefix}-{uuid.uuid4().hex}"
        choices: list[_Choice] = []
        try:
            for i, p in enumerate(params):
                stream = submit(prompt_ids, p, prefix, prompt,
                                rid=rid if body.n == 1 else f"{rid}-{i}")
                choices.append(_Choice(i, stream, IncrementalDetokenizer(tokenizer.decode),
                                       StopBuffer(stops), tokenizer.decode, len(prompt_ids),
                                       lazy=lazy and not stops))
        except BaseException:
            for ch in choices:
                ch.stream.abort()
            raise
        return rid, choices

    async def run_choices(choices: list[_Choice], request: Request) -> None:
        """Drive every choice to its end (finished, or cut at a stop string); aborts them all if
        the client disconnects first or one fails."""
        async def consume(ch: _Choice) -> None:
            async for out in ch.stream:
                ch.feed(out)
                if ch.done:
                    return

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.ensure_future(consume(ch)) for ch in choices]
        watcher = asyncio.ensure_future(disconnected())
        pending = set(tasks)
        try:
            while pending:
                done, _ = await asyncio.wait(pending | {watcher},
                                             return_when=asyncio.FIRST_COMPLETED)
                if watcher in done:
                    raise APIError(499, "client disconnected", code="client_closed_request")
                errors = [t.exception() for t in done]
                for e in errors:
                    if e is not None:
                        raise e
                pending -= done
            if any(not ch.done for ch in choices):
                raise APIError(503, "the request ended without output", "server_error")
        except EngineUnavailableError as e:
            raise APIError(503, str(e), "server_error", code="unavailable") from None
        finally:
            watcher.cancel()
            for t in tasks:
                t.cancel()
            for ch in choices:
                ch.stream.abort()

    def total_usage(choices: Sequence[_Choice]) -> Usage:
        """The prompt counted once; completion tokens and forwards summed over the choices."""
        n_p = choices[0].prompt_tokens
        n_c = sum(ch.completion_tokens() for ch in choices)
        return Usage(prompt_tokens=n_p, completion_tokens=n_c, total_tokens=n_p + n_c,
                     num_forwards=sum(ch.last.num_forwards for ch in choices if ch.last))

    def sse_choices(choices: list[_Choice], opening: list[dict],
                    events: Callable[[_Choice, str], list[dict]],
                    closing: Callable[[], list[dict]]) -> StreamingResponse:
        """SSE over all choices: ``opening``, then ``events(choice, delta)`` whenever a choice's
        releasable text grew or it ended (``choice.done``), then ``closing()`` once every choice
        ended, then ``data: [DONE]``. Outputs are interleaved in arrival order."""
        async def gen() -> AsyncIterator[str]:
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(ch: _Choice) -> None:
                try:
                    async for out in ch.stream:
                        queue.put_nowait((ch, out))
                    queue.put_nowait((ch, None))
                except EngineUnavailableError as e:
                    queue.put_nowait((ch, e))

            tasks: list[asyncio.Future] = []
            try:
                for ev in opening:
                    yield f"data: {json.dumps(ev)}\n\n"
                tasks = [asyncio.ensure_future(pump(ch)) for ch in choices]
                left = len(choices)
                while left:
                    ch, item = await queue.get()
                    if ch.done:
                        continue                 # outputs after a stop string: ignored
                    if isinstance(item, EngineUnavailableError):
                        raise item
                    delta = ch.feed(item) if item is not None else ch.end()
                    if delta or ch.done:
                        for ev in events(ch, delta):
                            yield f"data: {json.dumps(ev)}\n\n"
                    if ch.done:
                        left -= 1
                for ev in closing():
                    yield f"data: {json.dumps(ev)}\n\n"
            except EngineUnavailableError as e:
                yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
            finally:
                for t in tasks:
                    t.cancel()
                for ch in choices:               # every engine request ends with the response
                    ch.stream.abort()
            yield "data: [DONE]\n\n"

        return _SSEResponse(gen(), [ch.stream for ch in choices])

    def sse(stream: RequestStream, events: Callable[[str, RequestOutput | None], list[dict]],
            ) -> StreamingResponse:
        """Stream ``events(delta_text, output)`` as SSE ``data:`` lines, then ``data: [DONE]``;
        ``events("", None)`` gives the opening events."""
        detok = IncrementalDetokenizer(tokenizer.decode)

        async def gen() -> AsyncIterator[str]:
            try:
                for ev in events("", None):
                    yield f"data: {json.dumps(ev)}\n\n"
                async for out in stream:
                    delta = detok.step(out.token_ids, final=out.finished)
                    if delta or out.finished:
                        for ev in events(delta, out):
                            yield f"data: {json.dumps(ev)}\n\n"
            except EngineUnavailableError as e:
                yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
            yield "data: [DONE]\n\n"

        return _SSEResponse(gen(), [stream])

    # ---------------------------------------------------------------------------- endpoints
    @app.get("/health")
    async def health():
        if not async_engine.alive:
            return JSONResponse({"status": "error", "error": repr(async_engine.error)}, 503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if not async_engine.ready:
            return JSONResponse({"status": "draining" if async_engine.draining else "error"}, 503,
                                headers={"Retry-After": "5"})
        return {"status": "ready", "running": async_engine.num_running,
                "waiting": async_engine.num_waiting}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model",
                                            "created": created, "owned_by": "flash-dllm",
                                            "max_model_len": max_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        ids, text = encode_prompt(body.prompt)
        rid, choices = submit_choices(ids, body, body.max_tokens, "cmpl", text)
        model = served_model_name
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            t0 = int(time.time())

            def events(ch: _Choice, delta: str) -> list[dict]:
                return [CompletionChunk(id=rid, created=t0, model=model, choices=[
                    CompletionChoice(index=ch.index, text=delta, finish_reason=ch.finish_reason)
                ]).model_dump(exclude_none=False, exclude={"usage"})]

            def closing() -> list[dict]:
                if not include_usage:
                    return []
                return [{"id": rid, "object": "text_completion", "created": t0, "model": model,
                         "choices": [], "usage": total_usage(choices).model_dump()}]
            return sse_choices(choices, [], events, closing)
        await run_choices(choices, request)
        return CompletionResponse(id=rid, model=model, usage=total_usage(choices), choices=[
            CompletionChoice(index=ch.index, text=ch.text, finish_reason=ch.finish_reason)
            for ch in choices])

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(messages)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        rid, choices = submit_choices(tokenizer.encode(text), body, max_tokens, "chatcmpl", text)
        model = served_model_name
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            t0 = int(time.time())

            def chunk(index: int, delta: ChatDelta, finish: str | None) -> dict:
                ev = ChatCompletionChunk(id=rid, created=t0, model=model, choices=[
                    ChatChunkChoice(index=index, delta=delta, finish_reason=finish)]).model_dump(
                        exclude={"usage"})
                ev["choices"][0]["delta"] = delta.model_dump(exclude_none=True)   # as OpenAI
                return ev

            def events(ch: _Choice, delta: str) -> list[dict]:
                ev = [chunk(ch.index, ChatDelta(content=delta), None)] if delta else []
                if ch.done:
                    ev.append(chunk(ch.index, ChatDelta(), ch.finish_reason))
                return ev

            def closing() -> list[dict]:
                if not include_usage:
                    return []
                return [{"id": rid, "object": "chat.completion.chunk", "created": t0,
                         "model": model, "choices": [], "usage": total_usage(choices).model_dump()}]
            opening = [chunk(ch.index, ChatDelta(role="assistant", content=""), None)
                       for ch in choices]
            return sse_choices(choices, opening, events, closing)
        await run_choices(choices, request)
        return ChatCompletionResponse(id=rid, model=model, usage=total_usage(choices), choices=[
            ChatChoice(index=ch.index, message=ChatMessageOut(content=ch.text),
                       finish_reason=ch.finish_reason) for ch in choices])

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        ids, text = encode_prompt(body.prompt)
        knobs = body.model_copy(update={"steps": body.num_inference_steps}) \
            if body.num_inference_steps is not None else body
        stream = submit(ids, make_params(knobs, body.max_new_tokens), "gen", text)
        if body.stream:
            def events(delta: str, out: RequestOutput | None) -> list[dict]:
                if out is None:
                    return []
                ev = {"id": stream.request_id, "text": delta, "finished": out.finished}
                if out.finished:
                    ev.update(finish_reason=out.finish_reason, num_forwards=out.num_forwards,
                              token_ids=out.token_ids, usage=usage(out).model_dump())
                return [ev]
            return sse(stream, events)
        out = await final_output(stream, request)
        return GenerateResponse(id=stream.request_id, text=tokenizer.decode(out.token_ids),
                                token_ids=out.token_ids, finish_reason=out.finish_reason,
                                num_forwards=out.num_forwards,
                                tokens_per_forward=round(out.tokens_per_forward, 4),
                                usage=usage(out))

    return app


@dataclass(eq=False)
class _Choice:
    """One OpenAI choice: its engine request and the text released so far.

    ``feed(output)`` returns the text that may be sent now: the committed prefix's new text
    (``IncrementalDetokenizer``) minus any tail that could still begin a stop string
    (``StopBuffer``). Once the text holds a stop string the choice is done with finish_reason
    "stop" and its engine request is aborted at once (its KV pages are freed before the next
    step). ``lazy`` (non-streamed, no stop strings): decode only the final output.
    """

    index: int
    stream: RequestStream
    detok: IncrementalDetokenizer
    buf: StopBuffer
    decode: Callable[[list[int]], str]
    prompt_tokens: int
    lazy: bool = False
    last: RequestOutput | None = None
    done: bool = False
    finish_reason: str | None = None
    _tokens: int | None = field(default=None, repr=False)

    def feed(self, out: RequestOutput) -> str:
        self.last = out
        if self.lazy and not out.finished:
            return ""
        delta = self.buf.push(self.detok.step(out.token_ids, final=out.finished),
                              final=out.finished)
        if self.buf.stopped:
            self.stream.abort()
            self.done, self.finish_reason = True, "stop"
        elif out.finished:
            self.done, self.finish_reason = True, out.finish_reason
        return delta

    def end(self) -> str:
        """The request's stream ended without a final output (aborted elsewhere)."""
        delta = self.buf.push("", final=True)
        self.done, self.finish_reason = True, "abort"
        return delta

    @property
    def text(self) -> str:
        return self.buf.output

    def completion_tokens(self) -> int:
        """Tokens of the returned text: all committed answer ids, or, for an answer cut at a stop
        string, the fewest leading ids whose decoding covers the returned text (a token that
        straddles the cut counts; the stop string's own tokens do not)."""
        if self.last is None:
            return 0
        if not self.buf.stopped:
            return len(self.last.token_ids)
        if self._tokens is None:
            self._tokens = tokens_covering(self.last.token_ids, self.text, self.decode)
        return self._tokens


class _SSEResponse(StreamingResponse):
    """Server-sent events whose requests are aborted (pages freed) however the response ends:
    finished, client disconnected, or cancelled."""

    def __init__(self, content, streams: list[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._streams:
                stream.abort()
            await self.body_iterator.aclose()
