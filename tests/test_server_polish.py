"""What a new user tripped on, server side: the parameter policy for what OpenAI clients send,
lone surrogates, bodies without a JSON Content-Type, 429 messages that name the limit, and the
SIGTERM drain with its limit (in-process, and over a real ``flash-dllm serve`` subprocess).

In-process tests drive the app through httpx ``ASGITransport`` over the tiny random checkpoint.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import write_tiny_checkpoint
from flash_dllm.config import EngineConfig
from flash_dllm.entrypoints.serve import load_async_engine
from flash_dllm.server.app import build_app
from flash_dllm.server.protocol import (CHAT_POLICY, COMPLETION_POLICY, IGNORED_PARAMS,
                                        NEUTRAL_PARAMS)

MODEL = "tiny"
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("polish") / "tiny", "llada")


def make_app(ckpt, config=None, **kw):
    aeng, tok, _ = load_async_engine(ckpt, config=config or EngineConfig(num_kv_pages=64))
    return build_app(aeng, tok, MODEL, **kw), aeng


@pytest.fixture(scope="module")
def app(ckpt):
    return make_app(ckpt)[0]


@pytest.fixture(scope="module")
def strict_app(ckpt):
    return make_app(ckpt, strict_params=True)[0]


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                             timeout=60)


def post(app, path, body=None, **kw) -> httpx.Response:
    async def go():
        async with client(app) as c:
            return await (c.post(path, json=body, **kw) if body is not None else
                          c.post(path, **kw))
    return asyncio.run(go())


def body_for(path: str, **extra) -> dict:
    base = {"messages": MSGS} if path == CHAT else {"prompt": "hi"}
    return {**base, "max_tokens": 2, **extra}


def sse_events(text: str) -> list:
    return [b[6:] if b[6:] == "[DONE]" else json.loads(b[6:])
            for b in text.split("\n\n") if b.startswith("data: ")]


# ------------------------------------------------------------------------ parameter policy
NEUTRAL = [
    (CHAT, "presence_penalty", 0), (CMPL, "frequency_penalty", 0.0), (CHAT, "logprobs", False),
    (CMPL, "logprobs", None), (CHAT, "top_logprobs", 0), (CHAT, "logit_bias", {}),
    (CHAT, "response_format", {"type": "text"}), (CHAT, "tools", []),
    (CHAT, "tool_choice", "none"), (CHAT, "tool_choice", "auto"), (CHAT, "functions", []),
    (CHAT, "function_call", "none"), (CHAT, "modalities", ["text"]), (CHAT, "audio", None),
    (CHAT, "web_search_options", None), (CMPL, "echo", False), (CMPL, "best_of", 1),
    (CMPL, "suffix", ""),
]
REFUSED = [
    (CHAT, "presence_penalty", 0.5, "penalties"), (CMPL, "frequency_penalty", -1, "penalties"),
    (CHAT, "logprobs", True, "not supported by this engine"),
    (CMPL, "logprobs", 1, "log-probabilities"), (CHAT, "top_logprobs", 3, "log-probabilities"),
    (CMPL, "logit_bias", {"5": -100}, "logits"),
    (CHAT, "response_format", {"type": "json_object"}, "structured output"),
    (CHAT, "tools", [{"type": "function", "function": {"name": "f"}}], "tool calling"),
    (CHAT, "tool_choice", "required", "tool calling"),
    (CHAT, "function_call", {"name": "f"}, "tool calling"),
    (CHAT, "modalities", ["text", "audio"], "only produces text"),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}, "only produces text"),
    (CHAT, "web_search_options", {}, "web search"), (CMPL, "echo", True, "echoing"),
    (CMPL, "best_of", 2, "use n"), (CMPL, "suffix", "x", "insertion"),
]
IGNORED = [
    (CHAT, {"user": "u"}, "user"),
    (CMPL, {"store": False, "metadata": {"k": "v"}}, "store,metadata"),
    (CHAT, {"service_tier": "auto", "parallel_tool_calls": True},
     "service_tier,parallel_tool_calls"),
    (CHAT, {"prompt_cache_key": "k", "safety_identifier": "s", "prediction": {"type": "content"}},
     "prompt_cache_key,safety_identifier,prediction"),
    (CMPL, {"stream_options": {"include_usage": True, "include_obfuscation": False},
            "stream": True}, "stream_options.include_obfuscation"),
]


def test_policy_lists_are_consistent():
    assert set(IGNORED_PARAMS).isdisjoint(NEUTRAL_PARAMS)
    for name in set(CHAT_POLICY) | set(COMPLETION_POLICY):
        assert name in IGNORED_PARAMS or name in NEUTRAL_PARAMS, name
    tested = {n for _, n, *_ in NEUTRAL} | {n for _, n, *_ in REFUSED}
    assert tested == set(NEUTRAL_PARAMS)


@pytest.mark.parametrize("path,name,value", NEUTRAL, ids=[f"{n}={v!r}" for _, n, v in NEUTRAL])
def test_neutral_values_are_accepted(app, path, name, value):
    r = post(app, path, body_for(path, **{name: value}))
    assert r.status_code == 200, r.text
    assert "x-flash-dllm-ignored" not in r.headers


@pytest.mark.parametrize("path,name,value,why", REFUSED,
                         ids=[f"{n}={v!r}" for _, n, v, _ in REFUSED])
def test_other_values_are_400_naming_the_parameter_and_why(app, path, name, value, why):
    r = post(app, path, body_for(path, **{name: value}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and err["message"].startswith(f"{name}: ") and why in err["message"]


@pytest.mark.parametrize("path,extra,header", IGNORED, ids=[h for _, _, h in IGNORED])
def test_harmless_parameters_are_ignored_and_named_in_a_header(app, path, extra, header):
    r = post(app, path, body_for(path, **extra))
    assert r.status_code == 200, r.text
    assert r.headers["x-flash-dllm-ignored"] == header


def test_ignored_parameter_is_logged_once(app):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("uvicorn.error")
    log.addHandler(handler)
    try:
        for _ in range(2):
            r = post(app, CMPL, body_for(CMPL, prompt_cache_retention="24h"))
            assert r.headers["x-flash-dllm-ignored"] == "prompt_cache_retention"
    finally:
        log.removeHandler(handler)
    assert sum("prompt_cache_retention" in rec.getMessage() for rec in records) == 1


def test_unknown_parameters_stay_400(app):
    r = post(app, CHAT, body_for(CHAT, frobnicate=1))
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
    r = post(app, CMPL, body_for(CMPL, tools=[]))            # a chat parameter on completions
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


@pytest.mark.parametrize("name,value", [("presence_penalty", 0), ("logit_bias", {}),
                                        ("store", False), ("metadata", {}), ("tools", [])])
def test_strict_mode_refuses_every_policy_parameter(strict_app, name, value):
    r = post(strict_app, CHAT, body_for(CHAT, **{name: value}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and "unknown or unsupported parameter" in err["message"]


def test_strict_mode_keeps_user_and_the_developer_role(strict_app):
    msgs = [{"role": "developer", "content": "be brief"}, *MSGS]
    r = post(strict_app, CHAT, {"messages": msgs, "max_tokens": 2, "user": "u"})
    assert r.status_code == 200, r.text


def test_developer_role_is_a_system_message(app):
    def answer(role):
        r = post(app, CHAT, {"messages": [{"role": role, "content": "be brief"}, *MSGS],
                             "max_tokens": 8})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    assert answer("developer") == answer("system")


# ---------------------------------------------------------------------------- lone surrogates
SURROGATES = [
    (CMPL, b'{"prompt": "abc\\udc80", "max_tokens": 2}', "prompt"),
    (CMPL, b'{"prompt": ["abc\\ud800"], "max_tokens": 2}', "prompt"),
    ("/generate", b'{"prompt": "\\udc80x", "max_new_tokens": 2}', "prompt"),
    (CHAT, b'{"messages": [{"role": "user", "content": "abc\\udc80"}]}', "messages[0].content"),
    (CHAT, b'{"messages": [{"role": "system", "content": "ok"}, {"role": "user", "content": '
           b'[{"type": "text", "text": "a\\udfff"}]}]}', "messages[1].content"),
]


@pytest.mark.parametrize("path,raw,param", SURROGATES, ids=[p for _, _, p in SURROGATES])
def test_lone_surrogate_is_400_naming_the_field(app, path, raw, param):
    r = post(app, path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "lone surrogate" in err["message"]


def test_lone_surrogate_in_the_model_name_is_a_404_not_a_500(app):
    r = post(app, CMPL, content=b'{"prompt": "x", "model": "gpt\\udc80"}')
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


# ------------------------------------------------------------------------------ content type
@pytest.mark.parametrize("ctype", ["application/x-www-form-urlencoded", "text/plain", None,
                                   "application/json; charset=utf-8"])
def test_json_body_is_accepted_whatever_the_content_type(app, ctype):
    headers = {} if ctype is None else {"content-type": ctype}
    r = post(app, CMPL, content=json.dumps(body_for(CMPL)).encode(), headers=headers)
    assert r.status_code == 200, r.text


def test_a_body_that_is_not_json_says_so(app):
    r = post(app, CMPL, content=b"prompt=hi&max_tokens=2",
             headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "not JSON" in msg and "application/x-www-form-urlencoded" in msg
    r = post(app, CMPL, content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]


# ------------------------------------------------------------------------- 429 names the limit
async def _until(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("config,expect", [
    (EngineConfig(num_kv_pages=64, max_num_seqs=1, max_waiting=1),
     "Running: 1 of --max-num-seqs 1 (full)"),
    (EngineConfig(num_kv_pages=15, max_waiting=1), "KV pages reserved: 15 of 15"),
], ids=["max-num-seqs", "kv-pages"])
def test_queue_full_message_names_the_limits(ckpt, config, expect):
    app, aeng = make_app(ckpt, config)
    long = {"prompt": "ab", "max_tokens": 224, "block_length": 32}     # 15 pages of 16

    async def go():
        async with client(app) as c:
            first = asyncio.create_task(c.post(CMPL, json=long))
            await _until(lambda: aeng.num_running == 1 and aeng.num_waiting == 0)
            second = asyncio.create_task(c.post(CMPL, json=long))
            await _until(lambda: aeng.num_waiting == 1)
            third = await c.post(CMPL, json=long)
            for t in (first, second):               # cancelled handlers abort their requests
                t.cancel()
            await asyncio.gather(first, second, return_exceptions=True)
            return third
    r = asyncio.run(go())
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    msg = r.json()["error"]["message"]
    assert "the waiting queue is full" in msg and "--max-waiting 1" in msg and expect in msg


# --------------------------------------------------------------------------------- the drain
LONG = {"prompt": "long one", "max_tokens": 224, "block_length": 32}


def test_drain_limit_ends_in_flight_requests_with_errors(ckpt):
    """Drain limit 0: the running responses are cut at once, a stream with an error event then
    [DONE], a non-streamed one with a 503 error body; new requests, /ready, /health get 503."""
    app, aeng = make_app(ckpt, drain_timeout=0)
    drain = app.state.context.drain

    async def go():
        async with client(app) as c:
            streamed = asyncio.create_task(c.post(CMPL, json={**LONG, "stream": True}))
            plain = asyncio.create_task(c.post(CMPL, json=LONG))
            await _until(lambda: aeng.num_running == 2)
            drained = asyncio.create_task(drain.run())
            await _until(lambda: aeng.draining)
            refused = [await c.post(CMPL, json=body_for(CMPL)), await c.get("/v1/models"),
                       await c.get("/ready"), await c.get("/health")]
            return await streamed, await plain, refused, await drained
    streamed, plain, refused, finished_in_time = asyncio.run(go())
    assert not finished_in_time
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "drain_timeout"
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "drain_timeout"
    assert "--drain-timeout" in plain.json()["error"]["message"]
    for r in [plain, *refused]:
        assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
    assert refused[0].json()["error"]["type"] == "server_error"


def test_drain_within_the_limit_lets_requests_finish(ckpt):
    app, aeng = make_app(ckpt, drain_timeout=120)
    drain = app.state.context.drain

    async def go():
        async with client(app) as c:
            plain = asyncio.create_task(c.post(CMPL, json=body_for(CMPL, max_tokens=16)))
            await _until(lambda: aeng.num_unfinished == 1)
            return await drain.run(), await plain
    finished_in_time, plain = asyncio.run(go())
    assert finished_in_time and plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.slow
def test_sigterm_drain_limit_over_a_real_server(tmp_path):
    """``flash-dllm serve --drain-timeout 3``: after SIGTERM the socket keeps answering 503 (with
    Retry-After) to /ready, /health and new requests; at the limit a stream in flight ends with an
    error event then [DONE], a non-streamed request with a 503 error body, a client stuck half-way
    through its body with a 503; then the process exits."""
    from flash_dllm.bench.serve import free_port

    # 2048 positions: a 1024-token request runs far longer than the drain limit on any machine
    ckpt = write_tiny_checkpoint(tmp_path / "tiny", "llada", max_sequence_length=2048)
    port, limit = free_port(), 3
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "flash_dllm.cli", "serve", "--model", str(ckpt),
                             "--port", str(port), "--drain-timeout", str(limit),
                             "--log-level", "warning"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    long = {"prompt": "long one", "max_tokens": 1024, "block_length": 32}
    got: dict = {}

    def stream():
        with httpx.stream("POST", url + CMPL, json={**long, "stream": True}, timeout=60) as r:
            got["stream"] = [ln for ln in r.iter_lines() if ln]

    def plain():
        got["plain"] = httpx.post(url + CMPL, json=long, timeout=60)

    try:
        _wait_ready(proc, url)
        clients = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in clients:
            t.start()
        half = socket.create_connection(("127.0.0.1", port))
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        _poll(lambda: "flash_dllm_requests_running 2.0" in httpx.get(url + "/metrics").text,
              "two running requests")
        t_signal = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _poll(lambda: httpx.get(url + "/ready").status_code == 503, "/ready to turn 503")
        during = [httpx.get(url + "/ready"), httpx.get(url + "/health"),
                  httpx.post(url + CMPL, json={"prompt": "x", "max_tokens": 2})]
        for t in clients:
            t.join(60)
        half.settimeout(60)
        half_reply = half.recv(4096)
        proc.wait(timeout=60)
        exited_after = time.monotonic() - t_signal
    finally:
        if proc.poll() is None:
            proc.kill()
    for r in during:
        assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
    assert during[2].json()["error"]["code"] == "unavailable"
    lines = got["stream"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "drain_timeout"
    assert got["plain"].status_code == 503
    assert got["plain"].json()["error"]["code"] == "drain_timeout"
    assert half_reply.startswith(b"HTTP/1.1 503")
    assert exited_after < limit + 30                # the limit, the grace, a slow machine


def _poll(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _wait_ready(proc, url: str) -> None:
    def ready() -> bool:
        assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
        try:
            return httpx.get(url + "/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False
    _poll(ready, "the server to start", timeout=90)
