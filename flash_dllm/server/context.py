"""Per-app server state (``ServerContext``) and the request preparation every endpoint shares.

``build_app`` stores one ``ServerContext`` on ``app.state.context``; handlers receive it through the
``server_context`` dependency. Its methods turn client input into engine input (model check,
prompt ids, ``SamplingParams``, submission) and engine refusals into OpenAI-style ``APIError``s.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from flash_dllm.config import SamplingParams
from flash_dllm.engine.async_engine import (AsyncEngine, EngineUnavailableError, QueueFullError,
                                            RequestStream)
from flash_dllm.server.errors import APIError, param_of
from flash_dllm.server.metrics import ServerMetrics
from flash_dllm.server.protocol import DLLMKnobs


@dataclass(frozen=True, eq=False)
class ServerContext:
    """What the endpoints of one app share. ``tokenizer`` needs ``encode``, ``decode`` and
    ``apply_chat_template`` (``flash_dllm.models.tokenizer.Tokenizer``)."""

    async_engine: AsyncEngine
    tokenizer: Any
    served_model_name: str
    metrics: ServerMetrics
    max_model_len: int                                   # the engine's max_position
    created: int = field(default_factory=lambda: int(time.time()))   # /v1/models "created"

    def count_error(self, status: int) -> None:
        self.metrics.http_errors.labels(status=str(status)).inc()

    def check_model(self, name: str | None) -> None:
        """404 unless ``name`` is absent or the served model's name."""
        if name is not None and name != self.served_model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{self.served_model_name}'", param="model",
                           code="model_not_found")

    def encode_prompt(self, prompt) -> tuple[list[int], str | None]:
        """(prompt ids, prompt text or None) of a string, an id list, or a one-element list of
        either (more than one prompt per request is a 400)."""
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, f"only one prompt per request is supported, got {len(prompt)}",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), prompt
        return list(prompt), None

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
               prompt: str | None) -> RequestStream:
        """One engine request; a full queue is 429, a draining or dead engine 503, a request the
        engine cannot hold 400 (``context_length_exceeded`` when it is too long)."""
        try:
            return self.async_engine.submit(prompt_ids, params, request_id=request_id,
                                            prompt=prompt)
        except QueueFullError as e:
            raise APIError(429, str(e), "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except EngineUnavailableError as e:
            raise APIError(503, str(e), "server_error", code="unavailable",
                           headers={"Retry-After": "5"}) from None
        except ValueError as e:
            msg = str(e)
            if "maximum length" in msg or "KV pages" in msg:
                param = "prompt" if len(prompt_ids) >= self.max_model_len else "max_tokens"
                raise APIError(400, msg, param=param, code="context_length_exceeded") from None
            raise APIError(400, msg, param="prompt") from None


def make_params(knobs: DLLMKnobs, max_tokens: int | None) -> SamplingParams:
    """The request's ``SamplingParams``; a bad combination is a 400 naming the parameter."""
    try:
        return knobs.sampling_params(max_tokens)
    except ValueError as e:
        raise APIError(400, str(e), param=param_of(str(e))) from None


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def server_context(request: Request) -> ServerContext:
    """FastAPI dependency: the app's ``ServerContext``."""
    # NOTE: async so FastAPI calls it inline; a plain ``def`` dependency would hop to a thread
    return request.app.state.context
