"""Request guard (API key 401, body size 413) and OpenAI-style errors for the server."""
from __future__ import annotations

import hmac
import json
from dataclasses import fields
from typing import Callable

from fastapi.responses import JSONResponse

from flash_dllm.config import SamplingParams
from flash_dllm.server.protocol import DLLMKnobs, error_body

DEFAULT_MAX_BODY_BYTES = 1 << 20
_PARAM_NAMES = set(DLLMKnobs.model_fields) | {f.name for f in fields(SamplingParams)}
PROTECTED_PREFIXES = ("/v1/", "/generate")      # /health, /ready, /metrics stay open


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code),
                            status_code=self.status, headers=self.headers)


# ------------------------------------------------------------------------------ ASGI guard layer
async def _send_json(send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *headers]})
    await send({"type": "http.response.body", "body": data})


class Guard:
    """API key check (401) and body size limit (413), before any JSON parsing.

    The body is read here (at most ``max_body_bytes`` + one chunk) and replayed to the app; later
    ``receive`` calls pass through, so the app still sees the client's disconnect.
    """

    def __init__(self, app, api_key: str | None, max_body_bytes: int, on_error: Callable) -> None:
        self.app, self.api_key, self.max_body_bytes, self.on_error = app, api_key, max_body_bytes, on_error

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"].startswith(PROTECTED_PREFIXES):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else \
                headers.get(b"x-api-key", b"").decode("latin-1")
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                self.on_error(401)
                msg = ("missing API key: send 'Authorization: Bearer <key>'" if not token
                       else "incorrect API key provided")
                return await _send_json(send, 401, error_body(msg, "authentication_error",
                                                              None, "invalid_api_key"),
                                        [(b"www-authenticate", b"Bearer")])
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_big = error_body(f"request body exceeds the limit of {self.max_body_bytes} bytes",
                             code="request_too_large")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            self.on_error(413)
            return await _send_json(send, 413, too_big)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                self.on_error(413)
                return await _send_json(send, 413, too_big)
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One readable message (and the first offending parameter) from pydantic/FastAPI errors."""
    for e in errors:
        if e.get("type") == "json_invalid":
            ctx = e.get("ctx", {}).get("error", "")
            return f"malformed JSON body: {ctx}".rstrip(": "), None
    unknown = [str(e["loc"][-1]) for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        return (f"unknown or unsupported parameter(s): {', '.join(repr(u) for u in unknown)}",
                unknown[0])
    by_field: dict[str, list[dict]] = {}
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if not loc and e.get("type") in ("missing", "model_attributes_type", "dict_type",
                                         "model_type"):
            return "the request body must be a JSON object", None
        by_field.setdefault(loc[0] if loc else "body", []).append(e)
    parts = []
    for name, errs in by_field.items():
        # NOTE: a union field (prompt, content) reports one error per alternative: show the first
        msg = errs[0].get("msg", "invalid value")
        loc = [str(x) for x in errs[0].get("loc", ()) if x != "body"]
        where = ".".join(x for x in loc if not x.startswith(("str", "list[", "function-"))) or name
        parts.append(f"{where}: {msg}" + (" (no accepted type matches)" if len(errs) > 1 else ""))
    more = f" (+{len(parts) - 3} more)" if len(parts) > 3 else ""
    return "invalid request: " + "; ".join(parts[:3]) + more, next(iter(by_field), None)


def param_of(message: str) -> str | None:
    """The parameter a SamplingParams error names first (block_length for a divisibility error)."""
    if "multiple of block_length" in message:
        return "block_length"
    head = message.split(" ", 1)[0]
    return head if head in _PARAM_NAMES else None
