"""HTTP request/response models: the OpenAI completion + chat schemas and ``/generate``.

Requests are strict: wrong JSON types are errors (no ``"16"`` -> 16 coercion) and unknown fields
are rejected by name. Besides the OpenAI fields, every ``SamplingParams`` knob (``block_length``,
``steps``, ``decode``, ``cache``, ``threshold``, ``gamma``, ``top_k``, the sentinels' and the
caches' knobs, ...) is accepted as an extra body field (``DLLMKnobs``, generated from the
knobs' metadata: a new knob is a new body field).

The OpenAI parameters this engine does not use follow one policy (``IGNORED_PARAMS`` and
``NEUTRAL_PARAMS`` below; ``ServerContext.check_request`` applies it): the harmless ones are
accepted and ignored, the others are accepted only at the value that means "off" and are a 400
naming the parameter and why otherwise. With ``strict_params`` every one of them is a 400.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from flash_dllm.config import DEFAULT_BLOCK_LENGTH, SamplingParams
from flash_dllm.defaults import SamplingDefaults, fit_block_length
from flash_dllm.knobs import knobs
from flash_dllm.server.stops import stop_strings

MAX_N = 16                                       # choices per request (OpenAI ``n``)


# ------------------------------------------------------------------------- the parameter policy
# Parameters popular OpenAI clients send that change nothing this engine produces: accepted with
# any value, ignored, named in the response header ``X-Flash-DLLM-Ignored`` and logged once per
# name. (``user`` is also accepted in strict mode, as it always was.)
IGNORED_PARAMS: dict[str, str] = {
    "user": "an end-user id for OpenAI's abuse monitoring",
    "store": "OpenAI-side storage of the completion",
    "metadata": "tags for stored completions",
    "service_tier": "OpenAI's processing tier",
    "prompt_cache_key": "OpenAI's prompt-cache routing (prefix reuse here is automatic)",
    "prompt_cache_retention": "OpenAI's prompt-cache lifetime",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
    "parallel_tool_calls": "no tools are called",
    "prediction": "a latency hint (predicted output); the answer is the same without it",
    "stream_options.include_obfuscation": "OpenAI's stream padding",
}


def _is_zero(v) -> bool:
    return v is None or (type(v) in (int, float) and v == 0)


def _is_off(v) -> bool:
    return v is None or v is False


@dataclass(frozen=True)
class Neutral:
    """A parameter accepted only at the value that means "off" (what this engine does anyway)."""

    accepts: str                              # the accepted values, as the 400 message says
    why: str                                  # why any other value is refused
    ok: Callable[[Any], bool] = lambda v: v is None


_NO_TOOLS = "tool calling is not supported by this engine"
_NO_LOGPROBS = ("not supported by this engine (a diffusion LLM unmasks tokens in any order and "
                "computes no per-token log-probabilities)")

# Parameters accepted at their neutral value only; any other value is a 400 "<name>: <why>".
NEUTRAL_PARAMS: dict[str, Neutral] = {
    "presence_penalty": Neutral("0", "penalties change sampling in a way this engine does not "
                                     "implement", _is_zero),
    "frequency_penalty": Neutral("0", "penalties change sampling in a way this engine does not "
                                      "implement", _is_zero),
    "logprobs": Neutral("null or false", _NO_LOGPROBS, _is_off),
    "top_logprobs": Neutral("null or 0", _NO_LOGPROBS, _is_zero),
    "logit_bias": Neutral("null or {}", "biasing token logits is not supported by this engine",
                          lambda v: v is None or v == {}),
    "response_format": Neutral('{"type": "text"}', "structured output (json_object, json_schema) "
                               "is not supported by this engine",
                               lambda v: v is None or v == {"type": "text"}),
    "tools": Neutral("null or []", _NO_TOOLS, lambda v: v is None or v == []),
    "tool_choice": Neutral('null, "none" or "auto"', _NO_TOOLS,
                           lambda v: v is None or v in ("none", "auto")),
    "functions": Neutral("null or []", _NO_TOOLS, lambda v: v is None or v == []),
    "function_call": Neutral('null, "none" or "auto"', _NO_TOOLS,
                             lambda v: v is None or v in ("none", "auto")),
    "modalities": Neutral('["text"]', "this engine only produces text",
                          lambda v: v is None or v == ["text"]),
    "audio": Neutral("null", "this engine only produces text"),
    "web_search_options": Neutral("null", "web search is not supported by this engine"),
    "echo": Neutral("null or false", "echoing the prompt is not supported by this engine",
                    _is_off),
    "best_of": Neutral("null or 1", "ranking samples needs log-probabilities, which this engine "
                       "does not compute; use n",
                       lambda v: v is None or (type(v) is int and v == 1)),
    "suffix": Neutral('null or ""', "insertion (suffix) is not supported by this engine",
                      lambda v: v is None or v == ""),
}

_COMMON_POLICY = ("user", "store", "metadata", "service_tier", "prompt_cache_key",
                  "prompt_cache_retention", "safety_identifier", "presence_penalty",
                  "frequency_penalty", "logprobs", "logit_bias")
COMPLETION_POLICY = _COMMON_POLICY + ("echo", "best_of", "suffix")
CHAT_POLICY = _COMMON_POLICY + ("top_logprobs", "response_format", "tools", "tool_choice",
                                "functions", "function_call", "parallel_tool_calls", "prediction",
                                "modalities", "audio", "web_search_options")


def _policy_fields(name: str, base: type, names: tuple[str, ...]) -> type:
    """``base`` plus one field per policy parameter: any JSON value, checked by the policy."""
    return create_model(name, __base__=base, **{n: (Any, None) for n in names})


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class KnobBody(_Strict):
    """The base of a generated knob model (``knob_model``): the request's sampling params from
    the knobs the client sent."""

    PARAMS: ClassVar[type] = SamplingParams      # the dataclass the model was generated from

    def sampling_params(self, max_tokens: int | None,
                        defaults: SamplingDefaults | None = None) -> SamplingParams:
        """The request's ``PARAMS``: the knobs the client sent (and ``max_tokens``, the
        endpoint's own field) over the server's ``defaults`` (``flash_dllm.defaults``: its
        flags, the checkpoint's generation_config.json, the recommended defaults); raises
        ``ValueError`` naming the field on a bad value or combination."""
        cls = self.PARAMS
        kw: dict[str, Any] = {k.name: getattr(self, k.name) for k in knobs(cls)
                              if k.http and getattr(self, k.name) is not None}
        if max_tokens is not None:
            kw["max_tokens"] = max_tokens
        return (defaults or SamplingDefaults()).params(kw, cls)


def knob_model(params: type, name: str) -> type[KnobBody]:
    """A strict model with one optional body field per HTTP knob of the dataclass ``params``
    (``SamplingParams``): the knob's JSON type, its help as the description, None (not sent)
    meaning the default.

    NOTE: ranges and choices are not pydantic constraints: they are checked when
    ``sampling_params`` builds ``params`` (a 400 naming the field, with the message of the
    knob's own check), so a choice registered after import (a decode policy, a cache mode) is
    accepted, and an HTTP error says what ``SamplingParams`` says.
    """
    body = {k.name: (k.type | None, Field(None, description=k.help_text()))
            for k in knobs(params) if k.http}
    model = create_model(name, __base__=KnobBody, __doc__=f"Per-request knobs of every endpoint "
                                                         f"(see ``{params.__name__}``).", **body)
    model.PARAMS = params
    return model


# every SamplingParams knob but max_tokens (each endpoint names its own)
DLLMKnobs = knob_model(SamplingParams, "DLLMKnobs")


def default_block_length(max_tokens: int) -> int:
    """The largest divisor of ``max_tokens`` up to the default block length (32), so that any
    ``max_tokens`` works without the client knowing about blocks."""
    return fit_block_length(max_tokens, DEFAULT_BLOCK_LENGTH)


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: Any = None              # ignored (IGNORED_PARAMS)


class _OpenAICommon(DLLMKnobs):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # n choices = n engine requests for the same prompt; with a seed, choice i uses seed + i
    n: int = Field(1, ge=1, le=MAX_N)
    # the answer ends right before the first stop string (finish_reason "stop"); up to 4
    stop: str | list[str] | None = None
    POLICY: ClassVar[tuple[str, ...]] = ()       # the policy parameters this endpoint accepts

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stop_strings(v)                          # raises ValueError: a 400 naming "stop"
        return v

    def stop_strings(self) -> tuple[str, ...]:
        return stop_strings(self.stop)

    def policy_params(self) -> dict[str, Any]:
        """The policy parameters the client sent (``IGNORED_PARAMS``, ``NEUTRAL_PARAMS``)."""
        sent = {n: getattr(self, n) for n in self.POLICY if n in self.model_fields_set}
        if self.stream_options is not None and \
                "include_obfuscation" in self.stream_options.model_fields_set:
            sent["stream_options.include_obfuscation"] = self.stream_options.include_obfuscation
        return sent


class CompletionRequest(_policy_fields("_CompletionPolicy", _OpenAICommon, COMPLETION_POLICY)):
    POLICY: ClassVar[tuple[str, ...]] = COMPLETION_POLICY
    # a string, a list of token ids, or a one-element list of either
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


# what an OpenAI content part of another modality is called, by its type
MEDIA_PARTS = {"image_url": "image", "input_image": "image", "image": "image",
               "input_audio": "audio", "audio": "audio", "file": "file", "input_file": "file"}


class MediaPart(BaseModel):
    """A content part this text model cannot read (an image, audio, a file): parsed so that the
    400 says so (``ChatMessage.media_part``) instead of calling its fields unknown."""

    model_config = ConfigDict(extra="allow")
    type: Literal[tuple(MEDIA_PARTS)]


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]    # developer: a system message
    content: str | list[TextPart | MediaPart]
    name: str | None = None

    def media_part(self) -> tuple[int, str] | None:
        """(index, type) of the first content part that is not text, or None."""
        if isinstance(self.content, str):
            return None
        return next(((i, p.type) for i, p in enumerate(self.content)
                     if isinstance(p, MediaPart)), None)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_policy_fields("_ChatPolicy", _OpenAICommon, CHAT_POLICY)):
    POLICY: ClassVar[tuple[str, ...]] = CHAT_POLICY
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
