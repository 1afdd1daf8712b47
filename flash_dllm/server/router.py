"""The HTTP endpoints: one handler each, over the app's ``ServerContext``.

Admin (``/health``, ``/ready``, ``/metrics``, ``/v1/models``), OpenAI (``/v1/completions``,
``/v1/chat/completions``: n choices, stop strings, SSE chunks as OpenAI sends them) and the native
``/generate``. Handlers validate and submit; ``flash_dllm.server.choices`` drives the engine
requests to a response.
"""
from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from flash_dllm.core.request import RequestOutput
from flash_dllm.decoding.registry import DECODE_POLICIES
from flash_dllm.server.choices import (Choice, final_output, run_choices, sse_choices,
                                       submit_choices, total_usage, usage)
from flash_dllm.server.context import (ServerContext, check_text, make_params, new_request_id,
                                       server_context)
from flash_dllm.server.drain import RETRY_AFTER, Drain
from flash_dllm.server.errors import APIError
from flash_dllm.server.health import unservable, workers
from flash_dllm.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                        ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
                                        ChatMessageOut, CompletionChoice, CompletionChunk,
                                        CompletionRequest, CompletionResponse, GenerateRequest,
                                        GenerateResponse, MEDIA_PARTS)

# the decode policy a bare step count selects (the first that reads ``steps``)
STEPS_POLICY = next(n for n in DECODE_POLICIES if DECODE_POLICIES[n].reads_steps)

router = APIRouter()
Ctx = Annotated[ServerContext, Depends(server_context)]


# ---------------------------------------------------------------------------------------- admin
@router.get("/health")
async def health(ctx: Ctx):
    """200 while the engine serves: ``{"status": "ok"}``, "degraded" when a disaggregated
    worker was lost but each role keeps a live one; 503 when the engine failed, drains, or a
    role has no live worker left. A disaggregated engine lists its ``workers``."""
    eng = ctx.async_engine
    if not eng.alive:
        return JSONResponse({"status": "error", "error": repr(eng.error)}, 503)
    if eng.draining:
        return JSONResponse({"status": "draining"}, 503, headers={"Retry-After": RETRY_AFTER})
    snap = eng.stats
    ws = workers(snap)
    if ws is None:
        return {"status": "ok"}
    why = unservable(snap)
    if why is not None:
        return JSONResponse({"status": "error", "error": why, "workers": ws}, 503)
    return {"status": "ok" if all(w["state"] == "up" for w in ws) else "degraded",
            "workers": ws}


@router.get("/ready")
async def ready(ctx: Ctx):
    eng = ctx.async_engine
    if not eng.ready:
        status = ("draining" if eng.draining else "warming_up" if eng.warming and eng.alive
                  else "error")
        return JSONResponse({"status": status}, 503, headers={"Retry-After": RETRY_AFTER})
    why = unservable(eng.stats)           # a disaggregated role with no live worker left
    if why is not None:
        return JSONResponse({"status": "error", "error": why}, 503)
    return {"status": "ready", "running": eng.num_running, "waiting": eng.num_waiting}


@router.get("/metrics")
async def prometheus(ctx: Ctx):
    return Response(ctx.metrics.render(), media_type=ctx.metrics.content_type)


@router.get("/v1/models")
async def models(ctx: Ctx):
    # sampling_defaults: what a request that sends no dLLM knob gets (issue 42): per knob its
    # value and its source (the server's flags, generation_config.json, or recommended)
    defaults = ctx.default_params()
    return {"object": "list", "data": [{"id": ctx.served_model_name, "object": "model",
                                        "created": ctx.created, "owned_by": "flash-dllm",
                                        "max_model_len": ctx.max_model_len,
                                        "sampling_defaults": defaults["values"],
                                        "sampling_defaults_source": defaults["sources"]}]}


# --------------------------------------------------------------------------------------- OpenAI
@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, ctx: Ctx):
    ctx.check_request(body, request)
    ids, text = ctx.encode_prompt(body.prompt)
    rid, choices = submit_choices(ctx, ids, body, body.max_tokens, "cmpl", text)
    if body.stream:
        return completion_stream(rid, ctx.served_model_name, choices, _include_usage(body),
                                 ctx.drain)
    await run_choices(choices, request.receive, ctx.drain)
    return CompletionResponse(id=rid, model=ctx.served_model_name, usage=total_usage(choices),
                              choices=[CompletionChoice(index=ch.index, text=ch.text,
                                                        finish_reason=ch.finish_reason)
                                       for ch in choices])


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: Request, ctx: Ctx):
    ctx.check_request(body, request)
    for i, m in enumerate(body.messages):
        if (media := m.media_part()) is not None:
            j, kind = media
            raise APIError(400, f"messages[{i}].content[{j}] is a part of type {kind!r}: "
                                f"{MEDIA_PARTS[kind]} inputs are not supported by this text "
                                "model; send text parts only", param=f"messages[{i}].content[{j}]")
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in body.messages]
    for i, m in enumerate(messages):
        check_text(m["content"], f"messages[{i}].content")
    try:
        text = ctx.tokenizer.apply_chat_template(messages)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    max_tokens = body.max_completion_tokens or body.max_tokens
    rid, choices = submit_choices(ctx, ctx.tokenizer.encode(text), body, max_tokens, "chatcmpl",
                                  text)
    if body.stream:
        return chat_stream(rid, ctx.served_model_name, choices, _include_usage(body), ctx.drain)
    await run_choices(choices, request.receive, ctx.drain)
    return ChatCompletionResponse(id=rid, model=ctx.served_model_name, usage=total_usage(choices),
                                  choices=[ChatChoice(index=ch.index,
                                                      message=ChatMessageOut(content=ch.text),
                                                      finish_reason=ch.finish_reason)
                                           for ch in choices])


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def completion_stream(rid: str, model: str, choices: list[Choice], include_usage: bool,
                      drain: Drain) -> StreamingResponse:
    """``text_completion`` chunks: one per text delta of a choice (its last carries the
    finish_reason), then the usage chunk if asked for."""
    t0 = int(time.time())

    def events(ch: Choice, delta: str) -> list[dict]:
        return [CompletionChunk(id=rid, created=t0, model=model, choices=[
            CompletionChoice(index=ch.index, text=delta, finish_reason=ch.finish_reason)
        ]).model_dump(exclude_none=False, exclude={"usage"})]

    def closing() -> list[dict]:
        if not include_usage:
            return []
        return [{"id": rid, "object": "text_completion", "created": t0, "model": model,
                 "choices": [], "usage": total_usage(choices).model_dump()}]

    return sse_choices(choices, [], events, closing, drain)


def chat_stream(rid: str, model: str, choices: list[Choice], include_usage: bool,
                drain: Drain) -> StreamingResponse:
    """``chat.completion.chunk``s as OpenAI sends them: a role chunk per choice, content deltas,
    an empty delta with the finish_reason, then the usage chunk if asked for."""
    t0 = int(time.time())

    def chunk(index: int, delta: ChatDelta, finish: str | None) -> dict:
        ev = ChatCompletionChunk(id=rid, created=t0, model=model, choices=[
            ChatChunkChoice(index=index, delta=delta, finish_reason=finish)]).model_dump(
                exclude={"usage"})
        ev["choices"][0]["delta"] = delta.model_dump(exclude_none=True)   # as OpenAI
        return ev

    def events(ch: Choice, delta: str) -> list[dict]:
        ev = [chunk(ch.index, ChatDelta(content=delta), None)] if delta else []
        if ch.done:
            ev.append(chunk(ch.index, ChatDelta(), ch.finish_reason))
        return ev

    def closing() -> list[dict]:
        if not include_usage:
            return []
        return [{"id": rid, "object": "chat.completion.chunk", "created": t0, "model": model,
                 "choices": [], "usage": total_usage(choices).model_dump()}]

    opening = [chunk(ch.index, ChatDelta(role="assistant", content=""), None) for ch in choices]
    return sse_choices(choices, opening, events, closing, drain)


# ------------------------------------------------------------------------------------ /generate
@router.post("/generate")
async def generate(body: GenerateRequest, request: Request, ctx: Ctx):
    ids, text = ctx.encode_prompt(body.prompt)
    # num_inference_steps is a step count: a request that sends it and no decode policy
    # decodes with the policy that follows one (``DecodePolicy.reads_steps``: LLaDA's vanilla;
    # under the default threshold policy it did nothing)
    knobs = body.model_copy(update={"steps": body.num_inference_steps,
                                    **({"decode": STEPS_POLICY} if body.decode is None else {})}) \
        if body.num_inference_steps is not None else body
    stream = ctx.submit(ids, make_params(knobs, body.max_new_tokens,
                                          ctx.sampling_defaults), new_request_id("gen"), text)
    decode, rid = ctx.tokenizer.decode, stream.request_id
    if body.stream:
        return sse_choices([Choice.of(0, stream, decode, (), len(ids))], [],
                           lambda ch, delta: generate_events(rid, delta, ch.last), lambda: [],
                           ctx.drain)
    out = await final_output(stream, decode, request.receive, ctx.drain)
    return GenerateResponse(id=rid, text=decode(out.token_ids),
                            token_ids=out.token_ids, finish_reason=out.finish_reason,
                            num_forwards=out.num_forwards,
                            tokens_per_forward=round(out.tokens_per_forward, 4), usage=usage(out))


def generate_events(rid: str, delta: str, out: RequestOutput | None) -> list[dict]:
    """One event per text delta; the last adds finish_reason, forwards, ids and usage."""
    if out is None or not (delta or out.finished):
        return []
    ev = {"id": rid, "text": delta, "finished": out.finished}
    if out.finished:
        ev.update(finish_reason=out.finish_reason, num_forwards=out.num_forwards,
                  token_ids=out.token_ids, usage=usage(out).model_dump())
    return [ev]
