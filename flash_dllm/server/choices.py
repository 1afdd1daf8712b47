"""Driving engine requests for a response: n choices with stop strings, to completion or as SSE.

OpenAI ``n`` runs n engine requests for the same prompt (choice i seeded ``seed + i``); ``stop``
strings cut each choice's text right before the first occurrence and abort its engine request as
soon as its decoded committed prefix holds one (``flash_dllm.server.stops``).

NOTE: every engine request a response submitted is aborted however the response ends (finished,
cut at a stop string, client disconnected, another choice failed, the drain limit passed, the task
cancelled): aborting frees its KV pages before the next engine step, and aborting a finished
request is a no-op. A request nobody reads would otherwise decode to the end of its canvas,
holding its pages.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Sequence

from starlette.responses import StreamingResponse

from flash_dllm.core.request import RequestOutput
from flash_dllm.engine.async_engine import EngineUnavailableError, RequestStream
from flash_dllm.engine.streams import RequestFailed
from flash_dllm.server.context import ServerContext, make_params, new_request_id
from flash_dllm.server.detokenize import IncrementalDetokenizer
from flash_dllm.server.drain import RETRY_AFTER, Drain
from flash_dllm.server.errors import APIError
from flash_dllm.server.protocol import Usage, error_body
from flash_dllm.server.stops import StopBuffer, tokens_covering

Decode = Callable[[list[int]], str]
Receive = Callable[[], Awaitable[dict]]          # the ASGI ``receive`` of the HTTP request


@dataclass(eq=False)
class Choice:
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
    decode: Decode
    prompt_tokens: int
    lazy: bool = False
    last: RequestOutput | None = None
    done: bool = False
    finish_reason: str | None = None
    _tokens: int | None = field(default=None, repr=False)

    @classmethod
    def of(cls, index: int, stream: RequestStream, decode: Decode, stops: Sequence[str],
           prompt_tokens: int, lazy: bool = False) -> Choice:
        return cls(index, stream, IncrementalDetokenizer(decode), StopBuffer(stops), decode,
                   prompt_tokens, lazy=lazy)

    def feed(self, out: RequestOutput) -> str:
        self.last = out
        if self.lazy and not out.finished:
            return ""
        delta = self.buf.push(self.detok.step(out.token_ids, final=out.finished),
                              final=out.finished)
        if self.buf.stopped:
            self.stream.abort(finish_reason="stop")     # counted as a stop, not an abort
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


# ----------------------------------------------------------------------- submit and run to the end
def submit_choices(ctx: ServerContext, prompt_ids: list[int], body, max_tokens: int | None,
                   prefix: str, prompt: str | None) -> tuple[str, list[Choice]]:
    """(response id, choices) for an OpenAI request ``body``: one engine request per choice. With a
    ``seed``, choice i samples with ``seed + i`` (reproducible, and the choices differ); without
    one, each request draws its own seed. If submitting choice k fails, the ones already submitted
    are aborted and the error is raised."""
    stops, lazy = body.stop_strings(), not body.stream
    params = [make_params(body if body.seed is None or i == 0 else
                          body.model_copy(update={"seed": body.seed + i}), max_tokens,
                          ctx.sampling_defaults)
              for i in range(body.n)]
    rid = new_request_id(prefix)
    choices: list[Choice] = []
    try:
        for i, p in enumerate(params):
            stream = ctx.submit(prompt_ids, p, rid if body.n == 1 else f"{rid}-{i}", prompt)
            choices.append(Choice.of(i, stream, ctx.tokenizer.decode, stops, len(prompt_ids),
                                     lazy=lazy and not stops))
    except BaseException:
        for ch in choices:
            ch.stream.abort()
        raise
    return rid, choices


async def run_choices(choices: list[Choice], receive: Receive, drain: Drain) -> None:
    """Drive every choice to its end (finished, or cut at a stop string); aborts them all if the
    client disconnects first (an ``http.disconnect`` on ``receive``), one fails, or the drain
    limit passes (a 503)."""
    async def consume(ch: Choice) -> None:
        async for out in ch.stream:
            ch.feed(out)
            if ch.done:
                return

    async def disconnected():
        while (await receive())["type"] != "http.disconnect":
            pass

    tasks = [asyncio.ensure_future(consume(ch)) for ch in choices]
    watcher = asyncio.ensure_future(disconnected())
    cut = drain.cutoff()
    pending = set(tasks)
    try:
        while pending:
            done, _ = await asyncio.wait(pending | {watcher, cut},
                                         return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                raise APIError(499, "client disconnected", code="client_closed_request")
            if cut in done:
                raise APIError(503, drain.message(), "server_error", code=drain.code,
                               headers={"Retry-After": RETRY_AFTER})
            for e in [t.exception() for t in done]:
                if e is not None:
                    raise e
            pending -= done
        if any(not ch.done for ch in choices):
            raise APIError(503, "the request ended without output", "server_error")
    except RequestFailed as e:       # this request alone: the server is fine (/health ok)
        raise APIError(500, str(e), "server_error", code="request_failed") from None
    except EngineUnavailableError as e:
        raise APIError(503, str(e), "server_error", code="unavailable") from None
    finally:
        watcher.cancel()
        cut.cancel()
        for t in tasks:
            t.cancel()
        for ch in choices:
            ch.stream.abort()


async def final_output(stream: RequestStream, decode: Decode, receive: Receive,
                       drain: Drain) -> RequestOutput:
    """The finished output of one engine request (``/generate``): ``run_choices`` on a single lazy
    choice with no stop strings, so a disconnect, an engine failure or the drain limit is handled
    alike."""
    ch = Choice.of(0, stream, decode, (), 0, lazy=True)
    await run_choices([ch], receive, drain)
    return ch.last


def usage(out: RequestOutput) -> Usage:
    n_p, n_c = len(out.prompt_token_ids), len(out.token_ids)
    return Usage(prompt_tokens=n_p, completion_tokens=n_c, total_tokens=n_p + n_c,
                 num_forwards=out.num_forwards)


def total_usage(choices: Sequence[Choice]) -> Usage:
    """The prompt counted once; completion tokens and forwards summed over the choices."""
    n_p = choices[0].prompt_tokens
    n_c = sum(ch.completion_tokens() for ch in choices)
    return Usage(prompt_tokens=n_p, completion_tokens=n_c, total_tokens=n_p + n_c,
                 num_forwards=sum(ch.last.num_forwards for ch in choices if ch.last))


# ------------------------------------------------------------------------------------------ SSE
def _data(ev: dict | str) -> str:
    return f"data: {ev if isinstance(ev, str) else json.dumps(ev)}\n\n"


def sse_choices(choices: list[Choice], opening: list[dict],
                events: Callable[[Choice, str], list[dict]],
                closing: Callable[[], list[dict]], drain: Drain) -> StreamingResponse:
    """SSE over all choices: ``opening``, then ``events(choice, delta)`` whenever a choice's
    releasable text grew or it ended (``choice.done``), then ``closing()`` once every choice
    ended, then ``data: [DONE]``. Outputs are interleaved in arrival order; an engine failure, or
    the drain limit passing, becomes one error event before ``[DONE]``."""
    async def gen() -> AsyncIterator[str]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(ch: Choice) -> None:
            try:
                async for out in ch.stream:
                    queue.put_nowait((ch, out))
                queue.put_nowait((ch, None))
            except EngineUnavailableError as e:
                queue.put_nowait((ch, e))

        tasks: list[asyncio.Future] = []
        cut = drain.cutoff()
        cut.add_done_callback(lambda f: f.cancelled() or queue.put_nowait((None, None)))
        try:
            for ev in opening:
                yield _data(ev)
            tasks = [asyncio.ensure_future(pump(ch)) for ch in choices]
            left = len(choices)
            while left:
                ch, item = await queue.get()
                if ch is None:
                    raise APIError(503, drain.message(), "server_error", code=drain.code)
                if ch.done:
                    continue                     # outputs after a stop string: ignored
                if isinstance(item, EngineUnavailableError):
                    raise item
                delta = ch.feed(item) if item is not None else ch.end()
                if delta or ch.done:
                    for ev in events(ch, delta):
                        yield _data(ev)
                if ch.done:
                    left -= 1
            for ev in closing():
                yield _data(ev)
        except EngineUnavailableError as e:
            yield _data(error_body(str(e), "server_error", code="request_failed" if isinstance(
                e, RequestFailed) else "unavailable"))
        except APIError as e:
            yield _data(error_body(e.message, e.type, e.param, e.code))
        finally:
            cut.cancel()
            for t in tasks:
                t.cancel()
            for ch in choices:                   # every engine request ends with the response
                ch.stream.abort()
        yield _data("[DONE]")

    return SSEResponse(gen(), [ch.stream for ch in choices])


class SSEResponse(StreamingResponse):
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
            # NOTE: the generator may be parked at a ``yield`` when the client goes (starlette
            # cancels the send, not the generator), so its ``finally`` would run only at
            # ``aclose``: abort the requests first, then close it
            for stream in self._streams:
                stream.abort()
            await self.body_iterator.aclose()
