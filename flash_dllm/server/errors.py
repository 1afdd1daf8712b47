"""OpenAI-style errors for the server: ``APIError``, and readable messages for validation errors."""
from __future__ import annotations

import json
from dataclasses import fields

from fastapi.responses import JSONResponse

from flash_dllm.config import SamplingParams
from flash_dllm.server.protocol import DLLMKnobs, error_body

DEFAULT_MAX_BODY_BYTES = 1 << 20
_PARAM_NAMES = set(DLLMKnobs.model_fields) | {f.name for f in fields(SamplingParams)}


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return ErrorResponse(error_body(self.message, self.type, self.param, self.code),
                             status_code=self.status, headers=self.headers)


class ErrorResponse(JSONResponse):
    """JSON as ASCII: a message quoting client input (a lone surrogate, say) always encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content).encode()


def validation_message(errors: list[dict], content_type: str | None = None
                       ) -> tuple[str, str | None]:
    """One readable message (and the first offending parameter) from pydantic/FastAPI errors;
    ``content_type``: the one the client sent (a body that is not JSON says so)."""
    for e in errors:
        if e.get("type") == "json_invalid":
            ctx = e.get("ctx", {}).get("error", "")
            if content_type and "json" not in content_type.lower():
                return (f"the request body is not JSON (sent as Content-Type: {content_type}): "
                        f"send the parameters as one JSON object ({ctx})"), None
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
