"""The official ``openai`` Python client as the test of the server.

One in-process uvicorn server on a free loopback port (``InProcessServer``) over the tiny random
LLaDA checkpoint, with an API key, ``max_num_seqs=2`` and ``max_waiting=1`` so that the queue can
be filled. Everything goes through ``openai.OpenAI``: completions, chat, streaming with
``stream_options={"include_usage": True}``, ``n``, ``stop``, the parameters clients send by
default, and our errors surfacing as the client's own exception classes with our message.
"""
from __future__ import annotations

import json
import socket
import time

import pytest

openai = pytest.importorskip("openai")

from conftest import write_tiny_checkpoint  # noqa: E402
from flash_dllm.config import EngineConfig  # noqa: E402

MODEL = "tiny"
KEY = "sk-flash-dllm-test"
LONG = {"model": MODEL, "prompt": "long one", "max_tokens": 960, "block_length": 32}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from flash_dllm.bench.serve import InProcessServer
    from flash_dllm.entrypoints.serve import load_async_engine
    from flash_dllm.server.app import build_app

    # 1024 positions: a LONG request runs for hundreds of forwards, so it is surely still
    # running while the queue fills (it is aborted when its client hangs up)
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("oai") / "tiny", "llada",
                                 max_sequence_length=1024)
    aeng, tok, _ = load_async_engine(ckpt, config=EngineConfig(num_kv_pages=256, max_num_seqs=2,
                                                               max_waiting=1))
    app = build_app(aeng, tok, MODEL, api_key=KEY)
    with InProcessServer(app, aeng) as srv:
        yield srv, aeng


@pytest.fixture(scope="module")
def client(server):
    srv, _ = server
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _stream_text(chunks, chat: bool) -> tuple[dict[int, str], list]:
    texts: dict[int, str] = {}
    usage = []
    for ch in chunks:
        if ch.usage is not None:
            assert ch.choices == []                   # the usage chunk comes alone, last
            usage.append(ch.usage)
            continue
        assert not usage, "a chunk after the usage chunk"
        for c in ch.choices:
            piece = (c.delta.content if chat else c.text) or ""
            texts[c.index] = texts.get(c.index, "") + piece
    return texts, usage


def test_completions_streamed_equals_non_streamed(client):
    kw = dict(model=MODEL, prompt="Hello there", max_tokens=16)
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.model == MODEL
    assert full.choices[0].finish_reason in ("stop", "length")
    u = full.usage
    assert u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    texts, usage = _stream_text(client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}), chat=False)
    assert texts == {0: full.choices[0].text}
    assert len(usage) == 1 and usage[0].completion_tokens == u.completion_tokens


def test_chat_streamed_with_usage_and_developer_role(client):
    msgs = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16)
    msg = full.choices[0].message
    assert full.object == "chat.completion" and msg.role == "assistant"
    as_system = client.chat.completions.create(
        model=MODEL, max_tokens=16, messages=[{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": "hi"}])
    assert as_system.choices[0].message.content == msg.content    # developer = system
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=16, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    texts, usage = _stream_text(chunks, chat=True)
    assert texts == {0: msg.content}
    assert usage[0].completion_tokens == full.usage.completion_tokens
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == full.choices[0].finish_reason


def test_n_and_stop(client):
    ref = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=16)
    text = ref.choices[0].text
    stop = text[4:6]
    assert len(stop) == 2, text
    cut = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=16, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    many = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, n=2, seed=7, temperature=0.8)
    assert sorted(c.index for c in many.choices) == [0, 1]
    texts, usage = _stream_text(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, n=2, seed=7,
        temperature=0.8, stream=True, stream_options={"include_usage": True}), chat=True)
    assert texts == {c.index: c.message.content for c in many.choices}   # seed i: reproducible
    assert usage[0].completion_tokens == many.usage.completion_tokens


def test_default_client_parameters_are_accepted(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        presence_penalty=0, frequency_penalty=0, logit_bias={}, logprobs=False, top_p=1,
        response_format={"type": "text"}, user="u-1", store=False, metadata={"k": "v"},
        service_tier="auto", tools=[], tool_choice="none", seed=1)
    assert raw.headers["x-flash-dllm-ignored"] == "user,store,metadata,service_tier"
    assert raw.parse().choices[0].finish_reason in ("stop", "length")


def test_errors_are_the_clients_exceptions(server, client):
    srv, _ = server
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=msgs, logprobs=True)
    assert "logprobs: not supported by this engine" in e.value.message
    assert e.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", presence_penalty=0.5)
    assert e.value.body["param"] == "presence_penalty" and "penalties" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4096)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="x", max_tokens=4)
    assert e.value.code == "model_not_found" and "'gpt-9' does not exist" in e.value.message
    wrong = openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert e.value.code == "invalid_api_key"
    assert [m.id for m in client.models.list().data] == [MODEL]


def _hold(srv, body: dict) -> socket.socket:
    """A non-streamed request on a raw socket: in flight until the socket closes (a hang-up
    aborts its engine request at once)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\n"
              b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return s


def _until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_full_queue_is_rate_limit_error(server, client):
    srv, aeng = server
    held = []
    try:
        # NOTE: one at a time: a request counts as waiting until the step that admits it ends
        for n in (1, 2):
            held.append(_hold(srv, LONG))
            _until(lambda: aeng.num_running == n and aeng.num_waiting == 0, f"{n} running")
        held.append(_hold(srv, LONG))
        _until(lambda: aeng.num_waiting == 1, "one waiting request")
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=4)
        assert e.value.response.headers["retry-after"] == "1"
        msg = e.value.message
        assert "--max-waiting 1" in msg and "Running: 2 of --max-num-seqs 2 (full)" in msg
    finally:
        for s in held:
            s.close()
    _until(lambda: aeng.num_unfinished == 0, "the held requests to be aborted")
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=4).choices

