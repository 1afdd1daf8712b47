"""``Guard``: the ASGI layer in front of the app, for what must happen before any routing.

In order: the API key (401), the drain (503 with ``Retry-After`` for new API requests), the body
size limit (413), a body in UTF-8 (400 naming the first bad byte), and a JSON body whatever its
``Content-Type`` (curl's ``-d`` sends ``application/x-www-form-urlencoded``; other
OpenAI-compatible servers parse JSON anyway). It counts the API requests in flight for the drain,
and adds the ``X-Flash-DLLM-Ignored`` header that lists the parameters a handler ignored
(``request.state.ignored_params``).
"""
from __future__ import annotations

import asyncio
import hmac
import json
from typing import Callable

from flash_dllm.server.drain import RETRY_AFTER, Drain
from flash_dllm.server.protocol import error_body

PROTECTED_PREFIXES = ("/v1/", "/generate")      # /health, /ready, /metrics stay open
IGNORED_HEADER = b"x-flash-dllm-ignored"


async def send_json(send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()             # ASCII: a lone surrogate cannot break it
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *headers]})
    await send({"type": "http.response.body", "body": data})


class Guard:
    """API key (401), drain (503), body size (413) and JSON content type, before the app.

    The body is read here (at most ``max_body_bytes`` + one chunk) and replayed to the app; later
    ``receive`` calls pass through, so the app still sees the client's disconnect.
    """

    def __init__(self, app, api_key: str | None, max_body_bytes: int, on_error: Callable,
                 drain: Drain) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.on_error, self.drain = on_error, drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIXES):
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope["headers"]}
        if self.api_key is not None and not self._authorized(headers):
            return await self._refuse_key(send, headers)
        if self.drain.draining:
            return await self._error(send, 503, error_body(
                "the server is shutting down; retry on another replica or after the restart",
                "server_error", None, "unavailable"),
                [(b"retry-after", RETRY_AFTER.encode()), (b"connection", b"close")])
        self.drain.active += 1
        try:
            if scope["method"] not in ("POST", "PUT", "PATCH"):
                return await self.app(scope, receive, send)
            await self._with_body(scope, receive, send, headers)
        finally:
            self.drain.active -= 1

    # ----------------------------------------------------------------------------------- steps
    def _authorized(self, headers: dict) -> bool:
        token = self._token(headers)
        return hmac.compare_digest(token.encode(), self.api_key.encode())

    @staticmethod
    def _token(headers: dict) -> str:
        auth = headers.get(b"authorization", b"").decode("latin-1")
        return auth[7:].strip() if auth[:7].lower() == "bearer " else \
            headers.get(b"x-api-key", b"").decode("latin-1")

    async def _refuse_key(self, send, headers: dict) -> None:
        msg = ("missing API key: send 'Authorization: Bearer <key>'" if not self._token(headers)
               else "incorrect API key provided")
        await self._error(send, 401, error_body(msg, "authentication_error", None,
                                                "invalid_api_key"),
                          [(b"www-authenticate", b"Bearer")])

    async def _error(self, send, status: int, body: dict, headers=()) -> None:
        self.on_error(status)
        await send_json(send, status, body, headers)

    async def _with_body(self, scope, receive, send, headers: dict) -> None:
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._too_big(send)
        # NOTE: a client may stall half-way through its body; the drain must still end, so the
        # read races the drain's expiry (a future: nothing is polled)
        reading = asyncio.ensure_future(self._read_body(receive))
        cut = self.drain.cutoff()
        try:
            await asyncio.wait({reading, cut}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cut.cancel()
            if not reading.done():
                reading.cancel()
        if not reading.done() or reading.cancelled():
            return await self._error(send, 503, error_body(self.drain.message(), "server_error",
                                                           None, self.drain.code),
                                     [(b"retry-after", RETRY_AFTER.encode()),
                                      (b"connection", b"close")])
        body = reading.result()
        if body is None:                          # the client went away
            return
        if body is False:
            return await self._too_big(send)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            # NOTE: FastAPI would say only "There was an error parsing the body"; name the byte,
            # as the CLI does for a file that is not UTF-8 (models/loader.py)
            return await self._error(send, 400, error_body(
                f"the request body is not valid UTF-8 (byte 0x{body[e.start]:02x} at offset "
                f"{e.start}): send JSON encoded as UTF-8", code="invalid_encoding"))
        await self.app(self._as_json(scope, headers), _replay(body, receive),
                       self._add_ignored(scope, send))

    async def _read_body(self, receive) -> bytes | None | bool:
        """The whole body; None if the client disconnected, False past ``max_body_bytes``."""
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return False
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    async def _too_big(self, send) -> None:
        await self._error(send, 413, error_body(
            f"request body exceeds the limit of {self.max_body_bytes} bytes",
            code="request_too_large"))

    @staticmethod
    def _as_json(scope, headers: dict):
        """The scope with ``Content-Type: application/json``; the client's type is kept in
        ``request.state.body_content_type`` for the error message of a body that is not JSON."""
        state = scope.setdefault("state", {})
        sent = headers.get(b"content-type", b"").decode("latin-1")
        state["body_content_type"] = sent
        if sent.split(";")[0].strip().lower() == "application/json":
            return scope
        rest = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
        return {**scope, "headers": [*rest, (b"content-type", b"application/json")]}

    @staticmethod
    def _add_ignored(scope, send):
        state = scope.setdefault("state", {})

        async def send_with_header(msg) -> None:
            if msg["type"] == "http.response.start" and state.get("ignored_params"):
                value = ",".join(state["ignored_params"]).encode("latin-1")
                msg = {**msg, "headers": [*msg.get("headers", []), (IGNORED_HEADER, value)]}
            await send(msg)
        return send_with_header


def _replay(body: bytes, receive):
    """``receive`` that first returns the body read already, then passes through."""
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay
