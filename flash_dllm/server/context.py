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
from flash_dllm.defaults import SamplingDefaults
from flash_dllm.engine.async_engine import (AsyncEngine, EngineUnavailableError, QueueFullError,
                                            RequestStream)
from flash_dllm.engine.core import resolve_params
from flash_dllm.server.drain import RETRY_AFTER, Drain, log
from flash_dllm.server.errors import APIError, param_of
from flash_dllm.server.metrics import ServerMetrics
from flash_dllm.server.protocol import IGNORED_PARAMS, NEUTRAL_PARAMS, DLLMKnobs


@dataclass(frozen=True, eq=False)
class ServerContext:
    """What the endpoints of one app share. ``tokenizer`` needs ``encode``, ``decode`` and
    ``apply_chat_template`` (``flash_dllm.models.tokenizer.Tokenizer``)."""

    async_engine: AsyncEngine
    tokenizer: Any
    served_model_name: str
    metrics: ServerMetrics
    max_model_len: int                                   # the engine's max_position
    drain: Drain
    strict_params: bool = False                          # every policy parameter is a 400
    # what a request gets for the knobs it leaves out: the server's flags, then the checkpoint's
    # generation_config.json, then the recommended defaults (``flash_dllm.defaults``)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    created: int = field(default_factory=lambda: int(time.time()))   # /v1/models "created"
    _logged: set = field(default_factory=set, repr=False)     # ignored parameters logged once

    def default_params(self) -> dict:
        """What a request that sends no knob gets (``/v1/models``' ``sampling_defaults``): each
        knob's value, the cache resolved against the served model's family, and its source."""
        eng = self.async_engine.engine
        return self.sampling_defaults.effective(lambda p: resolve_params(p, eng.cfg))

    def count_error(self, status: int) -> None:
        self.metrics.http_errors.labels(status=str(status)).inc()

    def check_model(self, name: str | None) -> None:
        """404 unless ``name`` is absent or the served model's name."""
        if name is not None and name != self.served_model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{self.served_model_name}'", param="model",
                           code="model_not_found")

    def check_request(self, body, request: Request) -> None:
        """The model (404) and the parameter policy of ``protocol``: a parameter sent at a value
        the engine cannot honour is a 400 naming it and why; ignored ones are listed in
        ``request.state.ignored_params`` (the ``X-Flash-DLLM-Ignored`` header) and logged once.
        With ``strict_params`` every policy parameter but ``user`` is a 400."""
        self.check_model(body.model)
        sent = body.policy_params()
        if self.strict_params:
            refused = [n for n in sent if n != "user"]
            if refused:
                raise APIError(400, "unknown or unsupported parameter(s): "
                               f"{', '.join(repr(n) for n in refused)} (this server runs with "
                               "--strict-params)", param=refused[0])
        ignored = []
        for name, value in sent.items():
            rule = NEUTRAL_PARAMS.get(name)
            if rule is None:
                ignored.append(name)
            elif not rule.ok(value):
                raise APIError(400, f"{name}: {rule.why} (accepted: {rule.accepts})", param=name)
        if ignored:
            request.state.ignored_params = ignored
            for name in ignored:
                if name not in self._logged:
                    self._logged.add(name)
                    log.warning("ignoring the parameter '%s' (%s); the response header "
                                "X-Flash-DLLM-Ignored names it (logged once)",
                                name, IGNORED_PARAMS[name])

    def encode_prompt(self, prompt) -> tuple[list[int], str | None]:
        """(prompt ids, prompt text or None) of a string, an id list, or a one-element list of
        either (more than one prompt per request is a 400)."""
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, f"only one prompt per request is supported, got {len(prompt)}",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            if not prompt:
                # NOTE: the tokenizer's BOS alone would make it a one-token prompt: the engine
                # would run every step of the canvas and answer noise
                raise APIError(400, "prompt is empty: send some text to continue",
                               param="prompt")
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
            msg = (f"server busy: {e}. Retry later." if "--max-queue-wait" in str(e)
                   else self.queue_full_message())
            raise APIError(429, msg, "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except EngineUnavailableError as e:
            raise APIError(503, str(e), "server_error", code="unavailable",
                           headers={"Retry-After": RETRY_AFTER}) from None
        except ValueError as e:
            msg = str(e)
            if "maximum length" in msg or "KV pages" in msg:
                param = "prompt" if len(prompt_ids) >= self.max_model_len else "max_tokens"
                raise APIError(400, msg, param=param, code="context_length_exceeded") from None
            raise APIError(400, msg, param="prompt") from None

    def queue_full_message(self) -> str:
        """Why a request was refused with 429: the limit hit (``--max-waiting``), and the state of
        the limits the waiting requests wait on (running slots, KV pages), with their flags."""
        aeng = self.async_engine
        cfg, snap = aeng.config, aeng.stats          # (the page counts: the latest snapshot)
        running, used, total = aeng.num_running, snap.pages_used, snap.pages_total
        full = lambda cond: " (full)" if cond else ""          # noqa: E731
        return (f"server busy: the waiting queue is full ({aeng.num_waiting} request(s) wait for "
                f"admission; the limit is --max-waiting {cfg.max_waiting}). Running: {running} "
                f"of --max-num-seqs {cfg.max_num_seqs}{full(running >= cfg.max_num_seqs)}; KV "
                f"pages reserved: {used} of {total} (--kv-cache-gb / --num-kv-pages)"
                f"{full(used >= total)}. Retry later.")


def check_text(text: str, param: str) -> None:
    """A 400 naming ``param`` for text that is not valid Unicode: a lone UTF-16 surrogate (the
    JSON escape ``\\udc80`` of half a pair) cannot be encoded or tokenised."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} is not valid Unicode: it holds the lone surrogate "
                            f"{text[e.start]!r} at character {e.start} (half of a UTF-16 pair "
                            f"escaped as \\uXXXX in JSON); send whole characters",
                       param=param) from None


def make_params(knobs: DLLMKnobs, max_tokens: int | None,
                defaults: SamplingDefaults | None = None) -> SamplingParams:
    """The request's ``SamplingParams`` over the server's ``defaults``; a bad combination is a
    400 naming the parameter."""
    try:
        return knobs.sampling_params(max_tokens, defaults)
    except ValueError as e:
        raise APIError(400, str(e), param=param_of(str(e))) from None


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def server_context(request: Request) -> ServerContext:
    """FastAPI dependency: the app's ``ServerContext``."""
    # NOTE: async so FastAPI calls it inline; a plain ``def`` dependency would hop to a thread
    return request.app.state.context
