"""HTTP request/response models: the OpenAI completion + chat schemas and ``/generate``.

Requests are strict: wrong JSON types are errors (no ``"16"`` -> 16 coercion) and unknown fields
are rejected by name. Besides the OpenAI fields, the dLLM knobs ``block_length``, ``steps``,
``decode``, ``cache``, ``threshold``, ``gamma`` (and ``top_k``) are accepted as extra body fields.
"""
from __future__ import annotations

import time
from dataclasses import fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from flash_dllm.config import DEFAULT_BLOCK_LENGTH, SamplingParams
from flash_dllm.server.stops import stop_strings

MAX_N = 16                                       # choices per request (OpenAI ``n``)

_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class DLLMKnobs(_Strict):
    """Per-request sampling knobs shared by every endpoint (see ``SamplingParams``)."""

    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0)
    block_length: int | None = Field(None, ge=1)
    steps: int | None = Field(None, ge=1)
    decode: str | None = None
    cache: str | None = None
    threshold: float | None = Field(None, gt=0.0, le=1.0)
    gamma: float | None = Field(None, gt=0.0, allow_inf_nan=False)   # decode="verify" acceptance

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """The request's SamplingParams; raises ``ValueError`` naming the field on a bad combination."""
        # NOTE: a knob SamplingParams does not know (yet) is range-checked here and not passed on
        kw: dict[str, Any] = {k: getattr(self, k) for k in DLLMKnobs.model_fields
                              if getattr(self, k) is not None and k in _SAMPLING_FIELDS}
        kw["max_tokens"] = max_tokens if max_tokens is not None else SamplingParams.max_tokens
        if "block_length" not in kw:
            kw["block_length"] = default_block_length(kw["max_tokens"])
        return SamplingParams(**kw)


def default_block_length(max_tokens: int) -> int:
    """The largest divisor of ``max_tokens`` up to the default block length (32), so that any
    ``max_tokens`` works without the client knowing about blocks."""
    return max(d for d in range(1, min(DEFAULT_BLOCK_LENGTH, max_tokens) + 1) if max_tokens % d == 0)


class StreamOptions(_Strict):
    include_usage: bool = False


class _OpenAICommon(DLLMKnobs):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # n choices = n engine requests for the same prompt; with a seed, choice i uses seed + i
    n: int = Field(1, ge=1, le=MAX_N)
    # the answer ends right before the first stop string (finish_reason "stop"); up to 4
    stop: str | list[str] | None = None
    user: str | None = None                      # accepted, unused

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stop_strings(v)                          # raises ValueError: a 400 naming "stop"
        return v

    def stop_strings(self) -> tuple[str, ...]:
        return stop_strings(self.stop)


class CompletionRequest(_OpenAICommon):
    # a string, a list of token ids, or a one-element list of either
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_OpenAICommon):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class GenerateRequest(DLLMKnobs):
    prompt: str | list[int]
    max_new_tokens: int | None = Field(None, ge=1)
    num_inference_steps: int | None = Field(None, ge=1)
    stream: bool = False


# ------------------------------------------------------------------------------------- responses
class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    num_forwards: int = 0          # dLLM: model forwards that included the request


class CompletionChoice(_Out):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(_Out):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Out):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Out):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(CompletionResponse):
    """Streamed completions reuse the ``text_completion`` object with a text delta."""


class GenerateResponse(_Out):
    id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_forwards: int
    tokens_per_forward: float
    usage: Usage


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
