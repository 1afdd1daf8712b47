"""The soak's clients (``bench/soak.py``): one coroutine per kind of request, each returning a
record of what its client saw, classified so that a report can say whether every client got an
answer. Non-streamed requests go through the real ``openai`` client (no retries: every failure is
counted once), streams through raw httpx (the client must see the SSE error event and ``[DONE]``
itself, which ``openai``'s stream hides).

Outcomes: ``ok``; ``error_body`` (an HTTP error with OpenAI's error body); ``sse_error_done`` (a
stream that ended with an error event, then ``data: [DONE]``); ``connection_error`` (no answer at
all: refused, reset, or a stream cut without ``[DONE]``); ``disconnected`` (the client hung up on
purpose mid-stream); ``malformed`` (an answer that is none of these: an error without OpenAI's
body, a stream without ``[DONE]`` after its last event, a 200 with no text).
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx

OUTCOMES = ("ok", "error_body", "sse_error_done", "connection_error", "disconnected", "malformed")
KNOBS = {"decode": "threshold", "threshold": 0.9, "cache": "dual"}   # cache=dual keeps K/V:
                                                                     # prefix reuse and tiers
OPENAI = {"model", "prompt", "messages", "max_tokens", "temperature"}    # the rest: extra_body
NAMES = ["Ivy", "Vic", "Amy", "Bob", "Zoe", "Max", "Eli", "Kim"]
THINGS = ["pens", "apples", "cards", "shells", "books", "coins"]


def question(i: int) -> str:
    """A distinct arithmetic question per ``i`` (the demo model's kind of prompt)."""
    a, b = NAMES[i % len(NAMES)], NAMES[(i // len(NAMES) + 1 + i) % len(NAMES)]
    n, m = 7 + (i * 13) % 60, 1 + (i * 7) % 6
    return (f"{a} has {n} {THINGS[i % len(THINGS)]}. {b} has {m} fewer than {a}. "
            f"How many {THINGS[i % len(THINGS)]} do they have in all? (case {i})")


def record(phase: str, kind: str, path: str, body: dict) -> dict:
    return {"phase": phase, "kind": kind, "path": path, "body": body, "outcome": None,
            "error": None, "latency_s": None, "text": None, "t0": time.monotonic()}


def _done(rec: dict, outcome: str, error: str | None = None, text: str | None = None) -> dict:
    now = time.monotonic()
    rec.update(outcome=outcome, error=error, text=text, t_end=now,
               latency_s=round(now - rec.pop("t0"), 4))
    return rec


def error_class(status: int | None, body) -> str:
    """``"<status> <code>"``: the HTTP status and OpenAI error ``code`` (else its ``type``)."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return f"{status} <no error body>"
    return f"{status} {err.get('code') or err.get('type')}"


async def call_openai(client, phase: str, kind: str, body: dict) -> dict:
    """One non-streamed completion (``kind`` "completion") or chat (anything else) through the
    ``openai`` client."""
    import openai

    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    rec = record(phase, kind, path, body)
    std = {k: v for k, v in body.items() if k in OPENAI}
    extra = {k: v for k, v in body.items() if k not in OPENAI}
    try:
        if path == "/v1/completions":
            r = await client.completions.create(extra_body=extra, **std)
            text = r.choices[0].text
        else:
            r = await client.chat.completions.create(extra_body=extra, **std)
            text = r.choices[0].message.content
    except openai.APIStatusError as e:
        body_json = e.body if isinstance(e.body, dict) else None
        if body_json is not None and "error" not in body_json:   # the client unwraps "error"
            body_json = {"error": body_json}
        return _done(rec, "error_body" if body_json else "malformed",
                     error_class(e.status_code, body_json))
    except openai.APIConnectionError as e:
        return _done(rec, "connection_error", f"connection {type(e.__cause__ or e).__name__}")
    return _done(rec, "ok" if text is not None else "malformed", None, text)


async def call_stream(http: httpx.AsyncClient, phase: str, kind: str, path: str, body: dict,
                      disconnect_after: int | None = None) -> dict:
    """One streamed request over raw SSE; ``disconnect_after``: hang up after that many data
    events (the mid-stream disconnect fault)."""
    rec = record(phase, kind, path, {**body, "stream": True})
    chat = path.endswith("chat/completions")
    parts, error, events = [], None, 0
    try:
        async with http.stream("POST", path, json=rec["body"]) as r:
            if r.status_code != 200:
                raw = await r.aread()
                try:
                    parsed = json.loads(raw)
                except ValueError:
                    parsed = None
                ok = isinstance(parsed, dict) and isinstance(parsed.get("error"), dict)
                return _done(rec, "error_body" if ok else "malformed",
                             error_class(r.status_code, parsed))
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    if error is not None:
                        return _done(rec, "sse_error_done", error, "".join(parts))
                    return _done(rec, "ok", None, "".join(parts))
                if error is not None:         # an event after the error event: not the protocol
                    return _done(rec, "malformed", f"event after error ({error})")
                ev = json.loads(data)
                if "error" in ev:
                    error = error_class(200, ev)
                    continue
                for c in ev.get("choices", []):
                    parts.append((c.get("delta") or {}).get("content") or "" if chat
                                 else c.get("text") or "")
                events += 1
                if disconnect_after is not None and events >= disconnect_after:
                    return _done(rec, "disconnected")   # leaving the block closes the socket
    except (httpx.TransportError, OSError) as e:
        return _done(rec, "connection_error", f"connection {type(e).__name__}")
    return _done(rec, "connection_error" if error is None else "malformed",
                 "stream ended without [DONE]" + (f" after {error}" if error else ""))


def completion_body(i: int, max_tokens: int, model: str) -> dict:
    return {"model": model, "prompt": question(i), "max_tokens": max_tokens, "temperature": 0.0,
            **KNOBS}


def chat_body(messages: list, max_tokens: int, model: str) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            **KNOBS}


class Conversation:
    """A multi-turn chat whose every turn resends the whole history (prefix reuse)."""

    def __init__(self, i: int, system: str):
        self.i, self.turn = i, 0
        self.messages = [{"role": "system", "content": system},
                         {"role": "user", "content": question(1000 + i)}]

    async def step(self, client, phase: str, max_tokens: int, model: str) -> dict:
        rec = await call_openai(client, phase, "multiturn",
                                chat_body([dict(m) for m in self.messages], max_tokens, model))
        if rec["outcome"] == "ok":
            self.turn += 1
            self.messages += [{"role": "assistant", "content": rec["text"]},
                              {"role": "user", "content": question(2000 + 97 * self.i + self.turn)}]
        return rec


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))], 4)


async def gather_bounded(coros, limit: int):
    """Run coroutine factories with at most ``limit`` in flight; results in order."""
    sem = asyncio.Semaphore(limit)

    async def one(f):
        async with sem:
            return await f()
    return await asyncio.gather(*(one(f) for f in coros))
